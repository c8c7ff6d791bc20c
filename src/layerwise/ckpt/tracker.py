"""Per-group update statistics: how far each group moved since the version last saved.

The relative L2 change ``|w - w_saved| / |w_saved|`` drives ``filter``, ``topk`` and ``budget``;
``w_saved`` is the checkpointer's snapshot (shared, not copied). One pass over all groups every
12 steps is 1.1% of step time (``benchmarks/ckpt_savings.py``). Statistics may be taken on
another thread: a tensor modified in place since ``capture`` gives NaN, never a later value."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .moments import fp32_moments
from .provider import StateProvider

CHUNK_NUMEL = 1 << 19
"""Elements per chunk of the weight-difference pass (2 MiB of fp32: stays in cache)."""


@dataclass
class LiveGroup:
    """One group's live tensors, captured by reference (not copied), and their versions then."""

    params: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    optim: dict[str, torch.Tensor]
    """Optimizer state in blob keys."""
    versions: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def capture(cls, provider: StateProvider, group: str, grads: bool = True) -> LiveGroup:
        out = cls(provider.params(group), provider.grads(group) if grads else {},
                  provider.optimizer_state(group))
        out.versions = {kind: _versions(ts) for kind, ts in out._kinds().items()}
        return out

    def _kinds(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"params": self.params, "grads": self.grads, "optim": self.optim}

    def modified(self, kind: str) -> bool:
        """Whether a tensor of ``kind`` (params, grads, optim) was written in place since the
        capture. In-place ops bump a tensor's version counter; an optimizer step bumps at least
        its ``step`` tensors (fused AdamW on the CPU leaves the weights' counters alone)."""
        return _versions(self._kinds()[kind]) != self.versions.get(kind)


def _versions(ts: dict[str, torch.Tensor]) -> list[int]:
    return [t._version for t in ts.values()]


@dataclass(frozen=True)
class TrackerReferences:
    """The tracker's references at one moment (``UpdateTracker.save_references``)."""

    refs: dict[str, dict[str, torch.Tensor]]
    ref_norms: dict[str, float]


