"""The GPU check (the package ``benchmarks/gpu_check``) on the CPU: its pure helpers, its stage
runner, its schema as ``--print-schema`` prints it, and the whole check as a dry run (every
stage's Python on the asynchronous CPU backend, all but the CUDA calls), so it keeps working
against the engine between GPU runs."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_check import cli, cuda_tests, machine, report, schema, trace, wheels
from benchmarks.gpu_check import model as large_model
from benchmarks.gpu_check import store as host_store
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.split_master import split_torch
from layerwise.store import HostStore

REPO = Path(__file__).resolve().parents[2]


def _make_var(name: str) -> list[str]:
    m = re.search(rf"^{name} \?= (.*)$", (REPO / "Makefile").read_text(), re.M)
    assert m, f"{name} not in the Makefile"
    return m.group(1).split()


NOT_CARRIED = sorted(set(_make_var("GPU_IMAGE_LACKS")) - {w.split("==")[0] for w in _make_var("GPU_WHEELS")})
"""What the GPU machine's image lacks and ``make gpu-wheels`` does not bring (deepspeed)."""


def test_interval_union_and_intersection():
    assert trace.merge_intervals([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert trace.measure([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    a = [(0, 2), (1, 3), (10, 11)]
    b = [(2.5, 10.5), (0, 0.5)]
    assert trace.intersect_measure(a, b) == pytest.approx(0.5 + 0.5 + 0.5)
    assert trace.intersect_measure(a, []) == 0.0


def _ev(cat, name, ts_us, dur_us, stream, nbytes=None):
    args = {"stream": stream}
    if nbytes is not None:
        args["bytes"] = nbytes
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us, "pid": 0, "tid": stream,
            "args": args}


def test_copy_overlap_on_a_synthetic_trace(tmp_path):
    events = [
        # compute on stream 7: [0, 100) and [150, 300) us
        _ev("kernel", "gemm", 0, 100, 7), _ev("kernel", "gemm", 150, 150, 7),
        # H2D on stream 20: [50, 130): 50 of 80 us under compute; 1 GB in 80 us
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 80, 20, 10**9),
        # D2H on stream 21: [250, 350): 50 of 100 us under compute
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 250, 100, 21, 2 * 10**9),
        # a small pageable copy on the compute stream: serialised, reported apart
        _ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 140, 5, 7, 1000),
        _ev("gpu_memset", "Memset (Device)", 0, 400, 22),  # neither compute nor copy
        {"ph": "i", "name": "marker", "ts": 0},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ov = trace.copy_overlap(trace.load_trace_events(path))
    assert ov["compute_stream"] == 7
    assert ov["kernels"] == 2
    assert ov["compute_busy_s"] == pytest.approx(250e-6)
    assert ov["window_s"] == pytest.approx(350e-6)
    assert ov["compute_idle_fraction"] == pytest.approx(1 - 250 / 350)
    assert ov["h2d"]["count"] == 1 and ov["h2d"]["streams"] == [20]
    assert ov["h2d"]["overlap_fraction"] == pytest.approx(50 / 80)
    assert ov["h2d"]["gbps_active"] == pytest.approx(1.0 / 80e-6)
    assert ov["d2h"]["overlap_fraction"] == pytest.approx(0.5)
    assert ov["all_async_copies"]["overlap_fraction"] == pytest.approx(100 / 180)
    assert ov["copies_on_compute_stream"]["count"] == 1
    assert ov["pageable_copies"] == 1


def test_copy_overlap_reads_older_trace_spellings():
    """Older kineto: ``cat`` "Memcpy", the stream only in ``tid`` as "stream N"."""
    events = [{"ph": "X", "cat": "Kernel", "name": "k", "ts": 0, "dur": 10, "tid": "stream 7"},
              {"ph": "X", "cat": "Memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 5, "dur": 10,
               "tid": "stream 13"}]
    ov = trace.copy_overlap(events)
    assert ov["compute_stream"] == 7
    assert ov["h2d"]["streams"] == [13]
    assert ov["h2d"]["overlap_fraction"] == pytest.approx(0.5)
    assert ov["h2d"]["bytes"] == 0 and ov["h2d"]["gbps_active"] == 0.0


def test_parse_junit(tmp_path):
    """Counts of tests, and a module that failed to import (pytest's own spelling, as it wrote it
    for a ``ModuleNotFoundError``) as a collection error, not as a test."""
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="2" '
        'failures="1" skipped="1" tests="6">'
        '<testcase classname="" name="tests.c.test_zero"><error message="collection failure">ImportError '
        'while importing test module\nE   ModuleNotFoundError: No module named \'deepspeed\'</error></testcase>'
        '<testcase classname="tests.a" name="test_ok"/><testcase classname="tests.a" name="test_ok2"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="test_err"><error message="y"/></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped message="z"/></testcase>'
        '</testsuite></testsuites>')
    res = cuda_tests.parse_junit(xml)
    assert (res["total"], res["passed"], res["failed"], res["errors"], res["skipped"]) == (5, 2, 1, 1, 1)
    assert res["failing_tests"] == ["tests.a::test_bad", "tests.b::test_err"]
    assert res["collection_errors"] == [{"module": "tests.c.test_zero",
                                         "error": "E   ModuleNotFoundError: No module named 'deepspeed'"}]


