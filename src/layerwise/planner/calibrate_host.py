"""The host half of ``layerwise calibrate``: each probe runs the engine's own host kernel
(accumulation, optimizer step, pinned refresh, gloo reduce when asked), on the threads and CPUs
the engine gives it (``host_threads``), at the run's unit size. Rates count the bytes each kernel
moves, the same counts the cost model divides by."""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import torch

from ..models.adapter import ParamSpec, Unit
from ..optim.adamw import AdamWConfig, HostAdamW
from ..optim.adamw8bit import HostAdamW8bit
from ..optim.grad_accum import accumulate
from .hardware import GB, HardwareProfile
from .host_rates import config_name
from ..split_master import split_
from ..store import FlatLayout, UnitBuffers
from ..engine.host_threads import HostThreads, plan_host_threads

Clock = Callable[[], float]
T = TypeVar("T")


def median_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None,
                clock: Clock = time.perf_counter) -> float:
    """Median of ``repeats`` runs after a warm-up: the cost model adds these times up over a step
    of many runs, so each is priced at what a run typically takes, not at the fastest one; the
    median still ignores the odd descheduled run."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        sync()
        times.append(clock() - t)
    return statistics.median(times)


def _meminfo_total_bytes(path: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_limit_bytes(root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``),
    None when unlimited or unreadable."""
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        try:
            text = (Path(root) / name).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            v = int(text)
        except ValueError:
            continue
        return v if v < 1 << 60 else None  # v1 writes a huge number for "no limit"
    return None


def total_ram_bytes(meminfo: str = "/proc/meminfo", cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Physical RAM this process may use: ``MemTotal``, or the cgroup's limit when lower. (Physical
    pages times the page size undercounts nothing on Linux but is not what a container may use.)"""
    total = _meminfo_total_bytes(meminfo)
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 16 * GB
    limit = _cgroup_limit_bytes(cgroup_root)
    return min(total, limit) if limit else total


def on_host_worker(threads: HostThreads, fn: Callable[[], T], intra: int | None = None) -> T:
    """Run ``fn`` on a thread placed as the engine's host workers are (their CPU mask), with
    torch's intra-op threads at ``intra`` while it runs (restored after)."""
    before = torch.get_num_threads()
    if intra is not None:
        torch.set_num_threads(intra)
    try:
        with ThreadPoolExecutor(1, initializer=threads.initializer) as ex:
            return ex.submit(fn).result()
    finally:
        torch.set_num_threads(before)


def measure_accumulation(numel: int, repeats: int, threads: int = 1) -> tuple[float, float]:
    """(bf16 -> fp32, fp32 -> fp32) GB/s of ``grad_accum.accumulate`` adding (not the first
    landing) a ``numel`` gradient split over ``threads``, counted as 10 and 12 bytes an element."""
    dst = torch.zeros(numel)
    out = []
    for dtype, per_elem in ((torch.bfloat16, 10), (torch.float32, 12)):
        src = torch.randn(numel).to(dtype)
        t = median_time(lambda: accumulate(dst, src, first=False, threads=threads), repeats)
        out.append(numel * per_elem / t / 1e9)
    return out[0], out[1]


