"""Data-parallel scaling: the step time of 1 process and of 2 processes on the same global batch.

Measured part (this machine's CPUs, gloo): ``layerwise train`` run alone with a global batch of
``B`` rows per micro-batch, and as 2 ranks launched the way ``torchrun --nproc-per-node 2``
launches them (RANK/WORLD_SIZE/LOCAL_RANK/... in the environment) with ``B/2`` rows each. Both
split the same cores: the single process gets ``T`` intra-op threads, each rank ``T/2``. The
step time is each run's own median step time after the first (``run.json``'s
``measured_step_s``, the engine's clock around ``train_step``, rank 0's, which includes waiting
for the other rank in the collectives). The two are interleaved for ``--rounds`` rounds and
the medians compared: ``speedup_2proc = step_s_1proc / step_s_2proc``. The 2 ranks run with the
gradients reduced on the "device" (the default; here host tensors, the reduction inline on the
synchronous CPU backend's compute thread) and, interleaved with them, on the host
(``dist.grad_reduce=host``: the fp32 sum reduced on the landing side):
``device_over_host_reduce_step``.

On 2 shared cores expect little: the ranks contend for the same cores the single process
already uses, and add a reduction and a second store of gradients. The figure that matters is
on GPUs, where each rank has its own device.

Save part: one layer-wise save of a model's whole state (``full`` policy; weights and AdamW
moments changed before every save, so nothing is deduplicated) by the 2 processes of one gloo
launch, each holding an identical copy of the store (as two nodes do), in two run directories
side by side: written by rank 0 alone (``mine=`` every group on rank 0, none on rank 1) and by
both ranks (the groups ``train/dist/saving.group_writers`` deals them). The time is rank 0's
wall clock from ``save`` to ``wait`` returning (the commit), both ranks starting together after
a barrier; the two kinds are interleaved for ``--rounds`` rounds (``save_s_1writer``,
``save_s_2writers``, medians). Runs in a temp directory under ``TMPDIR``.

Predicted part: the planner's scaling model (``layerwise plan --gpus``; ``scaling_model.py``
beside this script): predicted step and speedup for 1/2/4/8 GPUs and 2 nodes of 8 on a
qwen2.5-14b shape with the h200 preset (``predicted_speedup_8gpu``, and under ``predicted`` the
whole table, also with gradients reduced on the GPUs).

Prints one JSON object; ``--quick`` runs fewer, shorter steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scaling_model import predicted  # the script's own directory is on sys.path

from layerwise.ckpt.checkpointer import Checkpointer
from layerwise.ckpt.collective import TorchExchange
from layerwise.ckpt.store_provider import HostStoreStateProvider
from layerwise.models import get_flavor
from layerwise.optim.adamw import AdamWConfig, HostAdamW
from layerwise.store import init_store
from layerwise.train.dist.saving import group_writers

SRC = Path(__file__).resolve().parents[1] / "src"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, out: Path, overrides: list[str], threads: int) -> float:
    """One ``layerwise train`` launch of ``world`` processes; rank 0's median step time."""
    cmd = [sys.executable, "-c", "import sys; from layerwise.cli import main; sys.exit(main())",
           "train", f"out_dir={out}", *overrides]
    base = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": str(threads)}
    if world > 1:
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port()), WORLD_SIZE=str(world),
                    LOCAL_WORLD_SIZE=str(world))
    procs = [subprocess.Popen(cmd, env={**base, **({"RANK": str(r), "LOCAL_RANK": str(r)}
                                                   if world > 1 else {})},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode:
            raise RuntimeError(f"train failed ({world} process(es)):\n{err[-3000:]}")
    return float(json.loads((out / "run.json").read_text())["measured_step_s"])


def _save_worker(rank: int, port: int, model: str, rounds: int, tmp: str, threads: int) -> None:
    """One of the 2 ranks of the save part; rank 0 writes its times to ``tmp/save_times.json``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    _, store = init_store(get_flavor(model).build_config(), seed=0)
    opt = HostAdamW(AdamWConfig())
    for buf in store:
        opt.init_state(buf)
    provider = HostStoreStateProvider(store, {b.name: opt for b in store})
    writers = group_writers(store, 2)
    exchange = TorchExchange(timeout_s=600)
    kinds = {"save_s_1writer": set(writers) if rank == 0 else set(),
             "save_s_2writers": {g for g, r in writers.items() if r == rank}}
    def open_run(kind: str) -> Checkpointer:
        return Checkpointer(Path(tmp) / kind, provider=provider, policy="full",
                            tracker_log=False, exchange=exchange, mine=kinds[kind])
    cks = {}
    for kind in kinds:  # rank 0 creates each run directory, then the other rank opens it
        if rank == 0:
            cks[kind] = open_run(kind)
        dist.barrier()
        if rank != 0:
            cks[kind] = open_run(kind)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for step in range(1, rounds + 1):
        for kind, ck in cks.items():  # interleaved
            for buf in store:  # the same new state on both ranks: no blob is a duplicate
                buf.write_master(buf.read_master() + 1e-3)
                buf.state["exp_avg"].add_(1e-3)
                buf.state["exp_avg_sq"].add_(1e-6)
                buf.state["step"].fill_(step)
            dist.barrier()
            t0 = time.perf_counter()
            ck.save(step)
            ck.wait()
            times[kind].append(time.perf_counter() - t0)
    for ck in cks.values():
        ck.close()
    if rank == 0:
        (Path(tmp) / "save_times.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def save_part(args: argparse.Namespace, model: str) -> dict:
    """Save wall time with 1 writer and with 2 (``_save_worker``)."""
    with tempfile.TemporaryDirectory(prefix="lw-scaling-save-") as tmp:
        mp.start_processes(_save_worker, args=(_port(), model, args.rounds, tmp,
                                               max(1, args.threads // 2)),
                           nprocs=2, join=True, start_method="spawn")
        times = json.loads((Path(tmp) / "save_times.json").read_text())
    s1, s2 = (statistics.median(times[k]) for k in ("save_s_1writer", "save_s_2writers"))
    return {"save_model": model, "save_s_1writer": s1, "save_s_2writers": s2,
            "save_speedup_2writers": s1 / s2, "save_s_all": times}


def predicted_part(args: argparse.Namespace) -> dict:
    """The planner's predicted scaling, from ``scaling_model.predicted``."""
    pred = predicted(milp_time_limit_s=2.0 if args.quick else 5.0)
    top = {k: v for k, v in pred.items() if k.startswith("predicted_speedup_") and "device" not in k}
    return {**top, "predicted": pred}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="intra-op threads of the single process (each of 2 ranks gets half)")
    args = ap.parse_args()
    global_rows, steps, seq = (4, 4, 64) if args.quick else (8, 8, 128)
    common = ["model=llama-demo", f"seq_len={seq}", f"steps={steps}", "plan=every-2",
              "eval.every=0", "eval.batches=1", "export=false", "log.track_every=0",
              "data.corpus_tokens=100000", "log.progress=lines", "log.every=1000"]
    kinds = {"1": (1, []), "2": (2, []), "2host": (2, ["dist.grad_reduce=host"])}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lw-scaling-") as tmp:
        for k in range(args.rounds):
            for kind, (world, extra) in kinds.items():  # interleaved: load drift hits all
                out = Path(tmp) / f"w{kind}-{k}"
                rows = global_rows // world
                times[kind].append(run(world, out, common + [f"micro_batch_size={rows}", *extra],
                                       max(1, args.threads // world)))
    s1, s2, s2h = (statistics.median(times[k]) for k in kinds)
    saves = save_part(args, "llama-demo" if args.quick else "llama-30m")
    print(json.dumps({
        "benchmark": "scaling", "quick": args.quick, "model": "llama-demo", "seq_len": seq,
        "global_rows_per_step": global_rows, "steps": steps, "rounds": args.rounds,
        "threads_total": args.threads,
        "step_s_1proc": s1, "step_s_2proc": s2, "speedup_2proc": s1 / s2,
        "step_s_2proc_host_reduce": s2h, "device_over_host_reduce_step": s2 / s2h,
        "step_s_1proc_all": times["1"], "step_s_2proc_all": times["2"],
        "step_s_2proc_host_reduce_all": times["2host"], **saves,
        **predicted_part(args),
        "wall_s": time.perf_counter() - t0, "loadavg": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
