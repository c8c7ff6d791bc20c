"""The ``wheels`` stage: install the wheels the GPU image lacks (``make gpu-wheels`` puts them in
``.whl/``) and say, for each one expected, whether it was installed, is missing or failed.

Each wheel is installed on its own (``pip install --no-index --no-deps --target SITE``), so one
that fails does not hide the others; the site is put on ``sys.path`` (and ``PYTHONPATH``, for the
CUDA tests' pytest) before any stage imports what it holds. The stage fails when an expected
wheel is missing or did not install: a stage that needs it would fail later for a reason that
reads less plainly.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from .report import CheckFailed

WHEEL_STATUSES = ("installed", "missing", "failed")


def _dist(name: str) -> str:
    """A distribution's name as a wheel file spells it (PEP 427: runs of ``-_.`` as ``_``)."""
    return re.sub(r"[-_.]+", "_", name.split("==")[0]).lower()


def find_wheels(wheel_dir: Path, expected: list[str]) -> tuple[dict[str, Path | None], list[Path]]:
    """Each expected name's wheel in ``wheel_dir`` (None: missing), and the other wheels there."""
    files = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    found: dict[str, Path | None] = {}
    for name in expected:
        mine = [f for f in files if f.name.split("-")[0].lower() == _dist(name)]
        found[name.split("==")[0]] = mine[-1] if mine else None
    used = {f for f in found.values() if f is not None}
    return found, [f for f in files if f not in used]


def _install(wheel: Path, site: Path) -> tuple[bool, str | None]:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
           "--no-cache-dir", "--upgrade", "--disable-pip-version-check", "--target", str(site), str(wheel)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except Exception as e:  # noqa: BLE001 - reported as the wheel's failure
        return False, f"{type(e).__name__}: {e}"
    if proc.returncode != 0:
        return False, (proc.stderr.strip() or proc.stdout.strip())[-1000:] or f"pip exit {proc.returncode}"
    return True, None


def use_site(site: Path) -> None:
    """Make what ``site`` holds importable here and in child processes."""
    s = str(site)
    if s not in sys.path:
        sys.path.insert(0, s)
    sys.path_importer_cache.pop(s, None)  # a lookup before the site existed cached "nothing here"
    importlib.invalidate_caches()
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if s not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([s, *parts])


def run_wheels(wheel_dir: Path, site: Path, expected: list[str], data: dict[str, Any]) -> None:
    found, others = find_wheels(wheel_dir, expected)
    data.update(wheel_dir=str(wheel_dir), site=str(site), expected=[n.split("==")[0] for n in expected],
                wheels={})
    site.mkdir(parents=True, exist_ok=True)
    for name, wheel in list(found.items()) + [(f.name.split("-")[0], f) for f in others]:
        rec: dict[str, Any] = {"file": wheel.name if wheel else None, "status": "missing", "error": None,
                               "expected": name in found}
        if wheel is not None:
            ok, err = _install(wheel, site)
            rec.update(status="installed" if ok else "failed", error=err)
        data["wheels"][name] = rec
    use_site(site)
    bad = {n: r["status"] for n, r in data["wheels"].items() if r["status"] != "installed"}
    data["counts"] = {s: sum(r["status"] == s for r in data["wheels"].values()) for s in WHEEL_STATUSES}
    if bad:
        raise CheckFailed(f"wheels not installed from {wheel_dir}: {bad}")
