"""Measure the machine this runs on and return a :class:`HardwareProfile`.

What is measured (each the median of a few repeats, after a warm-up: ``median_time``):

- ``peak_tflops``: a square matmul in the compute dtype (fp32 on CPU, bf16 on CUDA);
- ``efficiency``: the FLOP rate of a decoder layer's backward exactly as the engine runs it
  (``layer_ops.layer_backward`` on a flat weight buffer; the cost model's FLOPs over its
  measured time) divided by that matmul rate, so attention, norms and the framework's overhead
  are priced as they are on this machine;
- ``fwd_efficiency``: the same for the layer's forward without a graph (``layer_fwd``, recompute);
- the layer fit's intercept (a layer op's dispatch and Python, through two token counts), so
  that the rates above exclude it; the profile's ``op_overhead_s`` is in the end, on a CPU, what
  a tiny step costs beyond the simulator's price of it, per op (``calibrate_engine``: the
  engine's bookkeeping, the optimizer's and the landing's Python, kernels colder between them
  than in a hot loop), 0 on a GPU (its host issues the engine's work ahead). Given the run's model and
  micro-batch (``model``, ``seq_len``, ``micro_batch_size``), the layer is the model's and the fit
  runs through the run's micro-batch and twice it (on a large GPU a small layer at a few hundred
  tokens is launch-bound noise); without them a llama-30m layer, 512 and 8 tokens;
- the device by shape (``plan/device_cost.py``; the probes: ``calibrate_probes``):
  ``gemm_tflops_points``, a GEMM's rate at a few weight sizes and the rate it reads that weight
  at (8 rows; on a CPU from weights out of the caches, ``COLD_WEIGHT_BYTES``, and the rate per
  row beyond that pass: ``gemm_point``);
  ``device_mem_gbps``, an elementwise add's bytes per second; ``gather_gbps``, a row gather's
  (``GATHER_PROBE``); and the launches,
  from a layer at the fit's small point (``fit_launches``): ``kernel_launch_s`` per
  forward kernel and ``backward_launch_s`` per backward kernel, what the layer takes beyond its
  kernels' rooflines (its modules' Python and dispatch grow with its kernels, so the profile's
  ``op_overhead_s`` is then 0), so one layer's measurement prices every width; on a CPU
  without a run shape the kernels other than GEMMs are first priced at what they take in the
  llama-30m layer (``in_layer_factor``, from its two points) and the launches fitted on a narrow layer
  (``LAUNCH_FLAVOR``) at 8 tokens; a kept layer's fixed costs (``saved_tensor_s``,
  ``storage_copy_s``) from a chain of saved tensors through the engine's ``KeptInternals``
  (``kept_probes``). The probes and the layers' runs are timed in turn, round by round
  (``measure_by_shape``), so the differences the fit takes are of times from the same seconds;
- copy bandwidth: on CUDA pinned H2D/D2H copies; on CPU the engine's "copies" are ``copy_``
  into slots allocated once;
- disk: write with fsync, then read back, in the spill directory;
- the host side (``calibrate_host``): gradient accumulation, the optimizer step (fp32 and 8-bit
  moments), the refresh into pinned memory, and (data parallel, asked) gloo's reduce, each at the
  threads and CPUs the engine will give it and at the run's unit size.

``cuda:N`` is measured on device N (its memory, its syncs).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from ..models.adapter import DecoderAdapter
from ..models.names import EMBED, HEAD
from ..models.registry import FLAVORS, get_flavor
from ..plan.cost import CostModel
from ..plan.device_cost import DeviceCost, kernels_s
from ..plan.hardware import HardwareProfile
from ..plan.hardware_choice import resolve_hardware
from ..plan.presets import PRESETS
from ..plan.shape import ModelShape
from ..store import FlatLayout
from .calibrate_engine import measure_tiny_step
from .calibrate_host import (Clock, median_time, median_times, measure_accumulation,
                             measure_gloo_reduce_gbps, measure_optimizer, measure_optimizer_8bit,
                             measure_pinned_copy_gbps, on_host_worker)
from .calibrate_probes import device_shape_probes, kept_probes
from .devices import this_machine
from .host_threads import plan_host_threads
from .layer_ops import layer_backward


DEFAULT_POINTS = ((1, 512), (1, 8))
"""(micro-batch size, sequence length) of the layer fit without a run shape."""
def _sync_for(device: str) -> Callable[[], None]:
    if device.startswith("cuda"):
        dev = torch.device(device)
        return lambda: torch.cuda.synchronize(dev)
    return lambda: None


def measure_matmul_tflops(device: str, dtype, n: int, repeats: int, clock: Clock = time.perf_counter) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = median_time(lambda: torch.mm(a, b), repeats, _sync_for(device), clock)
    return 2 * n**3 / t / 1e12


def _layer_runs(device: str, dtype, config) -> tuple[Callable, ModelShape]:
    """(``run(mbs, seq)`` -> (the layer's backward as the engine runs it, its forward without a
    graph), the layer's shape), for ``config``'s first decoder layer (default llama-30m)."""
    cfg = config if config is not None else get_flavor("llama-30m").build_config()
    adapter = DecoderAdapter(cfg)
    layout = FlatLayout.of(adapter.units[1])
    flat_w = (torch.randn(layout.numel, device=device) * 0.02).to(dtype)
    rotary = adapter.new_rotary(device)

    def run(mbs: int, seq: int) -> tuple[Callable[[], None], Callable[[], None]]:
        x = torch.randn(mbs, seq, cfg.hidden_size, device=device, dtype=dtype)
        grad_out = torch.randn_like(x)
        ctx = adapter.layer_context((1, seq), device, dtype, rotary)

        def fwd() -> None:
            with torch.no_grad():
                adapter.layer(0, layout.views(flat_w), x, ctx)

        return (lambda: layer_backward(adapter, 0, layout, flat_w, x, grad_out, ctx)), fwd

    return run, ModelShape.from_config(cfg)


LAUNCH_FLAVOR = "llama-debug"
"""The layer the launches are fitted on, on a CPU without a run shape: one too narrow (hidden 32)
for its kernels' rooflines to matter at a few tokens. A wider layer there is mostly its GEMMs'
passes over their weights, which run slower inside the layer than a hot probe says (its weights
together outgrow the core's cache): on a Xeon with 2 MB of L2 per core a llama-30m layer's 8-token
forward took 1.55 ms, 0.9 ms beyond its kernels as priced, and launches fitted there came out
26 µs where this layer gives 7 µs (and those price dense layers of hidden 64 ... 1024 at 256
tokens within 10%, against +100% ... +3%)."""


def measure_by_shape(hw: HardwareProfile, device: str, dtype, point: tuple[int, int], repeats: int,
                     clock: Clock = time.perf_counter, config=None,
                     other: tuple[int, int] | None = None) -> HardwareProfile:
    """``hw`` with the device-by-shape fields (``device_shape_probes``), the kept internals'
    (``kept_probes``) and the launches fitted to the layer at ``point`` (``fit_launches``).
    With ``other`` (a second point, on a synchronous device): the kernels other than GEMMs first
    priced at what they take in ``config``'s layer between the two points (``fit_in_layer``), and the launches
    fitted on the :data:`LAUNCH_FLAVOR` layer at ``point``. The probes and the layers are timed
    together, in turn (``median_times``): the fit takes differences of their times, and a probe
    timed at another moment's speed would move them by tens of percent."""
    run, shape = _layer_runs(device, dtype, config)
    probes, fields = device_shape_probes(device, dtype)
    kept, kept_fields = kept_probes(device, dtype)
    if other is not None and hw.synchronous:  # the in-layer factor is a synchronous device's
        narrow, launch_shape = _layer_runs(device, dtype, get_flavor(LAUNCH_FLAVOR).build_config())
        layer = list(narrow(*point)) + [run(*point)[0], run(*other)[0]]
    else:
        launch_shape, layer = shape, list(run(*point))
    times = median_times(probes + kept + layer, repeats, _sync_for(device), clock)
    n = len(probes) + len(kept)
    hw = replace(hw, **fields(times[:len(probes)]), **kept_fields(times[len(probes):n]))
    t_bwd, t_fwd, *t_rates = times[n:]
    if t_rates:
        hw = fit_in_layer(hw, shape, point, other, *t_rates)
    return fit_launches(hw, launch_shape, point, t_bwd, t_fwd)


def fit_launches(hw: HardwareProfile, shape: ModelShape, point: tuple[int, int], t_bwd: float,
                 t_fwd: float) -> HardwareProfile:
    """``hw`` with its launches fitted to a layer of ``shape`` timed at ``point``
    (``plan/device_cost.py``'s form): at a small point a narrow layer is mostly its kernels'
    launches. A forward's time less its kernels' rooflines, per kernel, is ``kernel_launch_s``
    (the modules' Python and dispatch: it grows with the kernel count, not per op, so
    ``op_overhead_s`` is 0); the backward op's time less its forward and every roofline, per
    backward kernel, is ``backward_launch_s`` (autograd's engine, no Python). The bare dispatch
    (``hw.kernel_launch_s`` as measured alone) is the floor of both."""
    free = DeviceCost(shape, replace(hw, kernel_launch_s=0.0, backward_launch_s=0.0), *point)
    floor = hw.kernel_launch_s or 0.0
    launch = max(floor, (t_fwd - free.layer_fwd_s(0)) / free.kernel_count(0))
    left = t_bwd - free.layer_bwd_s(0) - launch * free.kernel_count(0)
    back = max(floor, left / free.kernel_count(0, backward=True))
    return replace(hw, kernel_launch_s=launch, backward_launch_s=back, op_overhead_s=0.0)


def fit_in_layer(hw: HardwareProfile, shape: ModelShape, a: tuple[int, int], b: tuple[int, int],
                 t_a: float, t_b: float) -> HardwareProfile:
    """``hw`` with ``in_layer_factor`` fitted to a layer of ``shape`` whose backward op took
    ``t_a`` and ``t_b`` at points ``a`` and ``b`` (a synchronous device, where a kernel costs its
    launch plus its roofline)."""
    return replace(hw, in_layer_factor=in_layer_factor(shape, hw, a, b, t_a, t_b))


IN_LAYER_RANGE = (0.5, 6.0)
"""Where ``in_layer_factor`` is believed; outside it (a noisy fit) it is clamped."""
IN_LAYER_MIN_SHARE = 0.05
"""The least share of the rooflines' difference between the two points that the kernels other
than GEMMs must carry for their factor to be fitted (below it: 1, the probes' price)."""


def in_layer_factor(shape: ModelShape, hw: HardwareProfile, a: tuple[int, int], b: tuple[int, int],
                    t_a: float, t_b: float) -> float:
    """What the layer's kernels other than GEMMs take over their rooflines: the backward op's
    measured time between points ``a`` and ``b`` (where the launches cancel) less its GEMMs'
    rooflines' difference, over the other kernels' difference. A GEMM's probe is the same op,
    with cold weights, and prices the layer's GEMMs within a few percent; attention (priced at
    the GEMM rate) and the elementwise kernels run well below their probes inside a layer."""
    free = replace(hw, kernel_launch_s=0.0, backward_launch_s=0.0, in_layer_factor=1.0)

    def split_s(pt: tuple[int, int]) -> tuple[float, float]:
        cost = DeviceCost(shape, free, *pt)
        ks = cost.layer_forward(0) + cost.layer_backward(0)
        gemm = kernels_s([k for k in ks if k.kind == "gemm"], free)
        return gemm, kernels_s(ks, free) - gemm

    (g_a, o_a), (g_b, o_b) = split_s(a), split_s(b)
    d_other, d_all = o_a - o_b, (g_a + o_a) - (g_b + o_b)
    # launches dominate both points, or the other kernels are a sliver of what changes: no fit
    if abs(d_all) < 0.2 * max(g_a + o_a, g_b + o_b) or abs(d_other) < IN_LAYER_MIN_SHARE * abs(d_all):
        return 1.0
    lo, hi = IN_LAYER_RANGE
    return min(hi, max(lo, (t_a - t_b - (g_a - g_b)) / d_other))


def measure_layer(device: str, dtype, points: tuple[tuple[int, int], tuple[int, int]], repeats: int,
                  clock: Clock = time.perf_counter, config=None) -> tuple[float, float, float]:
    """(FLOP/s of a decoder layer's backward as the engine runs it, FLOP/s of its forward
    without a graph, seconds of fixed cost per op), each a fit through the two ``points``
    (micro-batch size, sequence length); the overhead is the intercept at the first point.
    ``config``: the model whose layer is timed (default llama-30m).

    The op's time is ``overhead + FLOPs / rate``: the fit keeps the fixed per-op cost (Python,
    dispatch) out of the rate, so the cost model, which adds ``op_overhead_s`` to every op,
    does not count it twice. The forward is fitted on its own: without autograd's bookkeeping
    it runs at a different rate than forward + backward.
    """
    run, shape = _layer_runs(device, dtype, config)
    sync = _sync_for(device)
    (m0, s0), (m1, s1) = points
    f0 = CostModel(shape, PRESETS["cpu"], m0, s0).layer_fwd_flops(0)
    f1 = CostModel(shape, PRESETS["cpu"], m1, s1).layer_fwd_flops(0)
    (bwd0, fwd0), (bwd1, fwd1) = run(m0, s0), run(m1, s1)
    tb0, tb1, tf0, tf1 = median_times([bwd0, bwd1, fwd0, fwd1], repeats, sync, clock)  # one speed
    bwd_rate = 3 * (f0 - f1) / _nonzero(tb0 - tb1, f0 - f1)
    fwd_rate = (f0 - f1) / _nonzero(tf0 - tf1, f0 - f1)
    overhead = max(0.0, tf0 - f0 / fwd_rate)
    return bwd_rate, fwd_rate, overhead


def _nonzero(dt: float, dflops: float) -> float:
    """A time difference with the sign of the FLOP difference, at least 1 ns (a noisy fit must
    not divide by zero or turn a rate negative)."""
    sign = 1.0 if dflops >= 0 else -1.0
    return sign * max(sign * dt, 1e-9)


def measure_copy_gbps(device: str, nbytes: int, repeats: int,
                      clock: Clock = time.perf_counter) -> tuple[float, float]:
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
    t = median_time(lambda: [slots[j % 2].copy_(src) for j in range(k)], repeats, clock=clock)
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


def _model_config(model):
    """A flavor name, a local HF model directory, or a config, as a config."""
    if model is None or not isinstance(model, (str, Path)):
        return model
    if str(model) in FLAVORS:
        return get_flavor(str(model)).build_config()
    if Path(model).is_dir():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model))
    raise ValueError(f"calibrate: unknown model {model!r}; use a flavor ({', '.join(sorted(FLAVORS))}) "
                     "or a local Hugging Face model directory")


