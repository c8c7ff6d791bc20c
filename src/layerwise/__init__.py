"""layerwise: train LLMs bigger than the GPU by streaming layers; checkpoint only what changed."""

__version__ = "0.1.0"
