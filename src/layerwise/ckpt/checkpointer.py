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

A save asks the policy which groups to write, copies those groups (weights + optimizer state)
to host memory, and a background thread writes the blobs, the step's non-layer state and
finally the manifest. One save writes at a time: the next ``save`` first waits for the previous
one (that wait is part of its blocked time, reported separately as ``wait_s``).

**Deferred snapshot** (``CheckpointConfig.snapshot``): where the provider can hold the next
update back (a torch optimizer: a step pre-hook) and the state is on the CPU, ``save`` only
captures the non-layer state (scheduler, RNG, extra) and references to the live tensors, and
returns. A helper thread then measures the statistics the policy needs, chooses the groups and
copies them, while the training loop runs its next forward and backward; the next
``optimizer.step()`` waits for that copy if it is not done (``SaveReport.stall_s``). The copy is
of the state at ``save``: the optimizer step is held back, and a tensor written in place
otherwise (its version counter moved) fails the save (``StateModifiedError``) rather than
storing a later state. ``observe`` is deferred the same way. The contract: between ``save``
(or ``observe``) and the next optimizer step, change weights and optimizer state only through
that step, or use ``snapshot="sync"``.

**Several writers** (``exchange=``, ``mine=``; ``ckpt.collective``): every rank holds a
checkpointer of the same state (a node's shared store, or identical copies) and calls ``save``
at the same step. Rank 0 alone measures and chooses, and broadcasts the choice; each rank copies
and writes the chosen groups it owns; rank 0, holding the run's lock from before the first
blob to the commit, gathers every rank's blob records and alone writes the step's files and
the manifest. A rank that fails or dies before the gather leaves the last committed step as it
was; the others fail within the exchange's timeout. The snapshot is taken inside ``save``
(never deferred); the writes still run on the writer thread, whose collectives use the
exchange's own process group.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from contextlib import nullcontext
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import nn

from .collective import RankExchange, SingleProcess
from .errors import CheckpointError, StateModifiedError
from .moments import fp32_moments, has_8bit
from .run_dir import (
    BLOB_FORMAT,
    BLOB_FORMAT_VERSION,
    BLOB_FORMAT_VERSION_8BIT,
    FIRST_VERSION_8BIT,
    BlobBatch,
    BlobPayload,
    BlobRecord,
    RunDir,
    now_unix_s,
    write_error,
)
from .policies import GroupStatus, Policy, PolicyContext, make_policy, select_with_reasons
from .resolve import ResolvedStep, open_run_step
from .provider import (
    PARAM,
    ModuleStateProvider,
    StateProvider,
    capture_rng,
    group_tensors,
    jsonable,
    restore_rng,
    rng_dict,
)
from .tracker import LiveGroup, TrackerReferences, UpdateTracker

SNAPSHOT_MODES = ("auto", "sync", "deferred")


@dataclass
class CheckpointConfig:
    policy: str = "full"
    """Registry name of the selection policy: full, parity, filter, topk, budget."""
    policy_options: dict[str, Any] = field(default_factory=dict)
    """Options of the policy, e.g. {"threshold": 1e-3, "max_staleness": 4, "full_every": 10}."""
    async_save: bool = True
    """Write in a background thread; ``save`` blocks only for the host snapshot."""
    sync_copy: bool = True
    """With ``async_save=False``: still copy the chosen groups first (False: write straight from
    the live tensors, no extra memory; the update tracker then keeps its own weight copy only if
    the policy reads weight changes)."""
    save_rng: bool = True
    """Store and restore python/numpy/torch RNG states (needed for bit-identical resume)."""
    track_every_steps: int = 10
    """``observe(step)`` takes statistics only every N steps (saves always measure)."""
    tracker_log: bool = True
    """Append the statistics to ``RUN/tracker.jsonl``."""
    snapshot: str = "auto"
    """When the statistics are measured and the chosen groups copied: ``"sync"`` inside ``save``
    (and ``observe``); ``"deferred"`` on a helper thread after they return, before the next
    optimizer step (see the module docstring); ``"auto"``: deferred with ``async_save`` where
    the provider can hold updates back and the state is on the CPU, else sync."""


@dataclass
class SaveReport:
    step: int
    selected: list[str]
    """Groups the policy chose (in model order; filled when the snapshot is taken)."""
    blocked_s: float
    """Time ``save`` held the caller (includes ``wait_s``; not ``stall_s``)."""
    wait_s: float
    """Part of ``blocked_s`` spent waiting for the previous save to finish."""
    snapshot_bytes: int
    """Bytes copied by the snapshot (filled when it is taken); with several writers, this
    rank's."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Why each selected group was written: ``policies.REASONS`` (never saved, ``full_every``,
    ``max_staleness``, or the policy's own criterion)."""
    deferred: bool = False
    """The statistics and the snapshot were taken on the helper thread, after ``save`` returned."""
    snapshot_s: float | None = None
    """Time to measure, choose and copy (inside ``blocked_s`` unless ``deferred``)."""
    stall_s: float = 0.0
    """Time the training loop's next optimizer step waited for a deferred snapshot: blocked
    time outside ``save``."""
    write_s: float | None = None
    """Background time to write blobs, state and manifest (None until done)."""
    written: list[str] | None = None
    """Groups whose bytes were new (the rest were deduplicated); on a rank other than 0 of
    several writers, of the groups it wrote."""
    bytes_written: int | None = None
    """New blob bytes plus the step's state files and manifest (rank 0's report only)."""

    def to_json(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class LoadResult:
    step: int
    """The committed step that was loaded."""
    extra: dict | None
    data_position: Any
    trainer_state: dict | None
    stale_groups: dict[str, int]
    """Groups whose version is older than ``step``: group -> step it was saved at."""


@dataclass
class _Rollback:
    """The bookkeeping of the committed versions before a save booked its own."""

    entries: dict[str, dict]
    save_index: int
    """The save index the save took."""
    references: TrackerReferences


@dataclass
class _Pending:
    """The save in flight: its future (for a deferred save, the snapshot's, which returns the
    write's) and, once the snapshot is booked, its write job."""

    future: Future
    job: _WriteJob | None = None
    deferred: bool = False


class _UpdateGate:
    """Holds the next update of the live state back while a helper thread still reads it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers: list[Callable[[float], None]] = []

    def enter(self, on_stall: Callable[[float], None]) -> Callable[[], None]:
        """A reader starts; ``on_stall(seconds)`` is told how long an update waited for it.
        Returns the call that ends the read."""
        with self._cv:
            self._readers.append(on_stall)

        def leave() -> None:
            with self._cv:
                self._readers.remove(on_stall)
                self._cv.notify_all()
        return leave

    def wait(self) -> None:
        """Called before an update: returns once no reader is left; the wait is charged to the
        newest reader (a save queued after an observation waits for both)."""
        with self._cv:
            if not self._readers:
                return
            charge, t0 = self._readers[-1], time.perf_counter()
            while self._readers:
                self._cv.wait()
        charge(time.perf_counter() - t0)


class DeferredStats(Mapping):
    """``observe``'s statistics while the helper thread takes them; reading waits for them."""

    def __init__(self, future: Future):
        self._future = future

    def _stats(self) -> dict[str, dict[str, float]]:
        return self._future.result()

    def __getitem__(self, group: str) -> dict[str, float]:
        return self._stats()[group]

    def __iter__(self) -> Iterator[str]:
        return iter(self._stats())

    def __len__(self) -> int:
        return len(self._stats())


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
        **options: Any,
    ):
        """``options``: fields of ``CheckpointConfig`` (e.g. ``async_save=False``) and the
        policy's own options (e.g. ``threshold=1e-3``), in one flat namespace.

        Saves written by several ranks (see *Several writers* in the module docstring):
        ``exchange`` joins this rank's checkpointer to the others' (``ckpt.collective``;
        default: one process) and ``mine`` names the groups this rank writes (a set, or a
        predicate on group names; default: all)."""
        cfg_fields = {f.name for f in fields(CheckpointConfig)}
        overrides = {k: v for k, v in options.items() if k in cfg_fields}
        policy_options = {k: v for k, v in options.items() if k not in cfg_fields}
        self.config = replace(config or CheckpointConfig(), **overrides)
        if provider is None:
            if model is None:
                raise ValueError("Checkpointer needs a model (and optimizer) or a StateProvider")
            provider = ModuleStateProvider(model, optimizer)
        elif model is not None:
            raise ValueError("pass either model/optimizer or provider=, not both")
        self.provider = provider
        self.scheduler = scheduler
        options = {**self.config.policy_options, **policy_options}
        self.policy: Policy = make_policy(policy if policy is not None else self.config.policy, **options)
        self.store = RunDir.create(run_dir)
        self.run_dir = self.store.root
        self.groups: list[str] = list(provider.group_names())
        self.exchange: RankExchange = exchange or SingleProcess()
        self.mine = self._own_groups(mine)
        self.tracker = UpdateTracker(
            provider, self.run_dir / "tracker.jsonl" if self.config.tracker_log else None)
        self.reports: list[SaveReport] = []
        self.observe_stall_s = 0.0
        """Time optimizer steps waited for deferred ``observe`` statistics (not for saves)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer") if self.config.async_save else None
        self._pending: _Pending | None = None
        self._buffers: dict[tuple, list[torch.Tensor]] = {}
        self._reader, self._hook, self._gate = self._deferral_setup()
        self._reads: list[Future] = []  # deferred observations in flight
        self._config_written = (self.run_dir / "config.json").exists()
        # Bookkeeping of committed versions (rebuilt from the newest manifest, or by load()).
        self._entries: dict[str, dict] = {}
        self._save_index = 0
        latest = self.store.latest_step()
        if latest is not None:
            self._adopt_manifest(self.store.read_manifest(latest))

    def _own_groups(self, mine: Callable[[str], bool] | Collection[str] | None) -> set[str]:
        if mine is None:
            return set(self.groups)
        own = {g for g in self.groups if mine(g)} if callable(mine) else set(mine)
        unknown = sorted(own - set(self.groups))
        if unknown:
            raise ValueError(f"mine= names groups the model does not have: {unknown[:5]}; "
                             f"its groups are {self.groups[:5]}...")
        return own

    def _deferral_setup(self) -> tuple[ThreadPoolExecutor | None, Any, _UpdateGate]:
        """The helper thread and the update hook of deferred snapshots, where they can be used."""
        mode, gate = self.config.snapshot, _UpdateGate()
        if mode not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot must be one of {SNAPSHOT_MODES} (got {mode!r})")
        if mode == "deferred" and self.exchange.world_size > 1:
            raise ValueError("snapshot='deferred' is for saves written by one process; with "
                             "several writers (exchange=) use snapshot='auto' or 'sync'")
        register = getattr(self.provider, "register_update_hook", None)
        hook = None
        if (mode != "sync" and self.config.async_save and register is not None
                and self.exchange.world_size == 1):
            hook = register(gate.wait)
        if hook is None:
            if mode == "deferred":
                raise ValueError(
                    "snapshot='deferred' needs async_save=True and a provider that can hold the "
                    "next update back (a model with its torch optimizer); use snapshot='sync'")
            return None, None, gate
        return ThreadPoolExecutor(1, thread_name_prefix="ckpt-snapshot"), hook, gate

    def _capture(self, grads: bool) -> dict[str, LiveGroup] | None:
        """References to every group's live tensors (and their versions) for a deferred read,
        or None when this read must be synchronous (no helper, or state off the CPU)."""
        if self._reader is None:
            return None
        live = {g: LiveGroup.capture(self.provider, g, grads) for g in self.groups}
        if all(t.device.type == "cpu" for lv in live.values()
               for ts in (lv.params, lv.grads, lv.optim) for t in ts.values()):
            return live
        if self.config.snapshot == "deferred":
            raise ValueError("snapshot='deferred' needs the model and optimizer state on the CPU "
                             "(a CUDA snapshot is copied inside save); use snapshot='auto'")
        return None

    def _drain_reads(self) -> None:
        """Wait for the deferred observations in flight (they use the tracker)."""
        if self._reads:
            wait_all(self._reads)

    # ----- bookkeeping --------------------------------------------------------------------

    def _adopt_manifest(self, manifest: dict) -> None:
        self._entries = {g: dict(e) for g, e in manifest["groups"].items()}
        self._save_index = int(manifest.get("save_index", 0)) + 1

    def _undo(self, rollback: _Rollback) -> None:
        """Forget the versions a failed save booked (``_book_versions``)."""
        self._entries = rollback.entries
        self._save_index = rollback.save_index
        self.tracker.restore_references(rollback.references)

    def has_checkpoint(self) -> bool:
        return self.store.latest_step() is not None

    # ----- statistics -----------------------------------------------------------------------

    def observe(self, step: int, force: bool = False) -> Mapping[str, dict[str, float]] | None:
        """Per-group update statistics at ``step`` every ``track_every_steps`` steps (or ``force``).

        Call after ``optimizer.step()`` and before ``zero_grad()`` to include gradient norms.
        Deferred (see the module docstring): returns at once; the statistics are taken on the
        helper thread before the next optimizer step, and reading the returned mapping waits for
        them. A gradient zeroed in place before it was read (``zero_grad(set_to_none=False)``)
        gives a NaN gradient norm, never the norm of a later gradient.
        """
        every = max(1, self.config.track_every_steps)
        if not force and step % every != 0:
            return None
        self._reads = [f for f in self._reads if not f.done() or f.exception() is not None]
        live = self._capture(grads=True)
        if live is None:  # synchronous, after whatever the helper thread still reads
            self._drain_reads()
            self._pending_snapshot()
            return self.tracker.observe(step)
        leave = self._gate.enter(self._add_observe_stall)

        def run() -> dict[str, dict[str, float]]:
            try:
                return self.tracker.observe(step, live)
            finally:
                leave()
        fut = self._reader.submit(run)
        self._reads.append(fut)
        return DeferredStats(fut)

    def _add_observe_stall(self, seconds: float) -> None:
        self.observe_stall_s += seconds

    def _pending_snapshot(self) -> None:
        """Wait until the pending save's snapshot (not its write) is taken."""
        if self._pending is not None and self._pending.deferred:
            wait_all([self._pending.future])

    # ----- saving ---------------------------------------------------------------------------

    def _group_nbytes(self, group: str) -> int:
        n = 0
        for k, t in group_tensors(self.provider, group).items():
            size = 4 if (not k.startswith(PARAM) and t.is_floating_point()) else t.element_size()
            n += t.numel() * size
        return n

    def save(self, step: int, extra: dict | None = None, *, data_position: Any = None,
             trainer_state: dict | None = None) -> SaveReport:
        """Checkpoint ``step``: choose groups, snapshot them, write in the background.

        ``extra`` (JSON-able dict), ``data_position`` and ``trainer_state`` are stored with the
        step and returned by ``load``. Raises the error of a previous failed background save.
        """
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        t0 = time.perf_counter()
        self._finish_pending()
        wait_s = time.perf_counter() - t0

        state_bytes, rng_tensors, config = b"", {}, None  # the step's files are rank 0's
        if self.exchange.rank == 0:
            state_bytes, rng_tensors = self._snapshot_state(step, extra, data_position, trainer_state)
            config = None if self._config_written else self.provider.model_config()
        report = SaveReport(step, [], 0.0, wait_s, 0)
        self.reports.append(report)
        live = self._capture(grads=False)
        if live is None:  # synchronous snapshot: measure, choose and copy now
            self._drain_reads()
            self._submit(self._prepare(step, report, state_bytes, rng_tensors, config, None))
        else:  # deferred: the helper thread does it before the next optimizer step
            report.deferred = True
            leave = self._gate.enter(lambda s: setattr(report, "stall_s", report.stall_s + s))
            pending = _Pending(Future(), deferred=True)

            def snapshot_then_write() -> Future:
                try:
                    pending.job = self._prepare(step, report, state_bytes, rng_tensors, config, live)
                finally:
                    leave()
                assert self._pool is not None
                return self._pool.submit(pending.job.run)
            pending.future = self._reader.submit(snapshot_then_write)
            self._pending = pending
        report.blocked_s = time.perf_counter() - t0
        return report

    def _prepare(self, step: int, report: SaveReport, state_bytes: bytes,
                 rng_tensors: dict[str, torch.Tensor], config: dict | None,
                 live: dict[str, LiveGroup] | None) -> _WriteJob:
        """Measure, choose, copy and book one save (in ``save``, or on the helper thread from
        the tensors ``live`` captured at ``save``); returns its write job."""
        t0 = time.perf_counter()
        decides = self.exchange.rank == 0
        statuses = self._group_statuses(step, live) if decides else []
        # Rank 0 chooses for every rank: it sees every group (the node's shared store, or an
        # identical copy) and holds the statistics; the others copy their share of its choice.
        reasons, unchanged = self.exchange.broadcast(
            (self._select_groups(step, statuses), {s.name for s in statuses if s.change == 0.0})
            if decides else None)
        selected = list(reasons)
        own = [g for g in selected if g in self.mine]
        copy = self.config.async_save or self.config.sync_copy
        snaps = self._snapshot_groups(own, copy, live)
        if live is not None:
            self._check_unmodified(step, live, selected, snaps)
        maybe_dup = (self._duplicate_hints(snaps, statuses) if decides
                     else {g: g in unchanged for g in snaps})
        rollback, old_refs = self._book_versions(snaps, copy, [g for g in selected if g not in own])
        report.selected[:] = selected
        report.reasons = reasons
        report.snapshot_bytes = sum(self._group_nbytes(g) for g in own)
        report.snapshot_s = time.perf_counter() - t0
        return _WriteJob(self, step, rollback.save_index, snaps, maybe_dup, state_bytes, rng_tensors,
                         config, report, old_refs=old_refs, copied=copy, rollback=rollback)

    def _check_unmodified(self, step: int, live: dict[str, LiveGroup], selected: list[str],
                          snaps: dict[str, dict[str, torch.Tensor]]) -> None:
        """Refuse a deferred snapshot of state written in place since ``save`` captured it: the
        statistics read every group's weights, the copy the chosen groups' optimizer state."""
        bad = [g for g, lv in live.items()
               if lv.modified("params") or (g in selected and lv.modified("optim"))]
        if bad:
            self._recycle(t for s in snaps.values() for t in s.values())
            self.tracker.forget_changes()
            raise StateModifiedError(
                f"checkpoint of step {step}: the live state of {bad[:3]} was written in place "
                "after save() and before its deferred snapshot was taken (only the optimizer "
                "step waits for it). Nothing of this save was committed. Change weights and "
                "optimizer state only through optimizer.step() between save() and the next "
                "step, call Checkpointer.wait() before doing so, or use snapshot='sync'.")

    def _group_statuses(self, step: int, live: dict[str, LiveGroup] | None = None) -> list[GroupStatus]:
        """What the policy sees of every group: its size, its change since the version last
        saved (``inf`` if never saved, ``nan`` if the policy does not read it) and its age."""
        statuses = []
        for pos, g in enumerate(self.groups):
            e = self._entries.get(g)
            age = None if e is None else self._save_index - int(e.get("saved_index", -1))
            if e is None:
                change = math.inf
            elif getattr(self.policy, "uses_change", True) or not self.tracker.has_reference(g):
                change = self.tracker.change(g, step, None if live is None else live[g].params)
            else:
                change = math.nan  # not needed by the policy; unchanged groups found on writing
            statuses.append(GroupStatus(g, self._group_nbytes(g), change, age, pos))
        return statuses

    def _select_groups(self, step: int, statuses: list[GroupStatus]) -> dict[str, str]:
        """The policy's choice plus every group never saved (a composite is complete), in
        model order, each with why it was chosen (``policies.REASONS``)."""
        return select_with_reasons(self.policy, PolicyContext(step, self._save_index, statuses),
                                   self.groups, self._entries)

    def _snapshot_groups(self, selected: list[str], copy: bool,
                         live: dict[str, LiveGroup] | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """The chosen groups' tensors as the blob stores them: host copies when ``copy``
        (reused buffers), else the live tensors (a synchronous save without a copy). From the
        tensors ``live`` captured at ``save`` when deferred."""
        if not copy and live is None:
            return _GroupsOnDemand(self.provider, selected)

        def tensors(g: str) -> dict[str, torch.Tensor]:
            if live is None:
                return group_tensors(self.provider, g)
            return {**{PARAM + n: t for n, t in live[g].params.items()}, **live[g].optim}
        snaps = {g: {k: self._host_copy(t, k) if copy else _as_blob_tensor(t, k)
                     for k, t in tensors(g).items()}
                 for g in selected}
        if any(t.is_pinned() for s in snaps.values() for t in s.values()):
            torch.cuda.synchronize()
        return snaps

    def _snapshot_state(self, step: int, extra: dict | None, data_position: Any,
                        trainer_state: dict | None) -> tuple[bytes, dict[str, torch.Tensor]]:
        """The step's non-layer state: ``state.json`` bytes and the torch RNG tensors."""
        state = {
            "format_version": self.store.version,
            "step": step,
            "scheduler": jsonable(self.scheduler.state_dict()) if self.scheduler is not None else None,
            "optimizer_param_groups": (self.provider.param_groups_state()
                                       if hasattr(self.provider, "param_groups_state") else None),
            "data_position": jsonable(data_position),
            "trainer_state": jsonable(trainer_state),
            "extra": jsonable(extra),
        }
        rng_tensors: dict[str, torch.Tensor] = {}
        if self.config.save_rng:
            # a provider with RNG states of its own (an imported checkpoint's) gives them
            own = getattr(self.provider, "rng_state", None)
            state["rng"], rng_tensors = own() if own is not None else capture_rng()
        return (json.dumps(state) + "\n").encode(), rng_tensors

    def _duplicate_hints(self, snaps: dict[str, dict[str, torch.Tensor]],
                         statuses: list[GroupStatus]) -> dict[str, bool | dict[str, torch.Tensor]]:
        """Per snapshot: may it be byte-identical to its last version? Such groups are hashed
        before writing (nothing written on a hit). True when measured unchanged; when not
        measured, the reference weights, compared on the writer thread (off the critical path)."""
        change_of = {s.name: s.change for s in statuses}
        hints: dict[str, bool | dict[str, torch.Tensor]] = {}
        for g in snaps:
            if math.isnan(change_of[g]):
                ref = self.tracker.reference(g)
                hints[g] = ref if ref is not None else False
            else:
                hints[g] = change_of[g] == 0.0
        return hints

    def _book_versions(self, snaps: dict[str, dict[str, torch.Tensor]], copy: bool,
                       others: list[str]) -> tuple[_Rollback, list[dict[str, torch.Tensor]]]:
        """Book the new versions now, before they are written: the snapshots become the
        tracker's references and the save takes the next save index. Returns what undoes this
        if the write fails, and the references replaced (reusable once the save commits).

        ``others``: chosen groups other ranks write; rank 0, whose tracker chooses, copies
        their weights as its references. The other ranks keep no references."""
        rollback = _Rollback({g: dict(e) for g, e in self._entries.items()}, self._save_index,
                             self.tracker.save_references())
        self._save_index += 1
        if self.exchange.rank != 0:
            return rollback, []
        old_refs = [r for g in [*snaps, *others] if (r := self.tracker.reference(g)) is not None]
        for g in [*snaps, *others]:
            if not copy and not getattr(self.policy, "uses_change", True):
                self.tracker.drop_reference(g)
            elif g in others:
                ref = {n: self._host_copy(t, PARAM + n) for n, t in self.provider.params(g).items()}
                if any(t.is_pinned() for t in ref.values()):
                    torch.cuda.synchronize()
                self.tracker.set_reference(g, ref)
            else:
                params = {k[len(PARAM):]: t for k, t in snaps[g].items() if k.startswith(PARAM)}
                self.tracker.set_reference(
                    g, params if copy else {n: t.clone() for n, t in params.items()})
        return rollback, old_refs

    def _submit(self, job: _WriteJob) -> None:
        """Run the write on the writer thread (or here, and wait, when not ``async_save``)."""
        if self._pool is not None:
            self._pending = _Pending(self._pool.submit(job.run), job)
            return
        fut: Future = Future()
        try:
            job.run()
            fut.set_result(None)
        except BaseException as e:
            fut.set_exception(e)
        self._pending = _Pending(fut, job)
        self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            out = pending.future.result()
            if isinstance(out, Future):  # a deferred save: its snapshot returned its write
                out.result()
        except BaseException:
            self._drain_reads()  # deferred observations use the tracker being rolled back
            job = pending.job
            if job is not None:  # booked: forget its versions
                self._undo(job.rollback)
                if job.copied:  # the snapshot is garbage now; the old references are live again
                    self._recycle(t for s in job.snaps.values() for t in s.values())
            raise
        job = pending.job
        assert job is not None
        if job.copied:
            # Optimizer state snapshots and replaced weight references are free for reuse (and
            # the weights too where they are no references: on the ranks that do not choose).
            keep = PARAM if self.exchange.rank == 0 else None
            self._recycle(t for s in job.snaps.values() for k, t in s.items()
                          if keep is None or not k.startswith(keep))
            self._recycle(t for r in job.old_refs for t in r.values())

    # ----- host snapshot buffers (reused: fresh pages cost more than the copy itself) --------

    def _host_copy(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """A contiguous host copy; optimizer state in fp32 (weights keep their dtype)."""
        t = t.detach()
        dtype = t.dtype
        if not key.startswith(PARAM) and t.is_floating_point():
            dtype = torch.float32
        if key.startswith("step/"):
            t = t.reshape(())
        pinned = t.device.type != "cpu"
        free = self._buffers.get((tuple(t.shape), dtype, pinned))
        if free:
            out = free.pop()
        else:
            out = torch.empty(t.shape, dtype=dtype, pin_memory=pinned)
        out.copy_(t, non_blocking=pinned)
        return out

    def _recycle(self, tensors) -> None:
        for t in tensors:
            self._buffers.setdefault((tuple(t.shape), t.dtype, t.is_pinned()), []).append(t)

    def wait(self) -> SaveReport | None:
        """Block until the running background save is committed (and deferred observations
        are taken); re-raise its error."""
        self._finish_pending()
        reads, self._reads = self._reads, []
        for f in reads:
            f.result()
        return self.reports[-1] if self.reports else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            for pool in (self._reader, self._pool):
                if pool is not None:
                    pool.shutdown(wait=True)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- loading --------------------------------------------------------------------------

    def load(self, step: int | None = None, *, strict: bool = True) -> LoadResult:
        """Load the state at ``step`` (default: newest committed) into model, optimizer,
        scheduler and RNG. ``strict``: every model group must be in the checkpoint."""
        self.wait()
        rs = open_run_step(self.run_dir, step)
        missing = [g for g in self.groups if g not in rs.entries]
        unknown = [g for g in rs.entries if g not in self.groups]
        if unknown or (strict and missing):
            raise ValueError(
                f"checkpoint step {rs.step} does not match the model: groups missing from the "
                f"checkpoint {missing}, groups unknown to the model {unknown}; load into the model "
                "it was saved from (or strict=False to skip missing groups)"
            )
        refs: dict[str, dict[str, torch.Tensor]] = {}
        for g in rs.groups():
            tensors = rs.load_group(g)
            self.provider.load_group(g, tensors)
            refs[g] = {k[len(PARAM):]: t for k, t in tensors.items() if k.startswith(PARAM)}
        st = rs.state()
        if self.scheduler is not None and st.get("scheduler") is not None:
            self.scheduler.load_state_dict(st["scheduler"])
        if hasattr(self.provider, "load_param_groups_state"):
            self.provider.load_param_groups_state(st.get("optimizer_param_groups"))
        if self.config.save_rng:
            rng = rng_dict(st.get("rng"), rs._rng_tensors())
            if rng:
                restore_rng(rng)
        self._adopt_manifest(rs.manifest)
        self.tracker.reset(refs)
        return LoadResult(
            step=rs.step, extra=st.get("extra"), data_position=st.get("data_position"),
            trainer_state=st.get("trainer_state"),
            stale_groups={g: e.saved_step for g, e in rs.entries.items() if e.saved_step < rs.step},
        )

    def resolve(self, step: int | None = None) -> ResolvedStep:
        self.wait()
        return open_run_step(self.run_dir, step)


class _GroupsOnDemand(Mapping):
    """The chosen groups of a save that does not copy (``async_save=False, sync_copy=False``),
    each read from the provider when it is used. A provider that materialises its groups (a
    checkpoint being imported, ``interop.ingest``) then holds one group at a time, not every
    chosen one; a module's live tensors cost nothing to read again."""

    def __init__(self, provider: StateProvider, groups: list[str]):
        self.provider, self.groups = provider, groups

    def __getitem__(self, group: str) -> dict[str, torch.Tensor]:
        if group not in self.groups:
            raise KeyError(group)
        return {k: _as_blob_tensor(t, k) for k, t in group_tensors(self.provider, group).items()}

    def __iter__(self) -> Iterator[str]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)


def _visible(store: RunDir, rec: BlobRecord) -> bool:
    """``rec``'s blob is in ``store``, whole (another process may have written it)."""
    try:
        return (store.root / rec.rel_path).stat().st_size == rec.nbytes
    except FileNotFoundError:
        return False


def _as_blob_tensor(t: torch.Tensor, key: str) -> torch.Tensor:
    """``t`` as the blob stores it, without a copy when it already is (sync saves)."""
    t = t.detach()
    if key.startswith("step/"):
        t = t.reshape(())
    if not key.startswith(PARAM) and t.is_floating_point() and t.dtype != torch.float32:
        t = t.float()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return t


def _blob_content(tensors: dict[str, torch.Tensor], group: str,
                  run_version: int) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A group's tensors and metadata as its blob stores them: 8-bit moments as they are (blob
    layout 2) in a run that may hold them, else as fp32 moments (layout 1)."""
    if run_version < FIRST_VERSION_8BIT:
        tensors = fp32_moments(tensors)
    layout = BLOB_FORMAT_VERSION_8BIT if has_8bit(tensors) else BLOB_FORMAT_VERSION
    return tensors, {"format": BLOB_FORMAT, "format_version": str(layout), "group": group}


class _WriteJob:
    """Everything one save writes, from host snapshots only (runs on the writer thread).

    The order is the commit protocol of ``docs/formats.md``: the new blobs (each fsynced, then
    their directories), the step's state files, then the manifest, which commits the step."""

    def __init__(self, ck: Checkpointer, step: int, save_index: int,
                 snaps: dict[str, dict[str, torch.Tensor]],
                 maybe_dup: dict[str, bool | dict[str, torch.Tensor]],
                 state_bytes: bytes, rng_tensors: dict[str, torch.Tensor], config: dict | None,
                 report: SaveReport, *, old_refs: list[dict[str, torch.Tensor]], copied: bool,
                 rollback: _Rollback):
        self.ck, self.step, self.save_index = ck, step, save_index
        self.rollback = rollback
        """What undoes this save's booking if its write fails."""
        self.snaps, self.maybe_dup = snaps, maybe_dup
        self.state_bytes, self.rng_tensors, self.config = state_bytes, rng_tensors, config
        self.report = report
        self.old_refs = old_refs
        """References the snapshots replace: free for reuse once the save commits."""
        self.copied = copied
        """The snapshots are the checkpointer's buffers (not the live tensors)."""
        self.prev_entries = {g: dict(e) for g, e in ck._entries.items()}

    def _maybe_duplicate(self, group: str) -> bool:
        hint = self.maybe_dup[group]
        if isinstance(hint, bool):
            return hint
        snap = self.snaps[group]  # hint: the previous version's weights; equal -> maybe identical
        return all(torch.equal(snap[PARAM + n], ref) for n, ref in hint.items() if PARAM + n in snap)

    def run(self) -> None:
        t0 = time.perf_counter()
        ck, store, step, ex = self.ck, self.ck.store, self.step, self.ck.exchange
        try:
            # Rank 0 holds the run's lock from before any rank writes until the commit, so a
            # `ckpt gc` never removes a blob written for a manifest still to come.
            with store.lock() if ex.rank == 0 else nullcontext():
                ex.barrier()
                if self.config is not None:
                    store.write_config(self.config)
                try:
                    own = self._write_blobs(store)
                except Exception as e:
                    if ex.world_size > 1:  # rank 0 gives up now, not at the timeout
                        ex.gather(f"rank {ex.rank}: {e}")
                    raise
                records = self._gather_records(own)
                if records is None:  # another rank's share: rank 0 commits
                    self._report(t0, [g for g, r in own.items() if r.written], None)
                    return
                groups, written, blob_bytes = self._entries(records)
                # Saving a committed step again replaces it: uncommit it before its files are
                # overwritten, so a failure here leaves the previous commit loadable.
                store.uncommit(step)
                files = self._write_step_files(store)
                nbytes = blob_bytes + sum(f["nbytes"] for f in files.values())
                store.commit(step, self._manifest(groups, written, nbytes, files))
        except CheckpointError:
            raise
        except OSError as e:
            raise write_error(e, store.root) from e
        if self.config is not None:
            ck._config_written = True
        ck._entries = {g: dict(e) for g, e in groups.items()}
        self._report(t0, written, nbytes)

    def _report(self, t0: float, written: list[str], nbytes: int | None) -> None:
        self.report.write_s = time.perf_counter() - t0
        self.report.written = written
        self.report.bytes_written = nbytes

    def _write_blobs(self, store: RunDir) -> dict[str, BlobRecord]:
        """Store this rank's snapshots as blobs, in model order; return their records when all
        new blobs and their directories are durable."""
        batch = BlobBatch()
        records: dict[str, BlobRecord] = {}
        for g in self.ck.groups:
            if g not in self.snaps:
                continue
            payload = BlobPayload.build(*_blob_content(self.snaps[g], g, store.version))
            try:
                records[g] = store.put_blob(payload, self._maybe_duplicate(g), batch)
            except BaseException:
                batch.finish_quietly()
                raise
        batch.finish()
        return records

    def _gather_records(self, own: dict[str, BlobRecord]) -> dict[str, BlobRecord] | None:
        """Every rank's records on rank 0 (None elsewhere), once every rank's blobs are
        durable. A rank that failed sent its error instead: rank 0 then commits nothing."""
        everyone = self.ck.exchange.gather(own)
        if everyone is None:
            return None
        failed = [x for x in everyone if isinstance(x, str)]
        if failed:
            raise CheckpointError(
                f"checkpoint of step {self.step}: another rank could not write its groups "
                f"({'; '.join(failed)}). Nothing of this save was committed; the previous "
                "committed checkpoint is intact.")
        records = {g: r for part in everyone for g, r in part.items()}
        unseen = [r.rel_path for part in everyone[1:] for r in part.values()
                  if not _visible(self.ck.store, r)]
        if unseen:  # written by a rank on another machine into a directory of its own
            raise CheckpointError(
                f"checkpoint of step {self.step}: blobs other ranks wrote are not in "
                f"{self.ck.store.root} ({unseen[:3]}): the run directory must be on a "
                "filesystem every writing rank sees. Nothing of this save was committed.")
        missing = [g for g in self.report.selected if g not in records]
        if missing:
            raise CheckpointError(
                f"checkpoint of step {self.step}: no rank wrote {missing[:5]} (each group needs "
                "a rank whose mine= includes it). Nothing of this save was committed.")
        return records

    def _entries(self, records: dict[str, BlobRecord]) -> tuple[dict[str, dict], list[str], int]:
        """The manifest entry of every group (the previous one for groups not saved now), the
        groups whose bytes were new, and their bytes."""
        groups: dict[str, dict] = {}
        written, nbytes = [], 0
        for g in self.ck.groups:
            rec = records.get(g)
            if rec is None:
                groups[g] = self.prev_entries[g]
                continue
            groups[g] = self._entry(g, rec)
            if rec.written:
                written.append(g)
                nbytes += rec.nbytes
        return groups, written, nbytes

    def _entry(self, group: str, rec: BlobRecord) -> dict:
        """The manifest entry of ``group``'s new version, stored as ``rec``."""
        prev = self.prev_entries.get(group)
        hash_name = self.ck.store.hash_name
        same_bytes = prev is not None and prev.get(hash_name) == rec.digest and not rec.written
        return {"blob": rec.rel_path, hash_name: rec.digest, "nbytes": rec.nbytes,
                "saved_step": self.step, "saved_index": self.save_index,
                "written_step": prev["written_step"] if same_bytes else self.step}

    def _write_step_files(self, store: RunDir) -> dict[str, dict]:
        """``state.json`` and ``rng.safetensors``, each durable; their manifest records."""
        files = {"state.json": store.write_step_file(self.step, "state.json", self.state_bytes)}
        if self.rng_tensors:
            files["rng.safetensors"] = store.write_step_file(
                self.step, "rng.safetensors", st_save(self.rng_tensors))
        return files

    def _manifest(self, groups: dict[str, dict], written: list[str], nbytes: int,
                  files: dict[str, dict]) -> dict:
        ck = self.ck
        version = ck.store.version
        return {
            "format": "layerwise-ckpt-manifest",
            "format_version": version,
            **({"hash": ck.store.hash_name} if version >= 2 else {}),
            "step": self.step,
            "save_index": self.save_index,
            "created_unix_s": now_unix_s(),
            "policy": ck.policy.name,
            "policy_config": ck.policy.config() if hasattr(ck.policy, "config") else {},
            "tied": bool(getattr(ck.provider, "tied", False)),
            "bytes_written": nbytes,
            "groups_written": written,
            "files": files,
            "groups": groups,
        }
