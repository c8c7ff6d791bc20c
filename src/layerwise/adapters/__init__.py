"""LoRA / QLoRA on the streaming engine: adapters trained, the base frozen (and possibly quantised).

``config`` (torch-free: ``LoraConfig``), ``quant`` (NF4 / int8 weight-only formats), ``linear`` (the
frozen linear and its template), ``layout`` (a unit's flat buffer: adapters, then the base),
``lora_adapter`` (the engine's adapter interface), ``lora_store`` (the host store).
"""
