"""A run's ``out_dir`` as files: whether it holds a run, its ``run.json`` (and the settings saved
there), clearing it for ``overwrite``. Torch-free: the command reads these before its heavy
imports."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, TextIO

from ..util.atomic import atomic_write_text

RUN_JSON = "run.json"
RUN_FORMAT_VERSION = 2
"""``run.json``'s format (docs/formats.md)."""

RUN_FILES = ("run.json", "metrics.jsonl", "tracker.jsonl", "samples.jsonl", "ckpt", "model",
             "tensorboard", "report.png")
"""What a run writes and ``overwrite=true`` removes (``plan.json`` is rewritten; the data
cache and a calibrated ``profile.json`` are kept)."""

PER_INVOCATION_KEYS = ("resume", "resume_from_checkpoint", "overwrite")
"""Settings of one command, not of the run: never taken from a saved config."""


def holds_run(out_dir: Path) -> list[str]:
    """The run files ``out_dir`` holds (empty: none)."""
    return [name for name in RUN_FILES if (out_dir / name).exists()]


def read_run_json(out_dir: Path) -> dict[str, Any] | None:
    """``out_dir/run.json``, or None when there is none (or it is not a run's)."""
    try:
        info = json.loads((out_dir / RUN_JSON).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def write_run_json(out_dir: Path, info: dict[str, Any]) -> None:
    atomic_write_text(out_dir / RUN_JSON, json.dumps(info, indent=2) + "\n")


def saved_config(out_dir: Path) -> dict[str, Any] | None:
    """The resolved settings the run in ``out_dir`` was started with (``run.json``'s
    ``config``), less the per-invocation keys; None when there are none."""
    info = read_run_json(out_dir)
    cfg = info.get("config") if info else None
    if not isinstance(cfg, dict):
        return None
    return {k: v for k, v in cfg.items() if k not in PER_INVOCATION_KEYS}


def clear_run(out_dir: Path) -> list[str]:
    """Remove the files of the run in ``out_dir`` (``overwrite=true``); the names removed."""
    gone = []
    for name in holds_run(out_dir):
        path = out_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
        gone.append(name)
    return gone


def open_metrics(path: Path, resumed_step: int, resumed_row: dict | None) -> TextIO:
    """``metrics.jsonl`` for appending. A resumed run keeps the rows up to its step and drops the
    rest (a killed run may have logged steps never committed, or a cut line); the resumed step's
    own row is put back from the checkpoint if missing."""
    if not resumed_step:
        return open(path, "w")
    kept, have_resumed = [], False
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if step <= resumed_step:
            kept.append(line + "\n")
            have_resumed |= step == resumed_step
    if resumed_row is not None and not have_resumed:
        kept.append(json.dumps(resumed_row) + "\n")
    atomic_write_text(path, "".join(kept))
    return open(path, "a")
