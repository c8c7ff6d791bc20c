"""Checkpoints assembled from others: merge, layer-range recipes, import into a run, store export."""
