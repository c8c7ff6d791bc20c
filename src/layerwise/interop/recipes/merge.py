"""Merge / export any checkpoint source into an ordinary checkpoint, atomically and streaming.

Built in a hidden temp dir and renamed into place only once complete, so a failed merge never
leaves a half-written output; sources are read one group at a time."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from ...util.atomic import fsync_dir
from ...util.dtypes import parse_dtype
from ..torchdist.dcp_checkpoint import write_dcp
from ..hf.model_dir_writer import require_config, write_config_files, write_hf
from ..hf.tokenizer_files import copy_model_files, model_files_of
from ..layout import CheckpointSource
from ..sources import open_source
from ..hf.trainer_checkpoint import write_trainer
from ..deepspeed.zero_checkpoint import ZeroCheckpointSource, write_zero

FORMATS = ("hf", "trainer", "dcp", "deepspeed")


def merge(
    source: CheckpointSource | str | Path,
    out_dir: str | Path,
    format: str = "hf",
    *,
    step: int | None = None,
    max_shard_size: int | str | None = "5GB",
    dtype: str | None = None,
    hparams: Any = None,
    template: str | Path | None = None,
    overwrite: bool = False,
    config: dict | str | Path | None = None,
    tokenizer: str | Path | None = None,
) -> dict[str, Any]:
    """Write ``source`` (a CheckpointSource or a path) to ``out_dir``; returns a summary.

    ``hparams``: AdamW hyper-parameters of a ``trainer`` export (default: the source's, else
    transformers'). ``template``: for ``deepspeed``, a ZeRO save whose layout is filled.
    ``config``: HF config of a DCP source. ``tokenizer``: directory whose tokenizer files go beside
    the weights (default: the source's own)."""
    if format not in FORMATS:
        raise ValueError(f"unknown export format {format!r}; choose one of {', '.join(FORMATS)}")
    if isinstance(source, (str, Path)):
        source = open_source(source, step, config)
    elif step is not None:
        raise ValueError("step= is only used when source is a path; an opened source already has its step")
    recipe = getattr(source, "recipe", None)
    if dtype is None and recipe is not None:
        dtype = recipe.dtype  # a recipe's `dtype:` applies unless overridden
    out = check_out(out_dir, overwrite)

    model_files = model_files_of(source, tokenizer) if format in ("hf", "trainer") else None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        config = require_config(source)
        extra = source.extra_state()
        torch_dtype = None if format == "deepspeed" else parse_dtype(dtype)  # ZeRO keeps fp32 masters
        summary = {"format": format, "step": int(extra.get("step") or 0)}
        if format == "hf":
            summary.update(write_hf(source, tmp, config, torch_dtype, max_shard_size=max_shard_size))
        elif format == "dcp":
            summary.update(write_dcp(source, tmp, config, extra, torch_dtype, hparams=hparams))
        elif format == "deepspeed":
            summary.update(write_zero(source, tmp, config, extra, template=_zero_template(source, template)))
        else:
            summary.update(write_trainer(source, tmp, config, extra, torch_dtype,
                                         max_shard_size=max_shard_size, hparams=hparams))
        write_config_files(tmp, config, torch_dtype, extra.get("generation_config"))
        if model_files is not None:
            copy_model_files(model_files, tmp)
        _fsync_tree(tmp)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if hasattr(source, "describe"):
        summary["sources"] = source.describe()
    if hasattr(source, "older_groups"):
        summary["older_groups"] = source.older_groups()
        summary["num_groups"] = len(source.groups())
    summary["tokenizer_from"] = None if model_files is None else str(model_files)
    summary["out"] = str(out)
    summary["seconds"] = round(time.perf_counter() - t0, 3)
    summary["bytes"] = dir_bytes(out)
    return summary


def check_out(out_dir: str | Path, overwrite: bool) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"--out {out} exists and is not empty; choose a new path or pass --overwrite")
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _zero_template(source: CheckpointSource, template: str | Path | None) -> Path:
    if template is not None:
        return Path(template)
    state = getattr(source, "state_source", source)  # a recipe: the source its state comes from
    if isinstance(state, ZeroCheckpointSource):
        return state.path
    raise ValueError("--format deepspeed needs --template: a ZeRO save (global_stepN dir) of the run "
                     "that will resume, saved after its first step with the same DeepSpeed config and "
                     "world size; its layout is filled with the source's numbers")


def _fsync_tree(path: Path) -> None:
    for f in sorted(path.rglob("*"), reverse=True):  # files before the dirs that hold them
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif f.is_dir():
            fsync_dir(f)
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
