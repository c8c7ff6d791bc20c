"""Writers of ordinary checkpoint formats from a :class:`~layerwise.ckpt.source.CheckpointSource`.

``hf``: a Hugging Face model dir; ``trainer``: an HF Trainer ``checkpoint-N`` dir. Both stream
group by group; :func:`layerwise.ckpt.merge.merge` makes them atomic.
"""
