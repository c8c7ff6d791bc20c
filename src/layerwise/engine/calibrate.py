"""Measure the machine this runs on and return a :class:`HardwareProfile`.

What is measured (each the fastest of a few repeats, after a warm-up):

- ``peak_tflops``: a square matmul in the compute dtype (fp32 on CPU, bf16 on CUDA);
- ``efficiency``: the FLOP rate of a decoder layer's backward exactly as the engine runs it
  (``layer_ops.layer_backward`` on a flat weight buffer; the cost model's FLOPs over its
  measured time) divided by that matmul rate, so attention, norms and the framework's overhead
  are priced as they are on this machine;
- ``fwd_efficiency``: the same for the layer's forward without a graph (``layer_fwd``, recompute);
- ``op_overhead_s``: the fixed cost of a layer op (dispatch + Python), the intercept of a fit
  through 512 and 8 tokens, so that the rates above exclude it;
- copy bandwidth: on CUDA pinned H2D/D2H copies; on CPU the engine's "copies" are ``copy_``
  into slots allocated once;
- disk: write with fsync, then read back, in the spill directory;
- host optimizer: fused AdamW over a flat fp32 buffer (as the host store updates a unit), and
  the gradient accumulation ``grad += copy``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..models.adapter import DecoderAdapter, ParamSpec, Unit
from ..models.registry import get_flavor
from ..optim.adamw import AdamWConfig, HostAdamW
from ..optim.adamw8bit import HostAdamW8bit
from ..plan.cost import CostModel
from ..plan.hardware import GB, PRESETS, HardwareProfile
from ..plan.shape import ModelShape
from ..store import FlatLayout, UnitBuffers
from .layer_ops import layer_backward


Clock = Callable[[], float]


def _best_time(fn: Callable[[], None], repeats: int, sync: Callable[[], None] = lambda: None,
               clock: Clock = time.perf_counter) -> float:
    """Fastest of ``repeats`` runs after a warm-up: what the machine can do when others let it
    (shared machines are noisy; the minimum is the stable statistic, as in ``timeit``)."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t = clock()
        fn()
        sync()
        times.append(clock() - t)
    return min(times)


def _total_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GB


def measure_matmul_tflops(device: str, dtype, n: int, repeats: int, clock: Clock = time.perf_counter) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    t = _best_time(lambda: torch.mm(a, b), repeats, sync, clock)
    return 2 * n**3 / t / 1e12


