"""Data-parallel scaling: the step time of 1 process and of 2 processes on the same global batch.

Measured part (this machine's CPUs, gloo): ``layerwise train`` run alone with a global batch of
``B`` rows per micro-batch, and as 2 ranks launched the way ``torchrun --nproc-per-node 2``
launches them (RANK/WORLD_SIZE/LOCAL_RANK/... in the environment) with ``B/2`` rows each. Both
split the same cores: the single process gets ``T`` intra-op threads, each rank ``T/2``. The
step time is each run's own median step time after the first (``run.json``'s
``measured_step_s``, the engine's clock around ``train_step``, rank 0's, which includes waiting
for the other rank in the collectives). The two are interleaved for ``--rounds`` rounds and
the medians compared: ``speedup_2proc = step_s_1proc / step_s_2proc``.

On 2 shared cores expect little: the ranks contend for the same cores the single process
already uses, and add a reduction and a second store of gradients. The figure that matters is
on GPUs, where each rank has its own device.

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

from scaling_model import predicted  # the script's own directory is on sys.path

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


def predicted_part(args: argparse.Namespace) -> dict:
    """The planner's predicted scaling (issue 11 item 6), from ``scaling_model.predicted``."""
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
              "eval_every=0", "eval_batches=1", "export=false", "track_every=0",
              "corpus_tokens=100000", "progress=lines", "log_every=1000"]
    times: dict[int, list[float]] = {1: [], 2: []}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lw-scaling-") as tmp:
        for k in range(args.rounds):
            for world in (1, 2):  # interleaved: drift in the machine's load hits both
                out = Path(tmp) / f"w{world}-{k}"
                rows = global_rows // world
                times[world].append(run(world, out, common + [f"micro_batch_size={rows}"],
                                        max(1, args.threads // world)))
    s1, s2 = statistics.median(times[1]), statistics.median(times[2])
    print(json.dumps({
        "benchmark": "scaling", "quick": args.quick, "model": "llama-demo", "seq_len": seq,
        "global_rows_per_step": global_rows, "steps": steps, "rounds": args.rounds,
        "threads_total": args.threads,
        "step_s_1proc": s1, "step_s_2proc": s2, "speedup_2proc": s1 / s2,
        "step_s_1proc_all": times[1], "step_s_2proc_all": times[2],
        **predicted_part(args),
        "wall_s": time.perf_counter() - t0, "loadavg": os.getloadavg()}, indent=2))


if __name__ == "__main__":
    main()
