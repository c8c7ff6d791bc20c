"""One rank of a test's data-parallel launch (``tests/train/test_distributed.py``): ``main``,
run by ``multiproc`` with torchrun's variables.

Argument: a JSON file with a list of runs ``{"overrides": [...], "port": int, "memory": path?}``;
each is ``train()`` of a small TrainConfig with those overrides, run one after the other with a
fresh process group (joined through the store at ``port``, which the test process holds).
``memory``: sample this process's ``/proc/self/smaps_rollup`` during the run and write the level
sample (``MemorySampler``) to ``<memory>.<rank>``. ``copied``: write the bytes each copy lane
of the run's engine moved (``copied_bytes``, at ``close``) to ``<copied>.<rank>``. ``env``:
variables set for that run and the ones after it. ``stall_in_blob_writes``: ``{"rank", "step", "marker"}``, a fault
(``stall_in_blob_writes``) for that run and the ones after it.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from layerwise import config
from layerwise.ckpt.checkpointer import Checkpointer
from layerwise.ckpt.run_dir import RunDir
from layerwise.engine.executor import StreamingEngine
from layerwise.train.loop import TrainConfig, train
from layerwise.util.logs import command_output

BASE = dict(model="llama-demo", seq_len=32, data={"corpus_tokens": 20_000},
            eval={"every": 0, "batches": 1}, log={"every": 1, "progress": "lines", "track_every": 0},
            schedule={"warmup_steps": 0, "min_lr_ratio": 1.0})


def smaps_rollup_kib() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        out[key] = int(rest.split()[0])
    return out


class MemorySampler:
    """Samples ``smaps_rollup`` every 10 ms. A rank's ``Pss_Shmem`` rises while it touches the
    store, halves page by page as the other rank touches the same pages, stays level through
    training, then falls to ~0 when the store is freed; the reported sample is the last one at
    least half the peak: the level, with the store still mapped."""

    def __init__(self) -> None:
        self.samples: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.samples.append(smaps_rollup_kib())

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        peak = max(s["Pss_Shmem"] for s in self.samples)
        return [s for s in self.samples if s["Pss_Shmem"] >= peak / 2][-1]


def stall_in_blob_writes(step: int, marker: str) -> None:
    """A fault: in the save of ``step`` (or the first save after it), this process stops for good
    right after it has handed its first blob of that save to the run directory (the bytes
    written, their fsync and rename possibly still running), and writes to ``marker``
    (atomically) where it stopped, so the test can kill it there and check:
    ``{"armed_at_save": s, "latest_committed": c}``, ``c`` the run's newest commit as this rank
    sees it then (the save it stopped in is ``c + 1``).

    It arms only once the previous save has finished (``Checkpointer.wait``): a save writes in
    the background and the next ``save`` first waits for it, so a fault armed on entry to
    ``save`` could stop the previous save's blobs instead (step 2 then never commits)."""
    save, put_blob = Checkpointer.save, RunDir.put_blob
    armed: list[int] = []

    def save_then_arm(self, at: int, *args, **kwargs):
        if at >= step and not armed:
            self.wait()
            armed.append(at)
        return save(self, at, *args, **kwargs)

    def put_blob_then_stall(self, *args, **kwargs):
        rec = put_blob(self, *args, **kwargs)
        if armed:
            part = f"{marker}.part"
            Path(part).write_text(json.dumps({"armed_at_save": armed[0],
                                              "latest_committed": self.latest_step()}))
            os.replace(part, marker)
            threading.Event().wait()  # for good: the test kills this process or leaves it so
        return rec

    Checkpointer.save, RunDir.put_blob = save_then_arm, put_blob_then_stall


@contextmanager
def copied_bytes_to(path: str | None) -> Iterator[None]:
    """Inside: at ``close``, each engine writes its copy lanes' byte counters to ``path``
    (None: nothing)."""
    close = StreamingEngine.close

    def close_then_write(self):
        Path(path).write_text(json.dumps(self.backend.copied_bytes))
        close(self)

    if path is not None:
        StreamingEngine.close = close_then_write
    try:
        yield
    finally:
        StreamingEngine.close = close


def main(rank: int, spec: str) -> None:
    runs = json.loads(Path(spec).read_text())
    for run in runs:
        os.environ.update(MASTER_PORT=str(run["port"]), **run.get("env", {}))
        fault = run.get("stall_in_blob_writes")
        if fault is not None and rank == fault["rank"]:
            stall_in_blob_writes(fault["step"], fault["marker"])
        cfg = config.apply_overrides(TrainConfig(**BASE), run["overrides"])
        sampler = MemorySampler() if run.get("memory") else None
        copied = f"{run['copied']}.{rank}" if run.get("copied") else None
        # rank 0's lines on stdout, as under `layerwise train`
        with command_output(), copied_bytes_to(copied):
            train(cfg)
        if sampler is not None:
            Path(f"{run['memory']}.{rank}").write_text(json.dumps(sampler.stop()))
