"""The on-disk layer store: content-addressed group blobs, one manifest per step, atomic commits.

Layout of a run directory (the format is documented in ``docs/formats.md``)::

    RUN/format.json                       {"format": "layerwise-ckpt", "format_version": 2,
                                           "hash": "blake3"}
    RUN/config.json                       the model's HF config (written once, if known)
    RUN/blobs/ab/<digest>.safetensors     one group version; named by the hash of its bytes
    RUN/steps/<step:012d>/state.json      non-layer state: scheduler, optimizer hyper-params,
                                          python/numpy RNG, data position, trainer state, extra
    RUN/steps/<step:012d>/rng.safetensors torch CPU/CUDA generator states (uint8 tensors)
    RUN/steps/<step:012d>/manifest.json   every group -> blob, checksum, saved step (written LAST)
    RUN/latest                            the newest committed step (moved after the manifest)
    RUN/tmp/                              temp files of writes in progress (safe to delete when
                                          no save is running)

A step is committed exactly when its ``manifest.json`` exists: every file it names was written
to a temp file, fsynced and renamed into place (and its directory fsynced) before the manifest
itself is written the same way. A crash at any point therefore leaves either the old set of
committed steps or the old set plus the new step, never a half step.

The content hash is the run's: BLAKE3 for runs created as format 2, sha256 for format 1 runs
(which are read, verified and, when saved into again, continued as format 1, so that the
layerwise that wrote them can still read them). Each manifest says which hash its checksums are.

Blob files are plain safetensors, streamed to disk by a small writer here so that a group is
never duplicated in memory to serialise it; the hash is computed on a second thread while the
bytes are written, so hashing costs no extra pass.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import blake3
import torch

from ..util.atomic import atomic_write_bytes, atomic_write_text, fsync_dir
from ..util.safetensors_io import dtype_name, encode_header, tensor_bytes
from .errors import CheckpointCorruptError, CheckpointWriteError
from .shard_ranges import ShardLayoutError, is_sharded, shard_layout

FORMAT = "layerwise-ckpt"
FORMAT_VERSION = 4
"""Written for new runs. Bump on any change a reader of an older version would misread; readers
refuse newer versions. 1: sha256 content addresses; 2: BLAKE3 (``"hash"`` in format.json and in
each manifest; entries carry their digest under the hash's name); 3: blobs may hold 8-bit
moments as codes and scales (blob layout 2, ``ckpt.moments``); runs of format 1 and 2 get fp32
moments, as their readers expect; 4: a group entry may be sharded, one blob per writing rank
(``ckpt.shards``, written by ``ckpt.sharded``)."""

FIRST_VERSION_SHARDED = 4
"""The first run format whose manifests may hold sharded group entries."""

HASH_OF_VERSION = {1: "sha256", 2: "blake3", 3: "blake3", 4: "blake3"}
"""The content hash a run of each format version uses."""

BLAKE3_MAX_THREADS = 1
"""Threads one BLAKE3 hasher may use (the ``blake3`` package's own pool). One: the hash runs on
its own thread beside the writer, which keeps the disk busy; more threads only compete with the
writer's copy into the page cache on a small machine."""

BLOB_FORMAT = "layerwise-group"
BLOB_FORMAT_VERSION = 1
"""The blob's own layout (safetensors, key order, metadata): unchanged by run format 2, so the
same state gives the same blob bytes in runs of either version (only the name differs)."""
BLOB_FORMAT_VERSION_8BIT = 2
"""The layout of a blob that holds 8-bit moments (``ckpt.moments``; runs of format 3 only).
Blobs without them keep layout 1, so fp32 state still gives the same bytes in every run."""
FIRST_VERSION_8BIT = 3
"""The first run format whose blobs may hold 8-bit moments."""
STEP_DIR_DIGITS = 12
CHUNK_BYTES = 1 << 20
"""Write/hash granularity. The hash thread and the write's copy into the page cache read each
chunk at the same time, so a chunk that stays in cache (1 MiB: a core's L2) is read from memory
once, not twice. On the shared 2-core machine (quick ckpt_io state, 4 interleaved rounds under
load 5-6) a save wrote 0.67 GB/s with 1 MiB chunks, 0.33-0.36 with 4 and 32 MiB."""


class Hasher(Protocol):
    """The ``hashlib``-like object of one content hash."""

    def update(self, data, /) -> object: ...

    def hexdigest(self) -> str: ...


def _blake3() -> Hasher:
    return blake3.blake3(max_threads=BLAKE3_MAX_THREADS)


HASHES: dict[str, Callable[[], Hasher]] = {"sha256": hashlib.sha256, "blake3": _blake3}
"""Content hashes by the name a manifest gives them; every one has a 64-hex-digit digest."""


def new_hasher(name: str) -> Hasher:
    try:
        return HASHES[name]()
    except KeyError:
        raise ValueError(f"unknown checkpoint content hash {name!r}; this layerwise knows "
                         f"{sorted(HASHES)}. Upgrade layerwise to read this run.") from None


def digest_bytes(data: bytes | memoryview, hash_name: str) -> str:
    h = new_hasher(hash_name)
    h.update(data)
    return h.hexdigest()


def manifest_hash(manifest: dict) -> str:
    """The content hash of a manifest's checksums: sha256 in format 1, named in format 2."""
    version = int(manifest.get("format_version", 1))
    name = manifest.get("hash", HASH_OF_VERSION.get(version, "sha256"))
    if name not in HASHES:
        raise ValueError(f"manifest of step {manifest.get('step')} uses content hash {name!r}; "
                         f"this layerwise knows {sorted(HASHES)}. Upgrade layerwise to read it.")
    return name


# ----- streaming safetensors writer ---------------------------------------------------------


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


def _write_payload(path: Path, payload: BlobPayload, hash_name: str | None,
                   fsync: bool = True) -> str | None:
    """Write ``payload`` to ``path`` (fsynced unless ``fsync=False``); return its digest under
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
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return h.hexdigest() if h is not None else None


def file_digest(path: Path, hash_name: str) -> str:
    h = new_hasher(hash_name)
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(CHUNK_BYTES)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def entry_blobs(entry: dict, hash_name: str) -> list[tuple[str, str, int | None]]:
    """``(path, digest, nbytes)`` of every blob a manifest group entry names: its one blob, or
    each of its shards' (format 4)."""
    recs = entry["shards"] if is_sharded(entry) else [entry]
    return [(r.get("blob", ""), str(r.get(hash_name)), r.get("nbytes")) for r in recs]


def _json_bytes(obj: object) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=False) + "\n").encode()