class UpdateTracker:
    def __init__(self, provider: StateProvider, log_path: Path | None = None):
        self.provider = provider
        self.log_path = log_path
        self._ref: dict[str, dict[str, torch.Tensor]] = {}
        self._ref_norm: dict[str, float] = {}
        self._change: dict[str, tuple[int, float]] = {}  # group -> (step measured, change)
        self._scratch = torch.empty(0)

    # ----- references (the last saved version of each group) ---------------------------

    def set_reference(self, group: str, params: dict[str, torch.Tensor]) -> None:
        """``params``: host copies of the weights just saved (by HF name); kept, not copied."""
        self._ref[group] = params
        self._ref_norm.pop(group, None)  # measured on first use, off the save's critical path
        self._change.pop(group, None)

    def drop_reference(self, group: str) -> None:
        self._ref.pop(group, None)
        self._ref_norm.pop(group, None)
        self._change.pop(group, None)

    def _reference_norm(self, group: str) -> float:
        norm = self._ref_norm.get(group)
        if norm is None:
            sq = sum(float(torch.linalg.vector_norm(t.float()) ** 2) for t in self._ref[group].values())
            norm = self._ref_norm[group] = math.sqrt(sq)
        return norm

    def has_reference(self, group: str) -> bool:
        return group in self._ref

    def reference(self, group: str) -> dict[str, torch.Tensor] | None:
        """The weights last saved for ``group`` (kept tensors, not copies), or None."""
        return self._ref.get(group)

    def reset(self, references: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
        """Forget every reference and measurement; then keep ``references`` (group -> weights,
        kept, not copied), e.g. the versions a checkpoint load just restored."""
        self._ref = dict(references or {})
        self._ref_norm.clear()  # measured on first use
        self._change.clear()

    def save_references(self) -> TrackerReferences:
        """The current references, to put back with ``restore_references`` if the save that is
        about to replace them fails."""
        return TrackerReferences(dict(self._ref), dict(self._ref_norm))

    def restore_references(self, saved: TrackerReferences) -> None:
        """Put back references taken by ``save_references``; measurements since are dropped
        (they were taken against the references being undone)."""
        self._ref = dict(saved.refs)
        self._ref_norm = dict(saved.ref_norms)
        self._change.clear()

    def forget_changes(self) -> None:
        """Drop the changes measured so far (they were read from state that is not trusted)."""
        self._change.clear()

    # ----- measurements -------------------------------------------------------------------

    def _diff_norm(self, live: torch.Tensor, ref: torch.Tensor) -> float:
        if live.device != ref.device:
            return self._diff_norm_on_device(live, ref)
        if live.dtype != torch.float32 or ref.dtype != torch.float32:
            return float(torch.linalg.vector_norm(live.float() - ref.float()))
        # Cache-sized chunks: the difference never round-trips through main memory, so the
        # cost is one read of each operand.
        a, b = live.reshape(-1), ref.reshape(-1)
        if self._scratch.numel() < CHUNK_NUMEL:
            self._scratch = torch.empty(CHUNK_NUMEL)
        sq = 0.0
        for i in range(0, a.numel(), CHUNK_NUMEL):
            n = min(CHUNK_NUMEL, a.numel() - i)
            s = self._scratch[:n]
            torch.sub(a[i:i + n], b[i:i + n], out=s)
            sq += float(torch.linalg.vector_norm(s)) ** 2
        return math.sqrt(sq)

    @staticmethod
    def _diff_norm_on_device(live: torch.Tensor, ref: torch.Tensor) -> float:
        """Live weights on a GPU, the reference on the host: bring the reference over in chunks
        (from pinned memory, asynchronously) and subtract there, one host sync at the end, rather
        than copying the whole live tensor to pageable host memory."""
        a, b = live.reshape(-1), ref.reshape(-1)
        sq = torch.zeros((), dtype=torch.float64, device=live.device)
        for i in range(0, a.numel(), CHUNK_NUMEL):
            chunk = b[i:i + CHUNK_NUMEL].to(live.device, non_blocking=b.is_pinned())
            sq += torch.linalg.vector_norm(a[i:i + CHUNK_NUMEL].float() - chunk.float()).double() ** 2
        return math.sqrt(float(sq))

    def change(self, group: str, step: int, live: dict[str, torch.Tensor] | None = None) -> float:
        """Relative L2 change since the last saved version (``inf`` if none) of ``live`` (default:
        now); a value ``observe`` measured at ``step`` is reused."""
        ref = self._ref.get(group)
        if ref is None:
            return math.inf
        if group in self._change and self._change[group][0] == step:
            return self._change[group][1]
        live = self.provider.params(group) if live is None else live
        sq = 0.0
        for n, r in ref.items():
            sq += self._diff_norm(live[n], r) ** 2
        num = math.sqrt(sq)
        den = self._reference_norm(group)
        out = num / den if den > 0 else (0.0 if num == 0 else math.inf)
        self._change[group] = (step, out)
        return out

    def capture(self) -> dict[str, LiveGroup]:
        """Every group's live tensors, by reference, for an ``observe`` made later (elsewhere)."""
        return {g: LiveGroup.capture(self.provider, g) for g in self.provider.group_names()}

    def observe(self, step: int, live: dict[str, LiveGroup] | None = None) -> dict[str, dict[str, float]]:
        """Statistics of every group at ``step``, appended to the JSONL log; NaN (``null``) for
        tensors modified in place since the capture."""
        live = self.capture() if live is None else live
        stats: dict[str, dict[str, float]] = {}
        for group, lv in live.items():
            optim = fp32_moments(lv.optim)  # 8-bit moments: the norms of their fp32 values
            m1 = [t for k, t in optim.items() if k.startswith("exp_avg/")]
            m2 = [t for k, t in optim.items() if k.startswith("exp_avg_sq/")]
            st = {
                "change": self.change(group, step, lv.params),
                "grad_norm": _norm(list(lv.grads.values())),
                "exp_avg_norm": _norm(m1),
                "exp_avg_sq_norm": _norm(m2),
            }
            if lv.modified("params"):
                st["change"] = math.nan
                self._change.pop(group, None)
            if lv.modified("grads"):
                st["grad_norm"] = math.nan
            if lv.modified("optim"):
                st["exp_avg_norm"] = st["exp_avg_sq_norm"] = math.nan
            stats[group] = st
        if self.log_path is not None:
            rec = {"step": step, "groups": {g: {k: (v if math.isfinite(v) else None) for k, v in s.items()}
                                            for g, s in stats.items()}}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return stats


def _norm(ts: list[torch.Tensor]) -> float:
    if not ts:
        return 0.0
    norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in ts])
    return float(torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms])))
