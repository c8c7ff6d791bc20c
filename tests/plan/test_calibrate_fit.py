"""Calibration's layer fit and the cost model's use of it: the per-op overhead is not counted
twice, and a forward without a graph is priced at its own rate."""

from dataclasses import replace

import pytest

import layerwise.engine.calibrate as calibrate
import layerwise.engine.calibrate_probes as calibrate_probes
from layerwise.models import get_flavor
from layerwise.plan.cost import CostModel
from layerwise.plan.device_cost import DeviceCost, kernels_s
from layerwise.plan.presets import PRESETS
from layerwise.plan.shape import ModelShape


def test_layer_fit_recovers_rates_and_overhead(monkeypatch):
    """Times synthesised from ``overhead + FLOPs / rate`` (backward 3x the forward FLOPs, each
    op with its own rate) come back exactly from the fit through 512 and 8 tokens.

    Mutation seen caught: the old calibration (rate from the 512-token time alone, overhead =
    the 8-token backward / 3): the rate then absorbs the overhead and the overhead is wrong."""
    shape = ModelShape.from_config(get_flavor("llama-30m").build_config())
    flops = {n: CostModel(shape, PRESETS["cpu"], 1, n).layer_fwd_flops(0) for n in (512, 8)}
    overhead_s, bwd_rate, fwd_rate = 3e-3, 8e10, 1.2e11
    times = [overhead_s + 3 * flops[512] / bwd_rate, overhead_s + 3 * flops[8] / bwd_rate,
             overhead_s + flops[512] / fwd_rate, overhead_s + flops[8] / fwd_rate]
    # measure_layer times, in one batch: backward 512, backward 8, forward 512, forward 8
    monkeypatch.setattr(calibrate, "median_times", lambda fns, *a, **kw: times[:len(fns)])
    b, f, o = calibrate.measure_layer("cpu", __import__("torch").float32, ((1, 512), (1, 8)), 1)
    assert b == pytest.approx(bwd_rate, rel=1e-9)
    assert f == pytest.approx(fwd_rate, rel=1e-9)
    assert o == pytest.approx(overhead_s, rel=1e-9)


def test_forward_is_priced_at_its_own_rate():
    """``layer_fwd`` (and recompute) use ``fwd_efficiency``; ``layer_bwd`` and the head use
    ``efficiency``; a profile without ``fwd_efficiency`` (older files) prices both alike.

    Mutation seen caught: ``layer_fwd_s`` dividing by ``flops_per_s``."""
    shape = ModelShape.from_config(get_flavor("llama-30m").build_config())
    hw = replace(PRESETS["cpu"], efficiency=0.5, fwd_efficiency=1.0, op_overhead_s=0.0)
    c = CostModel(shape, hw, 2, 256)
    peak = hw.peak_tflops * 1e12
    assert c.layer_fwd_s(0) == pytest.approx(c.layer_fwd_flops(0) / peak)
    assert c.layer_bwd_s(0) == pytest.approx(3 * c.layer_fwd_flops(0) / (0.5 * peak))
    old = CostModel(shape, replace(hw, fwd_efficiency=None), 2, 256)
    assert old.layer_fwd_s(0) == pytest.approx(c.layer_fwd_flops(0) / (0.5 * peak))
    with pytest.raises(ValueError, match="fwd_efficiency"):
        replace(hw, fwd_efficiency=1.5)


def test_launches_are_fitted_per_kernel_from_the_layer():
    """Times synthesised from the shape model (rooflines + ``n_fwd x L_f`` for the forward,
    + ``n_bwd x L_b`` more for the backward op) give back both launches exactly, and the per-op
    overhead is 0 (the layer's Python is its kernels'), so one layer's measurement carries to
    layers of other widths through their kernel counts.

    Mutation seen caught: the backward's launch divided over all its op's kernels (forward's
    included) instead of the backward's alone."""
    from layerwise.plan.device_cost import DeviceCost

    shape = ModelShape.from_config(get_flavor("llama-30m").build_config())
    hw = replace(PRESETS["cpu"], device_mem_gbps=20.0, kernel_launch_s=2e-6,
                 gemm_tflops_points=((1e4, 0.05), (1e7, 0.04)))
    free = DeviceCost(shape, replace(hw, kernel_launch_s=0.0, backward_launch_s=0.0), 1, 8)
    n_f, n_b = free.kernel_count(0), free.kernel_count(0, backward=True)
    l_f, l_b = 60e-6, 25e-6
    got = calibrate.fit_launches(hw, shape, (1, 8), free.layer_bwd_s(0) + n_f * l_f + n_b * l_b,
                                 free.layer_fwd_s(0) + n_f * l_f)
    assert got.kernel_launch_s == pytest.approx(l_f, rel=1e-9)
    assert got.backward_launch_s == pytest.approx(l_b, rel=1e-9)
    assert got.op_overhead_s == 0.0
    full = DeviceCost(shape, got, 1, 8)
    assert full.layer_bwd_s(0) == pytest.approx(free.layer_bwd_s(0) + n_f * l_f + n_b * l_b)


