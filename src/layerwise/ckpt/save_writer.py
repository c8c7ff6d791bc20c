"""The write of one ``Checkpointer`` save, on the writer thread, from host snapshots only, in the
commit order of ``docs/formats.md``. With several writers rank 0 holds the run's lock from before
any rank writes until the commit, so ``ckpt gc`` never removes a blob a coming manifest names."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from .blob_codec import KeyFrame, encode_delta, moments_8bit, read_key_frame
from .blob_store import BlobBatch, BlobPayload, BlobRecord, blob_rel, has_blob
from .collective import RankExchange
from .commit import ManifestHeader, commit_step, written_step
from .errors import CheckpointError, write_error
from ..models.names import joined_group
from .provider import PARAM
from .run_dir import RunDir
from .shard_ranges import is_sharded
from .step_state import StepState

DuplicateHint = bool | dict[str, torch.Tensor]
"""May a snapshot be byte-identical to its committed version? True/False, or the committed
version's weights, compared on the writer thread (off the critical path)."""


@dataclass(frozen=True)
class WriteJob:
    """Everything one save writes, fixed before the write starts."""

    step: int
    header: ManifestHeader
    """The manifest's save index, policy, tied flag."""
    groups: list[str]
    """Every group of the model, in model order."""
    selected: list[str]
    """The groups this save writes (on every rank: all ranks' share)."""
    snaps: Mapping[str, dict[str, torch.Tensor]]
    """This rank's chosen groups, as the blobs store them."""
    maybe_dup: dict[str, DuplicateHint]
    committed: dict[str, dict]
    """Every group's committed manifest entry before this save (the entry of a group not saved
    now)."""
    step_state: StepState | None
    """The step's files; rank 0's only (None on the other ranks)."""
    config: dict | None
    """The model's config, for a run that has no ``config.json`` yet (rank 0)."""
    slices: Mapping[str, dict[str, dict]] = field(default_factory=dict)
    """Chosen expert groups (``ckpt.expert_groups``): the ``tensors`` record of their one shard,
    their ranges in the layer's fused tensors (rank 0)."""
    encoding: str = "plain"
    """``CheckpointConfig.encoding``: ``delta`` codes fp32 weights against a key frame,
    ``moments8`` stores fp32 moments 8-bit (``ckpt.blob_codec``)."""


@dataclass(frozen=True)
class WriteResult:
    """What a finished write tells its checkpointer."""

    write_s: float
    written: list[str]
    """Groups whose bytes were new (of this rank's, on a rank that does not commit)."""
    bytes_written: int | None
    """New blob bytes plus the step's files and manifest (None: another rank committed)."""
    entries: dict[str, dict] | None
    """The committed manifest's group entries (None: another rank committed)."""


