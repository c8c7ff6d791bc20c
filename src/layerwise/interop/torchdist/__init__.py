"""torch.distributed formats: DCP dirs, and torchtitan's parameter names."""
