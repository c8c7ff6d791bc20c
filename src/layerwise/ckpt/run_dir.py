"""The on-disk layer store: content-addressed group blobs, one manifest per step, atomic commits.

Layout and format: ``docs/formats.md``. A step is committed exactly when its ``manifest.json``
exists; every file it names is fsynced and renamed into place first, so a crash leaves either
the old committed steps or those plus the new one, never a half step."""


from __future__ import annotations

import json
import shutil
from contextlib import AbstractContextManager
from pathlib import Path

from ..util.atomic import atomic_write_bytes, atomic_write_text, fsync_dir
from .blob_store import BlobBatch, BlobPayload, BlobRecord, put_blob
from .content_hash import CONTENT_HASH, digest_bytes, manifest_hash
from .errors import CheckpointCorruptError, write_error
from .run_format import json_bytes, locate_run, read_format, refuse_version, write_format
from .run_lock import run_lock
from .run_upkeep import GcReport, StepChecker, VerifyReport, entry_blobs, sweep_blobs

STEP_DIR_DIGITS = 12


class RunDir:
    """Reads and writes one run directory. Writers hold the run's lock while they write."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.hash_name = CONTENT_HASH
        """The run's content hash: names its blobs and checksums its files."""

    # ----- opening ---------------------------------------------------------------------

    @classmethod
    def create(cls, root: str | Path) -> RunDir:
        """Open ``root`` for writing, creating an empty run if needed."""
        store = cls(root)
        if (store.root / "format.json").exists():
            read_format(store.root)
        else:
            if store.root.exists() and any(store.root.iterdir()):
                raise ValueError(
                    f"{store.root} exists, is not empty and is not a layerwise checkpoint run "
                    "(no format.json); pick an empty or new directory"
                )
            store.root.mkdir(parents=True, exist_ok=True)
            write_format(store.root)
        for sub in ("blobs", "steps", "tmp"):
            (store.root / sub).mkdir(exist_ok=True)
        fsync_dir(store.root)
        return store

    @classmethod
    def open(cls, root: str | Path) -> RunDir:
        """Open an existing run for reading: ``root``, or the run in its ``ckpt/`` (a
        ``layerwise train`` out_dir; ``run_format.locate_run``)."""
        store = cls(locate_run(root))
        if not store.root.is_dir():
            raise FileNotFoundError(f"checkpoint run directory {store.root} does not exist")
        read_format(store.root)
        return store

    # ----- paths ----------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return self.root / "steps" / f"{step:0{STEP_DIR_DIGITS}d}"

    def manifest_path(self, step: int) -> Path:
        return self.step_dir(step) / "manifest.json"

    def _step_dirs(self) -> list[tuple[int, Path]]:
        d = self.root / "steps"
        return sorted((int(p.name), p) for p in (d.iterdir() if d.is_dir() else [])
                      if p.is_dir() and p.name.isdigit())

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
        refuse_version(m.get("format_version"), path)
        manifest_hash(m)  # a hash this layerwise cannot check is refused here, not at load
        return m

    def read_config(self) -> dict | None:
        p = self.root / "config.json"
        return json.loads(p.read_text()) if p.exists() else None

    def lock(self, blocking: bool = True) -> AbstractContextManager[None]:
        """Exclusive writer lock of the run (saves, gc). Non-blocking raises if held."""
        return run_lock(self.root, blocking)

    # ----- writing (caller holds the lock) ----------------------------------------------

    def write_config(self, config: dict) -> None:
        atomic_write_bytes(self.root / "config.json", json_bytes(config))

    def put_blob(self, payload: BlobPayload, maybe_duplicate: bool,
                 batch: BlobBatch) -> BlobRecord:
        """Store one group version; an identical existing blob is reused (nothing written).
        ``maybe_duplicate``: hash first and skip a hit (for groups believed unchanged). The fsync
        and rename run on ``batch``'s thread."""
        return put_blob(self.root, self.hash_name, payload, maybe_duplicate, batch)

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
            atomic_write_bytes(self.manifest_path(step), json_bytes(manifest))
            fsync_dir(self.step_dir(step).parent)
        except OSError as e:
            raise write_error(e, self.manifest_path(step)) from e
        try:
            newest = self.latest_step()
            if newest is not None:
                atomic_write_text(self.root / "latest", f"{newest}\n")
        except OSError:
            pass  # the commit stands; ``latest`` is a hint and readers fall back to the manifests

    def uncommit(self, step: int) -> None:
        """Remove ``step``'s manifest durably; ``latest`` moves off it first, so after a crash it
        names a committed step (or lags behind the newest)."""
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

    # ----- checking and cleaning ----------------------------------------------------------

    def verify(self, steps: list[int] | None = None) -> VerifyReport:
        """Check every committed step (or ``steps``): files present, sizes and checksums (each
        manifest's hash) match."""
        rep = VerifyReport()
        committed = self.committed_steps()
        # what interrupted saves leave: step directories without a manifest, temp files
        rep.warnings += [f"step {step}: no manifest (an interrupted save; not committed)"
                         for step, p in self._step_dirs() if not (p / "manifest.json").exists()]
        n_tmp = sum(1 for _ in (self.root / "tmp").iterdir()) if (self.root / "tmp").is_dir() else 0
        if n_tmp:
            rep.warnings.append(f"{n_tmp} temp file(s) in tmp/ from interrupted or running saves")
        pointer = self.latest_pointer()
        if committed and pointer is not None and pointer not in committed:
            rep.faults.append(f"latest points to step {pointer}, which has no manifest")
        elif committed and pointer != committed[-1]:
            rep.warnings.append(f"latest is {pointer}, newest committed step is {committed[-1]}")
        checker = StepChecker(self.root, rep)
        for step in committed if steps is None else steps:
            rep.steps.append(step)
            try:
                m = self.read_manifest(step)
            except (CheckpointCorruptError, FileNotFoundError, ValueError) as e:
                rep.faults.append(f"step {step}: {e}")
                continue
            checker.check(step, self.step_dir(step), m)
        return rep

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
            removed, freed = sweep_blobs(self.root, needed)
            if kept:
                atomic_write_text(self.root / "latest", f"{kept[-1]}\n")
        return GcReport(kept, dropped, removed, freed)
