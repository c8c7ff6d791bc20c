"""Content-addressed group blobs: ``RUN/blobs/ab/<digest>.safetensors``, one group version each.

Streamed to disk so a group is never duplicated in memory, hashed on a second thread while
written (no extra pass), fsynced and renamed before any manifest may name it."""

from __future__ import annotations

import os
import struct
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..util.atomic import fsync_dir
from ..util.safetensors_io import dtype_name, encode_header, tensor_bytes
from .content_hash import CHUNK_BYTES, new_hasher
from .errors import write_error
from .moments import has_8bit

BLOB_FORMAT = "layerwise-group"
BLOB_FORMAT_VERSION = 1
"""The blob's own layout (safetensors, key order, metadata) when it holds neither 8-bit moments
nor delta-coded weights."""
BLOB_FORMAT_VERSION_8BIT = 2
"""The layout of a blob that holds 8-bit moments (``ckpt.moments``).
Blobs without them keep layout 1."""
BLOB_FORMAT_VERSION_DELTA = 3
"""The layout of a blob whose fp32 weights are delta-coded against a key frame
(``ckpt.blob_codec``)."""


@dataclass
class BlobPayload:
    """A group version ready to be written: a safetensors header plus tensors in file order."""

    header: bytes
    tensors: list[torch.Tensor]
    nbytes: int

    @classmethod
    def build(cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> BlobPayload:
        # Widest dtypes first keeps every tensor aligned to its element size (header is 8-aligned).
        keys = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
        entries: dict[str, dict] = {}
        ordered, offset = [], 0
        for k in keys:
            t = tensors[k]
            dtype = dtype_name(k, t)
            t = t.detach()
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.to("cpu").contiguous()
            n = t.numel() * t.element_size()
            entries[k] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + n]}
            ordered.append(t)
            offset += n
        text = encode_header(entries, dict(sorted(metadata.items())))
        text += b" " * (-len(text) % 8)
        header = struct.pack("<Q", len(text)) + text
        return cls(header, ordered, len(header) + offset)

    @classmethod
    def of_group(cls, tensors: dict[str, torch.Tensor], group: str,
                 coded: dict[str, str] | None = None) -> BlobPayload:
        """A group's tensors as its blob stores them: with 8-bit moments as they are (blob layout
        2), else layout 1. ``coded``: the metadata of tensors ``blob_codec.encode_delta`` coded
        (layout 3)."""
        layout = (BLOB_FORMAT_VERSION_DELTA if coded else
                  BLOB_FORMAT_VERSION_8BIT if has_8bit(tensors) else BLOB_FORMAT_VERSION)
        return cls.build(tensors, {"format": BLOB_FORMAT, "format_version": str(layout), "group": group,
                                   **(coded or {})})

    def chunks(self) -> Iterator[memoryview]:
        yield memoryview(self.header)
        for t in self.tensors:
            raw = tensor_bytes(t)
            for i in range(0, len(raw), CHUNK_BYTES):
                yield raw[i:i + CHUNK_BYTES]

    def digest(self, hash_name: str) -> str:
        h = new_hasher(hash_name)
        for c in self.chunks():
            h.update(c)
        return h.hexdigest()


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def _write_payload(path: Path, payload: BlobPayload, hash_name: str | None) -> str | None:
    """Write ``payload`` to ``path`` (not fsynced: ``BlobBatch`` does); return its digest under
    ``hash_name`` (None: not hashed)."""
    h = new_hasher(hash_name) if hash_name is not None else None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if h is None:
            for c in payload.chunks():
                _write_all(fd, c)
        else:
            # The hashes and os.write release the GIL: hash chunk i while writing it.
            with ThreadPoolExecutor(1) as pool:
                pending = None
                for c in payload.chunks():
                    if pending is not None:
                        pending.result()
                    pending = pool.submit(h.update, c)
                    _write_all(fd, c)
                if pending is not None:
                    pending.result()
    finally:
        os.close(fd)
    return h.hexdigest() if h is not None else None


@dataclass(frozen=True)
class BlobRecord:
    digest: str
    """Hash (the run's) of the blob file's bytes; also its name (content addressing)."""
    nbytes: int
    rel_path: str
    """Path relative to the run directory."""
    written: bool
    """False when an identical blob already existed (deduplicated, nothing written)."""
    base: dict | None = None
    """A delta blob's key frame record (``blob_codec``); None: a whole blob."""


class BlobBatch:
    """The blobs of one save, each fsynced and renamed on a helper thread while the next is written.
    Only after ``finish`` (also on leaving the context) may a manifest name them; on an error, blobs
    already handed over land or fail first, their own errors giving way to it."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-fsync")
        self._futures: list = []
        self.dirs: set[Path] = set()

    def submit(self, tmp: Path, final: Path) -> None:
        def land() -> None:
            try:
                fd = os.open(tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
                final.parent.mkdir(exist_ok=True)
                os.replace(tmp, final)
            except OSError as e:
                _unlink_quiet(tmp)
                raise write_error(e, tmp) from e
        self._futures.append(self._pool.submit(land))
        self.dirs.update((final.parent, final.parent.parent))  # blobs/<aa>/ may be new

    def finish(self) -> None:
        try:
            errors = []
            for f in self._futures:
                try:
                    f.result()
                except BaseException as e:  # keep waiting: no write may outlive the save
                    errors.append(e)
            if errors:
                raise errors[0]
            for d in sorted(self.dirs):
                fsync_dir(d)
        finally:
            self._pool.shutdown(wait=True)

    def __enter__(self) -> BlobBatch:
        return self

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        try:
            self.finish()
        except BaseException:
            if exc_type is None:
                raise


def blob_rel(digest: str) -> str:
    """A blob's path relative to the run directory."""
    return f"blobs/{digest[:2]}/{digest}.safetensors"


def has_blob(root: Path, digest: str, nbytes: int) -> bool:
    """The blob ``digest`` is in the run at ``root``, whole (another process may have written it)."""
    try:
        return (root / blob_rel(digest)).stat().st_size == nbytes
    except FileNotFoundError:
        return False


def put_blob(root: Path, hash_name: str, payload: BlobPayload, maybe_duplicate: bool,
             batch: BlobBatch) -> BlobRecord:
    """Store one group version in the run at ``root`` (``RunDir.put_blob`` says how)."""
    digest = payload.digest(hash_name) if maybe_duplicate else None
    if digest is not None and has_blob(root, digest, payload.nbytes):
        return BlobRecord(digest, payload.nbytes, blob_rel(digest), written=False)
    tmp = root / "tmp" / f"blob-{uuid.uuid4().hex}.tmp"
    try:
        got = _write_payload(tmp, payload, hash_name if digest is None else None)
        digest = digest or got
        assert digest is not None
        if has_blob(root, digest, payload.nbytes):
            tmp.unlink()
            return BlobRecord(digest, payload.nbytes, blob_rel(digest), written=False)
    except OSError as e:
        _unlink_quiet(tmp)
        raise write_error(e, tmp) from e
    batch.submit(tmp, root / blob_rel(digest))
    return BlobRecord(digest, payload.nbytes, blob_rel(digest), written=True)


def _unlink_quiet(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
