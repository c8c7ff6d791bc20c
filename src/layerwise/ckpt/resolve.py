"""Resolve a run directory at a step into a complete state, group by group.

The state at step N is the newest version <= N of every group, which the manifest of the newest
committed step <= N already lists. Readers go group by group (peak memory: one group); sharded
and expert-slice entries are joined so readers see whole layer groups (``entries`` keeps the
stored ones), and ``group_reader`` reads only a rank's elements, so N ranks' saves load at M."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from .blob_codec import blob_metadata, decode
from .blob_store import blob_rel
from .content_hash import digest_bytes, manifest_hash
from .errors import CheckpointCorruptError
from .run_dir import RunDir
from .shard_ranges import (ShardedGroupReader, ShardLayoutError, is_sharded, joined_parts,
                           joined_shards)
from .provider import rng_dict


@dataclass(frozen=True)
class GroupEntry:
    """One group's version in a resolved step."""

    group: str
    blob: str
    """Blob path relative to the run directory ("" for a sharded group)."""
    blob_path: Path
    digest: str
    """The blob's checksum (and name) under ``hash_name`` ("" for a sharded group)."""
    hash_name: str
    """The manifest's content hash (``blake3``)."""
    nbytes: int
    """Bytes of the blob (of a sharded group: of all its shard blobs)."""
    saved_step: int
    """The newest step whose state of this group is this blob (written or confirmed identical)."""
    written_step: int
    """The step at which these bytes were first written."""
    shards: tuple[dict, ...] | None = None
    """A sharded group's shard records (``ckpt.shard_ranges``); None: one blob."""
    slice_of: str | None = None
    """The layer group an expert group's slices belong to; None: a group of its own."""


class ResolvedStep:
    """The complete state of a layer-wise run at one committed step (a ``CheckpointSource``)."""

    def __init__(self, store: RunDir, step: int, requested_step: int | None = None):
        self.store = store
        self.run_dir = store.root
        self.step = step
        self.requested_step = step if requested_step is None else requested_step
        self.manifest = store.read_manifest(step)
        self.hash_name = manifest_hash(self.manifest)
        self.entries: dict[str, GroupEntry] = {
            g: self._entry(g, e) for g, e in self.manifest["groups"].items()}
        self.parts: dict[str, list[str]] = joined_parts(self.manifest["groups"])
        """Layer group -> its expert groups (layers saved with ``ckpt.expert_groups``)."""
        self._state: dict | None = None

    def _entry(self, group: str, e: dict) -> GroupEntry:
        saved = int(e["saved_step"])
        common = dict(group=group, hash_name=self.hash_name, saved_step=saved,
                      written_step=int(e.get("written_step", saved)))
        if is_sharded(e):
            shards = tuple(e["shards"])
            return GroupEntry(blob="", blob_path=self.store.root, digest="", shards=shards,
                              nbytes=sum(int(s["nbytes"]) for s in shards),
                              slice_of=e.get("slice_of"), **common)
        return GroupEntry(blob=e["blob"], blob_path=self.store.root / e["blob"],
                          digest=e[self.hash_name], nbytes=int(e["nbytes"]), **common)

    # ----- CheckpointSource -------------------------------------------------------------

    def groups(self) -> list[str]:
        """The groups as a reader sees them: a layer's expert groups joined into the layer."""
        return [g for g, e in self.entries.items() if e.slice_of is None]

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        """The group's tensors in blob keys, after checking the blob's checksum (of a sharded
        group: every shard's, and that the shards cover each tensor exactly; of a layer with
        expert groups: its part's and every expert slice's, joined into whole tensors)."""
        e = self._get(group)
        if e.shards is not None or group in self.parts:
            return self.group_reader(group).assemble()
        return load_blob(e.blob_path, e.digest, e.nbytes, e.hash_name)

    def group_reader(self, group: str) -> ShardedGroupReader | WholeGroupReader | JoinedGroupReader:
        """Reads parts of ``group``'s tensors (``keys()``, ``read(key, start, stop)``): of a
        sharded group, only the shards that hold the elements asked for."""
        e = self._get(group)
        if group in self.parts:
            base = self._plain_reader(group, e)
            parts = [self.manifest["groups"][g] for g in self.parts[group]]
            return JoinedGroupReader(group, base, ShardedGroupReader(
                group, joined_shards(parts), self._load_shard))
        return self._plain_reader(group, e)

    def _plain_reader(self, group: str, e: GroupEntry) -> ShardedGroupReader | WholeGroupReader:
        if e.shards is None:
            return WholeGroupReader(load_blob(e.blob_path, e.digest, e.nbytes, e.hash_name))
        return ShardedGroupReader(group, list(e.shards), self._load_shard)

    def _load_shard(self, rec: dict) -> dict[str, torch.Tensor]:
        return load_blob(self.store.root / rec["blob"], rec[self.hash_name], int(rec["nbytes"]),
                         self.hash_name)

    def _get(self, group: str) -> GroupEntry:
        e = self.entries.get(group)
        if e is None:
            raise ValueError(f"step {self.step} has no group {group!r}; groups: {self.groups()}")
        if e.slice_of is not None:
            raise ValueError(f"{group!r} is a slice of {e.slice_of!r}: read {e.slice_of!r}, which "
                             "joins the newest version of each of its experts")
        return e

    def model_config(self) -> dict | None:
        return self.store.read_config()

    def extra_state(self) -> dict:
        st = self.state()
        return {
            "step": self.step,
            "scheduler": st.get("scheduler"),
            "rng": rng_dict(st.get("rng"), self._rng_tensors()),
            "trainer_state": st.get("trainer_state"),
            "optimizer_param_groups": st.get("optimizer_param_groups"),
            "data_position": st.get("data_position"),
            "extra": st.get("extra"),
        }

    @property
    def policy(self) -> str | None:
        return self.manifest.get("policy")

    def state(self) -> dict:
        """The step's ``state.json`` (checksum-verified)."""
        if self._state is None:
            data = self._read_step_file("state.json")
            self._state = json.loads(data) if data is not None else {}
        return self._state

    def _rng_tensors(self) -> dict[str, torch.Tensor]:
        data = self._read_step_file("rng.safetensors")
        return st_load(data) if data is not None else {}

    def _read_step_file(self, name: str) -> bytes | None:
        rec = self.manifest.get("files", {}).get(name)
        if rec is None:
            return None
        path = self.store.step_dir(self.step) / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise CheckpointCorruptError(f"step {self.step}: {path} is missing") from None
        if digest_bytes(data, self.hash_name) != rec.get(self.hash_name):
            raise CheckpointCorruptError(
                f"step {self.step}: {path} does not match its checksum in the manifest (corrupt "
                "file); load an earlier step or restore the file"
            )
        return data

    def older_groups(self) -> dict[str, int]:
        """The groups whose newest saved state is older than the step (a composite: a selective
        policy skipped them since), each with the step it is from; empty: every group is the
        step's own."""
        return {g: e.saved_step for g, e in self.entries.items() if e.saved_step < self.step}


