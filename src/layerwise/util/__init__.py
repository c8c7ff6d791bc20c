"""Small helpers every package may use: atomic files, byte sizes, dtypes, JSON-safe values,
the safetensors encoding, and CLI command groups. Nothing here imports another layerwise package."""
