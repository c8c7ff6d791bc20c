"""Data parallel under torchrun: the ranks' context, one host store per node, the reducer."""
