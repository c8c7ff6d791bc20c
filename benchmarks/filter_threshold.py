"""How much each checkpoint group moves between two saves of a fine-tune: the measurement the
``filter`` policy's default threshold is chosen from.

A fine-tune starts from a trained model at a learning rate well below the one it was trained
with. Here: ``llama-demo`` (0.9M parameters, 6 groups) is first trained on the built-in corpus
(the Python standard library's source) at its own LR, exported, and then fine-tuned from that
export on prompt/completion data of another kind (arithmetic questions and answers) with
``layerwise train``'s defaults except the LR, a sweep of fine-tune LRs (``--lrs``). Each fine-tune
saves every ``--every`` steps with the ``full`` policy and takes the tracker's statistics at
each save, so every save's ``change`` of a group is its relative L2 change
``|w - w_saved| / |w_saved|`` since the previous save: what ``filter`` compares with its
threshold. Per LR: each group's median change per save interval, and for each candidate
threshold the share of (group, save) pairs above it.

Then the chosen default is run as ``layerwise train`` runs it (``filter`` with its default
threshold and the train default ``ckpt.max_staleness``) at each LR: groups written per save,
and how stale the composite's groups get, in steps; and the old default (1e-3) beside it.

Prints one JSON object. ``--quick``: fewer steps (about 3 minutes on 2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from layerwise import config as config_lib
from layerwise.ckpt import RunDir
from layerwise.ckpt.policies import FilterPolicy
from layerwise.train.config import CheckpointConfig, TrainConfig
from layerwise.train.loop import train

CANDIDATES = (1e-3, 3e-3, 0.01, 0.02, 0.03, 0.05, 0.1)
OLD_DEFAULT = 1e-3


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--lrs", default="2e-5,1e-4,3e-4", help="fine-tune learning rates")
    p.add_argument("--every", type=int, default=50, help="steps between saves (train's default)")
    p.add_argument("--pretrain-steps", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="fine-tune steps")
    p.add_argument("--measure-only", action="store_true", help="skip the filter runs")
    p.add_argument("--out", default=None, help="work directory (default: a temp dir)")
    return p.parse_args(argv)


def arithmetic_jsonl(path: Path, n: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        op = rng.choice("+-")
        lines.append(json.dumps({"prompt": f"Q: what is {a} {op} {b}? A:",
                                 "completion": f" {a + b if op == '+' else a - b}"}))
    path.write_text("\n".join(lines) + "\n")
    return path


COMMON = ["seq_len=128", "micro_batch_size=8", "log.progress=lines", "log.every=1000",
          "eval.every=0", "eval.batches=2"]


def _cfg(*overrides: str) -> TrainConfig:
    return config_lib.apply_overrides(TrainConfig(), [*COMMON, *overrides])


def pretrain(root: Path, steps: int) -> Path:
    out = root / "pretrain"
    train(_cfg(f"out_dir={out}", f"steps={steps}", "data.corpus_tokens=400000",
               "ckpt.every=0", "ckpt.at_end=false", "log.track_every=0", "overwrite=true"))
    return out / "model"


def _tracker_changes(out: Path) -> list[dict[str, float]]:
    """Per save after the first: every group's change since the previous save."""
    saves = set(RunDir.open(out / "ckpt").committed_steps())
    rows = [json.loads(x) for x in (out / "tracker.jsonl").read_text().splitlines()]
    first = min(saves)
    return [{g: v["change"] for g, v in r["groups"].items()} for r in rows
            if r["step"] in saves and r["step"] > first]


def measure(root: Path, base: Path, data: Path, lr: str, every: int, steps: int) -> dict:
    out = root / f"full-{lr}"
    train(_cfg(f"out_dir={out}", f"model={base}", f"data={data}", f"optimizer.lr={lr}",
               f"steps={steps}", f"ckpt.every={every}", "ckpt.policy=full",
               f"log.track_every={every}", "overwrite=true", "export=false"))
    saves = _tracker_changes(out)
    groups = list(saves[0])
    return {
        "median_change_per_save": {g: statistics.median(s[g] for s in saves) for g in groups},
        "share_above": {f"{t:g}": sum(v > t for s in saves for v in s.values())
                        / (len(saves) * len(groups)) for t in CANDIDATES},
        "saves_measured": len(saves),
    }


def run_filter(root: Path, base: Path, data: Path, lr: str, every: int, steps: int,
               threshold: float | None) -> dict:
    name = "default" if threshold is None else f"{threshold:g}"
    out = root / f"filter-{name}-{lr}"
    extra = [] if threshold is None else [f"ckpt.threshold={threshold}"]
    train(_cfg(f"out_dir={out}", f"model={base}", f"data={data}", f"optimizer.lr={lr}",
               f"steps={steps}", f"ckpt.every={every}", "ckpt.policy=filter", *extra,
               "log.track_every=0", "overwrite=true", "export=false"))
    store = RunDir.open(out / "ckpt")
    steps_saved = store.committed_steps()
    written, stale = [], 0
    for s in steps_saved:
        m = store.read_manifest(s)
        written.append(len(m.get("groups_written", [])))
        stale = max(stale, max(s - int(e["saved_step"]) for e in m["groups"].values()))
    groups = len(store.read_manifest(steps_saved[-1])["groups"])
    later = written[1:]  # the first save writes every group (none saved before)
    return {"groups": groups, "written_per_save": written,
            "mean_written_after_first": statistics.mean(later) if later else None,
            "saves_writing_every_group_after_first": sum(w == groups for w in later),
            "max_staleness_steps": stale}


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    pre_steps = args.pretrain_steps or (150 if args.quick else 300)
    steps = args.steps or (4 * args.every if args.quick else 6 * args.every)
    lrs = args.lrs.split(",")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        base = pretrain(root, pre_steps)
        data = arithmetic_jsonl(root / "arith.jsonl", 2000)
        measured = {lr: measure(root, base, data, lr, args.every, steps) for lr in lrs}
        default = FilterPolicy().threshold
        filtered = {lr: {"default": run_filter(root, base, data, lr, args.every, steps, None),
                         f"{OLD_DEFAULT:g}": run_filter(root, base, data, lr, args.every, steps,
                                                       OLD_DEFAULT)} for lr in lrs
                    } if not args.measure_only else None
    print(json.dumps({
        "benchmark": "filter_threshold", "model": "llama-demo", "pretrain_steps": pre_steps,
        "finetune_steps": steps, "every": args.every, "lrs": lrs,
        "default_threshold": default, "default_max_staleness": CheckpointConfig().max_staleness,
        "measured": measured, "filter_runs": filtered,
        "machine": {"python": sys.version.split()[0], "torch": torch.__version__,
                    "platform": platform.platform(), "cpus": os.cpu_count(),
                    "loadavg": os.getloadavg()},
        "wall_s": round(time.perf_counter() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
