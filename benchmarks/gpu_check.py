"""GPU check: run the CUDA path on one GPU and report what it did, as one JSON object.

Sections, in this order, each under its own try/except (a failure is recorded in the JSON and
the rest still runs), inside a global time budget (a section is not started when the time left
is under its estimate; the JSON is rewritten after every section, so a kill keeps what was done):

1. ``pytest``: ``pytest -m cuda`` in a subprocess; pass/fail counts from its JUnit XML.
2. ``calibration``: ``layerwise calibrate`` (``engine.calibrate.calibrate``) on the GPU, plus the
   efficiency of one decoder layer's backward of the model below at the run's micro-batch shape
   (calibrate times a ``llama-30m`` layer at 512 tokens, which says little about a 4096-wide one).
3. ``optimizer``: ``AdamW8bit`` on CUDA vs ``torch.optim.AdamW(fused=True)`` on the same params.
4. ``planner``: ``plan.search`` for the model below at the run's batch shape, with the best
   hardware profile available (calibrated at shape > calibrated > the ``h200`` preset).
5. ``store``: a HostStore for a 7B-class shape (default: Llama-3.1-8B widths, 16 of its 32
   layers), filled straight into its flat fp32 masters with seeded normal init (no HF model is
   built), 8-bit moments; pinned bytes vs store bytes.
6. ``plan:<name>``: for every-1, every-4, keep-all-host and the planner's plan: warm-up step,
   timed steps, one profiled step. Tokens/s, TFLOPS (cost-model FLOPs, 1x fwd + 2x bwd), device
   peak (``max_memory_reserved``) vs ``engine.predict_memory``, H2D/D2H GB/s and the fraction of
   copy time hidden behind compute (from the profiler's trace).
7. ``simulator``: the simulator's step time for each measured plan under each hardware profile,
   against the measured step.

Without CUDA (or without torch) it prints that there is no GPU and exits 0. Exit status on a
GPU: 0 when every section ran and every CUDA test passed, else 1 (the JSON says what failed).
The JSON schema is documented in docs/benchmarks.md ("GPU check").

    python benchmarks/gpu_check.py [--out gpu-check.json] [--layers 16] [--budget-s 450]
    make gpu-check GPU_CHECK_OUT=path.json          # installs layerwise (no deps) first

The pure helpers at the top (interval arithmetic, trace and JUnit parsing, store sizing, the
seeded store fill) are imported by tests/engine/test_cuda.py; this module imports nothing but
the standard library at load time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "layerwise-gpu-check/1"
GIB = 2**30
GB = 10**9


# ----- interval arithmetic ---------------------------------------------------------------------

def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[start, end)`` intervals, as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def measure(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    return sum(e - s for s, e in merge_intervals(intervals))


def intersect_measure(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union of ``a``) ∩ (union of ``b``)."""
    ua, ub = merge_intervals(a), merge_intervals(b)
    i = j = 0
    total = 0.0
    while i < len(ua) and j < len(ub):
        lo = max(ua[i][0], ub[j][0])
        hi = min(ua[i][1], ub[j][1])
        if hi > lo:
            total += hi - lo
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


# ----- profiler trace analysis -----------------------------------------------------------------

def load_trace_events(path: str | Path) -> list[dict[str, Any]]:
    """Complete events (``"ph": "X"``) of a trace written by ``torch.profiler``'s
    ``export_chrome_trace``."""
    with open(path) as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def _stream_of(event: dict[str, Any]) -> Any:
    args = event.get("args") or {}
    if "stream" in args:
        return args["stream"]
    tid = event.get("tid")
    if isinstance(tid, str) and tid.startswith("stream "):
        tid = tid[len("stream "):]
    try:
        return int(tid)
    except (TypeError, ValueError):
        return tid


