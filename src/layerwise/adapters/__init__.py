"""LoRA / QLoRA on the streaming engine: adapters trained, the base frozen (maybe quantised)."""
