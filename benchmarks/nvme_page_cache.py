"""How much host RAM the NVMe tier's boundaries hold in the page cache while they are on disk.

Counted by the kernel (``mmap`` + ``mincore`` over each spill file, ``util/direct_io.py``), side
by side in one run, median of ``--repeats``:

- ``o_direct``: the tier as it is (``O_DIRECT`` from page-aligned pinned staging buffers);
- ``synced_dropped``: its fallback for filesystems refusing ``O_DIRECT`` (buffered write,
  ``fdatasync``, ``POSIX_FADV_DONTNEED``);
- ``buffered_before``: the same bytes written as the tier wrote them before (buffered Python
  ``write``, nothing synced or dropped).

Two measurements per mode: right after the tier has written ``--boundaries`` boundaries (the
files are still on disk; with the write and read-back rates), and the largest count sampled
(every 5 ms) during a training step of a small model whose plan puts every boundary on NVMe.
Step times are for the record only: on a loaded machine they are noise next to 16 MiB of I/O. Prints one JSON object; ``nvme_tier_page_cache_bytes`` is
the first, for ``o_direct`` (target ~0).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import torch

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.backend import CpuBackend, Ref
from layerwise.engine.batch import Batch
from layerwise.engine.boundary_tiers import BoundaryTiers
from layerwise.models import get_flavor
from layerwise.plan import Plan
from layerwise.store import init_store
from layerwise.util import direct_io

MODES = ("o_direct", "synced_dropped", "buffered_before")


def _write_before(path, buf, nbytes, block, direct=True) -> bool:
    """The tier's write before ``O_DIRECT``: buffered, nothing synced or dropped."""
    with open(path, "wb") as f:
        f.write(buf[:nbytes])
    return False


class _Mode:
    """Runs the tier (and the engine, which builds its own) in one of ``MODES``."""

    def __init__(self, mode: str):
        self.mode = mode

    def __enter__(self):
        self._write = direct_io.write_file
        if self.mode == "buffered_before":
            direct_io.write_file = _write_before
        return self.mode == "o_direct"  # the tier's ``direct_io`` flag

    def __exit__(self, *exc):
        direct_io.write_file = self._write


def after_writes(mode: str, spill: str, count: int, numel: int) -> dict:
    """Store ``count`` boundaries on NVMe, wait for the writes, count resident bytes, read back."""
    with _Mode(mode) as direct:
        tiers = BoundaryTiers(CpuBackend(), spill, direct_io=direct)
        tiers.prepare(numel, torch.float32, num_offloaded=count, num_nvme=count)
        data = torch.randn(numel)
        t0 = time.perf_counter()
        for i in range(count):
            tiers.store(i, Ref(data), (numel,), "nvme")
        paths = [tiers._entries[i].stored.result()[0] for i in range(count)]
        write_s = time.perf_counter() - t0
        on_disk = sum(os.path.getsize(p) for p in paths)
        resident = tiers.page_cache_bytes()
        ok, read_s = True, 0.0
        for i in range(count):
            t0 = time.perf_counter()
            tiers.fetch(i)  # the file read, then the copy into a fetch slot
            read_s += time.perf_counter() - t0
            ok &= bool(torch.equal(tiers.on_device[i].reshape(-1), data))
            tiers.drop(i)
        tiers.close()
    return {"resident_bytes": resident, "on_disk_bytes": on_disk, "write_s": write_s, "read_s": read_s,
            "round_trip_exact": ok}


def during_step(mode: str, spill: str, layers: int, seq: int) -> dict:
    """The largest page-cache count of the NVMe boundaries sampled during a training step."""
    cfg = get_flavor("llama-30m").build_config(num_hidden_layers=layers)
    adapter, store = init_store(cfg)
    plan = Plan(["nvme"] * layers)
    with _Mode(mode) as direct:
        engine = StreamingEngine(adapter, store, plan, EngineConfig(spill_dir=spill))
        engine.acts.direct_io = direct
        ids = torch.randint(0, cfg.vocab_size, (2, seq))
        engine.compute_grads([Batch(ids, ids)])  # warm-up (staging buffers, fetch slots)
        peak, stop = [0], threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], engine.acts.page_cache_bytes())
                time.sleep(0.005)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        engine.compute_grads([Batch(ids, ids)])
        step_s = time.perf_counter() - t0
        stop.set()
        sampler.join()
        written = engine.acts.nvme_bytes_written // 2  # two steps so far
        engine.close()
    return {"max_resident_bytes": peak[0], "nvme_bytes_per_step": written, "step_s": step_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller boundaries and model")
    ap.add_argument("--spill-dir", default=None, help="where the NVMe tier writes (default: a temp dir)")
    ap.add_argument("--boundaries", type=int, default=None, help="boundaries written per repeat (4 quick, 8)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    numel = (2 << 20) if args.quick else (8 << 20)  # fp32: 8 MiB / 32 MiB per boundary
    count = args.boundaries or (4 if args.quick else 8)
    layers, seq = (4, 128) if args.quick else (8, 512)
    root = args.spill_dir or tempfile.gettempdir()
    load_start = os.getloadavg()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="nvme-page-cache-", dir=root) as spill:
        for mode in MODES:
            results[mode] = {"after_writes": [], "during_step": []}
        for _ in range(args.repeats):  # modes interleaved: the machine's drift hits all alike
            for mode in MODES:
                results[mode]["after_writes"].append(after_writes(mode, spill, count, numel))
                results[mode]["during_step"].append(during_step(mode, spill, layers, seq))
        fs = direct_io.filesystem_type(spill)
        block = direct_io.io_block_bytes(spill)
    summary = {}
    for mode, r in results.items():
        aw, ds = r["after_writes"], r["during_step"]
        on_disk = aw[0]["on_disk_bytes"]
        summary[mode] = {
            "resident_after_writes_bytes": int(statistics.median(x["resident_bytes"] for x in aw)),
            "resident_after_writes_fraction": round(statistics.median(x["resident_bytes"] for x in aw) / on_disk, 4),
            "write_gbps": round(on_disk / statistics.median(x["write_s"] for x in aw) / 1e9, 3),
            "read_gbps": round(on_disk / statistics.median(x["read_s"] for x in aw) / 1e9, 3),
            "round_trip_exact": all(x["round_trip_exact"] for x in aw),
            "max_resident_during_step_bytes": int(statistics.median(x["max_resident_bytes"] for x in ds)),
            "nvme_bytes_per_step": ds[0]["nvme_bytes_per_step"],
            "step_s": round(statistics.median(x["step_s"] for x in ds), 3),
        }
    out = {
        "benchmark": "nvme_page_cache",
        "nvme_tier_page_cache_bytes": summary["o_direct"]["resident_after_writes_bytes"],
        "nvme_tier_page_cache_bytes_buffered_before": summary["buffered_before"]["resident_after_writes_bytes"],
        "nvme_tier_page_cache_bytes_during_step": summary["o_direct"]["max_resident_during_step_bytes"],
        "modes": summary,
        "inputs": {"boundaries": count, "boundary_bytes": numel * 4, "repeats": args.repeats,
                   "step_model": f"llama-30m, {layers} layers, batch 2 x seq {seq}, every boundary on nvme",
                   "quick": args.quick},
        "spill": {"filesystem": fs, "block_bytes": block, "in_ram": fs in direct_io.RAM_FILESYSTEMS},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "load_avg_start": [round(x, 2) for x in load_start],
                    "load_avg_end": [round(x, 2) for x in os.getloadavg()]},
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
