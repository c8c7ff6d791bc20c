"""The device-by-shape probes ``layerwise calibrate`` times (``calibrate.measure_by_shape``), as
closures to time and the profile fields their times give: a launch, an add's bandwidth, a row
gather, GEMMs at a few weight sizes (their rate and their weight's pass: ``gemm_point``), and a
kept layer's fixed costs through the engine's ``KeptInternals``."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from .devices import make_backend
from .internals import KeptInternals

GEMM_PROBES = {"cpu": ((512, 64, 64), (512, 256, 256), (512, 1024, 1024), (512, 1024, 4096)),
               "cuda": ((8192, 1024, 1024), (8192, 4096, 4096), (8192, 8192, 8192))}
"""(M, K, N) of the GEMMs timed for ``gemm_tflops_points``: weights from cache-sized to far past
the caches (a CPU's rate falls once a weight leaves its L2), at a layer's rows."""
COLD_WEIGHT_BYTES = 64 << 20
"""Bytes a CPU's GEMM probes take their weights from in rotation, so that no call finds its
weight in the caches, as a layer's GEMM in a step does not (the step ran the other layers since):
priced by hot weights every GEMM-bound width ran 5-10% and the MoE's experts 5-7 points under
the engine (measured with ``benchmarks/sim_fidelity.py --widths``). Past any core's L2
and its share of the L3."""
GATHER_PROBE = {"cpu": (1024, 256), "cuda": (1 << 17, 1024)}
"""(rows, width) of the gather probe's source: twice its rows gathered by a random index (an MoE
of top-2 dispatching its tokens): 2 MiB out on a CPU (as the add, in its caches), 512 MiB on a GPU."""


def gemm_point(rows: int, flops: float, weight_bytes: float, t: float, t8: float,
               synchronous: bool) -> tuple[float, float, float]:
    """A ``gemm_tflops_points`` entry from a probe GEMM's time at ``rows`` (``t``) and at 8 rows
    (``t8``): on a synchronous device (a CPU's library packs the weight, then computes) its time
    is the weight's pass plus a cost per row, so the rate is each row's FLOPs over that cost and
    the pass the 8-row time less 8 rows (at least a twentieth of it, against noise); elsewhere
    the rate at ``rows`` and the 8-row time as the weight's pass."""
    if not synchronous:
        return (weight_bytes, flops / t / 1e12, weight_bytes / t8 / 1e9)
    per_row_s = max(t - t8, 1e-12) / (rows - 8)
    pass_s = max(t8 - 8 * per_row_s, 0.05 * t8)
    return (weight_bytes, flops / rows / per_row_s / 1e12, weight_bytes / pass_s / 1e9)


def device_shape_probes(device: str, dtype) -> tuple[list[Callable[[], None]], Callable[[list[float]], dict]]:
    """The profile's device-by-shape probes, as closures to time, and their fields from their
    times: the launch (a one-element add, per op over 100), the memory bandwidth (an add over
    3 x 1 MiB on a CPU, 3 x 128 MiB on a GPU), a row gather (``GATHER_PROBE``) and each probe
    GEMM's rate at its rows and at 8 (``gemm_point``), with the launch taken out where it is
    serial (a synchronous CPU). On a CPU each GEMM call reads the next of the weights that fit
    in ``COLD_WEIGHT_BYTES``."""
    on_gpu = device.startswith("cuda")
    one = torch.zeros(1, device=device, dtype=dtype)
    n = (64 << 20) if on_gpu else (1 << 18)
    a, b, c = (torch.ones(n, device=device, dtype=dtype) for _ in range(3))
    rows, width = GATHER_PROBE["cuda" if on_gpu else "cpu"]
    src = torch.randn(rows, width, device=device, dtype=dtype)
    idx = torch.randperm(2 * rows, device=device) // 2  # every row twice, shuffled
    fns = [lambda: [torch.add(one, one) for _ in range(100)], lambda: torch.add(a, b, out=c),
           lambda: src[idx]]
    first_gemm = len(fns)  # the GEMMs follow, each at its rows and at 8
    pool = None if on_gpu else torch.randn(COLD_WEIGHT_BYTES // (torch.finfo(dtype).bits // 8), dtype=dtype)
    gemms = []
    for m, k, nn in GEMM_PROBES["cuda" if on_gpu else "cpu"]:
        x = torch.randn(m, k, device=device, dtype=dtype)
        x8 = x[:8].contiguous()  # at 8 rows mostly the weight's pass (its FLOPs ~1% of the rows')
        if pool is None:
            ws = [torch.randn(k, nn, device=device, dtype=dtype)]
        else:  # views of the pool, one after another
            ws = [pool[o:o + k * nn].view(k, nn) for o in range(0, pool.numel() - k * nn + 1, k * nn)]
        turn = itertools.cycle(ws)
        fns += [lambda x=x, t=turn: torch.mm(x, next(t)), lambda x8=x8, t=turn: torch.mm(x8, next(t))]
        gemms.append((m, 2.0 * m * k * nn, float(k * nn * x.element_size())))

    def fields(times: list[float]) -> dict:
        launch = times[0] / 100
        serial = 0.0 if on_gpu else launch
        points = []
        for j, (m, flops, wbytes) in enumerate(gemms):
            at = first_gemm + 2 * j
            t, t8 = (max(x - serial, 1e-9) for x in times[at:at + 2])
            points.append(gemm_point(m, flops, wbytes, t, t8, not on_gpu))
        gathered = 2 * 2 * rows * width * src.element_size()  # rows read and written
        return dict(kernel_launch_s=launch, device_mem_gbps=3 * n * a.element_size() / times[1] / 1e9,
                    gather_gbps=gathered / max(times[2] - serial, 1e-9) / 1e9,
                    gemm_tflops_points=tuple(points))

    return fns, fields


KEPT_PROBE_TENSORS = 128
"""Tensors the kept-internals probe saves: a chain of that many ``sin``, each saving its input."""


def kept_probes(device: str, dtype) -> tuple[list[Callable[[], None]], Callable[[list[float]], dict]]:
    """The kept internals' fixed costs as closures to time, and their fields from their times:
    a chain of :data:`KEPT_PROBE_TENSORS` ``sin`` over 8 elements, forward then backward, with a
    plain graph, kept on the device tier (``KeptInternals``: the engine's hooks) and on the host
    tier (each saved storage copied out and fetched back). Per tensor and direction,
    ``saved_tensor_s`` is the device tier's excess over the plain graph and ``storage_copy_s``
    the host tier's over the device tier's (their bytes are nothing). A layer's own round trip
    would carry them too, but beside a layer's kernels they are a tenth of its time, within
    its run-to-run spread."""
    internals = KeptInternals(make_backend(device))
    x = torch.rand(8, device=device, dtype=dtype)
    grad = torch.ones_like(x)
    weights = torch.zeros(1, device=device, dtype=dtype)  # the chain reads none

    def chain(h: torch.Tensor) -> torch.Tensor:
        for _ in range(KEPT_PROBE_TENSORS):
            h = torch.sin(h)
        return h

    def plain() -> None:
        h = x.detach().requires_grad_()
        with torch.enable_grad():
            torch.autograd.grad(chain(h), h, grad)

    def kept(tier: str) -> Callable[[], None]:
        def round_trip() -> None:
            g = internals.begin("calibrate", tier)
            internals.forward(g, chain, x, weights, {}, [])
            internals.forward_queued(g)
            internals.backward(internals.ready("calibrate"), weights, grad)
            internals.clear()
        return round_trip

    def fields(times: list[float]) -> dict:
        t_plain, t_device, t_host = times
        per = 2 * KEPT_PROBE_TENSORS
        return dict(saved_tensor_s=max(0.0, (t_device - t_plain) / per),
                    storage_copy_s=max(0.0, (t_host - t_device) / per))

    return [plain, kept("device"), kept("host")], fields