def test_the_layers_other_kernels_are_priced_at_their_in_layer_factor_before_the_launches():
    """Times synthesised with every kernel but the GEMMs ``f`` times slower than the probes say
    (and the launches above) give back ``f`` from the backward op's two points, the probes'
    rates unchanged, and both launches exactly; priced with it, a layer's GEMMs cost what they
    cost before and every other kernel ``f`` times as much.

    Mutations seen caught: the factor fitted over every kernel's roofline difference, GEMMs' too
    (the earlier form: 1.18 here, not 2.5); the factor applied to GEMMs in ``kernels_s``
    (the fit then reads 6.0, its clamp); the launches fitted without the factor (they absorb the
    small point's share of the slowdown: ``kernel_launch_s`` 3% high)."""
    shape = ModelShape.from_config(get_flavor("llama-30m").build_config())
    hw = replace(PRESETS["cpu"], device_mem_gbps=20.0, gather_gbps=8.0, kernel_launch_s=2e-6,
                 gemm_tflops_points=((1e4, 0.05, 5.0), (1e7, 0.04, 3.0)))
    f, l_f, l_b = 2.5, 60e-6, 25e-6
    zero = replace(hw, in_layer_factor=f, kernel_launch_s=0.0, backward_launch_s=0.0)
    small, big = DeviceCost(shape, zero, 1, 8), DeviceCost(shape, zero, 1, 512)
    n_f, n_b = small.kernel_count(0), small.kernel_count(0, backward=True)
    launches = n_f * l_f + n_b * l_b
    got = calibrate.fit_in_layer(hw, shape, (1, 8), (1, 512), small.layer_bwd_s(0) + launches,
                                 big.layer_bwd_s(0) + launches)
    assert got.in_layer_factor == pytest.approx(f, rel=1e-9)
    got = calibrate.fit_launches(got, shape, (1, 8), small.layer_bwd_s(0) + launches,
                                 small.layer_fwd_s(0) + n_f * l_f)
    assert (got.device_mem_gbps, got.gather_gbps, got.gemm_tflops_points) == (
        hw.device_mem_gbps, hw.gather_gbps, hw.gemm_tflops_points)
    assert got.kernel_launch_s == pytest.approx(l_f, rel=1e-9)
    assert got.backward_launch_s == pytest.approx(l_b, rel=1e-9)
    ks = DeviceCost(shape, hw, 2, 128).layer_forward(0)
    gemms, rest = [k for k in ks if k.kind == "gemm"], [k for k in ks if k.kind != "gemm"]
    unit = replace(hw, kernel_launch_s=0.0, in_layer_factor=1.0)
    assert kernels_s(gemms, replace(unit, in_layer_factor=f)) == kernels_s(gemms, unit)
    assert kernels_s(rest, replace(unit, in_layer_factor=f)) == pytest.approx(f * kernels_s(rest, unit), rel=1e-12)


def test_the_in_layer_factor_is_1_where_the_other_kernels_barely_differ_between_the_points():
    """Where the kernels other than GEMMs carry under ``IN_LAYER_MIN_SHARE`` of the rooflines'
    difference between the two points, their factor is not fitted (noise over a sliver): 1.

    Mutation seen caught: the guard dropped (a 2% timing error then reads as 6.0, the clamp)."""
    shape = ModelShape.from_config(get_flavor("llama-30m").build_config())
    hw = replace(PRESETS["cpu"], device_mem_gbps=1e6, gather_gbps=1e6, kernel_launch_s=0.0,
                 gemm_tflops_points=((1e4, 0.05, 5.0), (1e7, 0.04, 3.0)))
    a, b = DeviceCost(shape, hw, 1, 8), DeviceCost(shape, hw, 64, 8)  # 8 tokens: no attention to speak of
    assert calibrate.in_layer_factor(shape, hw, (1, 8), (64, 8), a.layer_bwd_s(0),
                                     1.02 * b.layer_bwd_s(0)) == 1.0


def test_a_cpu_gemm_probe_gives_its_weight_pass_and_its_cost_per_row():
    """``gemm_point`` on a synchronous device: probe times synthesised as a weight's pass plus a
    cost per row (a CPU's GEMM library packs, then computes) give back both, the rate as each
    row's FLOPs over its cost; on an asynchronous device the rate at the probe's rows and the
    8-row time as the pass, as before.

    Mutation seen failing: the rate taken at the probe's rows on a CPU too (the pass counted in
    it: 1.2x slow here, and then again as the weight's read)."""
    rows, k, n, wbytes = 512, 256, 512, 256 * 512 * 4
    pass_s, per_row_s = 60e-6, 2.4e-6
    flops = 2.0 * rows * k * n
    t, t8 = pass_s + rows * per_row_s, pass_s + 8 * per_row_s
    got = calibrate_probes.gemm_point(rows, flops, wbytes, t, t8, synchronous=True)
    assert got == pytest.approx((wbytes, 2.0 * k * n / per_row_s / 1e12, wbytes / pass_s / 1e9), rel=1e-9)
    assert calibrate_probes.gemm_point(rows, flops, wbytes, t, t8, synchronous=False) == pytest.approx(
        (wbytes, flops / t / 1e12, wbytes / t8 / 1e9), rel=1e-12)