def gpu_activity(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kernels, copies) of a chrome trace; each ``{start_s, end_s, stream, name, bytes}``.

    Kineto writes GPU kernels with ``cat`` ``kernel`` and copies with ``gpu_memcpy`` (``Memcpy``
    in older versions); ``ts``/``dur`` are microseconds; ``args.stream`` is the CUDA stream and
    ``args.bytes`` a copy's size. Memsets are neither compute nor copies and are left out.
    """
    kernels, copies = [], []
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if cat not in ("kernel", "gpu_memcpy", "memcpy"):
            continue
        start = float(e["ts"]) * 1e-6
        end = start + float(e.get("dur", 0.0)) * 1e-6
        args = e.get("args") or {}
        rec = {"start_s": start, "end_s": end, "stream": _stream_of(e), "name": str(e.get("name", "")),
               "bytes": args.get("bytes")}
        (kernels if cat == "kernel" else copies).append(rec)
    return kernels, copies


def copy_direction(name: str) -> str:
    """``h2d``, ``d2h``, ``d2d`` or ``other`` from a kineto memcpy name
    (e.g. ``Memcpy HtoD (Pinned -> Device)``)."""
    if "HtoD" in name:
        return "h2d"
    if "DtoH" in name:
        return "d2h"
    if "DtoD" in name:
        return "d2d"
    return "other"


def copy_overlap(events: list[dict[str, Any]]) -> dict[str, Any]:
    """How the copies of a profiled window sit against its compute kernels.

    The compute stream is the stream with the most kernel time (the engine computes on the
    current stream). Copies on any other stream are the engine's asynchronous copies: per
    direction, their count, bytes, busy seconds (sum of durations), union seconds, bandwidth
    while copying (bytes / busy seconds), and the part of their union that overlaps the union of
    all kernels (``overlap_fraction``: 1.0 means every copy was hidden behind compute). Copies
    on the compute stream serialise with compute and are reported apart.
    """
    kernels, copies = gpu_activity(events)
    kernel_time: dict[Any, float] = {}
    for k in kernels:
        kernel_time[k["stream"]] = kernel_time.get(k["stream"], 0.0) + k["end_s"] - k["start_s"]
    compute_stream = max(kernel_time, key=kernel_time.get) if kernel_time else None
    compute_iv = [(k["start_s"], k["end_s"]) for k in kernels]
    everything = compute_iv + [(c["start_s"], c["end_s"]) for c in copies]
    window = (max(e for _, e in everything) - min(s for s, _ in everything)) if everything else 0.0
    compute_union = measure(compute_iv)
    out: dict[str, Any] = {
        "compute_stream": compute_stream,
        "kernel_streams": sorted(kernel_time, key=str),
        "kernels": len(kernels),
        "compute_busy_s": compute_union,
        "window_s": window,
        "compute_idle_fraction": (1.0 - compute_union / window) if window > 0 else None,
    }

    def summarise(group: list[dict[str, Any]]) -> dict[str, Any]:
        iv = [(c["start_s"], c["end_s"]) for c in group]
        busy = sum(e - s for s, e in iv)
        union = measure(iv)
        overlap = intersect_measure(iv, compute_iv)
        nbytes = sum(int(c["bytes"]) for c in group if isinstance(c["bytes"], (int, float)))
        return {
            "count": len(group),
            "bytes": nbytes,
            "busy_s": busy,
            "union_s": union,
            "gbps_active": (nbytes / busy / GB) if busy > 0 else None,
            "overlap_s": overlap,
            "overlap_fraction": (overlap / union) if union > 0 else None,
            "streams": sorted({c["stream"] for c in group}, key=str),
        }

    side = [c for c in copies if c["stream"] != compute_stream]
    for direction in ("h2d", "d2h"):
        out[direction] = summarise([c for c in side if copy_direction(c["name"]) == direction])
    out["all_async_copies"] = summarise(side)
    out["copies_on_compute_stream"] = summarise([c for c in copies if c["stream"] == compute_stream])
    out["pageable_copies"] = sum(1 for c in copies if "Pageable" in c["name"])
    return out


# ----- pytest --------------------------------------------------------------------------------

def parse_junit(path: str | Path) -> dict[str, Any]:
    """Counts and failing test ids from a pytest JUnit XML file."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    return {
        "total": counts["tests"],
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "failing_tests": failed,
    }


# ----- store sizing and seeded fill ------------------------------------------------------------

def pow2_ceil(n: int) -> int:
    """PyTorch's pinned (host) allocator rounds each block up to a power of two."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def store_bytes_estimate(unit_params: list[int], moments: str, compute_bytes: int,
                         block_size: int = 256) -> tuple[int, int]:
    """(logical bytes, bytes if every buffer is pinned and rounded up to a power of two) of a
    HostStore: per unit fp32 master + fp32 grad + compute copy + optimizer moments."""
    logical = rounded = 0
    for n in unit_params:
        sizes = [4 * n, 4 * n] + ([compute_bytes * n] if compute_bytes != 4 else [])
        if moments == "8bit":
            blocks = -(-n // block_size)
            sizes += [n, n, 4 * blocks, 4 * blocks]
        else:
            sizes += [4 * n, 4 * n]
        logical += sum(sizes)
        rounded += sum(pow2_ceil(s) for s in sizes)
    return logical, rounded


def fill_store_random(store, seed: int = 0, std: float = 0.02, device: str | None = None) -> None:
    """Seeded init written straight into a HostStore's flat fp32 masters, no HF model built:
    matrices N(0, std²), 1-D parameters named ``*norm*`` 1, other 1-D parameters (biases) 0;
    then the compute copies are refreshed. Random numbers are drawn on ``device`` (default: the
    GPU when there is one, where a 7B-class store fills in seconds) from one seeded generator,
    so a run is reproducible on the same device and torch version."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for buf in store:
        views = buf.layout.views(buf.master)
        for spec in buf.layout.specs:
            view = views[spec.local]
            if len(spec.shape) >= 2:
                noise = torch.randn(spec.shape, generator=gen, device=dev, dtype=torch.float32)
                view.copy_(noise.mul_(std))
                del noise
            elif "norm" in spec.local:
                view.fill_(1.0)
            else:
                view.zero_()
    store.refresh_compute()


def pinned_bytes(store) -> tuple[int, str]:
    """(pinned bytes of the store, how they were counted)."""
    return int(store.pinned_nbytes()), "store.pinned_nbytes() (the page-locked arena)"


# ----- bookkeeping ---------------------------------------------------------------------------

class Budget:
    def __init__(self, total_s: float):
        self.total_s = total_s
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.total_s - self.elapsed()