def _host_probe_numel(config, quick: bool) -> int:
    """Elements of a host probe: the run's largest decoder layer (a landing is one layer), capped
    so a probe's buffers stay a few hundred MB (a memory-bound kernel's rate is flat past the caches)."""
    cap = (4 << 20) if quick else (64 << 20)
    if config is None:
        return (4 << 20) if quick else (16 << 20)
    shape = ModelShape.from_config(config)
    layers = [shape.unit_params(u) for u in shape.unit_names() if u not in (EMBED, HEAD)]
    return max(1 << 16, min(cap, max(layers)))


def calibrate(quick: bool = False, device: str = "auto", spill_dir: str | None = None,
              name: str | None = None, cpu_time: bool = False, model=None, seq_len: int | None = None,
              micro_batch_size: int = 1, optimizer_threads: int = 1, gloo: bool = False) -> HardwareProfile:
    """Measure this machine. ``model`` (flavor, HF model dir or config) with ``seq_len`` and
    ``micro_batch_size``: time the run's own layer at the run's micro-batch (and twice it), and
    size the host probes to its layer. ``optimizer_threads``: the engine's
    (``EngineConfig.optimizer_threads``), which sets the optimizer's intra-op threads.
    ``gloo``: measure gloo's reduce (over the initialised process group, else two ranks in this
    process); it is measured anyway when torch.distributed is initialised.

    ``cpu_time``: time the compute, copies and optimizer by this process's CPU clock
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
    config = _model_config(model)
    if (config is None) != (seq_len is None):
        raise ValueError("calibrate: give the run's model and seq_len together (or neither)")
    if micro_batch_size < 1 or (seq_len is not None and seq_len < 1):
        raise ValueError(f"calibrate: micro_batch_size and seq_len must be >= 1, got {micro_batch_size}, {seq_len}")
    clock = time.process_time if cpu_time else time.perf_counter
    dtype = torch.bfloat16 if on_gpu else torch.float32
    reps = 3 if quick else 7
    n = (4096 if on_gpu else 1024) if quick else (8192 if on_gpu else 2048)
    points = DEFAULT_POINTS if config is None else ((micro_batch_size, seq_len), (2 * micro_batch_size, seq_len))
    layer_rate, fwd_rate, overhead = measure_layer(device, dtype, points, reps, clock, config)
    # a real layer can beat a lone square matmul of the size tried; peak is the largest of them
    peak = max(measure_matmul_tflops(device, dtype, n, reps, clock), layer_rate / 1e12, fwd_rate / 1e12)
    h2d, d2h = measure_copy_gbps(device, (64 << 20) if quick else (256 << 20), reps, clock)
    nvme_r, nvme_w = measure_disk_gbps(spill_dir, (32 << 20) if quick else (256 << 20), 2 if quick else 3)
    host = measure_host(device, _host_probe_numel(config, quick), reps, clock, optimizer_threads, gloo)
    free_disk = _free_bytes(spill_dir or tempfile.gettempdir())
    machine = this_machine(device)
    # what is not measured (reserves, compute dtype, lanes) is this machine's preset's; a GPU no
    # preset matches takes a GPU preset's (every GPU preset has the same)
    choice = resolve_hardware(machine=machine)
    base = choice.profile if choice is not None else PRESETS["h100"]
    ram = machine.ram_bytes
    dev_mem = machine.gpu_mem_bytes if on_gpu else ram
    profile = replace(
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
        op_overhead_s=overhead,
        **host,
        # not measured: the base preset's interconnects would be a guess about another machine
        gpus_per_node=max(1, torch.cuda.device_count()) if on_gpu else 1,
        intra_node_gbps=None, inter_node_gbps=None, node_host_link_gbps=None,
    )
    # without a run shape the fit's points are 8 and 512 tokens, launch- and compute-bound, which
    # tell the launches from the layer's rates; the run's own two points are both compute-bound
    # (the slope between them says little about the intercept), and priced at the run's shape the
    # launches fitted there reproduce its layer whatever the split
    profile = measure_by_shape(profile, device, dtype, points[1], reps, clock, config,
                               other=points[0] if config is None else None)
    # what a CPU step costs beyond its priced parts (``calibrate_engine``): on the synchronous
    # CPU backend it runs on the compute lane; a GPU's host issues it ahead of the device
    return profile if on_gpu else replace(profile, op_overhead_s=measure_tiny_step(profile, clock=clock).per_op_s)


def measure_host(device: str, numel: int, repeats: int, clock: Clock = time.perf_counter,
                 optimizer_threads: int = 1, gloo: bool = False) -> dict[str, float | None]:
    """The profile's host fields, each probe on the threads the engine gives that work: the
    landing's thread count and CPUs for the accumulation, the optimizer's intra-op threads for
    its step and the refresh (``host_threads.plan_host_threads``)."""
    import torch.distributed as dist

    threads = plan_host_threads(torch.device(device).type, optimizer_threads)
    bf16, fp32 = on_host_worker(threads, lambda: measure_accumulation(numel, repeats, threads.landing, clock))
    intra = threads.optimizer_intra
    split = torch.device(device).type == "cuda"  # bf16 compute: the split master, bf16 grads
    opt = on_host_worker(threads, lambda: measure_optimizer(numel, repeats, clock, split), intra)
    opt8 = on_host_worker(threads, lambda: measure_optimizer_8bit(numel, repeats, clock, split), intra)
    pinned = on_host_worker(threads, lambda: measure_pinned_copy_gbps(device, numel, repeats, clock), intra)
    reduce = None
    if gloo or (dist.is_available() and dist.is_initialized()):
        reduce = measure_gloo_reduce_gbps(numel, max(1, repeats // 2))
    return dict(host_accum_gbps=fp32, host_accum_bf16_gbps=bf16, optimizer_params_per_s=opt,
                optimizer_8bit_params_per_s=opt8, pinned_copy_gbps=pinned, gloo_reduce_gbps=reduce)


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
