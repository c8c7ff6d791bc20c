"""Write throughput of a full layer-wise save vs the disk and vs ``torch.save``.

A ~1B-parameter training state (TinyLlama-1.1B shapes: weights + both AdamW moments, fp32,
random values, 13.2 GB) is written four ways, side by side in one run:

- ``disk``: the disk's sequential write bandwidth: one file of the state's size written in
  64 MiB blocks (from the same random pool) and fsynced;
- ``layerwise``: a synchronous ``full`` save through ``Checkpointer`` into a new run (one
  safetensors blob per group named by its BLAKE3, hashed on a second thread while written,
  fsync per file, manifest last), straight from the live tensors (``sync_copy=False``);
- ``layerwise_sha256``: the same save with the hash replaced by sha256 (diagnostic only: no run
  format uses it), to show the hash's share side by side;
- ``torch.save``: the same tensors, one ``torch.save`` file per group, each fsynced.

To stay far below the machine's memory, every tensor is a view into one 1 GiB pool of random
values (at rotating offsets): the bytes written are those of the full state.

The three are interleaved for ``--rounds`` rounds and medians compared (the disk's speed drifts).
Every figure includes its fsync, so all are durable writes. A diagnostic write
(``write_gbps_without_hash``) repeats the layer-wise save with the hash replaced by a no-op,
to show what checksumming every byte costs on the machine. Prints one JSON object;
``--quick`` uses a ~0.2B-parameter state (under 2 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from layerwise.ckpt import Checkpointer, content_hash, run_format
from layerwise.ckpt.provider import DictStateProvider

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


def random_state(shapes: dict[str, dict[str, tuple]], pool_numel: int, seed: int = 0
                 ) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
    """Every tensor a contiguous view into one pool of random fp32 values, at rotating offsets.

    The bytes written are those of a full 1B-parameter state (random, incompressible within a
    tensor) while resident memory stays at the pool's size.
    """
    gen = torch.Generator().manual_seed(seed)
    pool = torch.empty(pool_numel).uniform_(-0.05, 0.05, generator=gen)
    offset, stride = 0, 4099  # odd stride: views start at different places every time
    out = {}

    def view(shape: tuple) -> torch.Tensor:
        nonlocal offset
        n = math.prod(shape)
        assert n <= pool_numel, "pool smaller than one tensor"
        if offset + n > pool_numel:
            offset = (offset + stride) % (pool_numel - n + 1)
            offset = min(offset, pool_numel - n)
        t = pool[offset:offset + n].view(shape)
        offset += n
        return t

    for group, params in shapes.items():
        ts = {}
        for name, shape in params.items():
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                ts[f"{kind}/{name}"] = view(shape)
            ts[f"step/{name}"] = torch.tensor(100.0)
        out[group] = ts
    return out, pool


def disk_write_s(path: Path, nbytes: int, source: torch.Tensor) -> float:
    """One file of ``nbytes`` written sequentially in 64 MiB blocks from ``source`` (the random
    pool, cycled: as cold in cache as the state itself), then fsynced."""
    src = memoryview(source.view(torch.uint8).numpy()).cast("B")
    t = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left, pos = nbytes, 0
        while left > 0:
            if pos >= len(src):
                pos = 0
            n = os.write(fd, src[pos:pos + min(left, BLOCK_BYTES, len(src) - pos)])
            left -= n
            pos += n
        os.fsync(fd)
    finally:
        os.close(fd)
    dt = time.perf_counter() - t
    path.unlink()
    return dt




def layerwise_save_s(run: Path, state: dict) -> tuple[float, int]:
    """Seconds and bytes of one synchronous full save, straight from the live tensors, into a
    new run."""
    shutil.rmtree(run, ignore_errors=True)
    ck = Checkpointer(run, provider=DictStateProvider(state), policy="full", async_save=False,
                      sync_copy=False, save_rng=False, tracker_log=False)
    t = time.perf_counter()
    rep = ck.save(1)
    dt = time.perf_counter() - t
    ck.close()
    shutil.rmtree(run)
    return dt, rep.bytes_written


@contextlib.contextmanager
def _hash_replaced(hasher):
    """Diagnostic only: saves with the run's hash replaced by ``hasher`` (a ``hashlib``-like
    factory). Never a mode of the product."""
    name = content_hash.CONTENT_HASH
    real = content_hash.HASHES[name]
    content_hash.HASHES[name] = hasher
    try:
        yield
    finally:
        content_hash.HASHES[name] = real


def _no_hash():
    """The same save with a no-op hash (unique fake names), to show what the hash of every byte
    costs on this machine."""

    class NoHash:
        def __init__(self, data: bytes = b""):
            pass

        def update(self, data) -> None:
            pass

        def hexdigest(self) -> str:
            return os.urandom(32).hex()

    return _hash_replaced(NoHash)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="~0.2B-parameter state (< 2 minutes)")
    p.add_argument("--pool-numel", type=int, default=1 << 28,
                   help="random fp32 values actually held in memory (1 GiB); tensors are views into it")
    p.add_argument("--no-probe-hash-cost", dest="probe_hash_cost", action="store_false",
                   help="skip the diagnostic save with a no-op hash (write_gbps_without_hash)")
    p.add_argument("--no-sha256", dest="sha256", action="store_false",
                   help="skip the diagnostic save with sha256 in place of the run's hash")
    p.add_argument("--rounds", type=int, default=3, help="interleaved measurement rounds (medians)")
    p.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    a = p.parse_args(argv)
    # TinyLlama-1.1B: vocab 32000, hidden 2048, intermediate 5632, 22 layers, 4 KV heads of 64.
    shapes = (llama_shapes(32000, 2048, 5632, 3, 256) if a.quick
              else llama_shapes(32000, 2048, 5632, 22, 256))
    load_start = os.getloadavg()
    root = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="ckpt_io_"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    state, pool = random_state(shapes, a.pool_numel)
    gen_s = time.perf_counter() - t0
    num_params = sum(t.numel() for g in state.values() for k, t in g.items() if k.startswith("param/"))
    nbytes = sum(t.numel() * t.element_size() for g in state.values() for t in g.values())

    disk_s, ours_s, torch_s, nohash_s, sha_s = [], [], [], [], []
    ours_bytes = torch_bytes = 0
    for _ in range(a.rounds):  # interleaved rounds: the disk's mood drifts, medians compare alike
        os.sync()
        disk_s.append(disk_write_s(root / "disk.bin", nbytes, pool))

        os.sync()
        run = root / "run"
        shutil.rmtree(run, ignore_errors=True)
        dt, ours_bytes = layerwise_save_s(run, state)
        ours_s.append(dt)

        if a.sha256:
            os.sync()
            with _hash_replaced(hashlib.sha256):
                sha_s.append(layerwise_save_s(run, state)[0])

        if a.probe_hash_cost:
            os.sync()
            with _no_hash():
                nohash_s.append(layerwise_save_s(run, state)[0])

        os.sync()
        # torch.save needs its tensors in their own storages (views would save the whole pool),
        # so each group is materialised (untimed) and saved to its own file (timed, with fsync).
        dt, torch_bytes = 0.0, 0
        for group, ts in state.items():
            own = {k: v.clone() for k, v in ts.items()}
            path = root / f"torch-{group}.pt"
            t = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(own, f)
                f.flush()
                os.fsync(f.fileno())
            dt += time.perf_counter() - t
            torch_bytes += path.stat().st_size
            del own
        torch_s.append(dt)
        for group in state:
            (root / f"torch-{group}.pt").unlink()
    if not a.dir:
        shutil.rmtree(root, ignore_errors=True)

    disk_gbps = nbytes / statistics.median(disk_s) / 1e9
    write_gbps = ours_bytes / statistics.median(ours_s) / 1e9
    torch_gbps = torch_bytes / statistics.median(torch_s) / 1e9
    sha_gbps = ours_bytes / statistics.median(sha_s) / 1e9 if sha_s else None
    out = {
        "benchmark": "ckpt_io",
        "inputs": {"quick": a.quick, "num_params": num_params, "state_bytes": nbytes,
                   "groups": len(state), "block_bytes": BLOCK_BYTES, "rounds": a.rounds,
                   "pool_numel": a.pool_numel, "format_version": run_format.FORMAT_VERSION,
                   "hash": content_hash.CONTENT_HASH,
                   "blake3_max_threads": content_hash.BLAKE3_MAX_THREADS, "chunk_bytes": content_hash.CHUNK_BYTES},
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "write_gbps": write_gbps,
        "disk_gbps": disk_gbps,
        "torch_save_gbps": torch_gbps,
        "fraction_of_disk": write_gbps / disk_gbps,
        "write_gbps_sha256": sha_gbps,
        "sha256_fraction_of_disk": sha_gbps / disk_gbps if sha_gbps else None,
        "write_gbps_without_hash": (ours_bytes / statistics.median(nohash_s) / 1e9) if nohash_s else None,
        "layerwise_without_hash_s": nohash_s,
        "torch_save_fraction_of_disk": torch_gbps / disk_gbps,
        "layerwise_s": ours_s,
        "layerwise_sha256_s": sha_s,
        "torch_save_s": torch_s,
        "disk_s": disk_s,
        "generate_s": gen_s,
        "wall_s": time.perf_counter() - t0,
        "targets": {"fraction_of_disk>=0.9": write_gbps / disk_gbps >= 0.9},
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