class Dev:
    """The device the check runs on: ``cuda``, or ``cpu`` for a dry run of this script on a
    machine without a GPU (``--device cpu``: a tiny model; no memory or copy figures)."""

    def __init__(self, torch, name: str):
        self.torch = torch
        self.name = name
        self.is_cuda = name.startswith("cuda")

    def sync(self) -> None:
        if self.is_cuda:
            self.torch.cuda.synchronize()

    def clean(self) -> None:
        gc.collect()
        if self.is_cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.is_cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def reserved(self) -> int | None:
        return int(self.torch.cuda.memory_reserved()) if self.is_cuda else None

    def allocated(self) -> int | None:
        return int(self.torch.cuda.memory_allocated()) if self.is_cuda else None

    def max_reserved(self) -> int | None:
        return int(self.torch.cuda.max_memory_reserved()) if self.is_cuda else None

    def max_allocated(self) -> int | None:
        return int(self.torch.cuda.max_memory_allocated()) if self.is_cuda else None

    def generator(self, seed: int):
        g = self.torch.Generator(device=self.name)
        g.manual_seed(seed)
        return g


def write_json(path: Path | None, obj: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class Check:
    """The JSON being built, its sections, the budget."""

    def __init__(self, args: argparse.Namespace, out: Path | None):
        self.args = args
        self.out = out
        self.budget = Budget(args.budget_s)
        self.result: dict[str, Any] = {
            "schema": SCHEMA,
            "status": "running",
            "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "budget_s": args.budget_s,
            "args": vars(args),
            "sections": {},
        }

    def save(self) -> None:
        self.result["wall_s"] = round(self.budget.elapsed(), 3)
        write_json(self.out, self.result)

    def section(self, name: str, estimate_s: float, fn: Callable[[], Any]) -> Any:
        rec: dict[str, Any] = {"ok": False, "wall_s": 0.0, "error": None, "skipped": None}
        self.result["sections"][name] = rec
        wanted = self.args.sections
        key = name.split(":")[0]
        if wanted and key != "setup" and key not in wanted and not (key == "store" and "plan" in wanted):
            rec["skipped"] = "not in --sections"
            self.save()
            return None
        if self.budget.left() < estimate_s:
            rec["skipped"] = (f"time budget: {self.budget.left():.0f} s left, the section needs "
                              f"about {estimate_s:.0f} s")
            self.save()
            return None
        t = time.perf_counter()
        print(f"[gpu-check {self.budget.elapsed():6.1f}s] {name} ...", file=sys.stderr, flush=True)
        try:
            out = fn()
            rec["ok"] = True
            return out
        except Exception as e:  # noqa: BLE001 - every failure is recorded, the rest still runs
            rec["error"] = f"{type(e).__name__}: {e}"[:2000]
            rec["traceback"] = traceback.format_exc()[-6000:]
            print(f"[gpu-check] {name} FAILED: {rec['error']}", file=sys.stderr, flush=True)
            return None
        finally:
            rec["wall_s"] = round(time.perf_counter() - t, 3)
            self.save()


# ----- sections ------------------------------------------------------------------------------

def machine_info(torch) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
    }
    for mod in ("transformers", "numba", "highspy"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "present")
        except Exception as e:  # noqa: BLE001
            info[mod] = f"missing ({type(e).__name__})"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["host_memtotal_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update({
            "device_name": p.name,
            "device_capability": f"{p.major}.{p.minor}",
            "device_total_mem_bytes": int(p.total_memory),
            "device_multiprocessors": p.multi_processor_count,
            "device_count": torch.cuda.device_count(),
        })
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as e:  # noqa: BLE001
        info["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        info["layerwise_commit"] = rev.stdout.strip() or None
    except Exception:  # noqa: BLE001
        info["layerwise_commit"] = None
    return info


def run_pytest(check: Check) -> dict[str, Any]:
    left = check.budget.left()
    timeout = max(30.0, min(check.args.pytest_timeout_s, left - check.args.reserve_after_pytest_s))
    with tempfile.TemporaryDirectory(prefix="layerwise-gpu-check-") as d:
        junit = Path(d) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={junit}"]
        if importlib.util.find_spec("pytest_timeout") is not None:
            cmd.append(f"--timeout={check.args.pytest_test_timeout_s}")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])])
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
            rc, output, timed_out = proc.returncode, proc.stdout + proc.stderr, False
        except subprocess.TimeoutExpired as e:
            def text(b):
                return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            rc, output, timed_out = None, text(e.stdout) + text(e.stderr), True
        res: dict[str, Any] = {"command": " ".join(cmd), "exit_code": rc, "timed_out": timed_out,
                               "timeout_s": round(timeout, 1), "wall_s": round(time.perf_counter() - t, 3)}
        if junit.exists():
            res.update(parse_junit(junit))
        res["output_tail"] = output[-4000:]
    check.result["pytest"] = res
    if not timed_out and rc == 0 and not res.get("passed"):
        raise RuntimeError("pytest -m cuda ran no CUDA test (all skipped or none collected)")
    if timed_out or rc not in (0,) or res.get("failed") or res.get("errors"):
        raise RuntimeError(f"pytest -m cuda: exit {rc}, {res.get('passed')} passed, {res.get('failed')} failed, "
                           f"{res.get('errors')} errors{' (timed out)' if timed_out else ''}")
    return res


