"""PEFT (LoRA) adapters in and out: ``adapter_dir``."""
