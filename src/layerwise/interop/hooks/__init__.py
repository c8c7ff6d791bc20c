"""Live training hooks: layer-wise saves written from a running HF Trainer, DeepSpeed or FSDP2 loop."""
