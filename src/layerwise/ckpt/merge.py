"""Merge / export any checkpoint source into an ordinary checkpoint, atomically and streaming.

``merge(source, out_dir, format=...)`` writes a Hugging Face model dir (``hf``) or an HF Trainer
``checkpoint-N`` dir (``trainer``). The output is built in a hidden temp dir next to ``out_dir`` and
renamed into place only once complete, so a failed merge (bad recipe, disk full, a kill) never
leaves a half-written output. Sources are read one group at a time.

The CLI (``layerwise ckpt merge``) is registered by :func:`register_cli`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from layerwise.ckpt.source import CheckpointSource, open_source
from layerwise.util.atomic import fsync_dir

FORMATS = ("hf", "trainer")


def merge(
    source: CheckpointSource | str | Path,
    out_dir: str | Path,
    format: str = "hf",
    *,
    step: int | None = None,
    max_shard_size: int | str | None = "5GB",
    dtype: str | None = None,
    hparams: Any = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write ``source`` (a CheckpointSource or a path for :func:`open_source`) to ``out_dir``.

    ``hparams`` (an :class:`~layerwise.ckpt.formats.trainer.AdamWHParams`) overrides the AdamW
    hyper-parameters of a ``trainer`` export; by default they come from the source, else
    transformers' defaults. Returns a summary (files, bytes, step, seconds).
    """
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if isinstance(source, (str, Path)):
        source = open_source(source, step)
    elif step is not None:
        raise ValueError("step= is only used when source is a path; an opened source already has its step")
    recipe = getattr(source, "recipe", None)
    if dtype is None and recipe is not None:
        dtype = recipe.dtype  # a recipe's `dtype:` applies unless overridden
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out} exists and is not empty; choose a new path or pass --overwrite")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        if format == "hf":
            from layerwise.ckpt.formats.hf import write_hf

            summary = write_hf(source, tmp, max_shard_size=max_shard_size, dtype=dtype)
        else:
            from layerwise.ckpt.formats.trainer import write_trainer

            summary = write_trainer(source, tmp, max_shard_size=max_shard_size, dtype=dtype, hparams=hparams)
        _fsync_tree(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if hasattr(source, "describe"):
        summary["sources"] = source.describe()
    summary["out"] = str(out)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    summary["bytes"] = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    return summary


def _fsync_tree(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(path)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` to ``out``; an existing ``out`` is swapped out first, then removed."""
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        else:
            out.rmdir()
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)  # put the previous output back
        raise
    fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old)


# ---------------------------------------------------------------------------------------------
# CLI


def register_cli(ckpt_subparsers: argparse._SubParsersAction) -> None:
    """Add ``merge`` to the ``layerwise ckpt`` subcommands."""
    p = ckpt_subparsers.add_parser(
        "merge",
        help="export a step (or a recipe of layers) to an HF model dir or HF Trainer checkpoint",
        description=(
            "Write an ordinary checkpoint from a layer-wise run step, an HF Trainer checkpoint-N dir "
            "or an HF model dir; or, with --recipe, from layer ranges of several of them. The output "
            "appears only when complete."
        ),
    )
    p.add_argument("run", nargs="?", help="layer-wise run dir, HF Trainer checkpoint-N dir or HF model dir")
    p.add_argument("--step", type=int, default=None, help="step of a layer-wise run (default: latest)")
    p.add_argument("--recipe", default=None, help="YAML recipe (mergekit/LLMTailor slices) instead of RUN")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--format", choices=FORMATS, default="hf", help="hf: model dir; trainer: checkpoint-N dir")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    p.add_argument("--dtype", default=None, help="cast weights (float32, bfloat16, float16); default: as stored")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_merge)


def _cmd_merge(args: argparse.Namespace) -> int:
    """Exit codes: 0 written; 2 a user mistake (bad arguments, recipe, source); 1 the write failed."""
    from layerwise.ckpt.errors import CheckpointError

    try:
        summary = _run_merge(args)
    except (ValueError, FileNotFoundError) as e:
        if not args.json:
            raise  # the ``layerwise`` entry point prints user mistakes as one line, exit 2
        print(json.dumps({"ok": False, "error": str(e)}))
        return 2
    except (CheckpointError, OSError) as e:
        msg = f"merge failed, nothing was written to {args.out}: {e}"
        print(json.dumps({"ok": False, "error": msg}) if args.json else f"layerwise ckpt merge: error: {msg}",
              file=sys.stdout if args.json else sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, **summary}, sort_keys=True))
    else:
        print(
            f"wrote {summary['format']} checkpoint of step {summary['step']} to {summary['out']}: "
            f"{len(summary['weight_files'])} weight file(s), {summary['bytes'] / 1e6:.1f} MB "
            f"in {summary['seconds']:.1f} s"
        )
        if "sources" in summary:
            for group, model in summary["sources"]["groups"].items():
                print(f"  {group:<12} <- {model}")
            print(f"  state (step, scheduler, RNG, trainer state) <- {summary['sources']['state_from']}")
    return 0


def _run_merge(args: argparse.Namespace) -> dict[str, Any]:
    if (args.run is None) == (args.recipe is None):
        raise ValueError("give either RUN or --recipe recipe.yaml (exactly one)")
    if args.recipe is not None:
        if args.step is not None:
            raise ValueError("--step does not apply to --recipe; write path@step for a source in the recipe")
        from layerwise.ckpt.recipe import load_recipe

        source: CheckpointSource | str = load_recipe(args.recipe).open()
        step = None
    else:
        source, step = args.run, args.step
    return merge(
        source, args.out, args.format, step=step, max_shard_size=args.max_shard_size, dtype=args.dtype,
        overwrite=args.overwrite,
    )
