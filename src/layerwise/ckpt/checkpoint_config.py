"""``CheckpointConfig``: how a ``Checkpointer`` saves, and the one flat namespace of options its
constructor takes (config fields and the policy's own options together)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any


DEFAULT_POLICY = "full"
"""The selection policy of every checkpointer by default (``Checkpointer``, the Trainer callback,
the DeepSpeed and FSDP2 loops, ``layerwise train``'s ``ckpt.policy``): every group at every save,
so a resume loses nothing. The selective policies (parity, filter, topk, budget) trade a
composite "step N" for fewer bytes, and are asked for by name."""


@dataclass
class CheckpointConfig:
    policy: str = DEFAULT_POLICY
    """Registry name of the selection policy: full, parity, filter, topk, budget."""
    policy_options: dict[str, Any] = field(default_factory=dict)
    """Options of the policy, e.g. {"threshold": 1e-3, "max_staleness": 4, "full_every": 10}."""
    async_save: bool = True
    """Write in a background thread; ``save`` blocks only for the host snapshot (a snapshot
    that would not fit in the RAM available is not taken: that save writes from the live
    tensors, inside ``save``; ``ckpt.snapshot_fit``)."""
    sync_copy: bool = True
    """With ``async_save=False``: still copy the chosen groups first (False: write straight from
    the live tensors, no extra memory; the update tracker then keeps its own weight copy only if
    the policy reads weight changes)."""
    save_rng: bool = True
    """Store and restore python/numpy/torch RNG states (needed for bit-identical resume)."""
    track_every_steps: int = 10
    """``observe(step)`` takes statistics only every N steps (saves always measure)."""
    tracker_log: bool = True
    """Append the statistics to ``RUN/tracker.jsonl``."""
    expert_groups: bool = False
    """Version each routed expert of an MoE layer as its own group (``ckpt.expert_groups``), so a
    policy writes only the experts that moved; for families with fused experts (a dense model
    keeps its layer groups). Needs fp32 optimizer moments."""
    encoding: str = "plain"
    """How a blob stores its tensors (``ckpt.blob_codec``): ``"plain"`` whole; ``"delta"`` fp32
    weights as their low halves plus the high halves that changed since the
    group's key frame blob, lossless (a new key frame when over half of them changed);
    ``"moments8"`` fp32 Adam moments block-wise 8-bit, lossy (a resume continues from
    moments within the 8-bit optimizer's error); ``"delta+moments8"`` both."""
    snapshot: str = "auto"
    """When the statistics are measured and the chosen groups copied: ``"sync"`` inside ``save``
    (and ``observe``); ``"deferred"`` on a helper thread after they return, before the next
    optimizer step (``ckpt.snapshot``); ``"auto"``: deferred with ``async_save`` where the
    provider can hold updates back and the state is on the CPU, else sync."""


def split_options(config: CheckpointConfig | None,
                  options: dict[str, Any]) -> tuple[CheckpointConfig, dict[str, Any]]:
    """``config`` with the options that name its fields applied, and the policy's options
    (``config.policy_options`` overridden by the rest of ``options``)."""
    names = {f.name for f in fields(CheckpointConfig)}
    cfg = replace(config or CheckpointConfig(), **{k: v for k, v in options.items() if k in names})
    return cfg, {**cfg.policy_options, **{k: v for k, v in options.items() if k not in names}}
