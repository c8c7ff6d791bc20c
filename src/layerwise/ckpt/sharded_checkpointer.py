"""Layer-wise saves written by every rank of a sharded training loop (FSDP2, DeepSpeed ZeRO).

::

    ckpt = ShardedCheckpointer("runs/a", provider, TorchExchange(timeout_s=600), policy="filter",
                               threshold=1e-3)
    if ckpt.has_checkpoint():
        start = ckpt.load().step + 1            # at this world size, whatever the save's was
    ...
    ckpt.save(step)                             # on every rank, after optimizer.step()

A ``ShardProvider`` hands each rank's elements as ``FlatShard``s. Partial statistics are summed
on rank 0 so the policy decides as an unsharded save would; each rank writes one blob per chosen
group; rank 0 checks the shards cover every tensor exactly and commits, and an error anywhere
raises on every rank with nothing committed. A load reads only the elements the rank holds now,
from any world size. Saves are synchronous. No FSDP/DeepSpeed knowledge here: see
``interop.hooks.fsdp2_loop`` and ``interop.hooks.zero_partitions``."""

from __future__ import annotations

import math
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ..util.safetensors_io import dtype_name
from .checkpoint_config import DEFAULT_POLICY
from .blob_store import BLOB_FORMAT, BLOB_FORMAT_VERSION, BlobBatch, BlobPayload
from .collective import RankExchange, SingleProcess
from .commit import (CommittedVersions, ManifestHeader, check_groups_match, commit_step,
                     load_result, written_step)
from .errors import CheckpointWriteError
from .host_copies import HostBufferPool, as_blob_tensor, stored_nbytes
from .policies import Policy, make_policy
from .provider import PARAM
from .reports import LoadResult, SaveReport
from .resolve import open_run_step
from .run_dir import RunDir
from .shard_ranges import shard_layout
from .step_state import StepState, restore_step_state


@dataclass(frozen=True)
class FlatShard:
    """One rank's elements of one tensor of a group."""

    key: str
    """Blob key, as an unsharded group names it: ``param/<hf_name>``, ``exp_avg/<hf_name>``,
    ``exp_avg_sq/<hf_name>``, ``step/<hf_name>`` (``ckpt.provider``)."""
    data: torch.Tensor
    """1-D: elements ``[start, start + numel)`` of the flattened full tensor, a view of the live
    state on any device (the save copies to the host only what it writes, and keeps a host copy
    of the weights it saved to measure the next change). Optimizer state is stored as fp32,
    weights in their dtype."""
    start: int
    full_shape: tuple[int, ...]
    """The full (unsharded) tensor's shape; ``()`` for a scalar such as ``step/``. A value every
    rank holds (a scalar, a replicated tensor) is handed by one rank only: the shards of a key
    must cover it exactly once, or the save fails before committing."""

    @property
    def stop(self) -> int:
        return self.start + self.data.numel()


