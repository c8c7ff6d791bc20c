"""Per-layer update statistics of a ``layerwise train`` run, every ``track_every`` steps, in
``RUN/tracker.jsonl`` (schema in ``docs/formats.md``).

With checkpoints the tracker is the ``Checkpointer``'s, so the change is measured once and is the
one its policy reads; without, a tracker of the run's own keeps an fp32 copy of the starting
weights (skipped, with a message, when RAM is short). Gradient norms come from the engine
(``StepStats.unit_grad_norms``): its update clears the gradients, so the tracker would read zeros.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TextIO

from ..ckpt.checkpointer import Checkpointer
from ..ckpt.store_provider import HostStoreStateProvider
from ..ckpt.tracker import UpdateTracker
from ..models.adapter import DecoderAdapter
from ..models.names import group_of
from ..store import HostStore
from ..util.atomic import atomic_write_text
from ..util.host_memory import available_host_memory

_log = logging.getLogger(__name__)

TRACKER_LOG = "tracker.jsonl"


def open_jsonl_upto(path: Path, last_step: int) -> TextIO:
    """``path`` for appending, keeping only its whole rows with ``step <= last_step`` (none for
    a fresh run, ``last_step == 0``): a killed run may have logged past its last checkpoint."""
    kept = []
    if last_step and path.exists():
        for line in path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= last_step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    atomic_write_text(path, "".join(kept))
    return open(path, "a")


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


class RunTracker:
    """Takes the statistics every ``every`` steps (0: never) and appends them to the log."""

    def __init__(self, out_dir: Path, every: int, adapter: DecoderAdapter, store: HostStore,
                 optimizers: dict, ckpt: Checkpointer | None, start_step: int):
        if every < 0:
            raise ValueError(f"track_every must be >= 0 (0: no tracker), got {every}")
        self.every = every
        self.path = out_dir / TRACKER_LOG
        self.tracker: UpdateTracker | None = None
        self.reference = "none"
        self._file: TextIO | None = None
        if not every:
            return
        self._unit_of = {group_of(p.hf_name, adapter.tied): u.name
                         for u in adapter.units for p in u.params}
        if ckpt is not None:
            self.tracker, self.reference = ckpt.tracker, "saved"
        else:
            provider = HostStoreStateProvider(store, optimizers)
            self.tracker = UpdateTracker(provider)
            need = sum(4 * b.layout.numel for b in store)  # fp32 copies, split or not
            avail = available_host_memory()
            if avail is not None and need > avail // 2:
                _log.warning(f"tracker: no reference copy of the weights ({need / 2**20:.0f} "
                             f"MiB, {avail / 2**20:.0f} MiB of RAM available): tracker.jsonl "
                             "gets norms only")
            else:
                for g in provider.group_names():
                    self.tracker.set_reference(
                        g, {n: t.clone() for n, t in provider.params(g).items()})
                self.reference = "start"
        self._file = open_jsonl_upto(self.path, start_step)

    def due(self, step: int, last: bool) -> bool:
        return self.tracker is not None and (step % self.every == 0 or last)

    def observe(self, step: int, unit_grad_norms: dict[str, float]) -> dict:
        """Statistics at ``step`` (after ``engine.synchronize()``: updates applied), one row."""
        assert self.tracker is not None and self._file is not None
        stats = self.tracker.observe(step)
        groups = {}
        for g, s in stats.items():
            grad = unit_grad_norms.get(self._unit_of.get(g, ""))
            groups[g] = {"change": _finite(s["change"]),
                         "grad_norm": None if grad is None else _finite(grad),
                         "exp_avg_norm": _finite(s["exp_avg_norm"]),
                         "exp_avg_sq_norm": _finite(s["exp_avg_sq_norm"])}
        row = {"step": step, "reference": self.reference, "groups": groups}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        return row

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
