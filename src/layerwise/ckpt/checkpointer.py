"""``Checkpointer``: layer-wise checkpoints for a plain PyTorch training loop.

::

    ckpt = Checkpointer("runs/a", model, optimizer, scheduler, policy="filter", threshold=1e-3)
    start = ckpt.load().step + 1 if ckpt.has_checkpoint() else 0   # resume, no rewrite
    for step in range(start, num_steps):
        loss.backward(); optimizer.step(); scheduler.step()
        ckpt.observe(step)                  # update statistics (every N steps; cheap)
        optimizer.zero_grad()
        if step % 100 == 0:
            ckpt.save(step, extra={"data_position": step + 1})   # blocks only to capture state
    ckpt.wait()                             # the last background write, and its errors

One save writes at a time (the next ``save`` waits: ``wait_s``). A host copy that would not fit
in available RAM is not made; that save writes from the live tensors (``snapshot == "live"``).

**Deferred snapshot** (``CheckpointConfig.snapshot``): ``save`` captures only the non-layer
state and references; a helper thread copies the groups while the loop runs forward/backward,
and the next ``optimizer.step()`` waits for it (``stall_s``). A tensor written in place before
then fails the save (``StateModifiedError``) rather than storing a later state: change state
only through the optimizer step, or use ``snapshot="sync"``.

**Several writers** (``exchange=``, ``mine=``): rank 0 chooses and broadcasts, each rank writes
the groups it owns, and rank 0 (holding the run's lock) gathers the records and commits. A rank
that fails before the gather leaves the last committed step as it was.

Threads: only the owner's thread changes the checkpointer's state; it adopts each
``WriteResult`` in ``wait``, the next ``save`` or ``close``."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .blob_codec import ENCODINGS
from .checkpoint_config import CheckpointConfig, split_options
from .collective import RankExchange, SingleProcess
from .commit import (CommittedVersions, ManifestHeader, check_groups_match, load_result,
                     regrouped)
from .expert_groups import chosen_slice_records, with_expert_groups
from . import exit_flush
from .errors import StateModifiedError
from .host_copies import (GroupsOnDemand, HostBufferPool, stored_nbytes,
                          synchronize_if_pinned)
from .policies import GroupStatus, Policy, make_policy
from .provider import PARAM, ModuleStateProvider, StateProvider, group_tensors
from .reports import LoadResult, SaveReport
from .resolve import ResolvedStep, open_run_step
from .run_dir import RunDir
from .save_writer import SaveWriter, WriteJob, WriteResult, duplicate_hints
from .snapshot import DeferredSnapshots
from .snapshot_fit import SnapshotFit, host_need_bytes
from .step_state import StepState, restore_step_state
from .tracker import LiveGroup, TrackerReferences, UpdateTracker

_log = logging.getLogger(__name__)


@dataclass
class _Prepared:
    """One save as its snapshot booked it: the write job, and what adopting or undoing it needs."""

    job: WriteJob
    report: SaveReport
    references: TrackerReferences
    """The tracker's references before the save booked its own: put back if the write fails."""
    old_refs: list[dict[str, torch.Tensor]]
    """References the snapshots replace: free for reuse once the save commits."""
    copied: bool
    """The snapshots are the pool's buffers (not the live tensors)."""


@dataclass
class _Pending:
    """The save in flight: its write's future (a ``WriteResult``) and its booking; for a
    deferred save the helper's future, which returns both once the snapshot is taken."""

    future: Future
    prepared: _Prepared | None = None
    deferred: bool = False


def _run_now(fn: Callable[[WriteJob], WriteResult], job: WriteJob) -> Future:
    """``fn(job)`` run on this thread, as a done future (its result or its error)."""
    fut: Future = Future()
    try:
        fut.set_result(fn(job))
    except BaseException as e:
        fut.set_exception(e)
    return fut


