"""The run directory's ``format.json``: which format version a run is and which content hash
it uses. Readers refuse newer versions; a run keeps the version it was created with."""

from __future__ import annotations

import json
from pathlib import Path

from ..util.atomic import atomic_write_bytes
from .content_hash import HASH_OF_VERSION, HASHES

FORMAT = "layerwise-ckpt"
FORMAT_VERSION = 6
"""Written for new runs. Bump on any change a reader of an older version would misread; readers
refuse newer versions. 1: sha256 content addresses; 2: BLAKE3 (``"hash"`` in format.json and in
each manifest; entries carry their digest under the hash's name); 3: blobs may hold 8-bit
moments as codes and scales (blob layout 2, ``ckpt.moments``); runs of format 1 and 2 get fp32
moments, as their readers expect; 4: a group entry may be sharded, one blob per writing rank
(``ckpt.shard_ranges``, written by ``ckpt.sharded_checkpointer``); 5: a layer's routed
experts may be groups of their own, each entry a one-shard slice of the fused tensors marked
``slice_of`` its layer (``ckpt.expert_groups``); 6: a blob's fp32 weights may be delta-coded
against a key frame blob of the same group (blob layout 3, ``ckpt.blob_codec``), its entry naming
that key frame under ``base``."""

FIRST_VERSION_DELTA = 6
"""The first run format whose blobs may be delta-coded."""

FIRST_VERSION_EXPERT_GROUPS = 5
"""The first run format whose manifests may hold expert-group (slice) entries."""

FIRST_VERSION_SHARDED = 4
"""The first run format whose manifests may hold sharded group entries."""

FIRST_VERSION_8BIT = 3
"""The first run format whose blobs may hold 8-bit moments."""

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
        {"format": FORMAT, "format_version": FORMAT_VERSION, "hash": HASH_OF_VERSION[FORMAT_VERSION]}))


def read_format(root: Path) -> tuple[int, str]:
    """(format version, content hash name) of the run at ``root``; refuses what this layerwise
    cannot read."""
    fmt = root / "format.json"
    if not fmt.exists():
        raise FileNotFoundError(
            f"{root} is not a layerwise checkpoint run (no format.json, nor ckpt/format.json); "
            "pass a `layerwise train` out_dir or the directory given to Checkpointer(run_dir=...)"
        )
    info = json.loads(fmt.read_text())
    if info.get("format") != FORMAT:
        raise ValueError(f"{fmt}: format {info.get('format')!r} is not {FORMAT!r}")
    version = int(info.get("format_version", -1))
    if version > FORMAT_VERSION or version < 1:
        raise ValueError(
            f"{root} has checkpoint format_version {version}; this layerwise reads "
            f"versions 1 to {FORMAT_VERSION}. Upgrade layerwise to read it."
        )
    hash_name = info.get("hash", HASH_OF_VERSION[version])
    if version == 1 and hash_name != "sha256":
        raise ValueError(f"{fmt}: format_version 1 runs are sha256, not {hash_name!r}")
    if hash_name not in HASHES:
        raise ValueError(f"{fmt}: content hash {hash_name!r} is unknown to this layerwise "
                         f"(known: {sorted(HASHES)}); upgrade layerwise to read it")
    return version, hash_name
