"""Foreign checkpoint formats in and out, built on the layer-wise core.

Owns: ``layout`` (HF / Trainer file names and the ``CheckpointSource`` protocol: the leaf every
module here imports), ``hf_dir`` (the one HF model-dir reader, also filling a HostStore),
``trainer`` (HF Trainer ``checkpoint-N`` read and write), ``hf_export`` (HF model dir writer),
``sources`` (open any checkpoint by path), ``recipe`` (mergekit/LLMTailor layer recipes),
``merge`` (atomic, streaming export), ``export`` (a HostStore as an HF dir), ``callback`` (the
``transformers.Trainer`` hook), ``fsdp`` (layer-wise saves of FSDP2 loops, each rank its shards)
and ``cli`` (``layerwise ckpt merge``).
"""
