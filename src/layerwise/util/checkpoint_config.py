"""``CheckpointConfig``: one config for ``layerwise train``'s ``ckpt.*`` keys and
``Checkpointer(**options)``. Torch-free: ``--help`` reads it first. ``metadata={"cli": False}``
fields are the library's alone; ``every``, ``at_end``, ``save_total_limit`` the command's."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_POLICY = "full"
"""The selection policy of every checkpointer by default (``Checkpointer``, the Trainer callback,
the DeepSpeed and FSDP2 loops, ``layerwise train``'s ``ckpt.policy``): every group at every save,
so a resume loses nothing. The selective policies (parity, filter, topk, budget) trade a
composite "step N" for fewer bytes, and are asked for by name."""

POLICY_NAMES = ("full", "parity", "filter", "topk", "budget")
"""The checkpoint core's policies (``layerwise.ckpt.POLICIES``; a test keeps the two equal)."""

POLICY_OPTIONS = {"threshold": ("filter",), "max_fraction": ("filter",), "k": ("topk",),
                  "budget_bytes": ("budget",), "budget_fraction": ("budget",),
                  "max_staleness": POLICY_NAMES, "full_every": POLICY_NAMES}
"""Policy options -> the policies that take them."""

_LIBRARY = {"cli": False}


@dataclass
class CheckpointConfig:
    every: int = 50
    """Save a layer-wise checkpoint to ``out_dir/ckpt`` every N steps (0: none on a schedule)."""
    at_end: bool = True
    """Also save at the last step, and when the run is interrupted (Ctrl-C, SIGTERM): save,
    then exit with the command that resumes."""
    policy: str = field(default=DEFAULT_POLICY, metadata={"choices": POLICY_NAMES})
    """Which groups a checkpoint writes: full (all: the default, lossless), or a selective one,
    whose "step N" is a composite of each group's newest saved version: parity (alternate
    halves), filter (those that moved more than ``threshold``), topk (the ``k`` that moved
    most), budget (bytes). Whatever the policy, the last save of a run and the save an
    interrupt makes write every group. Measured in a fine-tune resumed from a composite
    (``benchmarks/ckpt_savings.py --finetune``): parity +0.12% eval loss at 1.87x fewer bytes,
    filter at 0.01 +1.10% at 1.98x, budget 0.25 +0.74% at 3.74x."""
    threshold: float | None = None
    """filter: relative weight change since a group's saved version above which it is written
    (none: the policy's default, 0.01, measured on fine-tunes at LR 2e-5 to 1e-4; a run at a
    larger LR moves every group more than that between saves: raise it)."""
    max_fraction: float | None = None
    """filter: at most this fraction of a full checkpoint's bytes per save."""
    k: int | None = None
    """topk: groups per save (none: the policy's default, 4)."""
    budget_bytes: int | None = None
    """budget: bytes per save (none: ``budget_fraction`` of a full checkpoint)."""
    budget_fraction: float | None = None
    """budget: bytes per save as a fraction of a full checkpoint (none: 0.25)."""
    max_staleness: int | None = 4
    """Any policy: at most this many saves between two saves of any group, so a composite
    "step N" holds no group older than N - max_staleness x every steps (none: no bound; a
    ``Checkpointer`` without ``config=`` has none)."""
    full_every: int | None = None
    """Any policy: every N-th save writes every group."""
    expert_groups: bool = False
    """MoE models with fused experts: version each routed expert as its own checkpoint group
    (``layers.{i}.experts.{e}``), so a save writes only the experts that moved. Needs fp32
    optimizer moments."""
    encoding: str = field(default="plain", metadata={"choices": (
        "plain", "delta", "moments8", "delta+moments8")})
    """How a checkpoint stores its tensors: plain (whole); delta (fp32 weights, lossless: the
    low halves and only the high halves that changed since the group's key frame, a new key
    frame when over half of them changed; run format 6); moments8 (fp32 Adam moments
    block-wise 8-bit, lossy: a resume continues from moments within the 8-bit optimizer's
    error); delta+moments8 (both)."""
    save_total_limit: int | None = None
    """Keep only the newest N committed checkpoints (older steps and the blobs only they use
    are deleted after each save); none: keep all."""
    async_save: bool = field(default=True, metadata=_LIBRARY)
    """Write in a background thread; ``save`` blocks only for the host snapshot (a snapshot
    that would not fit in the RAM available is not taken: that save writes from the live
    tensors, inside ``save``; ``ckpt.snapshot_fit``)."""
    sync_copy: bool = field(default=True, metadata=_LIBRARY)
    """With ``async_save=False``: still copy the chosen groups first (False: write straight from
    the live tensors, no extra memory; the update tracker then keeps its own weight copy only if
    the policy reads weight changes)."""
    save_rng: bool = field(default=True, metadata=_LIBRARY)
    """Store and restore python/numpy/torch RNG states (needed for bit-identical resume)."""
    track_every_steps: int = field(default=10, metadata=_LIBRARY)
    """``observe(step)`` takes statistics only every N steps (saves always measure)."""
    tracker_log: bool = field(default=True, metadata=_LIBRARY)
    """Append the statistics to ``RUN/tracker.jsonl``."""
    snapshot: str = field(default="auto", metadata=_LIBRARY)
    """When the statistics are measured and the chosen groups copied: ``"sync"`` inside ``save``
    (and ``observe``); ``"deferred"`` on a helper thread after they return, before the next
    optimizer step; ``"auto"``: deferred with ``async_save`` where the provider can hold
    updates back and the state is on the CPU, else sync."""

    def policy_options(self) -> dict:
        """The policy options set (the others: the policy's defaults)."""
        return {k: getattr(self, k) for k in POLICY_OPTIONS if getattr(self, k) is not None}
