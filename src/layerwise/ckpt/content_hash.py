"""Content hashes: the digest that names a blob and checksums every file a manifest lists.

BLAKE3, the one hash of the run format; ``format.json`` and each manifest name it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3

CONTENT_HASH = "blake3"
"""The content hash of a run: names its blobs, checksums its files; a manifest's ``"hash"``."""

BLAKE3_MAX_THREADS = 1
"""Threads one BLAKE3 hasher may use (the ``blake3`` package's own pool). One: the hash runs on
its own thread beside the writer, which keeps the disk busy; more threads only compete with the
writer's copy into the page cache on a small machine."""

CHUNK_BYTES = 1 << 20
"""Write/hash granularity. The hash thread and the write's copy into the page cache read each
chunk at the same time, so a chunk that stays in cache (1 MiB: a core's L2) is read from memory
once, not twice. On the shared 2-core machine (quick ckpt_io state, 4 interleaved rounds under
load 5-6) a save wrote 0.67 GB/s with 1 MiB chunks, 0.33-0.36 with 4 and 32 MiB."""


HASHES: dict[str, Callable[[], Any]] = {
    CONTENT_HASH: lambda: blake3.blake3(max_threads=BLAKE3_MAX_THREADS)}
"""Content hashes (``hashlib``-like constructors) by the name a manifest gives them."""


def new_hasher(name: str) -> Any:
    try:
        return HASHES[name]()
    except KeyError:
        raise ValueError(f"unknown checkpoint content hash {name!r}; this layerwise knows "
                         f"{sorted(HASHES)}") from None


def digest_bytes(data: bytes | memoryview, hash_name: str) -> str:
    h = new_hasher(hash_name)
    h.update(data)
    return h.hexdigest()


def file_digest(path: Path, hash_name: str) -> str:
    h = new_hasher(hash_name)
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(CHUNK_BYTES)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def manifest_hash(manifest: dict) -> str:
    """The content hash of a manifest's checksums (the run's one hash); another is refused."""
    name = manifest.get("hash")
    if name != CONTENT_HASH:
        raise ValueError(f"manifest of step {manifest.get('step')} uses content hash {name!r}, "
                         f"not {CONTENT_HASH!r}")
    return name
