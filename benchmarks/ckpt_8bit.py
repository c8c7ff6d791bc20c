"""Checkpoint bytes per parameter when the optimizer keeps 8-bit moments (run format 3).

The streaming engine trains a model with three moment plans, side by side in one run: ``fp32``
everywhere, ``8bit`` everywhere, and ``mixed`` (the demo's: embedding and head fp32, decoder
layers 8-bit). Each takes three steps with a synchronous ``full`` save after each; the bytes are
measured from the blob files on the disk (the step's manifest names them), the save time with
the clock (median of the three saves). Prints one JSON object; ``--quick`` uses ``llama-demo``.

    python benchmarks/ckpt_8bit.py [--quick] [--flavor llama-30m]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from layerwise.ckpt import Checkpointer, RunDir
from layerwise.ckpt.store_provider import HostStoreStateProvider
from layerwise.engine import StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.models import get_flavor
from layerwise.plan import Plan
from layerwise.store import init_store

PLANS = {
    "fp32": lambda n: ["fp32"] * (n + 2),
    "8bit": lambda n: ["8bit"] * (n + 2),
    "mixed": lambda n: ["fp32"] + ["8bit"] * n + ["fp32"],
}


def measure(flavor: str, moments: str, root: Path, steps: int = 3) -> dict:
    cfg = get_flavor(flavor).build_config()
    adapter, store = init_store(cfg, seed=0)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 2,
                                                          moments=PLANS[moments](adapter.num_layers)))
    provider = HostStoreStateProvider(store, engine.optimizers)
    g = torch.Generator().manual_seed(0)
    save_s, per_step = [], []
    run = root / moments
    with Checkpointer(run, provider=provider, policy="full", async_save=False,
                      tracker_log=False) as ck:
        for step in range(1, steps + 1):
            ids = torch.randint(0, cfg.vocab_size, (2, 129), generator=g)
            engine.train_step([Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())])
            engine.synchronize()
            t0 = time.perf_counter()
            ck.save(step)
            save_s.append(time.perf_counter() - t0)
            m = RunDir.open(run).read_manifest(step)
            per_step.append(sum((run / e["blob"]).stat().st_size for e in m["groups"].values()))
    num_params = sum(b.layout.numel for b in store)
    engine.close()
    return {"num_params": num_params, "step_blob_bytes": per_step[-1],
            "bytes_per_param": round(per_step[-1] / num_params, 4),
            "save_s_median": round(statistics.median(save_s), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flavor", default="llama-30m")
    ap.add_argument("--quick", action="store_true", help="llama-demo (0.9M parameters)")
    a = ap.parse_args()
    flavor = "llama-demo" if a.quick else a.flavor
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as d:
        res = {m: measure(flavor, m, Path(d)) for m in PLANS}
    print(json.dumps({
        "benchmark": "ckpt_8bit", "flavor": flavor, "results": res,
        "bytes_ratio_8bit_over_fp32": round(res["8bit"]["step_blob_bytes"] / res["fp32"]["step_blob_bytes"], 4),
        "save_s_ratio_8bit_over_fp32": round(res["8bit"]["save_s_median"] / res["fp32"]["save_s_median"], 4),
        "target_bytes_per_param_8bit": 6.2,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
    }))


if __name__ == "__main__":
    main()
