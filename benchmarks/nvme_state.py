"""The training state on NVMe against the same run with everything in RAM: equal bits, the RAM it
takes, the page cache it leaves, the step time it costs.

The job: full training of a decoder built from a config here (``--layers`` x ``--hidden``, vocab
8192; 0.24B parameters by default, 12M with ``--quick``), saved as an HF directory once
(``benchmarks/.cache``), trained by ``layerwise train`` (the command users run, in a child
process each) on the built-in corpus, fp32 on the CPU, ``ckpt.policy=full`` saved at the end,
both told (``$LAYERWISE_HOST_MEM_AVAILABLE_BYTES``) that the RAM available is the whole store's
bytes plus 10 MB, so that neither takes a RAM snapshot of the model to save it (the ``nvme``
run never does; a snapshot would put the ``ram`` run's peak at twice its store), and both
without per-layer update statistics (``log.track_every=0``; a run with state on NVMe turns them
off, their reference being a RAM copy of every weight):

- ``ram``: everything in the host store's RAM;
- ``nvme``: ``host_mem_gb`` set to the RAM the store needs with every unit's optimizer moments
  in files (its weights and gradients in RAM, plus the staging slots; ``plan.state_placement``),
  ``state_dir`` on this machine's disk: ``state_over_budget`` is the store's bytes over it.

Figures (median of ``--repeats`` runs each, the two runs alternating):

- ``weights_equal_ram_run``: the final checkpoints of the two runs hold the same blobs (content
  addressed: every weight and moment bit for bit);
- ``peak_rss_over_budget``: the ``nvme`` child's peak RSS (``ru_maxrss`` from ``os.wait4``) over
  the budget plus the fixed runtime: the ``ram`` child's peak RSS less its store's allocated
  bytes;
- ``page_cache_max_bytes``: the most the page cache held of the state files, polled by this
  process with ``mincore`` while the child trains;
- ``step_time_over_ram_run``: the median step time (``metrics.jsonl``, first step left out) of
  ``nvme`` over ``ram``, at ``--seq-len`` x ``--micro-batch`` tokens a step; ``nvme_over_compute``:
  the disk time of a step's state traffic (each state file read once and written once, at the
  disk's own rates) over the ``ram`` run's step time;
- ``io_bound``: the same ``nvme`` run at ``--io-bound-tokens`` a step, where the traffic cannot
  hide: ``disk_fraction``, the disk time of its traffic over its step time (1.0: the step runs at
  the disk's own O_DIRECT rates, measured here first with 256 MiB written and read back);
- ``sim_error_pct``: the simulator's step time of each ``nvme`` run's own plan (``plan.json``,
  its ``state_tiers``) against the measured one, on the ``cpu`` profile with this disk's rates
  and its CPU rates scaled by one factor fitted to the ``ram`` run (the CPU is not modelled in
  detail: what is predicted is what the tier adds).

Prints one JSON object. ``--quick``: the small model, 3 steps, one repeat (checks that it runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from layerwise.ckpt.run_dir import RunDir
from layerwise.interop.hf.model_dir import load_config
from layerwise.models import DecoderAdapter
from layerwise.optim.adamw import state_nbytes
from layerwise.plan.plan import NVME_STATE_SLOTS, Plan
from layerwise.plan.shape import ModelShape
from layerwise.planner.presets import PRESETS
from layerwise.planner.simulator import simulate
from layerwise.store import FlatLayout, store_footprint
from layerwise.util import direct_io
from layerwise.util.host_memory import HOST_MEM_ENV

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"
LAYERWISE_MAIN = "import sys; from layerwise.cli import main; sys.exit(main())"


def model_dir(layers: int, hidden: int) -> Path:
    """An HF directory of a Llama-shaped decoder of ``layers`` x ``hidden`` (made once)."""
    path = CACHE / f"nvme-state-l{layers}-h{hidden}"
    if (path / "config.json").exists():
        return path
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 256), vocab_size=8192,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return path


def store_bytes(path: Path) -> tuple[int, int, int]:
    """(the RAM store's bytes with fp32 moments, the RAM the store needs with every unit's
    moments on NVMe incl. the staging slots, the moments' bytes) of the model at ``path``."""
    adapter = DecoderAdapter(load_config(path))
    moments = [state_nbytes(FlatLayout.of(u).numel) for u in adapter.units]
    whole = store_footprint(adapter, torch.float32, pin=False, state_nbytes=sum(moments)).total
    ram = whole - sum(moments) + NVME_STATE_SLOTS * max(moments)
    return whole, ram, sum(moments)


def disk_rates(directory: Path, nbytes: int = 256 << 20) -> tuple[float, float]:
    """This disk's own O_DIRECT write and read rates, GB/s (``util.direct_io``)."""
    block = direct_io.io_block_bytes(directory)
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096
    buf = memoryview(raw[start:start + nbytes].numpy())
    path = directory / "rate.bin"
    t0 = time.perf_counter()
    direct_io.write_file(path, buf, nbytes, block)
    t1 = time.perf_counter()
    direct_io.read_file(path, buf, nbytes, block)
    t2 = time.perf_counter()
    path.unlink()
    return nbytes / (t1 - t0) / 1e9, nbytes / (t2 - t1) / 1e9


class Watch:
    """Polls, while a child trains: the page-cache bytes (``mincore``) and sizes of the files in
    its state directory; its block I/O (``/proc/PID/io``, the kernel's count) each time a row
    appears in its ``metrics.jsonl``, so the bytes between two rows are a step's."""

    def __init__(self, directory: Path, pid: int, metrics: Path):
        self.directory, self.pid, self.metrics = directory, pid, metrics
        self.max_bytes = self.file_bytes = 0
        self.marks: dict[int, tuple[int, int]] = {}
        """Rows seen -> (read_bytes, write_bytes) of the child then."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _io(self) -> tuple[int, int] | None:
        try:
            fields = dict(line.split(": ") for line in Path(f"/proc/{self.pid}/io").read_text().splitlines())
        except OSError:
            return None
        return int(fields["read_bytes"]), int(fields["write_bytes"])

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                rows = self.metrics.read_text().count("\n")
            except OSError:
                rows = 0
            io = self._io()
            if rows and rows not in self.marks and io is not None:
                self.marks[rows] = io
            cached = size = 0
            for f in list(self.directory.glob("*.*")):
                try:
                    cached += direct_io.page_cache_bytes(f)
                    size += f.stat().st_size
                except (OSError, ValueError):
                    pass  # removed as the run ended
            self.max_bytes = max(self.max_bytes, cached)
            self.file_bytes = max(self.file_bytes, size)

    def io_per_step(self) -> tuple[float, float] | None:
        """(read, written) bytes a step, between the first row seen and the last but one (the
        last step's row may come after the final save has started)."""
        rows = sorted(self.marks)[:-1]
        if len(rows) < 2:
            return None
        (r0, w0), (r1, w1), n = self.marks[rows[0]], self.marks[rows[-1]], rows[-1] - rows[0]
        return (r1 - r0) / n, (w1 - w0) / n


def run(args, model: Path, out: Path, rows: int, seq_len: int, extra: list[str],
        available: int) -> dict:
    """``layerwise train`` in a child; its peak RSS, median step time, I/O a step, final
    checkpoint and plan."""
    cmd = [sys.executable, "-c", LAYERWISE_MAIN, "train", f"model={model}", f"out_dir={out}",
           f"steps={args.steps}", f"seq_len={seq_len}", f"micro_batch_size={rows}",
           "grad_accum=1", "device=cpu", "plan=keep-all", "eval.every=0", "export=false",
           "ckpt.every=0", "ckpt.policy=full", "data.corpus_tokens=300000", "log.progress=lines",
           "log.track_every=0",
           "overwrite=true", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), HOST_MEM_ENV: str(available),
           "PYTHONPATH": str(HERE.parent / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    state_dir = out.parent / f"{out.name}-state"
    state_dir.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{out.name}.log"
    shutil.rmtree(out, ignore_errors=True)
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
        watch = Watch(state_dir, p.pid, out / "metrics.jsonl")
        _, status, usage = os.wait4(p.pid, 0)
        watch.stop()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"layerwise train exited {status}; last lines of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-15:]))
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    manifest = RunDir.open(out / "ckpt").read_manifest(args.steps)
    plan = Plan.load(out / "plan.json")
    return {"peak_rss_bytes": usage.ru_maxrss * 1024, "plan": replace(plan, seq_len=seq_len),
            "step_s": statistics.median(r["step_s"] for r in metrics[1:]),
            "blobs": {g: e["blob"] for g, e in manifest["groups"].items()},
            "io_per_step": watch.io_per_step(), "tiers": plan.state_tiers,
            "page_cache_max_bytes": watch.max_bytes, "state_file_bytes": watch.file_bytes}


def simulated_s(model: Path, runs: dict[str, dict], disk: tuple[float, float]) -> dict[str, float]:
    """Each run's simulated step on the ``cpu`` profile with this disk's rates, every rate of
    the CPU (compute, memory, copies, optimizer) scaled by one factor until the ``ram`` run's
    simulated step is its measured one: what the ``nvme`` run's prediction adds is the tier."""
    shape = ModelShape.from_config(load_config(model))
    base = replace(PRESETS["cpu"], nvme_write_gbps=disk[0], nvme_read_gbps=disk[1],
                   host_mem_bytes=1 << 50)  # the runs' own plans say what lives where
    rates = ("peak_tflops", "device_mem_gbps", "h2d_gbps", "d2h_gbps", "host_accum_gbps",
             "host_accum_bf16_gbps", "pinned_copy_gbps", "optimizer_params_per_s",
             "optimizer_8bit_params_per_s")
    hw, speed = base, 1.0
    for _ in range(6):
        speed *= simulate(runs["ram"]["plan"], shape, hw).step_s / runs["ram"]["step_s"]
        hw = replace(base, **{f: getattr(base, f) * speed for f in rates})
    return {name: simulate(r["plan"], shape, hw).step_s for name, r in runs.items()}


def disk_s(io: tuple[float, float] | None, rates: tuple[float, float]) -> float | None:
    """Seconds this disk takes for ``io`` (read, written bytes) at its own rates (write, read)."""
    return None if io is None else io[0] / (rates[1] * 1e9) + io[1] / (rates[0] * 1e9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--io-bound-seq-len", type=int, default=32, help="tokens a step of the deep runs")
    ap.add_argument("--deep-over", type=float, default=3.5,
                    help="the deep runs' store over their RAM budget")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dir", default=None, help="where runs and state files go (default: a temp dir "
                    "under benchmarks/.cache: this machine's disk)")
    args = ap.parse_args()
    if args.quick:  # staging is a larger share of a small model: a lower deep ratio
        args.layers, args.hidden, args.steps, args.repeats, args.deep_over = 4, 384, 4, 1, 1.3
    load_start = os.getloadavg()
    print(f"load average {load_start}", file=sys.stderr)
    model = model_dir(args.layers, args.hidden)
    whole, budget, moments = store_bytes(model)
    deep_budget = int(whole / args.deep_over)
    CACHE.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="nvme-state-", dir=args.dir or CACHE))
    rates = disk_rates(work)
    available = whole + 10_000_000  # the store fits; a RAM snapshot of its state does not

    def on_nvme(name: str, gb: float) -> list[str]:
        return [f"host_mem_gb={gb / 1e9:.6f}", f"state_dir={work / (name + '-state')}"]

    jobs = {"ram": (args.micro_batch, args.seq_len, []),
            "nvme": (args.micro_batch, args.seq_len, on_nvme("nvme", budget)),
            "deep_ram": (1, args.io_bound_seq_len, []),
            "deep": (1, args.io_bound_seq_len, on_nvme("deep", deep_budget))}
    runs: dict[str, list[dict]] = {k: [] for k in jobs}
    for r in range(args.repeats):
        for name in jobs if r % 2 == 0 else reversed(list(jobs)):
            rows, seq, extra = jobs[name]
            res = run(args, model, work / name, rows, seq, extra, available)
            runs[name].append(res)
            print(f"{name}: step {res['step_s']:.2f} s, peak RSS {res['peak_rss_bytes'] / 2**30:.2f} GiB, "
                  f"I/O a step {res['io_per_step']}, load {os.getloadavg()[0]:.2f}", file=sys.stderr)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    fixed = med("ram", "peak_rss_bytes") - whole
    sims = [simulated_s(model, {"ram": a, "nvme": b}, rates) for a, b in zip(runs["ram"], runs["nvme"])]
    nvme_disk = statistics.median(d for r in runs["nvme"] if (d := disk_s(r["io_per_step"], rates)) is not None)
    deep_disk = [disk_s(r["io_per_step"], rates) for r in runs["deep"]]
    deep_tiers = runs["deep"][0]["tiers"]
    print(json.dumps({
        "benchmark": "nvme_state", "quick": args.quick,
        "model": {"dir": str(model), "layers": args.layers, "hidden": args.hidden},
        "store_bytes": whole, "moments_bytes": moments,
        "disk_gbps": {"write": round(rates[0], 3), "read": round(rates[1], 3)},
        "hiding": {
            "tokens_per_step": args.seq_len * args.micro_batch, "budget_bytes": budget,
            "state_tiers": runs["nvme"][0]["tiers"],
            "state_over_budget": round(whole / budget, 3),
            "weights_equal_ram_run": all(r["blobs"] == runs["ram"][0]["blobs"] for r in runs["nvme"]),
            "peak_rss_over_budget": round(med("nvme", "peak_rss_bytes") / (budget + fixed), 3),
            "step_s": {"ram": round(med("ram", "step_s"), 3), "nvme": round(med("nvme", "step_s"), 3)},
            "step_time_over_ram_run": round(med("nvme", "step_s") / med("ram", "step_s"), 3),
            "nvme_over_compute": round(nvme_disk / med("ram", "step_s"), 3),
            "sim_error_pct": round(statistics.median(
                abs(sim["nvme"] / b["step_s"] - 1) * 100 for sim, b in zip(sims, runs["nvme"])), 1),
            "simulated_step_s": [{k: round(v, 3) for k, v in sim.items()} for sim in sims]},
        "deep": {
            "tokens_per_step": args.io_bound_seq_len, "budget_bytes": deep_budget,
            "nvme_all_units": deep_tiers.count("nvme-all"), "state_tiers": deep_tiers,
            "state_over_budget": round(whole / deep_budget, 3),
            "weights_equal_ram_run": all(r["blobs"] == runs["deep_ram"][0]["blobs"] for r in runs["deep"]),
            "peak_rss_over_budget": round(med("deep", "peak_rss_bytes") / (deep_budget + fixed), 3),
            "step_s": {"ram": round(med("deep_ram", "step_s"), 3), "nvme": round(med("deep", "step_s"), 3)},
            "io_per_step_bytes": [r["io_per_step"] for r in runs["deep"]],
            "disk_fraction": round(statistics.median(
                d / r["step_s"] for d, r in zip(deep_disk, runs["deep"]) if d is not None), 3)},
        "peak_rss_bytes": {k: med(k, "peak_rss_bytes") for k in runs} | {"fixed_runtime": fixed},
        "page_cache_max_bytes": max(r["page_cache_max_bytes"] for k in ("nvme", "deep") for r in runs[k]),
        "repeats": args.repeats,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
    }, indent=1))
    shutil.rmtree(work)  # the runs' checkpoints: several times the model


if __name__ == "__main__":
    main()