def composite_text(step: int, older: dict[str, int], total: int) -> str | None:
    """One line saying that step ``step`` is a composite (``older``: group -> saved step, of
    ``total`` groups); None when it is not."""
    if not older:
        return None
    shown = ", ".join(f"{g} @ {s}" for g, s in list(older.items())[:6])
    more = f", … ({len(older) - 6} more)" if len(older) > 6 else ""
    return (f"step {step} is a composite: {len(older)} of {total} groups are older versions "
            f"({shown}{more}); a save with ckpt.policy=full, or a run's last save, holds every "
            "group at its step")


class WholeGroupReader:
    """``ShardedGroupReader``'s reading interface over a group stored as one blob."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def keys(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(t.shape), t.dtype) for k, t in self.tensors.items()}

    def read(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        flat = self.tensors[key].reshape(-1)
        stop = flat.numel() if stop is None else stop
        if not 0 <= start <= stop <= flat.numel():
            raise ValueError(f"{key}: range [{start}, {stop}) is outside its {flat.numel()} elements")
        return flat[start:stop].clone()


class JoinedGroupReader:
    """A layer saved with expert groups, read as one group: its non-expert part's tensors and,
    for the fused tensors, its experts' slices (which must cover each of them exactly)."""

    def __init__(self, group: str, base: ShardedGroupReader | WholeGroupReader,
                 experts: ShardedGroupReader):
        self.group, self.base, self.experts = group, base, experts
        both = sorted(set(base.keys()) & set(experts.keys()))
        if both:
            raise ShardLayoutError(f"group {group!r}: {both[:3]} are stored both in the layer's "
                                   "part and in its expert slices")

    def keys(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {**self.base.keys(), **self.experts.keys()}

    def read(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        reader = self.experts if key in self.experts.layout else self.base
        return reader.read(key, start, stop)

    def assemble(self) -> dict[str, torch.Tensor]:
        return {k: self.read(k).reshape(shape) for k, (shape, _) in self.keys().items()}


def load_blob(path: Path, digest: str, nbytes: int | None,
              hash_name: str) -> dict[str, torch.Tensor]:
    """Read a blob, verify its size and checksum (``digest`` under ``hash_name``), and
    deserialise it (safetensors; no pickle); a delta blob's weights are rebuilt from its key
    frame, verified the same way (``blob_codec``)."""
    tensors, meta = _read_blob(Path(path), digest, nbytes, hash_name)
    root = Path(path).parents[2]  # RUN/blobs/<aa>/<digest>.safetensors
    return decode(tensors, meta, hash_name,
                  lambda d: _read_blob(root / blob_rel(d), d, None, hash_name))


def _read_blob(path: Path, digest: str, nbytes: int | None,
               hash_name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorruptError(f"blob {path} is missing; run `layerwise ckpt verify`") from None
    if (nbytes is not None and len(data) != nbytes) or digest_bytes(data, hash_name) != digest:
        raise CheckpointCorruptError(
            f"blob {path} does not match its checksum (corrupt or truncated file); the run cannot "
            "be loaded at this step. `layerwise ckpt verify RUN` lists every affected step; load "
            "an unaffected one with --step."
        )
    return st_load(data), blob_metadata(data)


def open_run_step(run_dir: str | Path, step: int | None = None) -> ResolvedStep:
    """The state of a run at ``step`` (default: the newest committed step).

    A step that was not checkpointed resolves to the newest committed step before it."""
    store = RunDir.open(run_dir)
    steps = store.committed_steps()
    if not steps:
        raise FileNotFoundError(f"{store.root} has no committed checkpoint yet")
    if step is None:
        return ResolvedStep(store, steps[-1])
    older = [s for s in steps if s <= step]
    if not older:
        raise ValueError(
            f"{store.root} has no checkpoint at or before step {step}; the first committed step "
            f"is {steps[0]}"
        )
    return ResolvedStep(store, older[-1], requested_step=step)