def test_the_probes_and_the_layer_are_timed_in_one_batch(monkeypatch):
    """``measure_by_shape`` hands the probes (the kept internals' too) and the layers' runs (the
    launch layer's, and with ``other`` the rates' layer at both points)
    to one ``median_times`` call, so the times the launch fit subtracts come from the same seconds
    (``median_times`` runs them in turn: tests/engine/test_calibrate_host.py); what it fits is
    a profile with every device-by-shape field measured.

    Mutations seen caught: the layer timed in a ``median_times`` call of its own after the
    probes'; the launches fitted on the rates' layer."""
    import torch

    from layerwise.engine.calibrate_host import median_times

    batches = []

    def spy(fns, repeats, sync=lambda: None, clock=None):
        batches.append(len(fns))
        return median_times(fns, repeats, sync)

    monkeypatch.setattr(calibrate, "median_times", spy)
    fitted_on = []
    fit = calibrate.fit_launches
    monkeypatch.setattr(calibrate, "fit_launches", lambda hw, shape, *a: fitted_on.append(shape) or fit(hw, shape, *a))
    probes = len(calibrate_probes.device_shape_probes("cpu", torch.float32)[0])
    probes += len(calibrate_probes.kept_probes("cpu", torch.float32)[0])
    got = calibrate.measure_by_shape(PRESETS["cpu"], "cpu", torch.float32, (1, 8), 1,
                                     config=get_flavor("llama-demo").build_config(), other=(1, 64))
    assert batches == [probes + 4]  # the narrow layer's backward and forward, the layer's two backwards
    narrow = get_flavor(calibrate.LAUNCH_FLAVOR).build_config().hidden_size
    assert [s.hidden_size for s in fitted_on] == [narrow] != [128]  # not the rates' layer (llama-demo)
    assert got.saved_tensor_s is not None and got.storage_copy_s is not None
    assert got.kernel_launch_s > 0 and got.backward_launch_s > 0 and got.op_overhead_s == 0.0
    assert got.device_mem_gbps > 0 and len(got.gemm_tflops_points) == len(calibrate_probes.GEMM_PROBES["cpu"])
    assert got.gather_gbps > 0


def test_the_kept_probe_runs_the_engine_s_tiers_and_fits_per_tensor_and_storage(monkeypatch):
    """``kept_probes``: its host-tier round trip runs the engine's ``KeptInternals``, each of the
    chain's saved storages copied out and fetched back once (the backend's own byte counts; the
    device tier copies nothing), and its fields are the excesses per tensor and direction: the
    device tier's over the plain graph, the host tier's over the device tier's. Mutations seen
    failing: the host tier's excess taken over the plain graph (``storage_copy_s`` then carries
    the hooks too); the probe keeping its chain on the device tier for both closures."""
    import torch

    from layerwise.engine.backend import CpuBackend

    backend = CpuBackend()
    monkeypatch.setattr(calibrate_probes, "make_backend", lambda device: backend)
    (plain, device, host), fields = calibrate_probes.kept_probes("cpu", torch.float32)
    n = calibrate_probes.KEPT_PROBE_TENSORS
    plain(), device()
    assert backend.copied_bytes == {"h2d": 0, "d2h": 0}
    host()
    assert backend.copied_bytes == {"h2d": n * 8 * 4, "d2h": n * 8 * 4}  # n storages of 8 fp32 each way
    got = fields([1e-3, 1e-3 + 2 * n * 3e-6, 1e-3 + 2 * n * (3e-6 + 5e-6)])
    assert got == pytest.approx({"saved_tensor_s": 3e-6, "storage_copy_s": 5e-6}, rel=1e-9)


def test_a_cpu_gemm_probe_reads_a_weight_no_earlier_call_left_in_the_caches(monkeypatch):
    """On a CPU each call of a GEMM probe reads another weight, the probe's calls together spanning
    ``COLD_WEIGHT_BYTES`` (past any core's L2 and L3 share), as a layer's GEMM in a step reads a
    weight the other layers' work has pushed out of the caches.

    Mutation seen caught: one weight per probe, read hot by every call (the earlier form)."""
    import torch

    seen = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, w: seen.append(w.data_ptr()) or mm(x, w))
    fns, _ = calibrate_probes.device_shape_probes("cpu", torch.float32)
    first = len(fns) - 2 * len(calibrate_probes.GEMM_PROBES["cpu"])  # the GEMMs come last, each at its rows and at 8
    for j, (_, k, n) in enumerate(calibrate_probes.GEMM_PROBES["cpu"]):
        seen.clear()
        weight_bytes = k * n * 4
        calls = calibrate_probes.COLD_WEIGHT_BYTES // weight_bytes
        for _ in range(calls):
            fns[first + 2 * j]()
        assert len(set(seen)) == calls
        assert max(seen) + weight_bytes - min(seen) == calls * weight_bytes >= 0.99 * calibrate_probes.COLD_WEIGHT_BYTES
