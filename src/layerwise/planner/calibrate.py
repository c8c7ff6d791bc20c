"""Measure the machine this runs on and return a :class:`HardwareProfile`.

Each figure is the median of a few repeats after a warm-up, measuring the fields the roofline
prices a step by (``docs/planner.md``, "Calibration"); ``peak_tflops`` is what a GEMM sustains
here, so ``efficiency`` is 1. ``cuda:N`` is measured on device N."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..models.names import EMBED, HEAD
from .hardware import HardwareProfile
from .hardware_choice import resolve_hardware
from .presets import PRESETS
from ..plan.shape import ModelShape, load_shape
from .calibrate_host import (median_time, measure_accumulation, measure_gloo_reduce_gbps, measure_optimizer,
                             measure_optimizer_8bit, measure_pinned_copy_gbps, on_host_worker)
from .machine import this_machine
from ..engine.host_threads import plan_host_threads


def _sync_for(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        dev = torch.device(device)
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def measure_matmul_tflops(device: str, dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = median_time(lambda: torch.mm(a, b), repeats, _sync_for(device))
    return 2 * n**3 / t / 1e12


def measure_mem_gbps(device: str, dtype, numel: int, repeats: int) -> float:
    """Bytes per second (two read, one written) of ``c = a + b`` over ``numel`` elements."""
    a, b, c = (torch.ones(numel, device=device, dtype=dtype) for _ in range(3))
    t = median_time(lambda: torch.add(a, b, out=c), repeats, _sync_for(device))
    return 3 * numel * a.element_size() / t / 1e9


def measure_launch_s(device: str, dtype, repeats: int) -> float:
    """Seconds per kernel of 100 one-element adds in a row (their dispatch and launch)."""
    one = torch.zeros(1, device=device, dtype=dtype)
    return median_time(lambda: [torch.add(one, one) for _ in range(100)], repeats, _sync_for(device)) / 100


def measure_copy_gbps(device: str, nbytes: int, repeats: int) -> tuple[float, float]:
    n = nbytes // 4
    if device.startswith("cuda"):
        host = torch.empty(n, dtype=torch.float32).pin_memory()
        dev = torch.empty(n, dtype=torch.float32, device=device)
        sync = _sync_for(device)
        h2d = median_time(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
        d2h = median_time(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
        return nbytes / h2d / 1e9, nbytes / d2h / 1e9
    # The CPU backend copies a unit (a few MB to tens of MB) into a slot allocated once
    # (``copy_`` into warm pages); a clone would time fresh pages being allocated and faulted in,
    # several times slower.
    piece = min(n, 4 << 20)
    src = torch.ones(piece, dtype=torch.float32)
    k = max(1, n // piece)
    slots = [torch.empty(piece, dtype=torch.float32) for _ in range(2)]
    t = median_time(lambda: [slots[j % 2].copy_(src) for j in range(k)], repeats)
    return k * piece * 4 / t / 1e9, k * piece * 4 / t / 1e9


def measure_disk_gbps(directory: str | None, nbytes: int, repeats: int) -> tuple[float, float]:
    """(read, write) GB/s of a file in ``directory``; writes are fsync'ed."""
    data = os.urandom(min(nbytes, 1 << 20)) * max(1, nbytes // (1 << 20))
    with tempfile.TemporaryDirectory(dir=directory, prefix="layerwise-calib-") as d:
        path = Path(d) / "probe.bin"

        def write() -> None:
            with open(path, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())

        def read() -> None:
            with open(path, "rb") as f:
                buf = bytearray(len(data))
                f.readinto(buf)

        tw = median_time(write, repeats)
        tr = median_time(read, repeats)
    return len(data) / tr / 1e9, len(data) / tw / 1e9


def _host_probe_numel(shape: ModelShape | None, quick: bool) -> int:
    """Elements of a host probe: the run's largest decoder layer (a landing is one layer), capped
    so a probe's buffers stay a few hundred MB (a memory-bound kernel's rate is flat past the caches)."""
    cap = (4 << 20) if quick else (64 << 20)
    if shape is None:
        return (4 << 20) if quick else (16 << 20)
    layers = [shape.unit_params(u) for u in shape.unit_names() if u not in (EMBED, HEAD)]
    return max(1 << 16, min(cap, max(layers)))


def calibrate(quick: bool = False, device: str = "auto", spill_dir: str | None = None,
              name: str | None = None, model=None, optimizer_threads: int = 1,
              gloo: bool = False) -> HardwareProfile:
    """Measure this machine. ``model``: size the host probes to its largest layer.
    ``optimizer_threads``: the engine's. ``gloo``: measure gloo's reduce (always when
    torch.distributed is initialised)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available; use --device cpu")
    on_gpu = device.startswith("cuda")
    shape = model if model is None else (load_shape(str(model)) if isinstance(model, (str, Path))
                                         else ModelShape.from_config(model))
    dtype = torch.bfloat16 if on_gpu else torch.float32
    reps = 3 if quick else 7
    n = (4096 if on_gpu else 1024) if quick else (8192 if on_gpu else 2048)
    peak = measure_matmul_tflops(device, dtype, n, reps)
    mem = measure_mem_gbps(device, dtype, (64 << 20) if on_gpu else (4 << 20), reps)
    launch = measure_launch_s(device, dtype, reps)
    h2d, d2h = measure_copy_gbps(device, (64 << 20) if quick else (256 << 20), reps)
    nvme_r, nvme_w = measure_disk_gbps(spill_dir, (32 << 20) if quick else (256 << 20), 2 if quick else 3)
    host = measure_host(device, _host_probe_numel(shape, quick), reps, optimizer_threads, gloo)
    free_disk = _free_bytes(spill_dir or tempfile.gettempdir())
    machine = this_machine(device)
    # what is not measured (reserves, compute dtype, lanes, GEMM tile) is this machine's preset's;
    # a GPU no preset matches takes a GPU preset's (every GPU preset has the same)
    choice = resolve_hardware(machine=machine)
    base = choice.profile if choice is not None else PRESETS["h100"]
    ram = machine.ram_bytes
    dev_mem = machine.gpu_mem_bytes if on_gpu else ram
    return replace(
        base,
        name=name or f"calibrated-{device}",
        device_mem_bytes=dev_mem,
        device_reserved_bytes=min(base.device_reserved_bytes, dev_mem // 8),
        peak_tflops=peak, efficiency=1.0, device_mem_gbps=mem, kernel_launch_s=launch,
        h2d_gbps=h2d, d2h_gbps=d2h,
        nvme_read_gbps=nvme_r, nvme_write_gbps=nvme_w,
        nvme_capacity_bytes=int(free_disk * 0.8),
        host_mem_bytes=ram,
        host_reserved_bytes=min(base.host_reserved_bytes, ram // 8),
        **host,
        # not measured: the base preset's interconnects would be a guess about another machine
        gpus_per_node=max(1, torch.cuda.device_count()) if on_gpu else 1,
        intra_node_gbps=None, inter_node_gbps=None, node_host_link_gbps=None,
    )


def measure_host(device: str, numel: int, repeats: int, optimizer_threads: int = 1,
                 gloo: bool = False) -> dict[str, float | None]:
    """The profile's host fields, each probe on the threads the engine gives that work: the
    landing's thread count and CPUs for the accumulation, the optimizer's intra-op threads for
    its step and the refresh (``host_threads.plan_host_threads``)."""
    import torch.distributed as dist

    threads = plan_host_threads(torch.device(device).type, optimizer_threads)
    bf16, fp32 = on_host_worker(threads, lambda: measure_accumulation(numel, repeats, threads.landing))
    intra = threads.optimizer_intra
    split = torch.device(device).type == "cuda"  # bf16 compute: the split master, bf16 grads
    opt = on_host_worker(threads, lambda: measure_optimizer(numel, repeats, split), intra)
    opt8 = on_host_worker(threads, lambda: measure_optimizer_8bit(numel, repeats, split), intra)
    pinned = on_host_worker(threads, lambda: measure_pinned_copy_gbps(device, numel, repeats), intra)
    reduce = None
    if gloo or (dist.is_available() and dist.is_initialized()):
        reduce = measure_gloo_reduce_gbps(numel, max(1, repeats // 2))
    return dict(host_accum_gbps=fp32, host_accum_bf16_gbps=bf16, optimizer_params_per_s=opt,
                optimizer_8bit_params_per_s=opt8, pinned_copy_gbps=pinned, gloo_reduce_gbps=reduce)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