def measure_layer(device: str, dtype, tokens: int, repeats: int,
                  clock: Clock = time.perf_counter) -> tuple[float, float, float]:
    """(FLOP/s of a llama-30m layer's backward as the engine runs it, FLOP/s of its forward
    without a graph, seconds of fixed cost per op), each a fit through ``tokens`` and 8 tokens.

    The op's time is ``overhead + FLOPs / rate``: the fit keeps the fixed per-op cost (Python,
    dispatch) out of the rate, so the cost model, which adds ``op_overhead_s`` to every op,
    does not count it twice. The forward is fitted on its own: without autograd's bookkeeping
    it runs at a different rate than forward + backward.
    """
    cfg = get_flavor("llama-30m").build_config()
    adapter = DecoderAdapter(cfg)
    layout = FlatLayout.of(adapter.units[1])
    flat_w = (torch.randn(layout.numel, device=device) * 0.02).to(dtype)
    rotary = adapter.new_rotary(device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def run(seq: int) -> tuple[Callable[[], None], Callable[[], None]]:
        x = torch.randn(1, seq, cfg.hidden_size, device=device, dtype=dtype)
        grad_out = torch.randn_like(x)
        ctx = adapter.layer_context((1, seq), device, dtype, rotary)

        def fwd() -> None:
            with torch.no_grad():
                adapter.layer(0, layout.views(flat_w), x, ctx)

        return (lambda: layer_backward(adapter, 0, layout, flat_w, x, grad_out, ctx)), fwd

    shape = ModelShape.from_config(cfg)
    big = CostModel(shape, PRESETS["cpu"], 1, tokens).layer_fwd_flops(0)
    small = CostModel(shape, PRESETS["cpu"], 1, 8).layer_fwd_flops(0)
    (bwd_big, fwd_big), (bwd_small, fwd_small) = run(tokens), run(8)
    tb, tb8 = _best_time(bwd_big, repeats, sync, clock), _best_time(bwd_small, repeats, sync, clock)
    tf, tf8 = _best_time(fwd_big, repeats, sync, clock), _best_time(fwd_small, repeats, sync, clock)
    bwd_rate = 3 * (big - small) / max(tb - tb8, 1e-9)
    fwd_rate = (big - small) / max(tf - tf8, 1e-9)
    overhead = max(0.0, tf8 - small / fwd_rate)
    return bwd_rate, fwd_rate, overhead


def measure_copy_gbps(device: str, nbytes: int, repeats: int,
                      clock: Clock = time.perf_counter) -> tuple[float, float]:
    n = nbytes // 4
    if device.startswith("cuda"):
        host = torch.empty(n, dtype=torch.float32).pin_memory()
        dev = torch.empty(n, dtype=torch.float32, device=device)
        sync = torch.cuda.synchronize
        h2d = _best_time(lambda: dev.copy_(host, non_blocking=True), repeats, sync)
        d2h = _best_time(lambda: host.copy_(dev, non_blocking=True), repeats, sync)
        return nbytes / h2d / 1e9, nbytes / d2h / 1e9
    # The CPU backend copies a unit (a few MB to tens of MB) into a slot allocated once
    # (``copy_`` into warm pages); a clone would time fresh pages being allocated and faulted in,
    # several times slower.
    piece = min(n, 4 << 20)
    src = torch.ones(piece, dtype=torch.float32)
    k = max(1, n // piece)
    slots = [torch.empty(piece, dtype=torch.float32) for _ in range(2)]
    t = _best_time(lambda: [slots[j % 2].copy_(src) for j in range(k)], repeats, clock=clock)
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

        tw = _best_time(write, repeats)
        tr = _best_time(read, repeats)
    return len(data) / tr / 1e9, len(data) / tw / 1e9


def _probe_unit(numel: int):
    unit = Unit("probe", "layer", 0, (ParamSpec("w", "w", (numel // 1024, 1024)),))
    n = (numel // 1024) * 1024
    return UnitBuffers(unit, FlatLayout.of(unit), torch.zeros(n), torch.randn(n))


def measure_optimizer(numel: int, repeats: int, clock: Clock = time.perf_counter) -> tuple[float, float]:
    """(host AdamW params/s with fp32 moments, grad-accumulate GB/s), as the engine runs them."""
    buf = _probe_unit(numel)
    opt = HostAdamW(AdamWConfig())
    opt.init_state(buf)
    t = _best_time(lambda: opt.step_unit(buf, 1e-4, 1.0), repeats, clock=clock)
    grad = torch.zeros(buf.layout.numel)
    copy = torch.randn(buf.layout.numel)
    ta = _best_time(lambda: grad.add_(copy), repeats, clock=clock)
    return buf.layout.numel / t, buf.layout.numel * 12 / ta / 1e9


def measure_optimizer_8bit(numel: int, repeats: int, clock: Clock = time.perf_counter) -> float:
    """Params/s of the project's block-wise 8-bit AdamW."""
    buf = _probe_unit(numel)
    opt = HostAdamW8bit(AdamWConfig())
    opt.init_state(buf)
    t = _best_time(lambda: opt.step_unit(buf, 1e-4, 1.0), repeats, clock=clock)
    return buf.layout.numel / t


def calibrate(quick: bool = False, device: str = "auto", spill_dir: str | None = None,
              name: str | None = None, cpu_time: bool = False) -> HardwareProfile:
    """``cpu_time``: time the compute, copies and optimizer by this process's CPU clock
    (``time.process_time``), not the wall clock: on a machine shared with other jobs that is what
    the work costs rather than how long the others let it run. CPU only (a GPU's work is not
    this process's CPU time); the disk is timed by the wall clock either way."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available; use --device cpu")
    on_gpu = device.startswith("cuda")
    if cpu_time and on_gpu:
        raise ValueError("cpu_time calibration is for the CPU backend; a GPU is timed by the wall clock")
    clock = time.process_time if cpu_time else time.perf_counter
    dtype = torch.bfloat16 if on_gpu else torch.float32
    reps = 3 if quick else 7
    n = (4096 if on_gpu else 1024) if quick else (8192 if on_gpu else 2048)
    layer_rate, fwd_rate, overhead = measure_layer(device, dtype, 512, reps, clock)  # small counts under-rate the rate
    # a real layer can beat a lone square matmul of the size tried; peak is the largest of them
    peak = max(measure_matmul_tflops(device, dtype, n, reps, clock), layer_rate / 1e12, fwd_rate / 1e12)
    h2d, d2h = measure_copy_gbps(device, (64 << 20) if quick else (256 << 20), reps, clock)
    nvme_r, nvme_w = measure_disk_gbps(spill_dir, (32 << 20) if quick else (256 << 20), 2 if quick else 3)
    opt_rate, accum = measure_optimizer((4 << 20) if quick else (16 << 20), reps, clock)
    opt8 = measure_optimizer_8bit((4 << 20) if quick else (16 << 20), reps, clock)
    ram = _total_ram_bytes()
    free_disk = _free_bytes(spill_dir or tempfile.gettempdir())
    if on_gpu:
        dev_mem = torch.cuda.get_device_properties(0).total_memory
        base = replace(PRESETS["h100"], device_reserved_bytes=int(1.5 * GB), compute_dtype_bytes=2,
                       synchronous=False)
    else:
        dev_mem = ram
        base = PRESETS["cpu"]
    return replace(
        base,
        name=name or f"calibrated-{device}",
        device_mem_bytes=dev_mem,
        device_reserved_bytes=min(base.device_reserved_bytes, dev_mem // 8),
        peak_tflops=peak,
        efficiency=max(0.02, min(1.0, layer_rate / (peak * 1e12))),
        fwd_efficiency=max(0.02, min(1.0, fwd_rate / (peak * 1e12))),
        h2d_gbps=h2d, d2h_gbps=d2h,
        nvme_read_gbps=nvme_r, nvme_write_gbps=nvme_w,
        nvme_capacity_bytes=int(free_disk * 0.8),
        host_mem_bytes=ram,
        host_reserved_bytes=min(base.host_reserved_bytes, ram // 8),
        optimizer_params_per_s=opt_rate, optimizer_8bit_params_per_s=opt8,
        host_accum_gbps=accum,
        op_overhead_s=overhead,
        # not measured: the base preset's interconnects would be a guess about another machine
        gpus_per_node=max(1, torch.cuda.device_count()) if on_gpu else 1,
        intra_node_gbps=None, inter_node_gbps=None, node_host_link_gbps=None,
    )


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
