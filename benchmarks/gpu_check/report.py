"""The GPU check's JSON and its stages: each stage runs under its own try/except, inside a time
budget and after the stages it needs, and the file is rewritten when a stage starts and when it
ends, so a run that is killed keeps everything done so far and names the stage it was in.

Standard library only (the check imports nothing it does not use: each stage imports its own).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

SCHEMA_ID = "layerwise-gpu-check/2"
NOT_SELECTED = "not selected (--stages)"


class CheckFailed(RuntimeError):
    """A stage ran and its result is wrong (numbers out of tolerance, a test failed)."""


class StageSkipped(Exception):
    """A stage found, once started, that it has nothing to do; the message says why."""


def write_json(path: Path | None, obj: dict[str, Any]) -> None:
    """Write ``obj`` to ``path`` atomically (a reader never sees half a file)."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


class Report:
    """The JSON being built, the stages' records and the time budget."""

    def __init__(self, out: Path | None, budget_s: float, args: dict[str, Any], dry_run: bool,
                 selected: set[str] | None):
        self.out = out
        self.budget_s = budget_s
        self.selected = selected
        self.t0 = time.monotonic()
        self.result: dict[str, Any] = {
            "schema": SCHEMA_ID,
            "status": "running",
            "dry_run": dry_run,
            "started_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": 0.0,
            "budget_s": budget_s,
            "args": args,
            "stages": {},
        }

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def left_s(self) -> float:
        return self.budget_s - self.elapsed_s()

    def save(self) -> None:
        self.result["wall_s"] = round(self.elapsed_s(), 3)
        write_json(self.out, self.result)

    def status_of(self, name: str) -> str | None:
        rec = self.result["stages"].get(name)
        return rec["status"] if rec else None

    def stage(self, name: str, estimate_s: float, fn: Callable[[dict[str, Any]], Any],
              data_path: tuple[str, ...] | None = None, needs: tuple[str, ...] = ()) -> Any:
        """Run ``fn(data)`` as stage ``name``, where ``data`` is the dict placed at ``data_path``
        of the JSON (default: the stage's name) before ``fn`` starts, so what it wrote before a
        failure is kept. Skipped (with the reason) when not selected, when a stage it needs is
        not ``ok``, or when the budget left is under ``estimate_s``."""
        rec: dict[str, Any] = {"status": "skipped", "reason": None, "started_s": None, "wall_s": None,
                               "error": None, "traceback": None}
        self.result["stages"][name] = rec
        unmet = [f"{n} ({self.status_of(n) or 'not run'})" for n in needs if self.status_of(n) != "ok"]
        if self.selected is not None and name.split(":")[0] not in self.selected and name not in self.selected:
            rec["reason"] = NOT_SELECTED
        elif unmet:
            rec["reason"] = "needs " + ", ".join(unmet)
        elif self.left_s() < estimate_s:
            rec["reason"] = f"time budget: {self.left_s():.0f} s left, the stage needs about {estimate_s:.0f} s"
        if rec["reason"] is not None:
            self.save()
            return None
        data: dict[str, Any] = {}
        parent = self.result
        path = data_path or (name,)
        for key in path[:-1]:
            parent = parent.setdefault(key, {})
        parent[path[-1]] = data
        rec.update(status="running", started_s=round(self.elapsed_s(), 3))
        self.save()
        print(f"[gpu-check {self.elapsed_s():6.1f}s] {name} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            out = fn(data)
            rec["status"] = "ok"
            return out
        except StageSkipped as e:
            rec.update(status="skipped", reason=str(e))
            return None
        except Exception as e:  # noqa: BLE001 - every failure is recorded, the rest still runs
            rec.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000],
                       traceback=traceback.format_exc()[-6000:])
            print(f"[gpu-check] {name} FAILED: {rec['error']}", file=sys.stderr, flush=True)
            return None
        finally:
            rec["wall_s"] = round(time.perf_counter() - t, 3)
            self.save()

    def finish(self, critical: tuple[str, ...]) -> str:
        """The overall status: ``ok`` when every selected stage is ok; ``failed`` when none is,
        or when a ``critical`` stage (first contact) is not; else ``partial``."""
        stages = {n: r for n, r in self.result["stages"].items() if r["reason"] != NOT_SELECTED}
        ok = [n for n, r in stages.items() if r["status"] == "ok"]
        if len(ok) == len(stages):
            status = "ok"
        elif not ok or any(stages[n]["status"] != "ok" for n in critical if n in stages):
            status = "failed"
        else:
            status = "partial"
        self.result["status"] = status
        self.result["failed_stages"] = [n for n, r in stages.items() if r["status"] == "failed"]
        self.result["skipped_stages"] = [n for n, r in stages.items() if r["status"] == "skipped"]
        self.save()
        return status


_ABSENT = object()


@contextmanager
def hidden_modules(names: list[str]) -> Iterator[None]:
    """Make ``import name`` fail for each of ``names`` (``sys.modules[name] = None``), as on a
    machine without those packages; restored afterwards (a dry run inside the test suite)."""
    hide = set(names) | {m for m in sys.modules for n in names if m.startswith(n + ".")}  # loaded before
    saved = {n: sys.modules.get(n, _ABSENT) for n in hide}
    for n in hide:
        sys.modules[n] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for n, mod in saved.items():
            if mod is _ABSENT:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = mod  # type: ignore[assignment]