class SaveWriter:
    """Writes saves of one checkpointer into its run, joined to the other ranks' writers."""

    def __init__(self, store: RunDir, exchange: RankExchange):
        self.store, self.exchange = store, exchange

    def run(self, job: WriteJob) -> WriteResult:
        t0 = time.perf_counter()
        store, ex = self.store, self.exchange
        try:
            with store.lock() if ex.rank == 0 else nullcontext():
                ex.barrier()
                if job.config is not None:
                    store.write_config(job.config)
                try:
                    own = self._write_blobs(job)
                except Exception as e:
                    if ex.world_size > 1:  # rank 0 gives up now, not at the timeout
                        ex.gather(f"rank {ex.rank}: {e}")
                    raise
                records = self._gather_records(job, own)
                if records is None:  # another rank's share: rank 0 commits
                    return WriteResult(time.perf_counter() - t0,
                                       [g for g, r in own.items() if r.written], None, None)
                groups, written, blob_bytes = self._entries(job, records)
                assert job.step_state is not None
                manifest = commit_step(store, job.step, job.header, job.step_state, groups,
                                       written, blob_bytes)
        except CheckpointError:
            raise
        except OSError as e:
            raise write_error(e, store.root) from e
        return WriteResult(time.perf_counter() - t0, written, manifest["bytes_written"], groups)

    def _write_blobs(self, job: WriteJob) -> dict[str, BlobRecord]:
        """Store this rank's snapshots as blobs, in model order; return their records when all
        new blobs and their directories are durable."""
        records: dict[str, BlobRecord] = {}
        with BlobBatch() as batch:
            for g in job.groups:
                if g in job.snaps:
                    records[g] = self._put_group(job, g, batch)
        return records

    def _put_group(self, job: WriteJob, g: str, batch: BlobBatch) -> BlobRecord:
        """One group's blob: delta-coded against its key frame when the job asks for it and
        the delta pays (``blob_codec``), else whole. A group that may be unchanged is looked
        up whole first, so an unchanged key frame is reused, not coded against itself."""
        store, maybe_dup = self.store, _maybe_duplicate(job, g)
        tensors = job.snaps[g]
        if "moments8" in job.encoding:
            tensors = moments_8bit(tensors)
        plain = BlobPayload.of_group(tensors, g)
        base = self._key_frame(job, g)
        if base is None:
            return store.put_blob(plain, maybe_dup, batch)
        if maybe_dup:
            digest = plain.digest(store.hash_name)
            if has_blob(store.root, digest, plain.nbytes):
                return BlobRecord(digest, plain.nbytes, blob_rel(digest), written=False)
        try:
            key = read_key_frame(store.root / base.rel)
        except OSError:  # gone (never, while the manifest naming it is kept): a new key frame
            return store.put_blob(plain, False, batch)
        coded = encode_delta(tensors, key, base, store.hash_name)
        if coded is None:
            return store.put_blob(plain, False, batch)
        payload = BlobPayload.of_group(coded[0], g, coded=coded[1])
        rec = store.put_blob(payload, maybe_dup, batch)
        return replace(rec, base=base.record(store.hash_name))

    def _key_frame(self, job: WriteJob, g: str) -> KeyFrame | None:
        """The whole blob a new version of ``g`` may be coded against: its committed entry's key
        frame, or that entry's blob when it is whole; None when not coding or none is."""
        prev = job.committed.get(g)
        if "delta" not in job.encoding or prev is None or g in job.slices or is_sharded(prev):
            return None
        rec = prev.get("base") or prev
        return KeyFrame(rec["blob"], rec[self.store.hash_name], int(rec["nbytes"]))

    def _gather_records(self, job: WriteJob,
                        own: dict[str, BlobRecord]) -> dict[str, BlobRecord] | None:
        """Every rank's records on rank 0 (None elsewhere), once every rank's blobs are
        durable. A rank that failed sent its error instead: rank 0 then commits nothing."""
        everyone = self.exchange.gather(own)
        if everyone is None:
            return None
        failed = [x for x in everyone if isinstance(x, str)]
        if failed:
            raise CheckpointError(
                f"checkpoint of step {job.step}: another rank could not write its groups "
                f"({'; '.join(failed)}). Nothing of this save was committed; the previous "
                "committed checkpoint is intact.")
        records = {g: r for part in everyone for g, r in part.items()}
        unseen = [r.rel_path for part in everyone[1:] for r in part.values()
                  if not has_blob(self.store.root, r.digest, r.nbytes)]
        if unseen:  # written by a rank on another machine into a directory of its own
            raise CheckpointError(
                f"checkpoint of step {job.step}: blobs other ranks wrote are not in "
                f"{self.store.root} ({unseen[:3]}): the run directory must be on a "
                "filesystem every writing rank sees. Nothing of this save was committed.")
        missing = [g for g in job.selected if g not in records]
        if missing:
            raise CheckpointError(
                f"checkpoint of step {job.step}: no rank wrote {missing[:5]} (each group needs "
                "a rank whose mine= includes it). Nothing of this save was committed.")
        return records

    def _entries(self, job: WriteJob,
                 records: dict[str, BlobRecord]) -> tuple[dict[str, dict], list[str], int]:
        """The manifest entry of every group (the committed one for groups not saved now), the
        groups whose bytes were new, and their bytes."""
        hash_name = self.store.hash_name
        groups: dict[str, dict] = {}
        written, nbytes = [], 0
        for g in job.groups:
            rec = records.get(g)
            if rec is None:
                groups[g] = job.committed[g]
                continue
            prev = job.committed.get(g)
            prev_digest = None if prev is None else (
                prev["shards"][0].get(hash_name) if "slice_of" in prev else prev.get(hash_name))
            same_bytes = prev_digest == rec.digest and not rec.written
            where = {"blob": rec.rel_path, hash_name: rec.digest, "nbytes": rec.nbytes,
                     **({"base": rec.base} if rec.base is not None else {})}
            if g in job.slices:  # an expert's slices of its layer's fused tensors
                where = {"shards": [{**where, "tensors": job.slices[g]}],
                         "slice_of": joined_group(g), "nbytes": rec.nbytes}
            groups[g] = {**where, "saved_step": job.step, "saved_index": job.header.save_index,
                         "written_step": written_step(prev, same_bytes, job.step)}
            if rec.written:
                written.append(g)
                nbytes += rec.nbytes
        return groups, written, nbytes


def _maybe_duplicate(job: WriteJob, group: str) -> bool:
    hint = job.maybe_dup[group]
    if isinstance(hint, bool):
        return hint
    snap = job.snaps[group]  # hint: the previous version's weights; equal -> maybe identical
    return all(torch.equal(snap[PARAM + n], ref) for n, ref in hint.items() if PARAM + n in snap)


def duplicate_hints(snaps: Mapping[str, dict[str, torch.Tensor]], change_of: dict[str, float],
                    reference: Callable[[str], dict[str, torch.Tensor] | None]
                    ) -> dict[str, DuplicateHint]:
    """Per snapshot: may it be byte-identical to its last version (then it is hashed before
    writing)? Measured unchanged, or unmeasured and equal to its ``reference`` (compared off the
    critical path)."""
    hints: dict[str, DuplicateHint] = {}
    for g in snaps:
        if math.isnan(change_of[g]):
            ref = reference(g)
            hints[g] = ref if ref is not None else False
        else:
            hints[g] = change_of[g] == 0.0
    return hints
