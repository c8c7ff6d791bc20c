"""gloo on host memory: what a data-parallel reduction of fp32 gradients costs on this machine.

Two processes (``--world``) on one node, as ``train/`` runs them on the CPU backends (and as the
``dist.grad_reduce=host`` path runs on a GPU machine): ``dist.reduce`` to one rank and
``dist.all_reduce`` of fp32 host tensors of a layer's gradient size, timed by rank 0 (median of
``--reps`` after a warm-up), next to a single-process ``copy_`` of the same bytes in the same run
(the memory bus's pace, the ratio's denominator).

Bandwidths: ``algbw`` = tensor bytes / time; ``busbw`` = algbw x (G-1)/G for the reduce and
x 2(G-1)/G for the all-reduce (NCCL's convention): the figure ``plan.topology`` divides by
(``intra_reduce_s`` prices a reduce as (G-1)/G of the bytes over the link).

Usage: ``python benchmarks/gloo_reduce.py [--quick] [--world 2]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time(fn, reps: int) -> float:
    fn()  # warm-up: connections, pages
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rank(rank: int, world: int, init_file: str, sizes: list[int], reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    rows = {}
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32)

        def reduce() -> None:
            dist.reduce(t, dst=0)
            dist.barrier()  # every rank done: the reduce's end, not rank 0's part alone

        def all_reduce() -> None:
            dist.all_reduce(t)

        rows[nbytes] = {"reduce_s": _time(reduce, reps), "all_reduce_s": _time(all_reduce, reps)}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two sizes, 3 repetitions")
    ap.add_argument("--world", type=int, default=2, help="processes")
    args = ap.parse_args()
    mib = 2**20
    sizes = [4 * mib, 32 * mib] if args.quick else [4 * mib, 32 * mib, 128 * mib]
    reps = 3 if args.quick else 7
    g = args.world
    with tempfile.TemporaryDirectory(prefix="layerwise-gloo-") as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_rank, args=(g, os.path.join(tmp, "init"), sizes, reps, out), nprocs=g,
                           start_method="spawn")
        with open(out) as f:
            rows = {int(k): v for k, v in json.load(f).items()}
    torch.set_num_threads(1)
    results = {}
    for nbytes in sizes:
        src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
        copy_s = _time(lambda: dst.copy_(src), reps)
        r, a = rows[nbytes]["reduce_s"], rows[nbytes]["all_reduce_s"]
        results[str(nbytes)] = {
            "reduce_algbw_gbps": round(nbytes / r / 1e9, 3),
            "reduce_busbw_gbps": round(nbytes / r / 1e9 * (g - 1) / g, 3),
            "all_reduce_algbw_gbps": round(nbytes / a / 1e9, 3),
            "all_reduce_busbw_gbps": round(nbytes / a / 1e9 * 2 * (g - 1) / g, 3),
            "copy_gbps": round(nbytes / copy_s / 1e9, 3),
            "reduce_over_copy": round(copy_s / r, 4),
        }
    largest = results[str(sizes[-1])]
    print(json.dumps({
        "benchmark": "gloo_reduce", "world": g, "sizes_bytes": sizes, "reps": reps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "torch": torch.__version__, "python": sys.version.split()[0],
                    "loadavg": open("/proc/loadavg").read().split()[:3]},
        "by_size": results,
        "host_reduce_busbw_gbps": largest["reduce_busbw_gbps"],
    }))


if __name__ == "__main__":
    main()