# ----- the store --------------------------------------------------------------------------


@dataclass(frozen=True)
class BlobRecord:
    digest: str
    """Hash (the run's) of the blob file's bytes; also its name (content addressing)."""
    nbytes: int
    rel_path: str
    """Path relative to the run directory."""
    written: bool
    """False when an identical blob already existed (deduplicated, nothing written)."""


@dataclass
class VerifyReport:
    faults: list[str] = field(default_factory=list)
    """Anything that makes a committed step unloadable: missing or corrupt files."""
    warnings: list[str] = field(default_factory=list)
    """Harmless leftovers of interrupted saves (temp files, steps without a manifest)."""
    steps: list[int] = field(default_factory=list)
    blobs_checked: int = 0

    @property
    def ok(self) -> bool:
        return not self.faults

    def to_json(self) -> dict:
        return {"ok": self.ok, "faults": self.faults, "warnings": self.warnings,
                "steps": self.steps, "blobs_checked": self.blobs_checked}


@dataclass
class GcReport:
    kept_steps: list[int]
    dropped_steps: list[int]
    removed_blobs: int
    freed_bytes: int

    def to_json(self) -> dict:
        return dict(kept_steps=self.kept_steps, dropped_steps=self.dropped_steps,
                    removed_blobs=self.removed_blobs, freed_bytes=self.freed_bytes)


class BlobBatch:
    """The blobs of one save: each new blob is fsynced and renamed into place on a helper
    thread while the next one is written (the disk works while the CPU fills the page cache).
    ``finish`` waits for all of them and fsyncs their directories; only then may a manifest
    name them."""

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

    def finish_quietly(self) -> None:
        """On an error path: let the blobs already handed over land (or fail), so none is being
        written when the error is reported; their own errors give way to that one."""
        try:
            self.finish()
        except BaseException:
            pass


