"""Checkpoint bytes of a LoRA run: adapter-only saves against the adapter itself.

``layerwise train`` LoRA (r 16, alpha 32, every decoder linear; the pretrained demo's chats) on
a real model directory (default: SmolLM2-135M-Instruct, made by ``real_model.py``), a layer-wise
checkpoint every ``--every`` steps under each policy. Read from the disk afterwards: each save's
new blob bytes (``manifest.json``'s ``bytes_written`` less the step's own files), the exported
PEFT adapter's weights file, and the adapters' resumable state (weights + AdamW moments, as
``layerwise train`` keeps them), so that ``bytes_per_save / adapter_state_bytes`` says what a
save writes beyond what a resume needs (nothing of the frozen base).

Prints one JSON object (median over the saves after the first, which every policy writes
whole; load average printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_model import smollm2_dir  # noqa: E402
from layerwise.adapters.config import LoraConfig  # noqa: E402
from layerwise.ckpt import RunDir  # noqa: E402
from layerwise.train.config import CheckpointConfig  # noqa: E402
from layerwise.train.demo_pretrained import PretrainedDemoConfig, train_config, write_data  # noqa: E402
from layerwise.train.loop import train  # noqa: E402


def run(model_dir: Path, policy: str, root: Path, steps: int, every: int) -> dict:
    out = root / policy
    cfg = PretrainedDemoConfig(model=str(model_dir), out_dir=str(out), steps=steps,
                               lora=LoraConfig(r=16, alpha=32, merge=False))
    train_path, eval_path = write_data(out)
    tc = train_config(cfg, train_path, eval_path)
    tc.ckpt = CheckpointConfig(every=every, policy=policy)
    t0 = time.perf_counter()
    train(tc)
    wall_s = time.perf_counter() - t0
    rd = RunDir.open(out / "ckpt")
    saves = []
    for step in rd.committed_steps():
        m = rd.read_manifest(step)
        files = sum(int(f["nbytes"]) for f in m.get("files", {}).values())
        saves.append({"step": step, "blob_bytes": m["bytes_written"] - files, "files_bytes": files,
                      "groups_written": len(m["groups_written"]), "groups": len(m["groups"])})
    adapter = out / "adapter" / "adapter_model.safetensors"
    last = rd.read_manifest(rd.committed_steps()[-1])
    state_bytes = sum(int(e["nbytes"]) for e in last["groups"].values())
    later = [s["blob_bytes"] for s in saves[1:]] or [saves[0]["blob_bytes"]]
    return {"saves": saves, "adapter_file_bytes": adapter.stat().st_size,
            "adapter_state_bytes": state_bytes, "bytes_per_save_median": statistics.median(later),
            "bytes_per_save_over_state": statistics.median(later) / state_bytes,
            "first_save_over_state": saves[0]["blob_bytes"] / state_bytes,
            "first_save_over_adapter_file": saves[0]["blob_bytes"] / adapter.stat().st_size,
            "wall_s": wall_s}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a model directory (default: SmolLM2's)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--policies", default="full,parity")
    a = p.parse_args(argv)
    model_dir = Path(a.model) if a.model else smollm2_dir(fetch=False)
    if model_dir is None:
        sys.exit("no SmolLM2 directory: run `python benchmarks/real_model.py` first (pip install gguf)")
    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="ckpt_lora_") as tmp:
        runs = {pol: run(model_dir, pol, Path(tmp), a.steps, a.every) for pol in a.policies.split(",")}
    out = {"benchmark": "ckpt_lora", "model": str(model_dir), "steps": a.steps, "every": a.every,
           "policies": runs,
           "max_full_save_over_state": max(r["first_save_over_state"] for r in runs.values()),
           "load_average_start": load_start, "load_average_end": os.getloadavg()}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
