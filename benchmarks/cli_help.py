"""Wall time of ``layerwise --help`` and ``layerwise train --help``, each a fresh process.

The claim: each under 1 s, median of 5. The help path imports neither torch nor
transformers (``tests/train/test_first_hour.py`` checks that), so what is left is Python's
start-up and layerwise's own config modules. Each command runs ``--repeats`` times, one fresh
interpreter each (``python -c "from layerwise.cli import main; main()"``, what the console
script does); a bare ``python -c pass`` is timed the same way beside them, so a loaded machine
shows as a slow baseline rather than as a slow CLI. Two settings: with bytecode caches (what a
``pip install`` gives: ``.pyc`` files written by one uncounted warm-up run, into a scratch
``PYTHONPYCACHEPREFIX``), and without (``PYTHONDONTWRITEBYTECODE=1``, every module compiled at
every start, as on a read-only checkout). Prints one JSON object.

    PYTHONPATH=src python benchmarks/cli_help.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ENTRY = "import sys; from layerwise.cli import main; sys.exit(main())"


def wall_s(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def medians(commands: dict[str, list[str]], env: dict[str, str], repeats: int) -> dict:
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeats):  # interleaved, so a burst of load hits every command alike
        for name, argv in commands.items():
            times[name].append(wall_s(argv, env))
    return {"median_s": {n: round(statistics.median(t), 3) for n, t in times.items()},
            "max_s": {n: round(max(t), 3) for n, t in times.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "layerwise --help": [sys.executable, "-c", ENTRY, "--help"],
        "layerwise train --help": [sys.executable, "-c", ENTRY, "train", "--help"],
        "layerwise train --help-all": [sys.executable, "-c", ENTRY, "train", "--help-all"],
    }
    load_before = os.getloadavg()[0]
    out: dict = {"repeats": args.repeats}
    with tempfile.TemporaryDirectory() as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache
        for argv in commands.values():  # the warm-up that writes the .pyc files
            wall_s(argv, env)
        out["with_pyc"] = medians(commands, env, args.repeats)
    out["without_pyc"] = medians(commands, {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
                                 args.repeats)
    out["loadavg_1m_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    out["under_1_s_with_pyc"] = all(v < 1.0 for n, v in out["with_pyc"]["median_s"].items())
    print(json.dumps(out))


if __name__ == "__main__":
    main()