class RunDir:
    """Reads and writes one run directory. Writers hold the run's lock while they write."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.version = FORMAT_VERSION
        """The run's format version (read from ``format.json`` by ``create`` and ``open``)."""
        self.hash_name = HASH_OF_VERSION[FORMAT_VERSION]
        """The run's content hash: names its blobs and checksums its files."""

    # ----- opening ---------------------------------------------------------------------

    @classmethod
    def create(cls, root: str | Path) -> RunDir:
        """Open ``root`` for writing, creating an empty run if needed."""
        store = cls(root)
        fmt = store.root / "format.json"
        if fmt.exists():
            store._check_format()
        else:
            if store.root.exists() and any(store.root.iterdir()):
                raise ValueError(
                    f"{store.root} exists, is not empty and is not a layerwise checkpoint run "
                    "(no format.json); pick an empty or new directory"
                )
            store.root.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(fmt, _json_bytes({"format": FORMAT, "format_version": FORMAT_VERSION,
                                                 "hash": HASH_OF_VERSION[FORMAT_VERSION]}))
        for sub in ("blobs", "steps", "tmp"):
            (store.root / sub).mkdir(exist_ok=True)
        fsync_dir(store.root)
        return store

    @classmethod
    def open(cls, root: str | Path) -> RunDir:
        """Open an existing run for reading."""
        store = cls(root)
        if not store.root.is_dir():
            raise FileNotFoundError(f"checkpoint run directory {store.root} does not exist")
        store._check_format()
        return store

    def _check_format(self) -> None:
        fmt = self.root / "format.json"
        if not fmt.exists():
            raise FileNotFoundError(
                f"{self.root} is not a layerwise checkpoint run (no format.json); "
                "pass the directory given to Checkpointer(run_dir=...)"
            )
        info = json.loads(fmt.read_text())
        if info.get("format") != FORMAT:
            raise ValueError(f"{fmt}: format {info.get('format')!r} is not {FORMAT!r}")
        version = int(info.get("format_version", -1))
        if version > FORMAT_VERSION or version < 1:
            raise ValueError(
                f"{self.root} has checkpoint format_version {version}; this layerwise reads "
                f"versions 1 to {FORMAT_VERSION}. Upgrade layerwise to read it."
            )
        hash_name = info.get("hash", HASH_OF_VERSION[version])
        if version == 1 and hash_name != "sha256":
            raise ValueError(f"{fmt}: format_version 1 runs are sha256, not {hash_name!r}")
        if hash_name not in HASHES:
            raise ValueError(f"{fmt}: content hash {hash_name!r} is unknown to this layerwise "
                             f"(known: {sorted(HASHES)}); upgrade layerwise to read it")
        self.version, self.hash_name = version, hash_name

    # ----- paths ----------------------------------------------------------------------

    @staticmethod
    def blob_rel(digest: str) -> str:
        return f"blobs/{digest[:2]}/{digest}.safetensors"

    def step_dir(self, step: int) -> Path:
        return self.root / "steps" / f"{step:0{STEP_DIR_DIGITS}d}"

    def manifest_path(self, step: int) -> Path:
        return self.step_dir(step) / "manifest.json"

    def _step_dirs(self) -> list[tuple[int, Path]]:
        d = self.root / "steps"
        if not d.is_dir():
            return []
        out = []
        for p in d.iterdir():
            if p.is_dir() and p.name.isdigit():
                out.append((int(p.name), p))
        return sorted(out)

    def committed_steps(self) -> list[int]:
        """Steps whose manifest exists, ascending."""
        return [s for s, p in self._step_dirs() if (p / "manifest.json").exists()]

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def latest_pointer(self) -> int | None:
        p = self.root / "latest"
        try:
            return int(p.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def read_manifest(self, step: int) -> dict:
        path = self.manifest_path(step)
        if not path.exists():
            steps = self.committed_steps()
            raise FileNotFoundError(
                f"no committed checkpoint for step {step} in {self.root}; committed steps: "
                f"{steps if steps else 'none'}"
            )
        try:
            m = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointCorruptError(f"{path} is not valid JSON: {e}") from None
        version = int(m.get("format_version", -1))
        if version > FORMAT_VERSION:
            raise ValueError(f"{path} has format_version {version} > {FORMAT_VERSION}; upgrade layerwise")
        manifest_hash(m)  # a hash this layerwise cannot check is refused here, not at load
        return m

    def read_config(self) -> dict | None:
        p = self.root / "config.json"
        return json.loads(p.read_text()) if p.exists() else None

    # ----- locking ----------------------------------------------------------------------

    @contextmanager
    def lock(self, blocking: bool = True) -> Iterator[None]:
        """Exclusive writer lock of the run (saves, gc). Non-blocking raises if held."""
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                raise ValueError(
                    f"{self.root} is being written by another process (a save or gc is running); "
                    "retry when it has finished"
                ) from None
            yield
        finally:
            os.close(fd)  # closing releases the flock

    # ----- writing (caller holds the lock) ----------------------------------------------

    def write_config(self, config: dict) -> None:
        atomic_write_bytes(self.root / "config.json", _json_bytes(config))

    def put_blob(self, payload: BlobPayload, maybe_duplicate: bool = False,
                 batch: BlobBatch | None = None) -> BlobRecord:
        """Store one group version; an identical existing blob is reused (nothing written).

        ``maybe_duplicate`` hashes first (a memory pass) and skips the write on a hit: right for
        groups believed unchanged (frozen layers). Otherwise the hash is computed while writing.
        With a ``batch``, the fsync and rename happen on its thread (``batch.finish()`` before the
        manifest); without, before returning.
        """
        digest = payload.digest(self.hash_name) if maybe_duplicate else None
        if digest is not None and self._has_blob(digest, payload.nbytes):
            return BlobRecord(digest, payload.nbytes, self.blob_rel(digest), written=False)
        tmp = self.root / "tmp" / f"blob-{uuid.uuid4().hex}.tmp"
        try:
            got = _write_payload(tmp, payload, self.hash_name if digest is None else None,
                                 fsync=batch is None)
            digest = digest or got
            assert digest is not None
            if self._has_blob(digest, payload.nbytes):
                tmp.unlink()
                return BlobRecord(digest, payload.nbytes, self.blob_rel(digest), written=False)
            final = self.root / self.blob_rel(digest)
            if batch is None:
                final.parent.mkdir(exist_ok=True)
                os.replace(tmp, final)
        except OSError as e:
            _unlink_quiet(tmp)
            raise write_error(e, tmp) from e
        if batch is not None:
            batch.submit(tmp, final)
        else:
            fsync_dir(final.parent)
            fsync_dir(final.parent.parent)  # blobs/<aa>/ may be new
        return BlobRecord(digest, payload.nbytes, self.blob_rel(digest), written=True)

    def _has_blob(self, digest: str, nbytes: int) -> bool:
        p = self.root / self.blob_rel(digest)
        try:
            return p.stat().st_size == nbytes
        except FileNotFoundError:
            return False

    def write_step_file(self, step: int, name: str, data: bytes) -> dict:
        """Write one per-step file atomically; return its manifest record."""
        path = self.step_dir(step) / name
        try:
            atomic_write_bytes(path, data)
        except OSError as e:
            raise write_error(e, path) from e
        return {self.hash_name: digest_bytes(data, self.hash_name), "nbytes": len(data)}

    def commit(self, step: int, manifest: dict) -> None:
        """Make ``step`` committed: write the manifest, then move ``latest``. Every file the
        manifest names must already be durable (``BlobBatch.finish``)."""
        try:
            atomic_write_bytes(self.manifest_path(step), _json_bytes(manifest))
            fsync_dir(self.step_dir(step).parent)
        except OSError as e:
            raise write_error(e, self.manifest_path(step)) from e
        try:
            newest = self.latest_step()
            if newest is not None:
                atomic_write_text(self.root / "latest", f"{newest}\n")
        except OSError:
            pass  # the commit stands; ``latest`` is a hint and readers fall back to the manifests

    # ----- checking and cleaning ----------------------------------------------------------

    def verify(self, steps: list[int] | None = None) -> VerifyReport:
        """Check every committed step (or ``steps``): files present, sizes and checksums (each
        manifest's hash: sha256 in format 1, BLAKE3 in format 2) match."""
        rep = VerifyReport()
        hashed: dict[tuple[str, str], str | None] = {}  # (rel path, hash) -> digest (None: missing)
        committed = self.committed_steps()
        for step, p in self._step_dirs():
            if not (p / "manifest.json").exists():
                rep.warnings.append(f"step {step}: no manifest (an interrupted save; not committed)")
        tmp = self.root / "tmp"
        if tmp.is_dir():
            n = sum(1 for _ in tmp.iterdir())
            if n:
                rep.warnings.append(f"{n} temp file(s) in tmp/ from interrupted or running saves")
        pointer = self.latest_pointer()
        if committed and pointer is not None and pointer not in committed:
            rep.faults.append(f"latest points to step {pointer}, which has no manifest")
        elif committed and pointer != committed[-1]:
            rep.warnings.append(f"latest is {pointer}, newest committed step is {committed[-1]}")
        for step in committed if steps is None else steps:
            rep.steps.append(step)
            try:
                m = self.read_manifest(step)
            except (CheckpointCorruptError, FileNotFoundError, ValueError) as e:
                rep.faults.append(f"step {step}: {e}")
                continue
            if m.get("step") != step:
                rep.faults.append(f"step {step}: manifest says step {m.get('step')}")
            hash_name = manifest_hash(m)
            for g, e in m.get("groups", {}).items():
                if is_sharded(e):
                    try:
                        shard_layout(g, e["shards"])
                    except ShardLayoutError as err:
                        rep.faults.append(f"step {step}: {err}")
                        continue
                for rel, want, nbytes in entry_blobs(e, hash_name):
                    if (rel, hash_name) not in hashed:
                        path = self.root / rel
                        if not rel or not path.is_file():
                            hashed[rel, hash_name] = None
                        else:
                            hashed[rel, hash_name] = file_digest(path, hash_name)
                            rep.blobs_checked += 1
                    got = hashed[rel, hash_name]
                    if got is None:
                        rep.faults.append(f"step {step}: group {g}: blob {rel} is missing")
                    elif got != want:
                        rep.faults.append(f"step {step}: group {g}: blob {rel} checksum mismatch "
                                          f"({hash_name} {got[:12]}…, manifest {want[:12]}…)")
                    elif (self.root / rel).stat().st_size != nbytes:
                        rep.faults.append(f"step {step}: group {g}: blob {rel} has the wrong size")
            for name, rec in m.get("files", {}).items():
                path = self.step_dir(step) / name
                if not path.is_file():
                    rep.faults.append(f"step {step}: {name} is missing")
                elif file_digest(path, hash_name) != rec.get(hash_name):
                    rep.faults.append(f"step {step}: {name} checksum mismatch")
        return rep

    def uncommit(self, step: int) -> None:
        """Remove ``step``'s manifest durably, so nothing treats it as committed any more.

        ``latest`` is moved off ``step`` first (to the newest other committed step, or removed):
        after a crash at any point it names a committed step, or lags behind the newest one."""
        manifest = self.manifest_path(step)
        if not manifest.exists():
            return
        if self.latest_pointer() == step:
            older = [s for s in self.committed_steps() if s != step]
            if older:
                atomic_write_text(self.root / "latest", f"{older[-1]}\n")
            else:
                (self.root / "latest").unlink()
                fsync_dir(self.root)
        try:
            manifest.unlink()
        except FileNotFoundError:
            return
        fsync_dir(self.step_dir(step))

    def gc(self, keep: int) -> GcReport:
        """Keep the newest ``keep`` committed steps; drop the rest and every unreferenced blob."""
        if keep < 1:
            raise ValueError(f"--keep must be at least 1 (got {keep}); gc never drops every step")
        with self.lock(blocking=False):
            committed = self.committed_steps()
            kept, dropped = committed[-keep:], committed[:-keep]
            for step in dropped:
                # Uncommit first (manifest), then remove the rest: a crash leaves only garbage.
                self.uncommit(step)
            for step, p in self._step_dirs():
                if step not in kept:
                    shutil.rmtree(p, ignore_errors=True)
            needed = set()
            for step in kept:
                m = self.read_manifest(step)
                needed.update(rel for e in m["groups"].values()
                              for rel, _, _ in entry_blobs(e, manifest_hash(m)))
            removed, freed = 0, 0
            blobs = self.root / "blobs"
            for sub in sorted(blobs.iterdir()) if blobs.is_dir() else []:
                for f in sorted(sub.iterdir()):
                    rel = f"blobs/{sub.name}/{f.name}"
                    if rel not in needed:
                        freed += f.stat().st_size
                        f.unlink()
                        removed += 1
                if not any(sub.iterdir()):
                    sub.rmdir()
            tmp = self.root / "tmp"
            for f in tmp.iterdir() if tmp.is_dir() else []:
                freed += f.stat().st_size
                f.unlink()
            if kept:
                atomic_write_text(self.root / "latest", f"{kept[-1]}\n")
        return GcReport(kept, dropped, removed, freed)


def _unlink_quiet(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def write_error(e: OSError, path: Path) -> CheckpointWriteError:
    why = {
        errno.ENOSPC: "the disk is full",
        errno.EFBIG: "the file size limit was reached (ulimit -f / RLIMIT_FSIZE)",
        errno.EDQUOT: "the disk quota is exhausted",
    }.get(e.errno or 0, e.strerror or str(e))
    return CheckpointWriteError(
        f"checkpoint write to {path} failed: {why}. Nothing of this save was committed; the "
        "previous committed checkpoint is intact. Free space (e.g. `layerwise ckpt gc RUN --keep K`) "
        "or save elsewhere, then retry."
    )


def now_unix_s() -> float:
    return round(time.time(), 3)
