"""Write throughput of a full layer-wise save vs the disk and vs ``torch.save``.

A ~1B-parameter training state (TinyLlama-1.1B shapes: weights + both AdamW moments, fp32,
random values, ~13 GB) is written three ways, side by side in one run:

- ``disk``: the disk's sequential write bandwidth: one file of the state's size written in
  64 MiB blocks and fsynced;
- ``layerwise``: a synchronous ``full`` save through ``Checkpointer`` (one safetensors blob per
  group, sha256 on a second thread, fsync per file, manifest last), straight from the live
  tensors (``sync_copy=False``);
- ``torch.save``: the same tensors in one ``torch.save`` file, then fsync.

The three are interleaved for ``--rounds`` rounds and medians compared (the disk's speed drifts).
Every figure includes its fsync, so all three are durable writes. Prints one JSON object;
``--quick`` uses a ~0.2B-parameter state (under 2 minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from layerwise.ckpt import Checkpointer
from layerwise.ckpt.state import DictStateProvider

BLOCK_BYTES = 64 << 20


def llama_shapes(vocab: int, hidden: int, inter: int, layers: int, kv_dim: int) -> dict[str, dict[str, tuple]]:
    g = {"embed": {"model.embed_tokens.weight": (vocab, hidden)}}
    for i in range(layers):
        p = f"model.layers.{i}."
        g[f"layers.{i}"] = {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    g["norm"] = {"model.norm.weight": (hidden,)}
    g["lm_head"] = {"lm_head.weight": (vocab, hidden)}
    return g


def random_state(shapes: dict[str, dict[str, tuple]], seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for group, params in shapes.items():
        ts = {}
        for name, shape in params.items():
            ts[f"param/{name}"] = torch.empty(shape).uniform_(-0.05, 0.05, generator=gen)
            ts[f"exp_avg/{name}"] = torch.empty(shape).uniform_(-1e-3, 1e-3, generator=gen)
            ts[f"exp_avg_sq/{name}"] = torch.empty(shape).uniform_(0, 1e-6, generator=gen)
            ts[f"step/{name}"] = torch.tensor(100.0)
        out[group] = ts
    return out


def disk_write_s(path: Path, nbytes: int) -> float:
    block = memoryview(os.urandom(BLOCK_BYTES))
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            n = os.write(fd, block[: min(left, BLOCK_BYTES)])
            left -= n
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t
    path.unlink()
    return dt




def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="~0.2B-parameter state (< 2 minutes)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (medians)")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    a = p.parse_args(argv)
    # TinyLlama-1.1B: vocab 32000, hidden 2048, intermediate 5632, 22 layers, 4 KV heads of 64.
    shapes = (llama_shapes(32000, 2048, 5632, 3, 256) if a.quick
              else llama_shapes(32000, 2048, 5632, 22, 256))
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="ckpt_io_"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    state = random_state(shapes)
    gen_s = time.perf_counter() - t0
    num_params = sum(t.numel() for g in state.values() for k, t in g.items() if k.startswith("param/"))
    nbytes = sum(t.numel() * t.element_size() for g in state.values() for t in g.values())

    flat = {k: v for g in state.values() for k, v in g.items()}
    disk_s, ours_s, torch_s = [], [], []
    ours_bytes = torch_bytes = 0
    for _ in range(a.rounds):  # interleaved rounds: the disk's mood drifts, medians compare alike
        os.sync()
        disk_s.append(disk_write_s(root / "disk.bin", nbytes))

        os.sync()
        run = root / "run"
        shutil.rmtree(run, ignore_errors=True)
        ck = Checkpointer(run, provider=DictStateProvider(state), policy="full", async_save=False,
                          sync_copy=False, save_rng=False, tracker_log=False)
        t = time.perf_counter()
        rep = ck.save(1)
        ours_s.append(time.perf_counter() - t)
        ours_bytes = rep.bytes_written
        ck.close()
        shutil.rmtree(run)

        os.sync()
        t = time.perf_counter()
        with open(root / "state.pt", "wb") as f:
            torch.save(flat, f)
            f.flush()
            os.fsync(f.fileno())
        torch_s.append(time.perf_counter() - t)
        torch_bytes = (root / "state.pt").stat().st_size
        (root / "state.pt").unlink()
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)

    disk_gbps = nbytes / statistics.median(disk_s) / 1e9
    write_gbps = ours_bytes / statistics.median(ours_s) / 1e9
    torch_gbps = torch_bytes / statistics.median(torch_s) / 1e9
    out = {
        "benchmark": "ckpt_io",
        "inputs": {"quick": a.quick, "num_params": num_params, "state_bytes": nbytes,
                   "groups": len(state), "block_bytes": BLOCK_BYTES, "rounds": a.rounds},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__},
        "write_gbps": write_gbps,
        "disk_gbps": disk_gbps,
        "torch_save_gbps": torch_gbps,
        "fraction_of_disk": write_gbps / disk_gbps,
        "torch_save_fraction_of_disk": torch_gbps / disk_gbps,
        "layerwise_s": ours_s,
        "torch_save_s": torch_s,
        "disk_s": disk_s,
        "generate_s": gen_s,
        "wall_s": time.perf_counter() - t0,
        "targets": {"fraction_of_disk>=0.8": write_gbps / disk_gbps >= 0.8},
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
