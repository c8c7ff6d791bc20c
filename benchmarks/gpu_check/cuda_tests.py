"""The CUDA tests stage: pytest over only the test files that hold ``cuda``-marked tests.

Only those files are collected, so a package that the GPU machine lacks and that no CUDA test
file imports (deepspeed, for the ZeRO tests) cannot fail the collection; a collection error
that does happen is listed, the other files still run. Plugins are not auto-loaded (the
machine's image carries several); pytest-timeout is loaded by name when present. Names hidden
with ``--hide-modules`` are hidden in the pytest process too, through a one-line plugin.

A dry run runs the same command on a generated file of one ``cuda``-marked test (the real
CUDA tests are skipped without CUDA, and collecting them would import the whole stack again).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from .machine import REPO, find_spec_ok
from .report import CheckFailed

CUDA_MARK = re.compile(r"\bpytest\.mark\.cuda\b")

DRY_RUN_TEST = '''import importlib

import pytest

HIDDEN = {hidden!r}


@pytest.mark.cuda
def test_hidden_modules_are_hidden_here():
    """The pytest process sees the packages hidden from the check as missing."""
    for name in HIDDEN:
        with pytest.raises(ImportError):
            importlib.import_module(name)


def test_not_marked_cuda_is_deselected():
    raise AssertionError("-m cuda should have deselected this test")
'''


def cuda_test_files(tests_dir: Path = REPO / "tests") -> list[str]:
    """Test files (relative to the repository) whose text marks a test ``pytest.mark.cuda``."""
    return sorted(str(p.relative_to(REPO)) for p in tests_dir.rglob("test_*.py")
                  if CUDA_MARK.search(p.read_text(errors="replace")))


def pytest_command(files: list[str], junit: Path, per_test_timeout_s: float,
                   plugin_dir: Path | None, ini: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rfEs", "-p", "no:cacheprovider",
           "--continue-on-collection-errors", f"--junitxml={junit}"]
    if ini is not None:
        cmd += ["-c", str(ini), "--rootdir", str(ini.parent)]
    if find_spec_ok("pytest_timeout"):
        cmd += ["-p", "pytest_timeout", f"--timeout={per_test_timeout_s:g}"]
    if plugin_dir is not None:
        cmd += ["-p", "gpu_check_hide"]
    return cmd + files


def parse_junit(path: str | Path) -> dict[str, Any]:
    """Counts, failing test ids and collection errors from a pytest JUnit XML file.

    pytest writes a file that failed to import as a ``testcase`` named after the module with an
    ``error`` whose message is ``collection failure``; those are ``collection_errors`` (the
    module and the error's last line), not tests, and ``errors`` counts only errors of tests.
    """
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
    failed, collection = [], []
    for case in root.iter("testcase"):
        error = case.find("error")
        if error is not None and error.get("message") == "collection failure":
            lines = [ln.strip() for ln in (error.text or "").splitlines() if ln.strip()]
            collection.append({"module": case.get("name", ""), "error": lines[-1] if lines else ""})
        elif case.find("failure") is not None or error is not None:
            failed.append(f"{case.get('classname', '')}::{case.get('name', '')}")
    total = counts["tests"] - len(collection)
    errors = counts["errors"] - len(collection)
    return {"total": total, "passed": total - counts["failures"] - errors - counts["skipped"],
            "failed": counts["failures"], "errors": errors, "skipped": counts["skipped"],
            "failing_tests": failed, "collection_errors": collection}


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def run_cuda_tests(data: dict[str, Any], dry_run: bool, hidden: list[str], timeout_s: float,
                   per_test_timeout_s: float, host_mem_available_bytes: int | None = None) -> None:
    """pytest over the files with CUDA tests; ``host_mem_available_bytes`` (the host budget less
    this process's RSS) is the RAM their stores are checked against (``HOST_MEM_ENV``), not
    ``MemAvailable``, which starts far lower on the GPU machine."""
    from layerwise.util.host_memory import HOST_MEM_ENV

    files = cuda_test_files()
    data["files"] = files
    with tempfile.TemporaryDirectory(prefix="layerwise-gpu-check-pytest-") as d:
        tmp = Path(d)
        ini, cwd, run_files = None, REPO, files
        if dry_run:
            (tmp / "test_gpu_check_dry_run.py").write_text(DRY_RUN_TEST.format(hidden=hidden))
            ini = tmp / "pytest.ini"
            ini.write_text("[pytest]\nmarkers =\n    cuda: needs a CUDA device\n")
            cwd, run_files = tmp, ["test_gpu_check_dry_run.py"]
        plugin_dir = None
        if hidden:
            plugin_dir = tmp / "plugins"
            plugin_dir.mkdir()
            (plugin_dir / "gpu_check_hide.py").write_text(
                f"import sys\nfor _n in {hidden!r}:\n    sys.modules[_n] = None\n")
        junit = tmp / "junit.xml"
        cmd = pytest_command(run_files, junit, per_test_timeout_s, plugin_dir, ini)
        env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
        if host_mem_available_bytes is not None:
            env[HOST_MEM_ENV] = str(host_mem_available_bytes)
        data["host_mem_available_bytes"] = host_mem_available_bytes
        paths = [str(REPO / "src"), str(REPO), *([str(plugin_dir)] if plugin_dir else []), env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        data.update(ran_files=run_files, command=" ".join(cmd), timeout_s=round(timeout_s, 1))
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
            rc, output, timed_out = proc.returncode, proc.stdout + proc.stderr, False
        except subprocess.TimeoutExpired as e:
            rc, output, timed_out = None, _text(e.stdout) + _text(e.stderr), True
        data.update(exit_code=rc, timed_out=timed_out, wall_s=round(time.perf_counter() - t, 3))
        counts = parse_junit(junit) if junit.exists() else {}
        data.update({k: counts.get(k) for k in ("total", "passed", "failed", "errors", "skipped")})
        data["failing_tests"] = counts.get("failing_tests", [])
        data["collection_errors"] = counts.get("collection_errors", [])
        data["output_tail"] = output[-4000:]
    problems = []
    if timed_out:
        problems.append(f"timed out after {timeout_s:.0f} s")
    if data["failed"] or data["errors"] or rc not in (0, None) and not data["collection_errors"]:
        problems.append(f"exit {rc}: {data['failed']} failed, {data['errors']} errors: {data['failing_tests'][:10]}")
    if data["collection_errors"]:
        problems.append(f"{len(data['collection_errors'])} files not collected: {data['collection_errors']}")
    if not timed_out and not data["passed"]:
        problems.append("no CUDA test passed (none collected, or all skipped)")
    if problems:
        raise CheckFailed("; ".join(problems))