class Checkpointer:
    def __init__(
        self,
        run_dir: str | Path,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        policy: str | Policy | None = None,
        *,
        provider: StateProvider | None = None,
        config: CheckpointConfig | None = None,
        exchange: RankExchange | None = None,
        mine: Callable[[str], bool] | Collection[str] | None = None,
        available_memory: Callable[[], int | None] | None = None,
        **options: Any,
    ):
        """``options``: fields of ``CheckpointConfig`` and the policy's options, one flat namespace.
        ``exchange``/``mine``: see *Several writers* above. ``available_memory``: host bytes each
        snapshot is sized against (default: ``available_host_memory``)."""
        self.config, policy_options = split_options(config, options, policy)
        if self.config.encoding not in ENCODINGS:
            raise ValueError(f"encoding={self.config.encoding!r} is not one of {list(ENCODINGS)}; "
                             "'delta' codes fp32 weights against a key frame, 'plain' stores them whole")
        if provider is None:
            if model is None:
                raise ValueError("Checkpointer needs a model (and optimizer) or a StateProvider")
            provider = ModuleStateProvider(model, optimizer)
        elif model is not None:
            raise ValueError("pass either model/optimizer or provider=, not both")
        self.policy: Policy = make_policy(policy if policy is not None else self.config.policy,
                                          **policy_options)
        self.store = RunDir.create(run_dir)
        if self.config.expert_groups:
            provider = with_expert_groups(provider, self.store)
        self.provider = provider
        self.scheduler = scheduler
        self.run_dir = self.store.root
        self.groups: list[str] = list(provider.group_names())
        self.exchange: RankExchange = exchange or SingleProcess()
        self.mine = self._own_groups(mine)
        self.tracker = UpdateTracker(
            provider, self.run_dir / "tracker.jsonl" if self.config.tracker_log else None)
        self.reports: list[SaveReport] = []
        self.observe_stall_s = 0.0
        """Time optimizer steps waited for deferred ``observe`` statistics (not for saves)."""
        self._writer = SaveWriter(self.store, self.exchange)
        self._write_thread = (ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer")
                              if self.config.async_save else None)
        self._pending: _Pending | None = None
        self._buffers = HostBufferPool()
        self._fit = SnapshotFit(available_memory)
        self._deferred = DeferredSnapshots(provider, self.groups, self.config.snapshot,
                                           self.config.async_save, self.exchange.world_size)
        self._config_written = (self.run_dir / "config.json").exists()
        self._versions = regrouped(CommittedVersions.newest(self.store), self.groups)
        """The committed versions (rebuilt from the newest manifest, or by ``load``)."""
        self._closed = False
        exit_flush.track(self)  # a save still pending when the interpreter exits is written

    def _own_groups(self, mine: Callable[[str], bool] | Collection[str] | None) -> set[str]:
        if mine is None:
            return set(self.groups)
        own = {g for g in self.groups if mine(g)} if callable(mine) else set(mine)
        unknown = sorted(own - set(self.groups))
        if unknown:
            raise ValueError(f"mine= names groups the model does not have: {unknown[:5]}; "
                             f"its groups are {self.groups[:5]}...")
        return own

    def latest(self) -> int | None:
        """The newest committed step (None: none yet); a save still being written is not."""
        return self.store.latest_step()

    def has_checkpoint(self) -> bool:
        return self.latest() is not None

    # ----- statistics -----------------------------------------------------------------------

    def observe(self, step: int, force: bool = False) -> Mapping[str, dict[str, float]] | None:
        """Per-group update statistics every ``track_every_steps`` steps (or ``force``).

        Call after ``optimizer.step()`` and before ``zero_grad()`` to include gradient norms.
        Deferred: a gradient zeroed in place before it was read gives NaN, never a later gradient's
        norm."""
        every = max(1, self.config.track_every_steps)
        if not force and step % every != 0:
            return None
        live = self._deferred.capture(grads=True)
        if live is None:  # synchronous, after whatever the helper thread still reads
            self._deferred.drain()
            if self._pending is not None and self._pending.deferred:  # its snapshot, not write
                wait_all([self._pending.future])
            return self.tracker.observe(step)
        return self._deferred.observe(
            lambda: self.tracker.observe(step, live),
            lambda s: setattr(self, "observe_stall_s", self.observe_stall_s + s))

    # ----- saving ---------------------------------------------------------------------------

    def _group_nbytes(self, group: str, sizes: dict[str, int]) -> int:
        """``group``'s stored bytes, reckoned once a save (``sizes``: this save's so far): it
        reads the group (a split master's weights decoded, a unit on NVMe staged)."""
        if group not in sizes:
            sizes[group] = sum(stored_nbytes(k, t) for k, t in group_tensors(self.provider, group).items())
        return sizes[group]

    def save(self, step: int, extra: dict | None = None, *, data_position: Any = None,
             trainer_state: dict | None = None, every_group: bool = False) -> SaveReport:
        """Checkpoint ``step`` in the background (``every_group``: all groups, whatever the policy).

        Raises the error of a previous failed background save."""
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        t0 = time.perf_counter()
        self._finish_pending()
        wait_s = time.perf_counter() - t0

        state, config = None, None  # the step's files are rank 0's
        if self.exchange.rank == 0:
            state = StepState.capture(
                step, scheduler=self.scheduler, provider=self.provider,
                save_rng=self.config.save_rng, extra=extra, data_position=data_position,
                trainer_state=trainer_state)
            config = None if self._config_written else self.provider.model_config()
        report = SaveReport(step, [], 0.0, wait_s, 0)
        self.reports.append(report)
        live = self._deferred.capture(grads=False)
        if live is None:  # synchronous snapshot: measure, choose and copy now
            self._deferred.drain()
            self._start_write(self._prepare(step, report, state, config, None, every_group))
        else:  # deferred: the helper thread does it before the next optimizer step
            report.deferred = True

            def snapshot_then_write() -> tuple[_Prepared, Future]:
                prepared = self._prepare(step, report, state, config, live, every_group)
                assert self._write_thread is not None
                if not prepared.copied:  # written here: the next update waits for it
                    return prepared, _run_now(self._writer.run, prepared.job)
                return prepared, self._write_thread.submit(self._writer.run, prepared.job)
            future = self._deferred.submit(
                snapshot_then_write, lambda s: setattr(report, "stall_s", report.stall_s + s))
            self._pending = _Pending(future, deferred=True)
        report.blocked_s = time.perf_counter() - t0
        return report

    def _prepare(self, step: int, report: SaveReport, state: StepState | None,
                 config: dict | None, live: dict[str, LiveGroup] | None,
                 every_group: bool = False) -> _Prepared:
        """Measure, choose, copy and book one save (in ``save``, or on the helper thread from
        the tensors ``live`` captured at ``save``)."""
        t0 = time.perf_counter()
        decides = self.exchange.rank == 0
        sizes: dict[str, int] = {}
        statuses = self._group_statuses(step, sizes, live) if decides else []
        # Rank 0 chooses for every rank: it sees every group (the node's shared store, or an
        # identical copy) and holds the statistics; the others copy their share of its choice.
        reasons, unchanged = self.exchange.broadcast(
            (self._versions.select(self.policy, step, statuses, self.groups),
             {s.name for s in statuses if s.change == 0.0}) if decides else None)
        if every_group:
            reasons = {g: reasons.get(g, "every_group") for g in self.groups}
        selected = list(reasons)
        own = [g for g in selected if g in self.mine]
        copy = self.config.async_save or self.config.sync_copy
        copy = copy and self._copy_fits(step, own, [g for g in selected if g not in own], live)
        report.snapshot = "copy" if copy else "live"
        snaps = self._snapshot_groups(own, copy, live)
        if live is not None:
            self._check_unmodified(step, live, selected, snaps)
        report.changes = {s.name: s.change for s in statuses}
        maybe_dup = (duplicate_hints(snaps, report.changes, self.tracker.reference) if decides
                     else {g: g in unchanged for g in snaps})
        references, old_refs = self._book_references(snaps, copy,
                                                     [g for g in selected if g not in own])
        report.selected[:] = selected
        report.reasons = reasons
        report.snapshot_bytes = sum(self._group_nbytes(g, sizes) for g in own)
        report.snapshot_s = time.perf_counter() - t0
        header = ManifestHeader.of(self._versions.next_index, self.policy, self.provider)
        job = WriteJob(step, header, self.groups, selected, snaps, maybe_dup,
                       self._versions.copy_entries(), state, config,
                       chosen_slice_records(self.provider, selected, snaps) if decides else {},
                       self.config.encoding)
        return _Prepared(job, report, references, old_refs, copy)

    def _check_unmodified(self, step: int, live: dict[str, LiveGroup], selected: list[str],
                          snaps: Mapping[str, dict[str, torch.Tensor]]) -> None:
        """Refuse a deferred snapshot of state written in place since ``save`` captured it: the
        statistics read every group's weights, the copy the chosen groups' optimizer state."""
        bad = [g for g, lv in live.items()
               if lv.modified("params") or (g in selected and lv.modified("optim"))]
        if bad:
            if not isinstance(snaps, GroupsOnDemand):  # never the live tensors
                self._buffers.recycle(t for s in snaps.values() for t in s.values())
            self.tracker.forget_changes()
            raise StateModifiedError(
                f"checkpoint of step {step}: the live state of {bad[:3]} was written in place "
                "after save() and before its deferred snapshot was taken (only the optimizer "
                "step waits for it). Nothing of this save was committed. Change weights and "
                "optimizer state only through optimizer.step() between save() and the next "
                "step, call Checkpointer.wait() before doing so, or use snapshot='sync'.")

    def _group_statuses(self, step: int, sizes: dict[str, int],
                        live: dict[str, LiveGroup] | None = None) -> list[GroupStatus]:
        """What the policy sees of every group: its size, its change since the version last
        saved (``inf`` if never saved, ``nan`` if the policy does not read it) and its age."""
        def change(g: str) -> float:
            if getattr(self.policy, "uses_change", True) or not self.tracker.has_reference(g):
                return self.tracker.change(g, step, None if live is None else live[g].params)
            return math.nan  # not needed by the policy; unchanged groups found on writing
        return [self._versions.status(g, pos, self._group_nbytes(g, sizes), lambda g=g: change(g))
                for pos, g in enumerate(self.groups)]

    def _snapshot_groups(self, selected: list[str], copy: bool, live: dict[str, LiveGroup] | None
                         ) -> Mapping[str, dict[str, torch.Tensor]]:
        """The chosen groups' tensors as the blob stores them: host copies when ``copy``
        (reused buffers; from the tensors ``live`` captured at ``save`` when deferred), else
        read from the provider when used (no copy asked for, or it would not fit)."""
        if not copy:
            return GroupsOnDemand(self.provider, selected)
        snaps = {g: {k: self._buffers.copy(t, k) for k, t in self._tensors(g, live).items()}
                 for g in selected}
        synchronize_if_pinned(t for s in snaps.values() for t in s.values())
        return snaps

    def _tensors(self, g: str, live: dict[str, LiveGroup] | None) -> dict[str, torch.Tensor]:
        if live is None:
            return group_tensors(self.provider, g)
        return {**{PARAM + n: t for n, t in live[g].params.items()}, **live[g].optim}

    def _copy_fits(self, step: int, own: list[str], others: list[str],
                   live: dict[str, LiveGroup] | None) -> bool:
        """Whether the host buffers this save's copy would allocate (its groups, and on rank 0
        the weights of the groups other ranks write) fit in the RAM available now; a
        collective with several writers."""
        pairs = [(k, t) for g in own for k, t in self._tensors(g, live).items()]
        if self.exchange.rank == 0:
            pairs += [(PARAM + n, t) for g in others for n, t in self.provider.params(g).items()]
        need = host_need_bytes(self.exchange, self._buffers.fresh_nbytes(pairs))
        return self._fit.decide(step, need)

    def _book_references(self, snaps: Mapping[str, dict[str, torch.Tensor]], copy: bool,
                         others: list[str]) -> tuple[TrackerReferences, list[dict[str, torch.Tensor]]]:
        """Book the snapshots as the tracker's references before they are written. Returns the
        references before (put back on failure) and those replaced (reusable once committed).
        ``others``: groups other ranks write; only rank 0 keeps references."""
        before = self.tracker.save_references()
        if self.exchange.rank != 0:
            return before, []
        old_refs = [r for g in [*snaps, *others] if (r := self.tracker.reference(g)) is not None]
        for g in [*snaps, *others]:
            if not copy and not getattr(self.policy, "uses_change", True):
                self.tracker.drop_reference(g)
            elif g in others:
                self.tracker.set_reference(g, self._buffers.copy_group(self.provider.params(g), PARAM))
            else:
                params = {k[len(PARAM):]: t for k, t in snaps[g].items() if k.startswith(PARAM)}
                self.tracker.set_reference(
                    g, params if copy else {n: t.clone() for n, t in params.items()})
        return before, old_refs

    # ----- the write in flight --------------------------------------------------------------

    def _start_write(self, prepared: _Prepared) -> None:
        """Run the write on the writer thread (or here, and adopt it, when not ``async_save`` or
        from the live tensors)."""
        if self._write_thread is not None and prepared.copied:
            self._pending = _Pending(self._write_thread.submit(self._writer.run, prepared.job),
                                     prepared)
            return
        self._pending = _Pending(_run_now(self._writer.run, prepared.job), prepared)
        self._finish_pending()

    def _finish_pending(self) -> None:
        """Wait for the save in flight and adopt its result, or undo its booking and re-raise."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        prepared = pending.prepared
        try:
            result = pending.future.result()
            if pending.deferred:  # the helper returned the snapshot's booking and its write
                prepared, write = result
                result = write.result()
        except BaseException:
            self._deferred.drain()  # deferred observations use the tracker being rolled back
            if prepared is not None:
                self.tracker.restore_references(prepared.references)
                if prepared.copied:  # the snapshot is garbage now; the old references are live
                    self._buffers.recycle(t for s in prepared.job.snaps.values() for t in s.values())
            raise
        self._adopt(prepared, result)

    def _adopt(self, prepared: _Prepared, result: WriteResult) -> None:
        """A save's write is done: its report, the committed versions, its buffers."""
        report, job = prepared.report, prepared.job
        report.write_s, report.written = result.write_s, result.written
        report.bytes_written = result.bytes_written
        self._versions.saved(job.header.save_index, result.entries)
        if job.config is not None:
            self._config_written = True
        if prepared.copied:
            # Optimizer state snapshots and replaced weight references are free for reuse (and
            # the weights too where they are no references: on the ranks that do not choose).
            keep = PARAM if self.exchange.rank == 0 else None
            self._buffers.recycle(t for s in job.snaps.values() for k, t in s.items()
                                  if keep is None or not k.startswith(keep))
            self._buffers.recycle(t for r in prepared.old_refs for t in r.values())

    def wait(self) -> SaveReport | None:
        """Block until the running background save is committed (and deferred observations
        are taken); re-raise its error."""
        self._finish_pending()
        self._deferred.wait_reads()
        return self.reports[-1] if self.reports else None

    def unclosed_save(self) -> int | None:
        """The step of the last save when it is not yet waited for and the checkpointer is
        open (``exit_flush``); else None."""
        if self._closed or self._pending is None:
            return None
        return self.reports[-1].step if self.reports else None

    def close(self) -> None:
        """Wait for the last save (raising its error) and stop the threads; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            self._deferred.close()
            if self._write_thread is not None:
                self._write_thread.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- loading --------------------------------------------------------------------------

    def load(self, step: int | None = None, *, strict: bool = True) -> LoadResult | None:
        """Load ``step`` (default: newest committed) into model, optimizer, scheduler and RNG.
        ``strict``: every model group must be in the checkpoint. None if nothing is committed yet.
        """
        self.wait()
        if step is None and self.latest() is None:
            _log.warning(f"nothing to load: {self.run_dir} has no committed checkpoint yet "
                         "(a fresh start); load() returned None")
            return None
        rs = open_run_step(self.run_dir, step)
        check_groups_match(rs, self.groups, strict,
                           strict_hint=" (or strict=False to skip missing groups)")
        refs: dict[str, dict[str, torch.Tensor]] = {}
        for g in rs.groups():  # whole layers: an expert-grouped layer's versions joined
            tensors = rs.load_group(g)
            self.provider.load_group(g, tensors)
            refs.update(self._split_references(g, tensors))
        st = restore_step_state(rs, scheduler=self.scheduler, provider=self.provider,
                                save_rng=self.config.save_rng)
        self._versions.adopt(rs.manifest)
        self._versions = regrouped(self._versions, self.groups)
        self.tracker.reset(refs)
        return load_result(rs, st)

    def _split_references(self, group: str, tensors: dict[str, torch.Tensor]
                          ) -> dict[str, dict[str, torch.Tensor]]:
        """A loaded (joined) group's weights as the tracker's references of each of this
        checkpointer's groups it holds (an MoE layer's part and experts: views)."""
        params = {k[len(PARAM):]: t for k, t in tensors.items() if k.startswith(PARAM)}
        split = getattr(self.provider, "split_params", None)
        return split(group, params) if split is not None else {group: params}

    def reset_references(self, rs: ResolvedStep) -> None:
        """The versions of ``rs`` become the tracker's references (without loading them)."""
        refs: dict[str, dict[str, torch.Tensor]] = {}
        for g in rs.groups():
            refs.update(self._split_references(g, rs.load_group(g)))
        self.tracker.reset(refs)