def measure_layer_tflops(ctx: dict[str, Any]) -> dict[str, Any]:
    """One decoder layer's backward as the engine runs it (``layer_ops.layer_backward``), at the
    run's micro-batch shape, on the GPU: FLOP rate by the cost model's count (3x forward)."""
    import torch
    from layerwise.engine.layer_ops import layer_backward
    from layerwise.plan.cost import CostModel
    from layerwise.plan.hardware import PRESETS
    from layerwise.store import FlatLayout

    dev: Dev = ctx["dev"]
    adapter, shape, mbs, seq = ctx["adapter"], ctx["shape"], ctx["mbs"], ctx["seq"]
    layout = FlatLayout.of(adapter.units[1])
    gen = dev.generator(1)
    w = torch.randn(layout.numel, device=dev.name, generator=gen).mul_(0.02).to(torch.bfloat16)
    for spec, view in zip(layout.specs, layout.views(w).values()):
        if len(spec.shape) < 2:
            view.fill_(1.0 if "norm" in spec.local else 0.0)
    x = torch.randn(mbs, seq, shape.hidden_size, device=dev.name, generator=gen).to(torch.bfloat16)
    grad_out = torch.randn_like(x)
    pos = torch.arange(seq, device=dev.name)[None]
    rotary = adapter.new_rotary(dev.name)
    with torch.no_grad():
        rope = rotary(x, pos)
    masks = adapter.attention_masks(seq, torch.device(dev.name))

    def run():
        layer_backward(adapter, 0, layout, w, x, grad_out, rope, pos, masks)

    run()
    dev.sync()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        run()
        dev.sync()
        times.append(time.perf_counter() - t)
    flops = 3.0 * CostModel(shape, PRESETS["h200"], mbs, seq).layer_fwd_flops(0)
    best = min(times)
    del w, x, grad_out
    dev.clean()
    return {"layer_bwd_s": best, "layer_bwd_flops": flops, "layer_bwd_tflops": flops / best / 1e12}


def run_calibration(check: Check, ctx: dict[str, Any]) -> dict[str, Any]:
    from dataclasses import replace

    from layerwise.engine.calibrate import calibrate

    t = time.perf_counter()
    profile = calibrate(quick=check.args.calibrate_quick, device=ctx["dev"].name)
    cal_s = time.perf_counter() - t
    host = ctx["host_budget_bytes"]
    profile = replace(profile, host_mem_bytes=max(host, profile.host_reserved_bytes + 1))
    ctx["profiles"]["calibrated"] = profile
    layer = measure_layer_tflops(ctx)
    peak = max(profile.peak_tflops, layer["layer_bwd_tflops"])
    shaped = replace(profile, name=f"{profile.name}-at-shape", peak_tflops=peak,
                     efficiency=min(1.0, layer["layer_bwd_tflops"] / peak))
    ctx["profiles"]["calibrated-shape"] = shaped
    res = {"calibrate_s": round(cal_s, 3), "quick": check.args.calibrate_quick,
           "profile": profile.to_dict(), "layer_at_shape": layer,
           "profile_at_shape": {"peak_tflops": shaped.peak_tflops, "efficiency": shaped.efficiency},
           "host_mem_bytes_note": "host_mem_bytes set to the --host-mem-gib budget (MemTotal of a "
                                  "VM whose RAM grows on use is not the machine's size)"}
    check.result["calibration"] = res
    return res


def run_optimizer(check: Check, ctx: dict[str, Any]) -> dict[str, Any]:
    import torch
    from layerwise.optim.adamw8bit import AdamW8bit

    dev: Dev = ctx["dev"]
    layer_shapes = [spec.shape for spec in ctx["adapter"].units[1].params]
    shapes = layer_shapes * check.args.optim_layers
    gen = dev.generator(2)
    p0 = [torch.randn(s, device=dev.name, generator=gen).mul_(0.02) for s in shapes]
    grads = [torch.randn(s, device=dev.name, generator=gen).mul_(1e-3) for s in shapes]
    numel = sum(p.numel() for p in p0)
    hp = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def params():
        ps = [torch.nn.Parameter(p.clone()) for p in p0]
        for p, g in zip(ps, grads):
            p.grad = g  # shared, read-only for both optimizers
        return ps

    fused_p, q_p = params(), params()
    fused = torch.optim.AdamW(fused_p, fused=True, **hp)
    q8 = AdamW8bit(q_p, moments="8bit", **hp)
    # three steps from the same start: how far is the 8-bit trajectory from the fp32 one, relative
    # to how far the fp32 one moved? (step 1 uses exact moments; later steps read quantised ones)
    for _ in range(3):
        fused.step()
        q8.step()
    dev.sync()
    with torch.no_grad():
        moved = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(fused_p, p0)))
        diff = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(q_p, fused_p)))
    rel_diff = float(diff / moved)

    def state_bytes(opt) -> int:
        return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0)

    def timed(fn) -> float:
        dev.sync()
        t = time.perf_counter()
        fn()
        dev.sync()
        return time.perf_counter() - t

    q8_clip = AdamW8bit(q_p, moments="8bit", max_grad_norm=1.0, **hp)  # its own state, same params

    def fused_clip():
        torch.nn.utils.clip_grad_norm_(fused_p, 1.0)
        fused.step()

    # clip_grad_norm_ scales the shared grads in place: restore them after each clipped round
    saved = [g.clone() for g in grads]

    def restore():
        for g, s in zip(grads, saved):
            g.copy_(s)

    rounds = check.args.optim_rounds
    t_fused, t_q8, t_fused_clip, t_q8_clip = [], [], [], []
    for _ in range(rounds):  # interleaved, so drift hits both alike
        t_fused.append(timed(fused.step))
        t_q8.append(timed(q8.step))
        t_q8_clip.append(timed(q8_clip.step))
        t_fused_clip.append(timed(fused_clip))
        restore()
    med = statistics.median
    res = {
        "params": numel,
        "tensors": len(shapes),
        "shapes": f"{check.args.optim_layers} x the decoder-layer parameters of {ctx['flavor']}",
        "rounds": rounds,
        "adamw8bit_step_s": med(t_q8),
        "torch_fused_step_s": med(t_fused),
        "step_ratio_vs_torch_fused": med(t_q8) / med(t_fused),
        "adamw8bit_clip_step_s": med(t_q8_clip),
        "torch_fused_clip_step_s": med(t_fused_clip),
        "step_ratio_with_clip": med(t_q8_clip) / med(t_fused_clip),
        "adamw8bit_params_per_s": numel / med(t_q8),
        "torch_fused_params_per_s": numel / med(t_fused),
        "adamw8bit_state_bytes_per_param": state_bytes(q8) / numel,
        "torch_fused_state_bytes_per_param": state_bytes(fused) / numel,
        "update_rel_diff_after_3_steps": rel_diff,
    }
    del fused, q8, q8_clip, fused_p, q_p, p0, grads, saved
    dev.clean()
    check.result["optimizer"] = res
    return res


