"""The run directory's ``format.json``: which format version a run is and which content hash
it uses. A reader opens only the version it writes and refuses every other in one line."""

from __future__ import annotations

import json
from pathlib import Path

from ..util.atomic import atomic_write_bytes
from .content_hash import CONTENT_HASH

FORMAT = "layerwise-ckpt"
FORMAT_VERSION = 6
"""The one run format this layerwise writes and reads. Blobs and every checksum are BLAKE3
(``"hash"`` in format.json and in each manifest; entries carry their digest under the hash's
name); blobs may hold 8-bit moments as codes and scales (blob layout 2, ``ckpt.moments``); a
group entry may be sharded, one blob per writing rank (``ckpt.shard_ranges``, written by
``ckpt.sharded_checkpointer``); a layer's routed experts may be groups of their own, each entry
a one-shard slice of the fused tensors marked ``slice_of`` its layer (``ckpt.expert_groups``); a
blob's fp32 weights may be delta-coded against a key frame blob of the same group (blob layout
3, ``ckpt.blob_codec``), its entry naming that key frame under ``base``. Bump on any change a
reader of this version would misread."""

OUT_DIR_CKPT = "ckpt"
"""Where a ``layerwise train`` out_dir keeps its checkpoint run: every reader of a run takes the
out_dir as well as the run itself (``locate_run``)."""


def locate_run(path: str | Path) -> Path:
    """The checkpoint run at ``path``: ``path`` itself when it holds ``format.json``, else its
    ``ckpt/`` when that is a run (a ``layerwise train`` out_dir), else ``path`` unchanged (its
    reader then says it is not a run)."""
    root = Path(path)
    if not (root / "format.json").exists() and (root / OUT_DIR_CKPT / "format.json").exists():
        return root / OUT_DIR_CKPT
    return root


def json_bytes(obj: object) -> bytes:
    """A run file's JSON text (format.json, config.json, manifests), newline-terminated."""
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()


def write_format(root: Path) -> None:
    """``format.json`` of a new run (atomically: a run without it is not a run)."""
    atomic_write_bytes(root / "format.json", json_bytes(
        {"format": FORMAT, "format_version": FORMAT_VERSION, "hash": CONTENT_HASH}))


def refuse_version(version: object, where: Path) -> None:
    """Refuse, in one line, a run file (``where``) of a format version other than this
    layerwise's."""
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{where}: checkpoint run format_version {version}; this layerwise reads "
            f"{FORMAT_VERSION}: start the run again or use a layerwise that wrote it")


def read_format(root: Path) -> None:
    """Check that ``root`` is a run of this layerwise's format; refuse anything else."""
    fmt = root / "format.json"
    if not fmt.exists():
        raise FileNotFoundError(
            f"{root} is not a layerwise checkpoint run (no format.json, nor ckpt/format.json); "
            "pass a `layerwise train` out_dir or the directory given to Checkpointer(run_dir=...)"
        )
    info = json.loads(fmt.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{fmt}: format {info.get('format')!r} is not {FORMAT!r}")
    refuse_version(info.get("format_version"), root)
    if info.get("hash") != CONTENT_HASH:
        raise ValueError(f"{fmt}: content hash {info.get('hash')!r} is not {CONTENT_HASH!r}, "
                         f"the one format_version {FORMAT_VERSION} uses")
