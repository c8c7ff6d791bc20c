"""``layerwise calibrate``: the roofline's fields and the host fields are measured (the host's by
the engine's own kernels on the engine's threads), RAM from MemTotal or the cgroup limit."""

import json
from dataclasses import replace

import pytest
import torch

import layerwise.planner.calibrate as calibrate
from layerwise.planner import calibrate_host
from layerwise.engine.host_threads import plan_host_threads
from layerwise.planner.hardware import HardwareProfile
from layerwise.planner.presets import PRESETS

HOST_FIELDS = ("host_accum_gbps", "host_accum_bf16_gbps", "optimizer_params_per_s",
               "optimizer_8bit_params_per_s", "pinned_copy_gbps", "gloo_reduce_gbps")


def _shrink(monkeypatch, name, **over):
    fn = getattr(calibrate, name)

    def call(*args, **kwargs):
        import inspect
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.arguments.update(over)
        return fn(*bound.args, **bound.kwargs)
    monkeypatch.setattr(calibrate, name, call)


def test_calibrate_measures_every_field_the_pricing_uses(monkeypatch, tmp_path):
    """On CPU, sized to a tiny model: the roofline's fields (peak, memory bandwidth, launch) and
    every host field are measurements (gloo between two in-process ranks, asked), not the
    preset's figures; the profile round-trips as the current format.

    Mutation seen caught: ``measure_host`` returning the preset's ``host_accum_bf16_gbps``
    (the old calibrate timed no bf16 accumulation)."""
    _shrink(monkeypatch, "measure_matmul_tflops", n=64)
    _shrink(monkeypatch, "measure_mem_gbps", numel=1 << 16)
    _shrink(monkeypatch, "measure_copy_gbps", nbytes=1 << 20)
    _shrink(monkeypatch, "measure_disk_gbps", nbytes=1 << 20)
    hw = calibrate.calibrate(quick=True, device="cpu", spill_dir=str(tmp_path), model="llama-debug", gloo=True)
    cpu = PRESETS["cpu"]
    for f in HOST_FIELDS + ("peak_tflops", "device_mem_gbps", "kernel_launch_s"):
        assert getattr(hw, f) is not None and getattr(hw, f) > 0, f
        assert getattr(hw, f) != getattr(cpu, f), f"{f} is the preset's, not measured"
    assert hw.efficiency == 1.0 and hw.synchronous
    hw.save(tmp_path / "p.json")
    assert HardwareProfile.load(tmp_path / "p.json") == hw and hw.format_version == 8


def test_gloo_is_measured_only_when_asked(monkeypatch):
    """Without ``gloo`` (and no process group) no gloo ranks are started and the field is None."""
    monkeypatch.setattr(calibrate, "measure_gloo_reduce_gbps", lambda *a: pytest.fail("gloo started"))
    host = calibrate.measure_host("cpu", 1 << 16, 1)
    assert host["gloo_reduce_gbps"] is None and host["host_accum_bf16_gbps"] > 0


def test_host_probes_run_on_the_engine_threads(monkeypatch):
    """On CUDA the accumulation is split over the landing threads and the optimizer and the
    refresh run at the optimizer's intra-op threads, as ``host_threads`` places the engine's
    (probes stubbed: this records what they are given, no GPU needed).

    Mutation seen caught: the accumulation probe called with ``threads=1``."""
    cpus = frozenset(range(6))
    monkeypatch.setattr(calibrate, "plan_host_threads",
                        lambda kind, opt: plan_host_threads(kind, opt, cpus=cpus))
    monkeypatch.setattr("layerwise.engine.host_threads.os.sched_setaffinity", lambda *a: None)
    got = {}
    monkeypatch.setattr(calibrate, "measure_accumulation",
                        lambda numel, reps, threads: got.setdefault("landing", threads) and (1.0, 1.0))
    monkeypatch.setattr(calibrate, "measure_optimizer",
                        lambda *a: got.setdefault("opt", torch.get_num_threads()) and 1.0)
    monkeypatch.setattr(calibrate, "measure_optimizer_8bit", lambda *a: 1.0)
    monkeypatch.setattr(calibrate, "measure_pinned_copy_gbps",
                        lambda *a: got.setdefault("pinned", torch.get_num_threads()) and 1.0)
    want = plan_host_threads("cuda", 1, cpus=cpus)
    torch.set_num_threads(want.optimizer_intra + 1)  # not what the probes must run at (conftest
    before = torch.get_num_threads()                 # runs every test on 1; restored after it)
    calibrate.measure_host("cuda:1", 1 << 16, 1, optimizer_threads=1)
    assert got == {"landing": want.landing, "opt": want.optimizer_intra, "pinned": want.optimizer_intra}
    assert want.landing == 5 and torch.get_num_threads() == before