def planner_profile(ctx: dict[str, Any]):
    for name in ("calibrated-shape", "calibrated", "h200"):
        if name in ctx["profiles"]:
            return name, ctx["profiles"][name]
    raise AssertionError("no hardware profile")


def run_planner(check: Check, ctx: dict[str, Any]) -> dict[str, Any]:
    from layerwise.plan.search import SearchConfig, search

    name, hw = planner_profile(ctx)
    mbs, nmb, seq = ctx["mbs"], ctx["nmb"], ctx["seq"]
    cfg = SearchConfig(global_batch=mbs * nmb, micro_batch_sizes=(mbs,), prefetch_depth=1)
    res = search(ctx["shape"], hw, seq, cfg)
    plan = res.plan
    chosen = list(plan.moments or [])
    plan.moments = list(ctx["moments"])  # one store for every plan: its moments are fixed
    ctx["planner_plan"] = plan
    out = {
        "hardware": name,
        "plan_s": res.plan_s,
        "milp_solve_s": res.solve_s,
        "source": plan.source,
        "boundaries": plan.boundary_tiers,
        "tiers": tier_counts(plan.boundary_tiers),
        "micro_batch_size": plan.micro_batch_size,
        "num_micro_batches": plan.num_micro_batches,
        "prefetch_depth": plan.prefetch_depth,
        "moments_chosen": summarise_moments(chosen),
        "moments_used": summarise_moments(plan.moments),
        "predicted": plan.predicted,
        "rules_simulated": {n: c.sim.summary()["step_s"] for n, c in res.by_name.items()},
    }
    check.result["planner"] = out
    return out


def tier_counts(tiers: list[str]) -> dict[str, int]:
    return {t: tiers.count(t) for t in ("device", "host", "nvme", "recompute")}


def summarise_moments(moments: list[str]) -> dict[str, int]:
    return {m: moments.count(m) for m in sorted(set(moments))}


def build_store(check: Check, ctx: dict[str, Any]) -> dict[str, Any]:
    import torch
    from layerwise.store import HostStore

    t = time.perf_counter()
    store = HostStore(ctx["adapter"], compute_dtype=torch.bfloat16)
    alloc_s = time.perf_counter() - t
    t = time.perf_counter()
    fill_store_random(store, seed=check.args.seed, device=ctx["dev"].name)
    fill_s = time.perf_counter() - t
    ctx["store"] = store
    pinned, how = pinned_bytes(store)
    res = {
        "alloc_s": round(alloc_s, 3),
        "init_s": round(fill_s, 3),
        "init": (f"seeded normal(0, 0.02) matrices, norms 1, biases 0 (seed {check.args.seed}, "
                 f"drawn on {ctx['dev'].name})"),
        "store_nbytes_before_optimizer_state": store.nbytes(),
        "pinned_nbytes_before_optimizer_state": pinned,
        "pinned_counted_by": how,
        "host_allocator": host_allocator_stats(torch),
    }
    check.result["store"] = res
    return res


