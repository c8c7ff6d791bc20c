"""DeepSpeed ZeRO checkpoints, read and written without DeepSpeed."""