class GroupReader(Protocol):
    """Ranged reads of one stored group version (``ShardedGroupReader``, ``WholeGroupReader``)."""

    def keys(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor key of the stored group: full shape and dtype."""
        ...

    def read(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened full tensor ``key`` (1-D)."""
        ...


class ShardProvider(Protocol):
    """A rank's part of the live training state, group by group."""

    def group_names(self) -> list[str]:
        """Every group of the model in model order; the same list on every rank."""
        ...

    def shards(self, group: str) -> list[FlatShard]:
        """This rank's elements of ``group``: weights and optimizer state (none before the
        optimizer's first step). Empty shards may be left out."""
        ...

    def load_shards(self, group: str, reader: GroupReader) -> None:
        """Put this rank's elements of a stored version of ``group`` into the live state."""
        ...

    def model_config(self) -> dict | None:
        ...


@dataclass(frozen=True)
class PartialStats:
    """One rank's part of a group's statistics; ``combine`` sums them into the global ones."""

    nbytes: int
    """Bytes this rank's elements take in a blob."""
    diff_sq: float
    """Sum of squares of (weights - weights last saved) over this rank's elements."""
    ref_sq: float
    """Sum of squares of the weights last saved, over this rank's elements."""
    has_ref: bool
    """Whether this rank holds the version last saved (False after it was never saved)."""

    @staticmethod
    def combine(parts: list[PartialStats]) -> tuple[int, float]:
        """(bytes, relative L2 change) of the whole group: ``inf`` when a rank has no reference."""
        nbytes = sum(p.nbytes for p in parts)
        if not all(p.has_ref for p in parts):
            return nbytes, math.inf
        num, den = math.sqrt(sum(p.diff_sq for p in parts)), math.sqrt(sum(p.ref_sq for p in parts))
        return nbytes, num / den if den > 0 else (0.0 if num == 0 else math.inf)


def _outcome(fn) -> dict:
    """``fn()``'s result or its error, as a picklable record for the other ranks."""
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:  # every rank must hear of it, or they wait for a step that never comes
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _raise_if_failed(rec: dict, rank: int, what: str) -> Any:
    """``rec``'s value; its error (raised on whichever rank it happened) raised on this rank."""
    if rec["ok"]:
        return rec.get("value")
    if what == "setup":
        raise ValueError(f"rank {rank}: sharded checkpointer setup failed: {rec['error']}")
    raise CheckpointWriteError(f"rank {rank}: sharded checkpoint {what} failed: {rec['error']}. "
                               "Nothing of this save was committed; the previous committed "
                               "step is intact.")


class ShardedCheckpointer:
    """Layer-wise checkpoints of a loop whose state is sharded across ranks (create on every
    rank with the same arguments; ``exchange`` connects them)."""

    def __init__(self, run_dir: str | Path, provider: ShardProvider,
                 exchange: RankExchange | None = None, policy: str | Policy = DEFAULT_POLICY, *,
                 scheduler: Any = None, save_rng: bool = True, **policy_options: Any):
        self.provider, self.scheduler, self.save_rng = provider, scheduler, save_rng
        self.exchange = exchange or SingleProcess()
        self.rank, self.world_size = self.exchange.rank, self.exchange.world_size
        self.policy: Policy = make_policy(policy, **policy_options)
        self.groups = list(provider.group_names())
        # Rank 0 creates the run (format.json); the others open it once it exists.
        made = _outcome(lambda: RunDir.create(run_dir) and None) if self.rank == 0 else None
        _raise_if_failed(self.exchange.broadcast(made), self.rank, "setup")
        self.store = RunDir.open(run_dir)
        self.run_dir = self.store.root
        self._buffers = HostBufferPool()
        self._refs: dict[str, dict[str, torch.Tensor]] = {}
        """This rank's elements of each group's weights as last saved (or loaded), host copies."""
        self._versions = CommittedVersions.newest(self.store)

    def latest(self) -> int | None:
        """The newest committed step (None: none yet)."""
        return self.store.latest_step()

    def has_checkpoint(self) -> bool:
        return self.latest() is not None

    def close(self) -> None:
        """Free the host copies of the weights last saved (saves are synchronous: none is in
        flight to wait for); a later save would measure every group as never saved."""
        self._refs.clear()
        self._buffers = HostBufferPool()

    def _keep_references(self, group: str, shards: list[FlatShard]) -> None:
        """Host copies of the weights in ``shards`` become ``group``'s reference (the old one's
        buffers are reused)."""
        old = self._refs.get(group)
        self._refs[group] = self._buffers.copy_group(
            {s.key: s.data for s in shards if s.key.startswith(PARAM) and s.data.numel()})
        if old is not None:
            self._buffers.recycle(old.values())

    # ----- saving ----------------------------------------------------------------------------

    def partial_stats(self, group: str, shards: list[FlatShard]) -> PartialStats:
        ref = self._refs.get(group)
        nbytes = sum(stored_nbytes(s.key, s.data) for s in shards)
        diff_sq = ref_sq = 0.0
        if ref is not None:
            for s in shards:
                if s.key.startswith(PARAM):
                    r = ref.get(s.key)
                    if r is None or r.numel() != s.data.numel():
                        return PartialStats(nbytes, 0.0, 0.0, False)
                    live = s.data.detach().float()
                    diff_sq += float(torch.linalg.vector_norm(live - r.to(live.device).float())) ** 2
                    ref_sq += float(torch.linalg.vector_norm(r.float())) ** 2
        return PartialStats(nbytes, diff_sq, ref_sq, ref is not None)

    def save(self, step: int, extra: dict | None = None, *, data_position: Any = None,
             trainer_state: dict | None = None, every_group: bool = False) -> SaveReport:
        """Checkpoint ``step`` on every rank (a collective: call it on all of them).
        ``trainer_state``: rank 0's HF ``TrainerState`` dict (``merge --format trainer`` writes
        it as ``trainer_state.json``); ``every_group``: all groups, whatever the policy."""
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        t0 = time.perf_counter()
        ex = self.exchange
        shards = {g: [s for s in self.provider.shards(g) if s.data.numel()] for g in self.groups}
        own = {g: self.partial_stats(g, shards[g]) for g in self.groups}
        stats = ex.gather(own)
        decision = result = None
        with ExitStack() as held:
            if self.rank == 0:
                held.enter_context(self.store.lock())  # no gc while shards are being written
                decision = _outcome(lambda: self._decide(step, stats, every_group))
            chosen = _raise_if_failed(ex.broadcast(decision), self.rank, "selection")
            t_chosen = time.perf_counter()
            mine = _outcome(lambda: self._write_shards(chosen, shards))
            records = ex.gather(mine)
            if self.rank == 0:
                result = _outcome(lambda: self._commit(step, chosen, records, extra, data_position,
                                                      trainer_state))
            _raise_if_failed(ex.broadcast(result), self.rank, "commit")
        recs = _raise_if_failed(mine, self.rank, "write")
        for g in chosen["selected"]:
            self._keep_references(g, shards[g])
        t1 = time.perf_counter()
        return SaveReport(
            step, chosen["selected"], blocked_s=t1 - t0, wait_s=0.0,
            snapshot_bytes=sum(own[g].nbytes for g in chosen["selected"]),
            reasons=chosen["reasons"], snapshot="live", changes=chosen["changes"],
            snapshot_s=t_chosen - t0, write_s=t1 - t_chosen,
            written=[g for g, r in recs.items() if r["written"]],
            bytes_written=sum(r["nbytes"] for r in recs.values() if r["written"]))

    def _decide(self, step: int, stats: list[dict[str, PartialStats]] | None,
                every_group: bool = False) -> dict:
        """Rank 0: the policy's choice from the global statistics (plus every group never
        saved), with why, and which groups may be byte-identical to their last version."""
        assert stats is not None
        statuses = []
        for pos, g in enumerate(self.groups):
            nbytes, change = PartialStats.combine([s[g] for s in stats])
            statuses.append(self._versions.status(g, pos, nbytes, lambda c=change: c))
        reasons = self._versions.select(self.policy, step, statuses, self.groups)
        if every_group:
            reasons = {g: reasons.get(g, "every_group") for g in self.groups}
        unchanged = [s.name for s in statuses if s.change == 0.0]
        return {"selected": list(reasons), "reasons": reasons,
                "changes": {s.name: s.change for s in statuses}, "unchanged": unchanged,
                "save_index": self._versions.next_index}

    def _write_shards(self, chosen: dict, shards: dict[str, list[FlatShard]]) -> dict[str, dict]:
        """This rank's blob of every chosen group it holds elements of, durable on return."""
        out: dict[str, dict] = {}
        with BlobBatch() as batch:
            for g in chosen["selected"]:
                if not shards[g]:
                    continue
                tensors = {s.key: as_blob_tensor(s.data, s.key, flat=True) for s in shards[g]}
                if len(tensors) != len(shards[g]):
                    raise ValueError(f"group {g!r}: rank {self.rank} handed a key twice")
                meta = {"format": BLOB_FORMAT, "format_version": str(BLOB_FORMAT_VERSION),
                        "group": g, "shard": "flat"}
                rec = self.store.put_blob(BlobPayload.build(tensors, meta),
                                          g in chosen["unchanged"], batch)
                out[g] = {"rank": self.rank, "blob": rec.rel_path, self.store.hash_name: rec.digest,
                          "nbytes": rec.nbytes, "written": rec.written, "tensors": {
                              s.key: {"range": [s.start, s.stop], "shape": list(s.full_shape),
                                      "dtype": dtype_name(s.key, tensors[s.key])}
                              for s in shards[g]}}
        return out

    def _commit(self, step: int, chosen: dict, records: list[dict], extra: dict | None,
                data_position: Any, trainer_state: dict | None) -> None:
        """Rank 0: check every rank's records, write the step's state files, commit."""
        assert records is not None
        failed = [f"rank {i}: {r['error']}" for i, r in enumerate(records) if not r["ok"]]
        if failed:
            raise RuntimeError("; ".join(failed))
        per_rank = [r["value"] for r in records]
        groups = self._versions.copy_entries()
        written, nbytes = [], 0
        for g in chosen["selected"]:
            shard_recs = [{k: v for k, v in r[g].items() if k != "written"}
                          for r in per_rank if g in r]
            shard_layout(g, shard_recs)  # exact cover, or no commit
            new = [r[g] for r in per_rank if g in r and r[g]["written"]]
            if new:
                written.append(g)
                nbytes += sum(r["nbytes"] for r in new)
            groups[g] = self._entry(g, shard_recs, step, chosen["save_index"])
        if not (self.run_dir / "config.json").exists():
            config = self.provider.model_config()
            if config is not None:
                self.store.write_config(config)  # merge and export need the architecture
        state = StepState.capture(  # rank 0's RNG
            step, scheduler=self.scheduler, provider=self.provider,
            save_rng=self.save_rng, extra=extra, data_position=data_position,
            trainer_state=trainer_state, world_size=self.world_size)
        header = ManifestHeader.of(chosen["save_index"], self.policy, self.provider, self.world_size)
        self._versions.adopt(commit_step(self.store, step, header, state, groups, written, nbytes))

    def _entry(self, group: str, shard_recs: list[dict], step: int, save_index: int) -> dict:
        prev = self._versions.entries.get(group)
        same = (prev is not None and "shards" in prev
                and [(r["blob"], r["tensors"]) for r in prev["shards"]]
                == [(r["blob"], r["tensors"]) for r in shard_recs])
        return {"shards": shard_recs, "world_size": self.world_size,
                "nbytes": sum(r["nbytes"] for r in shard_recs), "saved_step": step,
                "saved_index": save_index, "written_step": written_step(prev, same, step)}

    # ----- loading ---------------------------------------------------------------------------

    def load(self, step: int | None = None) -> LoadResult | None:
        """Load ``step`` (default: newest committed) on every rank, from any world size; also the
        scheduler, optimizer hyper-parameters and rank 0's RNG. None if nothing is committed yet."""
        if step is None and self.latest() is None:
            return None
        rs = open_run_step(self.run_dir, step)
        check_groups_match(rs, self.groups)
        for g in self.groups:
            self.provider.load_shards(g, rs.group_reader(g))
            self._keep_references(g, self.provider.shards(g))
        st = restore_step_state(rs, scheduler=self.scheduler, provider=self.provider,
                                save_rng=self.save_rng)
        self._versions.adopt(rs.manifest)
        self.exchange.barrier()
        return load_result(rs, st)
