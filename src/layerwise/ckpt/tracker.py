"""Per-group update statistics: how far each group moved since the version last saved.

The relative L2 change ``|w - w_saved| / |w_saved|`` drives the ``filter``, ``topk`` and
``budget`` policies. The reference ``w_saved`` is the host snapshot the checkpointer took when it
last saved the group (shared, not copied again), so tracking costs one weight copy of memory in
total. Gradient and Adam-moment norms are logged alongside for diagnosis.

Cost is a few passes over the weights (no allocation: a reused scratch buffer), so statistics are
taken every ``every_steps`` steps (and at every save) rather than at every step; see
``docs/benchmarks.md`` for the measured overhead.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .state import StateProvider


@dataclass
class TrackerConfig:
    every_steps: int = 10
    """Take (and log) statistics every N steps; saves always get fresh weight changes."""
    log_name: str | None = "tracker.jsonl"
    """JSONL log file in the run directory (None: no log)."""


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
        sq = sum(float(torch.linalg.vector_norm(t.float()) ** 2) for t in params.values())
        self._ref_norm[group] = math.sqrt(sq)
        self._change.pop(group, None)

    def has_reference(self, group: str) -> bool:
        return group in self._ref

    # ----- measurements -------------------------------------------------------------------

    def _diff_norm(self, live: torch.Tensor, ref: torch.Tensor) -> float:
        if live.device != ref.device:
            live = live.to(ref.device)
        if live.dtype != torch.float32 or ref.dtype != torch.float32:
            return float(torch.linalg.vector_norm(live.float() - ref.float()))
        n = live.numel()
        if self._scratch.numel() < n:
            self._scratch = torch.empty(n)
        s = self._scratch[:n].view(live.shape)
        torch.sub(live, ref, out=s)
        return float(torch.linalg.vector_norm(s))

    def change(self, group: str, step: int | None = None) -> float:
        """Relative L2 change since the last saved version (``inf`` if none yet).

        A value measured at ``step`` already (by ``observe``) is reused.
        """
        ref = self._ref.get(group)
        if ref is None:
            return math.inf
        if step is not None and group in self._change and self._change[group][0] == step:
            return self._change[group][1]
        live = self.provider.params(group)
        sq = 0.0
        for n, r in ref.items():
            sq += self._diff_norm(live[n], r) ** 2
        num = math.sqrt(sq)
        out = num / self._ref_norm[group] if self._ref_norm[group] > 0 else (0.0 if num == 0 else math.inf)
        if step is not None:
            self._change[group] = (step, out)
        return out

    def observe(self, step: int) -> dict[str, dict[str, float]]:
        """Statistics of every group at ``step`` (call after ``optimizer.step()``, before
        ``zero_grad``); appended to the JSONL log."""
        stats: dict[str, dict[str, float]] = {}
        for group in self.provider.group_names():
            grads = list(self.provider.grads(group).values())
            opt = self.provider.optimizer_state(group)
            m1 = [t for k, t in opt.items() if k.startswith("exp_avg/")]
            m2 = [t for k, t in opt.items() if k.startswith("exp_avg_sq/")]
            stats[group] = {
                "change": self.change(group, step),
                "grad_norm": _norm(grads),
                "exp_avg_norm": _norm(m1),
                "exp_avg_sq_norm": _norm(m2),
            }
        if self.log_path is not None:
            rec = {"step": step, "groups": {g: {k: (None if math.isinf(v) else v) for k, v in s.items()}
                                            for g, s in stats.items()}}
            with open(self.log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        return stats


def _norm(ts: list[torch.Tensor]) -> float:
    if not ts:
        return 0.0
    norms = torch._foreach_norm([t.float() if t.dtype != torch.float32 else t for t in ts])
    return float(torch.linalg.vector_norm(torch.stack([n.float().cpu() for n in norms])))
