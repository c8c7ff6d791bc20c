"""Other tools' checkpoints in and out (``hf/``, ``deepspeed/``, ``torchdist/``, ``peft/``,
``recipes/``: merge, recipes, import, store export), and ``hooks/``: live training loops
(``transformers.Trainer``, DeepSpeed, FSDP2) writing layer-wise saves. ``layout`` is the leaf
(file names, the ``CheckpointSource`` protocol); ``sources`` opens any checkpoint by path."""