def test_fill_store_random_is_seeded_and_shaped():
    cfg = get_flavor("qwen2-debug-untied").build_config()  # has q/k/v biases
    adapter = DecoderAdapter(cfg)
    stores = []
    for _ in range(2):
        store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False)
        host_store.fill_store_random(store, seed=3, device="cpu")
        stores.append(store)
    a, b = stores
    for ua, ub in zip(a, b):
        assert torch.equal(ua.read_master(), ub.read_master()), "same seed, same weights"
        assert torch.equal(ua.compute, split_torch(ua.read_master())[0])  # the copy follows
        views = ua.weights()
        for spec in ua.layout.specs:
            v = views[spec.local]
            if len(spec.shape) >= 2:
                assert 0.015 < v.std().item() < 0.025, spec.local
            elif "norm" in spec.local:
                assert torch.all(v == 1), spec.local
            else:
                assert torch.all(v == 0), spec.local
    c = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False)
    host_store.fill_store_random(c, seed=4, device="cpu")
    assert not torch.equal(c["layers.0"].read_master(), a["layers.0"].read_master())


# ----- the stages' runner --------------------------------------------------------------------

def test_report_records_every_stage_and_goes_on(tmp_path):
    """A stage that raises is ``failed`` with its error, what it wrote is kept and the next stage
    runs; the file already names a stage while it runs; a stage whose need failed, or that the
    budget cannot cover, is skipped saying why. Mutation: without the try/except in
    ``Report.stage`` the error escapes; saving only when a stage ends leaves no ``running``."""
    out = tmp_path / "check.json"
    r = report.Report(out, budget_s=100, args={}, dry_run=True, selected=None)

    def fails(data):
        data["measured"] = 1.5
        raise report.CheckFailed("1.5 over 1.0")

    seen = {}
    r.stage("a", 0, fails)
    r.stage("b", 0, lambda data: seen.update(json.loads(out.read_text())))
    r.stage("c", 0, lambda data: None, needs=("a",))
    r.stage("d", 1000, lambda data: None)
    res = json.loads(out.read_text())
    assert res["stages"]["a"]["status"] == "failed" and res["stages"]["a"]["error"] == "CheckFailed: 1.5 over 1.0"
    assert res["a"] == {"measured": 1.5}
    assert seen["stages"]["b"]["status"] == "running" and res["stages"]["b"]["status"] == "ok"
    assert (res["stages"]["c"]["status"], res["stages"]["c"]["reason"]) == ("skipped", "needs a (failed)")
    assert "c" not in res
    assert res["stages"]["d"]["reason"].startswith("time budget: ")
    assert r.finish(critical=("b",)) == "partial"
    assert r.finish(critical=("a",)) == "failed"
    assert json.loads(out.read_text())["failed_stages"] == ["a"]


def test_report_status_ok_only_when_every_selected_stage_is():
    r = report.Report(None, budget_s=100, args={}, dry_run=True, selected={"a", "b"})
    r.stage("a", 0, lambda d: None)
    r.stage("b", 0, lambda d: None)
    r.stage("z", 0, lambda d: 1 / 0)  # not selected: never runs, never counts
    assert r.result["stages"]["z"]["reason"] == report.NOT_SELECTED
    assert r.finish(critical=("a",)) == "ok"


