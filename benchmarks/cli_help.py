"""Wall time of ``layerwise --help`` and ``layerwise train --help``, each a fresh process.

The claim (issue 20): each under 1 s, median of 5. The help path imports neither torch nor
transformers (``tests/train/test_first_hour.py`` checks that), so what is left is Python's
start-up and layerwise's own config modules. Each command runs ``--repeats`` times, one fresh
interpreter each (``python -c "from layerwise.cli import main; main()"``, what the console
script does); a bare ``python -c pass`` is timed the same way beside them, so a loaded machine
shows as a slow baseline rather than as a slow CLI. Prints one JSON object.

    PYTHONPATH=src python benchmarks/cli_help.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ENTRY = "import sys; from layerwise.cli import main; sys.exit(main())"


def wall_s(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


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
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.repeats):  # interleaved, so a burst of load hits every command alike
        for name, argv in commands.items():
            times[name].append(wall_s(argv))
    out = {"repeats": args.repeats, "loadavg_1m_before_after": [load_before, os.getloadavg()[0]],
           "median_s": {n: round(statistics.median(t), 3) for n, t in times.items()},
           "max_s": {n: round(max(t), 3) for n, t in times.items()}}
    out["under_1_s"] = all(out["median_s"][n] < 1.0 for n in commands if n != "python -c pass")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
