"""Checking and cleaning a run directory: what ``RunDir.verify`` and ``RunDir.gc`` report, the
check of one committed step's files against its manifest, and the sweep of unreferenced blobs."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .content_hash import file_digest, manifest_hash
from .shard_ranges import ShardLayoutError, is_sharded, joined_parts, joined_shards, shard_layout


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
        return {"ok": self.ok, **asdict(self)}


@dataclass
class GcReport:
    kept_steps: list[int]
    dropped_steps: list[int]
    removed_blobs: int
    freed_bytes: int

    def to_json(self) -> dict:
        return asdict(self)


def entry_blobs(entry: dict, hash_name: str) -> list[tuple[str, str, int | None]]:
    """``(path, digest, nbytes)`` of every blob a manifest group entry names: its one blob, or
    each of its shards', and the key frame of a delta blob."""
    recs = entry["shards"] if is_sharded(entry) else [entry, *([entry["base"]] if "base" in entry else [])]
    return [(r.get("blob", ""), str(r.get(hash_name)), r.get("nbytes")) for r in recs]


class StepChecker:
    """Checks committed steps' files against their manifests, hashing each blob once for all
    the steps that name it."""

    def __init__(self, root: Path, rep: VerifyReport):
        self.root, self.rep = root, rep
        self._hashed: dict[tuple[str, str], str | None] = {}  # (rel, hash) -> digest (None: missing)

    def check(self, step: int, step_dir: Path, manifest: dict) -> None:
        """Faults of ``step``: a manifest of another step, a bad shard layout, a blob or step
        file missing, of the wrong size or checksum."""
        rep = self.rep
        if manifest.get("step") != step:
            rep.faults.append(f"step {step}: manifest says step {manifest.get('step')}")
        hash_name = manifest_hash(manifest)
        entries = manifest.get("groups", {})
        for layer, parts in joined_parts(entries).items():  # expert slices cover their tensors
            try:
                shard_layout(layer, joined_shards([entries[g] for g in parts]))
            except (ShardLayoutError, KeyError, TypeError) as err:
                rep.faults.append(f"step {step}: expert groups of {layer}: {err}")
        for g, e in entries.items():
            if is_sharded(e) and "slice_of" not in e:
                try:
                    shard_layout(g, e["shards"])
                except ShardLayoutError as err:
                    rep.faults.append(f"step {step}: {err}")
                    continue
            for rel, want, nbytes in entry_blobs(e, hash_name):
                self._check_blob(f"step {step}: group {g}", rel, hash_name, want, nbytes)
        for name, rec in manifest.get("files", {}).items():
            path = step_dir / name
            if not path.is_file():
                rep.faults.append(f"step {step}: {name} is missing")
            elif file_digest(path, hash_name) != rec.get(hash_name):
                rep.faults.append(f"step {step}: {name} checksum mismatch")

    def _check_blob(self, where: str, rel: str, hash_name: str, want: str, nbytes: int | None) -> None:
        if (rel, hash_name) not in self._hashed:
            path = self.root / rel
            if not rel or not path.is_file():
                self._hashed[rel, hash_name] = None
            else:
                self._hashed[rel, hash_name] = file_digest(path, hash_name)
                self.rep.blobs_checked += 1
        got = self._hashed[rel, hash_name]
        if got is None:
            self.rep.faults.append(f"{where}: blob {rel} is missing")
        elif got != want:
            self.rep.faults.append(f"{where}: blob {rel} checksum mismatch "
                                   f"({hash_name} {got[:12]}…, manifest {want[:12]}…)")
        elif (self.root / rel).stat().st_size != nbytes:
            self.rep.faults.append(f"{where}: blob {rel} has the wrong size")


def sweep_blobs(root: Path, needed: set[str]) -> tuple[int, int]:
    """Remove every blob under ``root/blobs`` not in ``needed`` (paths relative to ``root``),
    then empty prefix directories and every temp file; returns (blobs removed, bytes freed)."""
    removed, freed = 0, 0
    blobs = root / "blobs"
    for sub in sorted(blobs.iterdir()) if blobs.is_dir() else []:
        for f in sorted(sub.iterdir()):
            rel = f"blobs/{sub.name}/{f.name}"
            if rel not in needed:
                freed += f.stat().st_size
                f.unlink()
                removed += 1
        if not any(sub.iterdir()):
            sub.rmdir()
    tmp = root / "tmp"
    for f in tmp.iterdir() if tmp.is_dir() else []:
        freed += f.stat().st_size
        f.unlink()
    return removed, freed
