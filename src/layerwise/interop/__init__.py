"""Other tools' checkpoints in and out, and the hooks that checkpoint their training loops.

Grouped by ecosystem, with format converters apart from live training hooks:

- ``layout`` (HF / Trainer file names, the ``CheckpointSource`` protocol: the leaf here) and
  ``sources`` (open any checkpoint by path);
- ``hf/``: HF model dirs read (``model_dir``) and written (``model_dir_writer``), HF Trainer
  ``checkpoint-N`` dirs (``trainer_checkpoint``);
- ``deepspeed/``: ZeRO stage 1-3 saves read and written without DeepSpeed (``zero_checkpoint``);
- ``torchdist/``: torch.distributed.checkpoint dirs (``dcp_checkpoint``), torchtitan's names
  (``titan_names``);
- ``recipes/``: ``merge`` (any source into an ordinary checkpoint), layer-range ``recipe``,
  ``import_checkpoints`` (``layerwise ckpt import``), ``store_export`` (a HostStore as an HF dir);
- ``hooks/``: live training loops writing layer-wise saves: ``trainer_callback``
  (``transformers.Trainer``), ``deepspeed_loop`` over ``zero_partitions``, ``fsdp2_loop``;
- ``cli`` (``layerwise ckpt merge`` / ``import``).
"""