def host_allocator_stats(torch) -> dict[str, Any] | None:
    """The pinned host allocator's byte counters (current, peak), where torch has them."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    return {k: v for k, v in stats.items() if "bytes" in k and (k.endswith(".current") or k.endswith(".peak"))}


def make_batches(ctx: dict[str, Any], seed: int):
    import torch
    from layerwise.engine.batch import Batch

    g = torch.Generator().manual_seed(seed)
    vocab = ctx["shape"].vocab_size
    out = []
    for _ in range(ctx["nmb"]):
        ids = torch.randint(0, vocab, (ctx["mbs"], ctx["seq"]), generator=g)
        labels = torch.randint(0, vocab, (ctx["mbs"], ctx["seq"]), generator=g)
        out.append(Batch(ids, labels))
    return out


def run_plan(check: Check, ctx: dict[str, Any], name: str, plan) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from layerwise.engine import EngineConfig, StreamingEngine
    from layerwise.plan.cost import CostModel
    from layerwise.plan.hardware import PRESETS

    dev: Dev = ctx["dev"]
    store, mbs, nmb, seq = ctx["store"], ctx["mbs"], ctx["nmb"], ctx["seq"]
    batches = ctx["batches"]
    lr = check.args.lr
    rec: dict[str, Any] = {
        "source": plan.source,
        "tiers": tier_counts(plan.boundary_tiers),
        "boundaries": plan.boundary_tiers,
        "prefetch_depth": plan.prefetch_depth,
        "micro_batch_size": mbs, "num_micro_batches": nmb, "seq_len": seq,
    }
    check.result["plans"][name] = rec
    dev.clean()
    dev.reset_peak()
    base_reserved, base_alloc = dev.reserved(), dev.allocated()
    t = time.perf_counter()
    spill = tempfile.mkdtemp(prefix="layerwise-gpu-check-spill-")
    engine = StreamingEngine(ctx["adapter"], store, plan,
                             EngineConfig(device=dev.name, compute_dtype=torch.bfloat16, spill_dir=spill))
    rec["engine_init_s"] = round(time.perf_counter() - t, 3)
    try:
        if "pinned_nbytes" not in check.result["store"]:  # the first engine created the optimizer state
            pinned, how = pinned_bytes(store)
            check.result["store"].update({"store_nbytes": store.nbytes(), "pinned_nbytes": pinned,
                                          "pinned_fraction": pinned / store.nbytes(),
                                          "host_allocator_with_state": host_allocator_stats(torch)})
        pred = engine.predict_memory(mbs, seq)
        rec["predicted_peak_bytes"] = pred.peak_bytes
        rec["predicted_peak_op"] = pred.peak_op
        rec["predicted_breakdown"] = pred.breakdown
        # warm-up (first-use costs: cuBLAS, pinned staging, the optimizer kernel), drained
        t = time.perf_counter()
        warm = engine.train_step(batches, lr)
        engine.synchronize()
        dev.sync()
        rec["warmup_step_s"] = round(time.perf_counter() - t, 3)
        # timed: consecutive steps (each next forward waits per unit for the last update), drained
        stats, marks = [], []
        t0 = time.perf_counter()
        for _ in range(check.args.steps):
            stats.append(engine.train_step(batches, lr))
            marks.append(time.perf_counter())
        engine.synchronize()
        dev.sync()
        t_end = time.perf_counter()
        step_s = (t_end - t0) / check.args.steps
        intervals = [b - a for a, b in zip([t0] + marks[:-1], marks)]
        tokens = mbs * seq * nmb
        flops = CostModel(ctx["shape"], PRESETS["h200"], mbs, seq).model_flops() * nmb
        peak_tflops = ctx.get("peak_tflops")
        rec.update({
            "steps": check.args.steps,
            "step_s": step_s,
            "step_return_intervals_s": intervals,
            "tokens_per_step": tokens,
            "tokens_per_s": tokens / step_s,
            "model_flops_per_step": flops,
            "tflops": flops / step_s / 1e12,
            "mfu": (flops / step_s / 1e12 / peak_tflops) if peak_tflops else None,
            "mfu_peak_tflops": peak_tflops,
            "losses": [warm.loss] + [s.loss for s in stats],
            "grad_norms": [warm.grad_norm] + [s.grad_norm for s in stats],
            "skipped_steps": sum(s.skipped for s in [warm, *stats]),
            "device_peak_reserved_bytes": dev.max_reserved() - base_reserved if dev.is_cuda else None,
            "device_peak_allocated_bytes": dev.max_allocated() - base_alloc if dev.is_cuda else None,
        })
        for k in ("reserved", "allocated"):
            peak = rec[f"device_peak_{k}_bytes"]
            rec[f"{k}_over_predicted"] = peak / pred.peak_bytes if peak is not None else None
        ctx["measured"][name] = (plan, rec)  # for the simulator, even if the profiled step fails
        check.save()
        # one profiled step, start to finish (its optimizer drained)
        if check.args.profile:
            with tempfile.TemporaryDirectory(prefix="layerwise-gpu-check-trace-") as d:
                dev.sync()
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.is_cuda else [])
                t = time.perf_counter()
                with profile(activities=activities) as prof:
                    engine.train_step(batches, lr)
                    engine.synchronize()
                    dev.sync()
                prof_step = time.perf_counter() - t
                path = Path(d) / f"trace-{name}.json"
                prof.export_chrome_trace(str(path))
                if check.args.trace_dir:
                    Path(check.args.trace_dir).mkdir(parents=True, exist_ok=True)
                    dst = Path(check.args.trace_dir) / path.name.replace(":", "_")
                    dst.write_bytes(path.read_bytes())
                ov = copy_overlap(load_trace_events(path))
                ov["profiled_step_s"] = prof_step
                ov["trace_bytes"] = path.stat().st_size
                rec["profile"] = ov
                rec["h2d_gbps"] = ov["h2d"]["gbps_active"]
                rec["d2h_gbps"] = ov["d2h"]["gbps_active"]
                rec["copy_overlap_fraction"] = ov["all_async_copies"]["overlap_fraction"]
        rec["host_allocator_after"] = host_allocator_stats(torch)
    finally:
        engine.close()
        del engine
        shutil.rmtree(spill, ignore_errors=True)
        dev.clean()
    return rec


def run_simulator(check: Check, ctx: dict[str, Any]) -> dict[str, Any]:
    from layerwise.plan.simulator import simulate

    out: dict[str, Any] = {"profiles": {n: p.to_dict() for n, p in ctx["profiles"].items()},
                           "max_abs_error_pct": {}}
    for name, (plan, rec) in ctx["measured"].items():
        if "step_s" not in rec:
            continue
        rec["simulated"] = {}
        for pname, hw in ctx["profiles"].items():
            sim = simulate(plan, ctx["shape"], hw, keep_trace=False)
            err = (sim.step_s - rec["step_s"]) / rec["step_s"] * 100
            rec["simulated"][pname] = {"step_s": sim.step_s, "error_pct": err,
                                       "peak_device_bytes": sim.peak_device_bytes,
                                       "busy_s": sim.busy_s, "fits": sim.fits}
            cur = out["max_abs_error_pct"].get(pname)
            out["max_abs_error_pct"][pname] = abs(err) if cur is None else max(cur, abs(err))
    check.result["simulator"] = out
    return out


# ----- main ----------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-check.json", help="JSON file to write (default gpu-check.json)")
    ap.add_argument("--budget-s", type=float, default=450.0,
                    help="global time budget; no section starts when less than its estimate is left")
    ap.add_argument("--sections", default="",
                    help="comma-separated subset of: pytest,calibration,optimizer,planner,store,plan,simulator")
    ap.add_argument("--model", default="llama3-8b", help="flavor whose widths are used (default llama3-8b)")
    ap.add_argument("--layers", type=int, default=16, help="decoder layers of that shape (default 16)")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    ap.add_argument("--moments", choices=("8bit", "fp32"), default="8bit", help="optimizer moments of every unit")
    ap.add_argument("--host-mem-gib", type=float, default=128.0,
                    help="host RAM of the machine (the GPU machine's RAM grows on use: MemTotal reads low)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per plan (after one warm-up step)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled step")
    ap.add_argument("--trace-dir", default=None, help="also keep each plan's chrome trace here")
    ap.add_argument("--calibrate-quick", action="store_true", help="calibrate --quick")
    ap.add_argument("--optim-layers", type=int, default=4, help="decoder layers' worth of params for the optimizer timing")
    ap.add_argument("--optim-rounds", type=int, default=7)
    ap.add_argument("--pytest-timeout-s", type=float, default=200.0)
    ap.add_argument("--pytest-test-timeout-s", type=float, default=120.0, help="per test (pytest-timeout)")
    ap.add_argument("--reserve-after-pytest-s", type=float, default=240.0,
                    help="budget kept for the other sections when pytest's timeout is set")
    ap.add_argument("--device", default="cuda",
                    help="cuda (the check) or cpu: a dry run of this script itself on a machine without a "
                         "GPU (use a tiny --model, e.g. llama-debug)")
    args = ap.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    return args


def no_gpu(reason: str) -> int:
    print(f"gpu-check: no GPU here ({reason}); nothing to check.")
    print(json.dumps({"schema": SCHEMA, "status": "no_cuda", "reason": reason}))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return no_gpu(f"torch is not importable: {type(e).__name__}: {e}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return no_gpu(f"torch {torch.__version__} sees no CUDA device")
    if str(REPO / "src") not in sys.path and importlib.util.find_spec("layerwise") is None:
        sys.path.insert(0, str(REPO / "src"))

    check = Check(args, Path(args.out))
    result = check.result
    result["machine"] = machine_info(torch)
    result["plans"] = {}
    check.save()
    ctx: dict[str, Any] = {"profiles": {}, "measured": {}, "dev": Dev(torch, args.device)}
    result["device"] = args.device

    def setup() -> dict[str, Any]:
        from layerwise.models import DecoderAdapter, get_flavor
        from layerwise.plan.hardware import PRESETS
        from layerwise.plan.shape import ModelShape

        flavor = get_flavor(args.model)
        full_layers = flavor.build_config().num_hidden_layers
        host_budget = int(args.host_mem_gib * GIB)
        layers = args.layers
        mbs, seq, nmb = args.micro_batch_size, args.seq_len, args.micro_batches
        # keep the pinned store (rounded up to powers of two), pinned host activations and a
        # margin inside 85% of the machine's RAM
        while True:
            cfg = flavor.build_config(num_hidden_layers=layers)
            shape = ModelShape.from_config(cfg, name=f"{args.model}[{layers} layers]")
            logical, rounded = store_bytes_estimate([shape.unit_params(u) for u in shape.unit_names()],
                                                    args.moments, 2)
            acts = layers * pow2_ceil(mbs * seq * shape.hidden_size * 2) * nmb
            if rounded + acts + 16 * GIB <= 0.85 * host_budget or layers <= 2:
                break
            layers -= 2
        ctx.update(flavor=args.model, shape=shape, mbs=mbs, seq=seq, nmb=nmb,
                   moments=[args.moments] * (layers + 2), host_budget_bytes=host_budget,
                   adapter=DecoderAdapter(cfg))
        ctx["profiles"]["h200"] = PRESETS["h200"].with_memory(host_mem_gb=host_budget / GB)
        from layerwise.plan.cost import CostModel
        model = {
            "flavor": args.model,
            "source": flavor.note,
            "family": flavor.family,
            "num_layers": layers,
            "num_layers_requested": args.layers,
            "num_layers_full": full_layers,
            "hidden_size": shape.hidden_size,
            "intermediate_size": shape.intermediate_size,
            "num_heads": shape.num_heads,
            "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim,
            "vocab_size": shape.vocab_size,
            "tied": shape.tied,
            "num_params": shape.num_params,
            "seq_len": seq,
            "micro_batch_size": mbs,
            "num_micro_batches": nmb,
            "tokens_per_step": mbs * seq * nmb,
            "model_flops_per_step": CostModel(shape, PRESETS["h200"], mbs, seq).model_flops() * nmb,
            "compute_dtype": "bfloat16",
            "moments": args.moments,
            "store_bytes_estimate": logical,
            "store_pinned_bytes_estimate_pow2": rounded,
            "host_budget_bytes": host_budget,
            "data": f"random token ids and labels (seed {args.seed + 1}), every position a target",
        }
        result["model"] = model
        return model

    check.section("setup", 0, setup)
    if "shape" not in ctx:
        result["status"] = "failed"
        check.save()
        print(json.dumps(result, indent=2, default=str))
        return 1

    check.section("pytest", 60, lambda: run_pytest(check))
    check.section("calibration", 60, lambda: run_calibration(check, ctx))
    if "calibrated" in ctx["profiles"]:
        ctx["peak_tflops"] = ctx["profiles"]["calibrated-shape"].peak_tflops \
            if "calibrated-shape" in ctx["profiles"] else ctx["profiles"]["calibrated"].peak_tflops
    else:
        ctx["peak_tflops"] = ctx["profiles"]["h200"].peak_tflops
    check.section("optimizer", 40, lambda: run_optimizer(check, ctx))
    check.section("planner", 30, lambda: run_planner(check, ctx))
    check.section("store", 60, lambda: build_store(check, ctx))
    if "store" in ctx:
        from layerwise.plan import Plan

        L, kw = ctx["shape"].num_layers, dict(micro_batch_size=ctx["mbs"], num_micro_batches=ctx["nmb"],
                                             seq_len=ctx["seq"], moments=list(ctx["moments"]))
        plans = {"every-1": Plan.every_k(L, 1, **kw), "every-4": Plan.every_k(L, 4, **kw),
                 "keep-all-host": Plan.keep_all(L, "host", **kw)}
        if "planner_plan" in ctx:
            plans["planner"] = ctx["planner_plan"]
        ctx["batches"] = make_batches(ctx, args.seed + 1)
        estimate = 60.0
        for name, plan in plans.items():
            t = time.perf_counter()
            check.section(f"plan:{name}", estimate, lambda n=name, p=plan: run_plan(check, ctx, n, p))
            if result["sections"][f"plan:{name}"]["ok"]:
                estimate = 1.2 * (time.perf_counter() - t)
        ctx.pop("store", None)
        ctx.pop("batches", None)
        ctx["dev"].clean()
    check.section("simulator", 5, lambda: run_simulator(check, ctx))

    failed = [n for n, s in result["sections"].items() if s["error"]]
    skipped = [n for n, s in result["sections"].items() if s["skipped"]]
    out_of_time = [n for n, s in result["sections"].items() if (s["skipped"] or "").startswith("time budget")]
    result["status"] = "failed" if failed else ("partial" if out_of_time else "ok")
    result["failed_sections"] = failed
    result["skipped_sections"] = skipped
    check.save()
    print(json.dumps(result, indent=2, default=str))
    print(summary(result))
    return 1 if failed or out_of_time else 0


def summary(result: dict[str, Any]) -> str:
    """A short table to read at the end of the output."""
    lines = [f"gpu-check: status {result['status']} in {result.get('wall_s', 0):.0f} s; "
             f"failed {result.get('failed_sections')}, skipped {result.get('skipped_sections')}"]
    py = result.get("pytest")
    if py:
        lines.append(f"pytest -m cuda: {py.get('passed')} passed, {py.get('failed')} failed, "
                     f"{py.get('errors')} errors, {py.get('skipped')} skipped (exit {py.get('exit_code')})")
    m = result.get("model")
    if m:
        lines.append(f"model: {m['flavor']} widths, {m['num_layers']} layers, {m['num_params'] / 1e9:.2f}B params, "
                     f"{m['micro_batch_size']} x {m['seq_len']} tokens x {m['num_micro_batches']}, {m['moments']} moments")
    lines.append(f"{'plan':<14}{'tok/s':>9}{'TFLOPS':>8}{'step s':>8}{'sim s':>8}{'res/pred':>9}"
                 f"{'H2D GB/s':>9}{'D2H GB/s':>9}{'overlap':>8}")

    def f(x, fmt):
        width = int(fmt.split(".")[0])
        return format(x, fmt) if isinstance(x, (int, float)) else "-".rjust(width)

    for name, r in (result.get("plans") or {}).items():
        sim = (r.get("simulated") or {})
        sim_s = next((sim[p]["step_s"] for p in ("calibrated-shape", "calibrated", "h200") if p in sim), None)
        lines.append(f"{name:<14}{f(r.get('tokens_per_s'), '9.0f')}{f(r.get('tflops'), '8.1f')}"
                     f"{f(r.get('step_s'), '8.3f')}{f(sim_s, '8.3f')}{f(r.get('reserved_over_predicted'), '9.3f')}"
                     f"{f(r.get('h2d_gbps'), '9.1f')}{f(r.get('d2h_gbps'), '9.1f')}"
                     f"{f(r.get('copy_overlap_fraction'), '8.2f')}")
    o = result.get("optimizer")
    if o:
        lines.append(f"optimizer ({o['params'] / 1e6:.0f}M params): AdamW8bit {o['adamw8bit_step_s'] * 1e3:.1f} ms, "
                     f"torch fused {o['torch_fused_step_s'] * 1e3:.1f} ms (ratio {o['step_ratio_vs_torch_fused']:.2f}); "
                     f"with clip {o['step_ratio_with_clip']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