def test_total_ram_reads_memtotal_and_the_cgroup_limit(tmp_path):
    """MemTotal (kB) when no cgroup limit, the limit when lower (v2 ``memory.max``, v1
    ``limit_in_bytes``), MemTotal again for v2 ``max`` and v1's "unlimited" huge number.

    Mutation seen caught: the old ``SC_PHYS_PAGES`` product (the box's pages, not this file)."""
    mem = tmp_path / "meminfo"
    mem.write_text("MemTotal:       8388608 kB\nMemFree:        1024 kB\n")
    root = tmp_path / "cg"
    root.mkdir()
    assert calibrate_host.total_ram_bytes(str(mem), str(root)) == 8 << 30
    (root / "memory.max").write_text("4294967296\n")
    assert calibrate_host.total_ram_bytes(str(mem), str(root)) == 4 << 30
    (root / "memory.max").write_text("max\n")
    assert calibrate_host.total_ram_bytes(str(mem), str(root)) == 8 << 30
    (root / "memory.max").unlink()
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text(str(2 << 30))
    assert calibrate_host.total_ram_bytes(str(mem), str(root)) == 2 << 30
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert calibrate_host.total_ram_bytes(str(mem), str(root)) == 8 << 30


def test_a_profile_of_another_format_version_is_refused_in_one_line(tmp_path):
    """An older, a newer and an unversioned profile file are refused in one line naming the
    file, its version, the one read and the command that measures it again; null host rates
    read ``host_accum_gbps``.

    Mutation seen failing: accepting version 7 (``refuse_version`` letting it through)."""
    d = PRESETS["h200"].to_dict()
    p = tmp_path / "old.json"
    for version in (3, 7, 9, None):
        p.write_text(json.dumps({**d, "format_version": version} if version is not None else
                                {k: v for k, v in d.items() if k != "format_version"}))
        with pytest.raises(ValueError) as err:
            HardwareProfile.load(p)
        msg = str(err.value)
        assert "\n" not in msg
        assert msg == (f"{p}: hardware profile format_version {version}; this layerwise reads 8: "
                       "measure it again with `layerwise calibrate --out FILE`"), msg
    hw = HardwareProfile.from_dict({**d, "host_accum_bf16_gbps": None, "pinned_copy_gbps": None})
    assert hw.accum_bf16_gbps == hw.pinned_gbps == d["host_accum_gbps"]


def test_a_profile_with_fields_no_longer_read_or_without_the_roofline_is_refused_in_one_line(tmp_path):
    """A profile written with the CPU-fitting fields (``in_layer_factor``, ``gemm_tflops_points``)
    or without ``device_mem_gbps`` is refused in one line naming how to
    regenerate it."""
    d = PRESETS["h200"].to_dict()
    for bad in ({**d, "in_layer_factor": 1.0, "gemm_tflops_points": None},
                {k: v for k, v in d.items() if k != "device_mem_gbps"}):
        p = tmp_path / "old.json"
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="layerwise calibrate --out FILE") as e:
            HardwareProfile.load(p)
        assert "\n" not in str(e.value)


def test_calibrate_names_the_optimizer_form_its_threads_and_the_rate_per_thread(monkeypatch):
    """The optimizer lines ``layerwise calibrate`` prints: the planner's configuration name of
    the form the probe times (on a GPU a bf16 gradient and the split master, as ``_probe_unit``
    builds it), the intra-op threads the engine gives the optimizer, and the rate per thread.

    Mutation seen caught: the per-thread rate printed as the whole rate (``/ intra`` dropped)."""
    cpus = frozenset(range(6))
    monkeypatch.setattr(calibrate_host, "plan_host_threads", lambda kind, opt: plan_host_threads(kind, opt, cpus=cpus))
    hw = replace(PRESETS["h200"], optimizer_params_per_s=1.5e9, optimizer_8bit_params_per_s=2e9)
    lines = calibrate_host.optimizer_lines(hw, "cuda", 1)
    assert lines[1] == ("optimizer 8bit-bf16grad-split: 2.000 Gparam/s on 5 intra-op thread(s) "
                        "(0.400 Gparam/s per thread), one unit at a time")
    assert lines[0].startswith("optimizer fp32-bf16grad-split: 1.500 Gparam/s on 5 ")
    probe = calibrate_host._probe_unit(1 << 12, split=True)
    assert calibrate_host.optimizer_form("cuda") == ("bf16", "split")
    assert probe.grad.dtype == torch.bfloat16 and probe.remainder is not None
    assert calibrate_host.optimizer_form("cpu") == ("fp32", "plain")
    assert "on 2 intra-op" in calibrate_host.optimizer_lines(hw, "cuda", 2)[0]


def test_a_timing_is_the_median_of_its_runs_not_the_fastest():
    """A step adds up many runs of each kernel, so calibration prices a run's typical time: of
    runs taking 1, 5, 2, 9, 3 (after a warm-up) ``median_time`` gives 3.

    Mutation seen caught: the minimum taken (1: every prediction under the engine by a layer's
    median-to-best spread, 3-15% on a shared VM)."""
    now, durations = [0.0], iter([7.0, 1.0, 5.0, 2.0, 9.0, 3.0])

    def run():
        now[0] += next(durations)

    assert calibrate_host.median_time(run, 5, clock=lambda: now[0]) == 3.0
