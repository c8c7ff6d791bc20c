"""Small helpers every package may use: atomic files, byte sizes, dtypes, JSON-safe values,
the safetensors encoding, CLI command groups and the host kernels' vector width. Nothing here
imports another layerwise package."""
