"""The multi-process tests (``pytest -m dist``) N times in a row while busy-loop processes load
every core, to show they do not flake: one JSON object with the runs, the failed runs and each
failing test id with how often it failed.

    PYTHONPATH=src python tests/stress_dist.py            # 20 runs, 2 busy loops
    PYTHONPATH=src python tests/stress_dist.py --runs 3 -- -k collective   # extra pytest args

Each run is a fresh ``pytest`` process (its own fork server, stores and temporary dirs); a run
counts as failed when pytest exits non-zero, and its failing tests are read from its JUnit XML.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _busy(stop) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF


def _failing(xml: Path) -> list[str]:
    """Test ids (``path::name``) that failed or errored in a JUnit XML report."""
    if not xml.exists():
        return []
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            path = case.get("classname", "").replace(".", "/")
            out.append(f"{path}.py::{case.get('name')}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--busy", type=int, default=2, help="busy-loop processes beside the tests")
    ap.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = ap.parse_args(argv)
    stop = multiprocessing.Event()
    loops = [multiprocessing.Process(target=_busy, args=(stop,), daemon=True)
             for _ in range(args.busy)]
    for p in loops:
        p.start()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), env.get("PYTHONPATH")) if p)
    failed_runs, failing, walls = 0, Counter(), []
    try:
        with tempfile.TemporaryDirectory(prefix="stress-dist-") as tmp:
            for i in range(args.runs):
                xml = Path(tmp) / f"run{i}.xml"
                t0 = time.monotonic()
                proc = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "dist",
                     f"--junitxml={xml}", *args.pytest_args],
                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                walls.append(round(time.monotonic() - t0, 1))
                if proc.returncode != 0:
                    failed_runs += 1
                    ids = _failing(xml) or [f"(pytest exit {proc.returncode}: {proc.stdout[-500:]})"]
                    failing.update(ids)
                print(f"run {i + 1}/{args.runs}: exit {proc.returncode} in {walls[-1]} s",
                      file=sys.stderr, flush=True)
    finally:
        stop.set()
        for p in loops:
            p.join(5)
            if p.is_alive():
                p.kill()
    print(json.dumps({"runs": args.runs, "busy_loops": args.busy, "failures": failed_runs,
                      "failing_tests": dict(failing), "run_wall_s": walls,
                      "loadavg_end": os.getloadavg()[0]}))
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