def _probe_unit(numel: int, split: bool = False) -> UnitBuffers:
    """A unit of about ``numel`` parameters in the form the engine keeps them: on a bf16 device
    (``split``) the master split into its bf16 copy source and remainder with a bf16 gradient
    (one landing per step, the default); else a plain fp32 master with an fp32 gradient."""
    unit = Unit("probe", "layer", 0, (ParamSpec("w", "w", (numel // 1024, 1024)),))
    n = (numel // 1024) * 1024
    w, g = torch.randn(n) * 0.02, torch.randn(n) * 1e-3
    if not split:
        return UnitBuffers(unit, FlatLayout.of(unit), w, g)
    hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    split_(w, hi, lo)
    return UnitBuffers(unit, FlatLayout.of(unit), None, g.to(torch.bfloat16), compute=hi, remainder=lo)


def measure_optimizer(numel: int, repeats: int, split: bool = False) -> float:
    """Params/s of the host AdamW step with fp32 moments (``HostAdamW.step_unit``), as the engine
    updates a unit, in the unit's form (``_probe_unit``; the caller sets the threads)."""
    buf = _probe_unit(numel, split)
    opt = HostAdamW(AdamWConfig())
    opt.init_state(buf)
    t = median_time(lambda: opt.step_unit(buf, 1e-4, 1.0), repeats)
    return buf.layout.numel / t


def measure_optimizer_8bit(numel: int, repeats: int, split: bool = False) -> float:
    """Params/s of the project's block-wise 8-bit AdamW step, in the unit's form."""
    buf = _probe_unit(numel, split)
    opt = HostAdamW8bit(AdamWConfig())
    opt.init_state(buf)
    t = median_time(lambda: opt.step_unit(buf, 1e-4, 1.0), repeats)
    return buf.layout.numel / t


def measure_pinned_copy_gbps(device: str, numel: int, repeats: int) -> float:
    """GB/s (4 read + 2 written an element) of the compute copy's refresh: ``copy_`` of an fp32
    master into a bf16 buffer, page-locked when ``device`` is CUDA (as the store's arena is)."""
    src = torch.randn(numel)
    dst = torch.empty(numel, dtype=torch.bfloat16)
    if device.startswith("cuda"):
        dst = dst.pin_memory()
    t = median_time(lambda: dst.copy_(src), repeats)
    return numel * 6 / t / 1e9


def _reduce_bus_gbps(nbytes: int, seconds: float, world: int) -> float:
    """A reduce's bus bandwidth: ``(W-1)/W`` of the bytes cross each rank's link."""
    return (world - 1) / world * nbytes / seconds / 1e9


def measure_gloo_reduce_gbps(numel: int, repeats: int) -> float:
    """Bus GB/s of gloo's reduce of an fp32 tensor of ``numel`` elements: over the initialised
    default group when there is one (every rank must call this), else between two ranks on
    threads of this process (gloo's TCP transport over loopback, as two processes on a node)."""
    import torch.distributed as dist

    nbytes = numel * 4
    if dist.is_available() and dist.is_initialized():
        t = torch.ones(numel)
        world = dist.get_world_size()

        def once() -> None:
            dist.reduce(t, dst=0)

        dist.barrier()
        s = median_time(once, repeats, sync=dist.barrier)
        return _reduce_bus_gbps(nbytes, s, world)
    store = dist.HashStore()
    times: dict[int, float] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def rank(r: int) -> None:
        try:
            pg = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=120))
            opts = dist.ReduceOptions()
            opts.rootRank, opts.reduceOp = 0, dist.ReduceOp.SUM
            t = torch.ones(numel)

            def once() -> None:
                barrier.wait()
                pg.reduce([t], opts).wait()

            times[r] = median_time(once, repeats)
        except BaseException as e:  # surfaced below, on the caller's thread
            errors.append(e)
            barrier.abort()

    workers = [threading.Thread(target=rank, args=(r,), name=f"calibrate-gloo-{r}") for r in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    return _reduce_bus_gbps(nbytes, max(times.values()), 2)


def optimizer_form(device_type: str) -> tuple[str, str]:
    """(gradient, master) the optimizer probes time (``_probe_unit``): on a GPU a bf16 gradient
    and the split master (a run whose step lands once: ``train/loop.py``), on the CPU fp32 both."""
    return ("bf16", "split") if device_type == "cuda" else ("fp32", "plain")


def optimizer_lines(profile: HardwareProfile, device_type: str, optimizer_threads: int) -> list[str]:
    """What ``layerwise calibrate`` measured of the optimizer, in the planner's configuration
    names (``plan.host_rates``): the rate, the threads it ran on and the rate per thread, so a
    measurement can be set beside a preset's per-core figures and its scaling assumption."""
    intra = plan_host_threads(device_type, optimizer_threads).optimizer_intra or torch.get_num_threads()
    grad, master = optimizer_form(device_type)
    lines = []
    for moments, rate in (("fp32", profile.optimizer_params_per_s), ("8bit", profile.optimizer_8bit_params_per_s)):
        lines.append(f"optimizer {config_name(moments, grad, master)}: {rate / 1e9:.3f} Gparam/s on {intra} "
                     f"intra-op thread(s) ({rate / 1e9 / intra:.3f} Gparam/s per thread), one unit at a time"
                     + (f"; the engine updates {optimizer_threads} units at once" if optimizer_threads > 1 else ""))
    return lines