# ----- the schema, defined once ------------------------------------------------------------------

def test_print_schema_prints_the_one_definition(capsys):
    """``--print-schema`` is how a reader gets the JSON's meaning (docs/results.md, "GPU check"):
    it prints ``render_markdown``, a table for every record, every key of each named."""
    assert cli.main(["--print-schema"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == schema.render_markdown().strip()
    assert "--print-schema" in (REPO / "docs" / "results.md").read_text()
    for rec in schema._records(schema.TOP, []):
        assert f"`{rec.title}`" in out
        for key in rec.keys:
            assert f"| `{key.name}` |" in out, (rec.title, key.name)


def test_schema_validation_names_each_departure():
    stage = {"status": "ok", "reason": None, "started_s": 0.0, "wall_s": 1.0, "error": None, "traceback": None}
    good = {"schema": report.SCHEMA_ID, "status": "ok", "dry_run": True, "started_at": "t", "wall_s": 1,
            "budget_s": 9.5, "args": {"anything": [1]}, "stages": {"device": stage},
            "host_ram": {"figure_used": "x", "host_budget_bytes": 1, "memtotal_bytes": None,
                         "memavailable_bytes": 2, "note": ""}}
    assert schema.validate(good) == []
    bad = json.loads(json.dumps(good))
    bad["extra"] = 1
    del bad["dry_run"]
    bad["wall_s"] = "1"
    bad["host_ram"]["host_budget_bytes"] = 1.5
    bad["stages"]["device"]["status"] = None
    bad["plan_order"] = [{"plan": "every-1"}]
    assert sorted(schema.validate(bad)) == sorted([
        "(top level).extra: not in the schema", "dry_run: missing", "wall_s: str, expected number",
        "host_ram.host_budget_bytes: float, expected int", "stages.device.status: null",
        "plan_order.0.predicted_peak_bytes: missing"])


# ----- pieces of the stages ----------------------------------------------------------------------

def test_cuda_test_files_are_those_with_cuda_tests():
    """Only these are collected on the GPU: the ZeRO tests (deepspeed) and the checkpoint tests
    (blake3) are not among them."""
    files = cuda_tests.cuda_test_files()
    assert {"tests/engine/test_cuda.py", "tests/optim/test_adamw8bit.py", "tests/test_store_pinned.py"} <= set(files)
    assert "tests/interop/test_zero.py" not in files and "tests/engine/test_gpu_check.py" not in files
    assert not any(f.startswith("tests/ckpt/") for f in files)


@pytest.mark.parametrize("moments", ["8bit", "fp32"])
def test_the_store_is_checked_against_the_budget_and_its_size_is_known(moments):
    """The model stage's estimate is the store's size to the byte (with its optimizer state), and
    the store's RAM check uses the host budget, not MemAvailable: a budget under the need is
    refused here, where MemAvailable would let it through. Mutation: building the store without
    ``mem_available=`` builds it."""
    lg = large_model.Large(machine.Dev(dry_run=True), "qwen2-debug-untied", 10**15, 2, 16, 1, moments)
    model, store = {}, {}
    large_model.run_model(lg, 4, model)
    host_store.run_store(lg, 0, store)
    assert model["store_bytes_estimate"] == store["store_nbytes"] == lg.store.nbytes()
    assert store["estimate_matches_store"] and store["ram_check"]["fits"]
    need = model["store_bytes_estimate"]
    lg.host_budget_bytes = (machine.process_rss_bytes() or 0) + need // 2
    with pytest.raises(ValueError, match="available"):
        host_store.run_store(lg, 0, {})


def _local_module_file(name: str) -> Path | None:
    base = REPO / "src" if name.split(".")[0] == "layerwise" else REPO
    path = base.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def _imports_at_load(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Modules a file imports when it is loaded: statements outside function bodies, except
    those guarded by ``except ImportError``; ``from a import b`` names ``a`` and ``a.b``."""
    out: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Try) and any(
                    isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                    for h in child.handlers):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                out.add(base)
                out.update(f"{base}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return out


def third_party_imports_at_load(modules: list[str]) -> set[str]:
    """Top-level names of the packages outside layerwise, tests/ and benchmarks/ that loading
    ``modules`` imports, following every such module they load (and the packages above it)."""
    seen, todo, third = set(), list(modules), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        if parts[0] not in ("layerwise", "tests", "benchmarks"):
            third.add(parts[0])
            continue
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        path = _local_module_file(name)
        if path is not None:
            todo += _imports_at_load(ast.parse(path.read_text()), name, path.name == "__init__.py")
    return third


def test_the_cuda_test_files_load_without_what_the_gpu_image_lacks():
    """Collecting the CUDA test files (what the check does on the GPU machine) imports none of
    the packages its image lacks that the wheels do not bring. Mutation: ``import deepspeed``
    at the top of tests/optim/test_adamw8bit.py fails it (as collecting tests/interop would)."""
    modules = [f[: -len(".py")].replace("/", ".") for f in cuda_tests.cuda_test_files()]
    third = third_party_imports_at_load(modules)
    assert {"torch", "transformers", "pytest"} <= third, third  # the walk follows the imports
    assert not third & set(NOT_CARRIED), sorted(third)
    assert "deepspeed" in third_party_imports_at_load(["tests.interop.test_zero"])


def test_the_check_loads_on_the_standard_library_alone():
    """Every module of the package imports only the standard library when loaded (each stage
    imports what it uses), so ``--print-schema`` and the no-GPU answer need nothing else and
    ``PYTORCH_CUDA_ALLOC_CONF`` is set before torch loads. Mutation: ``import torch`` at the top
    of ``benchmarks/gpu_check/plans.py`` fails it."""
    third = third_party_imports_at_load(["benchmarks.gpu_check.cli", "benchmarks.gpu_check.__main__"])
    assert {"argparse", "json"} <= third  # the walk reached cli's imports
    assert not {m for m in third if m not in sys.stdlib_module_names}, sorted(third)


def test_python_m_runs_the_check():
    """``python -m benchmarks.gpu_check`` from the repository root, as ``make gpu-check`` runs it."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--print-schema"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == schema.render_markdown().strip()
    assert "$(GPU_PY) -m benchmarks.gpu_check " in (REPO / "Makefile").read_text()


# ----- the whole check ---------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path, capsys):
    out = tmp_path / "gpu-check.json"
    assert cli.main(["--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "no GPU" in printed.err
    assert json.loads(printed.out)["status"] == "no_cuda"  # stdout: the one JSON object
    assert not out.exists()


STAGES = ["wheels", "device", "layer_check", "tiny_steps", "nvme_state", "pinned_arena", "copy_bandwidth",
          "cuda_tests", "model", "calibration", "optimizer", "planner", "plan:lora", "store"]


def _wheel(folder: Path, dist: str, broken: bool = False) -> Path:
    """A minimal pure-Python wheel of one empty package (``broken``: not a zip)."""
    path = folder / f"{dist}-0.1-py3-none-any.whl"
    if broken:
        path.write_bytes(b"not a wheel")
        return path
    info = f"{dist}-0.1.dist-info"
    files = {f"{dist}/__init__.py": "",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_each_wheel_is_reported_installed_missing_or_failed(tmp_path, monkeypatch):
    """One wheel installs, one expected is absent, one is not a wheel: each says so, the
    installed one imports from the site, and the stage fails naming the other two. Mutation
    seen failing: looking only at the folder's ``.whl`` files (an expected wheel that is absent
    goes unsaid, as ``make gpu-check``'s ``ls .whl/*.whl`` skipped it)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    d = tmp_path / "whl"
    d.mkdir()
    _wheel(d, "gc_probe_ok")
    _wheel(d, "gc_probe_bad", broken=True)
    data: dict = {}
    with pytest.raises(report.CheckFailed, match="gc-probe-missing"):
        wheels.run_wheels(d, tmp_path / "site", ["gc-probe-ok==0.1", "gc-probe-missing", "gc_probe_bad"], data)
    got = {n: r["status"] for n, r in data["wheels"].items()}
    assert got == {"gc-probe-ok": "installed", "gc-probe-missing": "missing", "gc_probe_bad": "failed"}
    assert data["wheels"]["gc_probe_bad"]["error"] and data["wheels"]["gc-probe-missing"]["file"] is None
    assert data["counts"] == {"installed": 1, "missing": 1, "failed": 1}
    assert importlib.import_module("gc_probe_ok").__file__.startswith(str(tmp_path / "site"))
    assert str(tmp_path / "site") in os.environ["PYTHONPATH"]  # the CUDA tests' pytest sees it too


@pytest.mark.parametrize("given,want,source", [
    (None, "expandable_segments:True", "set by the check"),
    ("max_split_size_mb:512", "max_split_size_mb:512,expandable_segments:True",
     "given; expandable_segments added by the check"),
    ("expandable_segments:False", "expandable_segments:False", "given")])
def test_the_alloc_conf_gets_expandable_segments_unless_the_user_chose(monkeypatch, given, want, source):
    if given is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", given)
    monkeypatch.setattr(machine, "ALLOC_CONF", dict(machine.ALLOC_CONF))
    machine.set_alloc_conf()
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == want and machine.ALLOC_CONF["source"] == source


def test_the_model_is_sized_to_the_gpu_less_the_margin(monkeypatch):
    """With every plan's predicted peak 1 GB a layer and the GPU's memory the margin plus 4.5 GB,
    the model comes out with 4 of the 8 layers asked for, its peak within the budget. Mutation
    seen failing: the device condition dropped from ``run_model``'s loop (it keeps 8 layers)."""
    monkeypatch.setattr(large_model, "cuda_peak_bytes", lambda shape, plan, mbs, seq: shape.num_layers * 10**9)
    mem = large_model.DEVICE_MARGIN_BYTES + 45 * 10**8
    monkeypatch.setattr(large_model, "device_memory", lambda lg: (mem, "test"))
    lg = large_model.Large(machine.Dev(dry_run=True), "qwen2-debug-untied", 10**15, 2, 64, 1, "8bit")
    data: dict = {}
    large_model.run_model(lg, 8, data)
    assert data["num_layers"] == 4 and data["fits_device"]
    assert data["device_budget_bytes"] == mem - large_model.DEVICE_MARGIN_BYTES == lg.device_budget_bytes
    assert data["device_peak_predicted_bytes"] <= data["device_budget_bytes"]


def test_gpu_check_dry_run_on_cpu(tmp_path, capsys):
    """Every stage's Python on the asynchronous CPU backend with a tiny model, with the packages
    the GPU image lacks and the wheels do not bring hidden (as there): every stage ``ok``, the
    JSON exactly what the schema (``--print-schema``) says, the RAM checks on the given budget.
    Mutations seen failing it: a stage writing a key the schema lacks; ``highspy`` dropped from
    GPU_WHEELS (the planner stage fails on the hidden import); the LoRA stage's base in
    ``compute`` instead of ``nf4`` (~2 bytes per layer parameter)."""
    out = tmp_path / "gpu-check.json"
    (tmp_path / "whl").mkdir()
    _wheel(tmp_path / "whl", "gc_probe_dry")
    rc = cli.main(["--dry-run", "--out", str(out), "--hide-modules", ",".join(NOT_CARRIED),
                         "--wheel-dir", str(tmp_path / "whl"), "--wheel-site", str(tmp_path / "site"),
                         "--wheels", "gc-probe-dry"])
    res = json.loads(out.read_text())
    bad = {n: s for n, s in res["stages"].items() if s["status"] != "ok"}
    assert rc == 0 and not bad, json.dumps(bad, indent=1)
    assert res["status"] == "ok" and res["failed_stages"] == res["skipped_stages"] == []
    assert schema.validate(res) == []
    order = [p["plan"] for p in res["plan_order"]]
    assert list(res["stages"]) == STAGES + [f"plan:{p}" for p in order] + ["simulator"]
    assert order[0] == "planner" and order[-1] == "layer-major", "the user's plan first"
    assert sorted(order[1:-2]) == ["every-1", "every-4", "keep-all-host"] and order[-2] == "packed"
    assert res["plans"]["packed"]["examples_per_row"] == 3 and res["plans"]["every-1"]["examples_per_row"] == 1
    peaks = [p["predicted_peak_bytes"] for p in res["plan_order"][1:-2]]
    assert peaks == sorted(peaks), "of the rules, the largest predicted device peak last"
    lm = res["plans"]["layer-major"]  # the production path of one landing per step
    assert lm["store"]["grad_dtype"] == "bfloat16" and lm["store"]["split_master"]
    assert lm["micro_batches_per_load"] == lm["num_micro_batches"] >= 2
    assert res["plans"]["every-1"]["store"]["grad_dtype"] == "float32"
    assert set(res["device"]["kernels"]) >= {"optimizer_8bit", "grad_accumulation", "split_master"}
    assert res["device"]["expandable_segments"] and res["device"]["cuda_alloc_conf_before_cuda_init"]
    assert res["wheels"]["wheels"]["gc-probe-dry"]["status"] == "installed"
    lora = res["plans"]["lora"]
    assert lora["lora"]["base_dtype"] == "nf4" and lora["lora"]["base_host_bytes_per_layer_param"] < 0.6
    assert lora["lora"]["loss_finite"] and lora["predicted_peak_bytes"] > 0 and lora["source"] == "lora"
    model = res["model"]
    assert model["fits_device"] and model["device_margin_bytes"] == large_model.DEVICE_MARGIN_BYTES
    assert {r["device_cap_bytes"] for r in res["plans"].values()} == {model["device_budget_bytes"]}
    nv = res["nvme_state"]  # state, weights and gradients in files: the same bits as in RAM
    assert nv["weights_equal"] and nv["moments_equal"] and nv["files_removed_at_close"] and not nv["in_ram"]
    assert set(nv["tiers"]) == {"state", "source", "grad"}
    assert all(t["read_bytes_per_step"][-1] > 0 and t["written_bytes_per_step"][-1] > 0 for t in nv["tiers"].values())
    ops = res["tiny_steps"]["op_counts"]
    assert all(ops.get(k) for k in ("fetch", "recompute_layer", "layer_fwd_keep", "fetch_internals")), ops
    assert res["cuda_tests"]["passed"] == 1 and "tests/engine/test_cuda.py" in res["cuda_tests"]["files"]
    budget = res["host_ram"]["host_budget_bytes"]
    assert res["store"]["ram_check"]["available_bytes"] < budget and res["store"]["estimate_matches_store"]
    assert 0 < res["cuda_tests"]["host_mem_available_bytes"] < budget  # the budget, not MemAvailable
    assert res["calibration"]["host_mem_bytes"] == res["planner"]["host_mem_bytes"] == budget
    for name, rec in res["plans"].items():
        assert len(rec["losses"]) == 2 and rec["skipped_steps"] == 0 and rec["tokens_per_s"] > 0, name
        assert rec["reserved_over_predicted"] is None and rec["profile"]["kernels"] == 0, name
    assert len(res["simulator"]["runs"]) == 6 * 3  # every plan under h200, calibrated, calibrated-shape
    printed = capsys.readouterr()
    assert "gpu-check: status ok" in printed.err and json.loads(printed.out)["status"] == "ok"


def test_gpu_check_on_a_gpu_needs_the_host_budget(tmp_path, monkeypatch, capsys):
    """On a GPU the RAM is given, never read from MemTotal: without --host-budget-gb the check
    says so and stops before touching anything."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    out = tmp_path / "gpu-check.json"
    assert cli.main(["--out", str(out)]) == 2
    assert "--host-budget-gb" in capsys.readouterr().err
    assert not out.exists()


def test_hidden_modules_cannot_be_imported_and_come_back(tmp_path, monkeypatch):
    """A package and its submodule loaded before (as deepspeed's may be in the test session)
    are both unimportable while hidden (``from pkg.sub import x`` too), and the same modules
    afterwards. Mutation: hiding only the package lets ``import_module("pkg.sub")`` through."""
    (tmp_path / "gc_probe_pkg").mkdir()
    (tmp_path / "gc_probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "gc_probe_pkg" / "sub.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    import gc_probe_pkg.sub

    with report.hidden_modules(["gc_probe_pkg"]):
        for name in ("gc_probe_pkg", "gc_probe_pkg.sub"):
            with pytest.raises(ImportError):
                importlib.import_module(name)
    assert importlib.import_module("gc_probe_pkg.sub") is gc_probe_pkg.sub
