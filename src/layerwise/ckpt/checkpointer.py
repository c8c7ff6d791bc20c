"""``Checkpointer``: layer-wise checkpoints for a plain PyTorch training loop.

::

    ckpt = Checkpointer("runs/a", model, optimizer, scheduler, policy="filter", threshold=1e-3)
    start = ckpt.load().step + 1 if ckpt.has_checkpoint() else 0   # resume, no rewrite
    for step in range(start, num_steps):
        loss.backward(); optimizer.step(); scheduler.step()
        ckpt.observe(step)                  # update statistics (every N steps; cheap)
        optimizer.zero_grad()
        if step % 100 == 0:
            ckpt.save(step, extra={"data_position": step + 1})   # blocks only for the snapshot
    ckpt.wait()                             # the last background write, and its errors

A save asks the policy which groups to write, copies those groups (weights + optimizer state)
to host memory, and returns; a background thread writes the blobs, the step's non-layer state
and finally the manifest. One save writes at a time: the next ``save`` first waits for the
previous one (that wait is part of its blocked time, reported separately as ``wait_s``).
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch import nn

from .errors import CheckpointError
from .run_dir import (
    BLOB_FORMAT,
    BLOB_FORMAT_VERSION,
    BlobBatch,
    BlobPayload,
    BlobRecord,
    RunDir,
    now_unix_s,
    write_error,
)
from .policies import GroupStatus, Policy, PolicyContext, make_policy
from .resolve import ResolvedStep, open_run_step
from .state import (
    PARAM,
    ModuleStateProvider,
    StateProvider,
    capture_rng,
    group_tensors,
    jsonable,
    restore_rng,
    rng_dict,
)
from .tracker import TrackerReferences, UpdateTracker


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


@dataclass
class SaveReport:
    step: int
    selected: list[str]
    """Groups the policy chose."""
    blocked_s: float
    """Time ``save`` held the caller (includes ``wait_s``)."""
    wait_s: float
    """Part of ``blocked_s`` spent waiting for the previous save to finish."""
    snapshot_bytes: int
    write_s: float | None = None
    """Background time to write blobs, state and manifest (None until done)."""
    written: list[str] | None = None
    """Groups whose bytes were new (the rest were deduplicated)."""
    bytes_written: int | None = None
    """New blob bytes plus the step's state files and manifest."""

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
        **options: Any,
    ):
        """``options``: fields of ``CheckpointConfig`` (e.g. ``async_save=False``) and the
        policy's own options (e.g. ``threshold=1e-3``), in one flat namespace."""
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
        self.tracker = UpdateTracker(
            provider, self.run_dir / "tracker.jsonl" if self.config.tracker_log else None)
        self.reports: list[SaveReport] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-writer") if self.config.async_save else None
        self._pending: Future | None = None
        self._pending_job: _WriteJob | None = None
        self._pending_rollback: _Rollback | None = None
        self._buffers: dict[tuple, list[torch.Tensor]] = {}
        self._config_written = (self.run_dir / "config.json").exists()
        # Bookkeeping of committed versions (rebuilt from the newest manifest, or by load()).
        self._entries: dict[str, dict] = {}
        self._save_index = 0
        latest = self.store.latest_step()
        if latest is not None:
            self._adopt_manifest(self.store.read_manifest(latest))

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

    def observe(self, step: int, force: bool = False) -> dict | None:
        """Per-group update statistics at ``step`` every ``track_every_steps`` steps (or ``force``).

        Call after ``optimizer.step()`` and before ``zero_grad()`` to include gradient norms.
        """
        every = max(1, self.config.track_every_steps)
        if not force and step % every != 0:
            return None
        return self.tracker.observe(step)

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

        statuses = self._group_statuses(step)
        selected = self._select_groups(step, statuses)
        copy = self.config.async_save or self.config.sync_copy
        snaps = self._snapshot_groups(selected, copy)
        state_bytes, rng_tensors = self._snapshot_state(step, extra, data_position, trainer_state)
        maybe_dup = self._duplicate_hints(snaps, statuses)
        rollback, old_refs = self._book_versions(snaps, copy)

        snapshot_bytes = sum(t.numel() * t.element_size() for s in snaps.values() for t in s.values())
        report = SaveReport(step, selected, 0.0, wait_s, snapshot_bytes)
        job = _WriteJob(self, step, rollback.save_index, snaps, maybe_dup, state_bytes, rng_tensors,
                        None if self._config_written else self.provider.model_config(), report,
                        old_refs=old_refs, copied=copy)
        self._submit(job, rollback)
        report.blocked_s = time.perf_counter() - t0
        self.reports.append(report)
        return report

    def _group_statuses(self, step: int) -> list[GroupStatus]:
        """What the policy sees of every group: its size, its change since the version last
        saved (``inf`` if never saved, ``nan`` if the policy does not read it) and its age."""
        statuses = []
        for pos, g in enumerate(self.groups):
            e = self._entries.get(g)
            age = None if e is None else self._save_index - int(e.get("saved_index", -1))
            if e is None:
                change = math.inf
            elif getattr(self.policy, "uses_change", True) or not self.tracker.has_reference(g):
                change = self.tracker.change(g, step)
            else:
                change = math.nan  # not needed by the policy; unchanged groups found on writing
            statuses.append(GroupStatus(g, self._group_nbytes(g), change, age, pos))
        return statuses

    def _select_groups(self, step: int, statuses: list[GroupStatus]) -> list[str]:
        """The policy's choice plus every group never saved (a composite is complete), in
        model order."""
        selected = set(self.policy.select(PolicyContext(step, self._save_index, statuses)))
        selected |= {g for g in self.groups if g not in self._entries}
        return [g for g in self.groups if g in selected]

    def _snapshot_groups(self, selected: list[str], copy: bool) -> dict[str, dict[str, torch.Tensor]]:
        """The chosen groups' tensors as the blob stores them: host copies when ``copy``
        (reused buffers), else the live tensors (a synchronous save without a copy)."""
        snaps = {g: {k: self._host_copy(t, k) if copy else _as_blob_tensor(t, k)
                     for k, t in group_tensors(self.provider, g).items()}
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
            state["rng"], rng_tensors = capture_rng()
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

    def _book_versions(self, snaps: dict[str, dict[str, torch.Tensor]],
                       copy: bool) -> tuple[_Rollback, list[dict[str, torch.Tensor]]]:
        """Book the new versions now, before they are written: the snapshots become the
        tracker's references and the save takes the next save index. Returns what undoes this
        if the write fails, and the references replaced (reusable once the save commits)."""
        rollback = _Rollback({g: dict(e) for g, e in self._entries.items()}, self._save_index,
                             self.tracker.save_references())
        old_refs = [r for g in snaps if (r := self.tracker.reference(g)) is not None]
        for g, snap in snaps.items():
            params = {k[len(PARAM):]: t for k, t in snap.items() if k.startswith(PARAM)}
            if copy:
                self.tracker.set_reference(g, params)
            elif getattr(self.policy, "uses_change", True):
                self.tracker.set_reference(g, {n: t.clone() for n, t in params.items()})
            else:
                self.tracker.drop_reference(g)
        self._save_index += 1
        return rollback, old_refs

    def _submit(self, job: _WriteJob, rollback: _Rollback) -> None:
        """Run the write on the writer thread (or here, and wait, when not ``async_save``)."""
        self._pending_job, self._pending_rollback = job, rollback
        if self._pool is not None:
            self._pending = self._pool.submit(job.run)
            return
        fut: Future = Future()
        try:
            job.run()
            fut.set_result(None)
        except BaseException as e:
            fut.set_exception(e)
        self._pending = fut
        self._finish_pending()

    def _finish_pending(self) -> None:
        fut, self._pending = self._pending, None
        if fut is None:
            return
        job, self._pending_job = self._pending_job, None
        rollback, self._pending_rollback = self._pending_rollback, None
        try:
            fut.result()
        except BaseException:
            if rollback is not None:
                self._undo(rollback)
            if job.copied:  # the snapshot is garbage now; the old references are live again
                self._recycle(t for s in job.snaps.values() for t in s.values())
            raise
        if job.copied:
            # Optimizer state snapshots and replaced weight references are free for reuse.
            self._recycle(t for s in job.snaps.values() for k, t in s.items() if not k.startswith(PARAM))
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
        """Block until the running background save is committed; re-raise its error."""
        self._finish_pending()
        return self.reports[-1] if self.reports else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)

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


def _finish_quietly(batch: BlobBatch) -> None:
    """Let the blobs already handed to ``batch`` land (or fail) before reporting an error."""
    try:
        batch.finish()
    except BaseException:
        pass


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


class _WriteJob:
    """Everything one save writes, from host snapshots only (runs on the writer thread).

    The order is the commit protocol of ``docs/formats.md``: the new blobs (each fsynced, then
    their directories), the step's state files, then the manifest, which commits the step."""

    def __init__(self, ck: Checkpointer, step: int, save_index: int,
                 snaps: dict[str, dict[str, torch.Tensor]],
                 maybe_dup: dict[str, bool | dict[str, torch.Tensor]],
                 state_bytes: bytes, rng_tensors: dict[str, torch.Tensor], config: dict | None,
                 report: SaveReport, *, old_refs: list[dict[str, torch.Tensor]], copied: bool):
        self.ck, self.step, self.save_index = ck, step, save_index
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
        ck, store, step = self.ck, self.ck.store, self.step
        try:
            with store.lock():
                if self.config is not None:
                    store.write_config(self.config)
                groups, written, blob_bytes = self._write_blobs(store)
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
        self.report.write_s = time.perf_counter() - t0
        self.report.written = written
        self.report.bytes_written = nbytes

    def _write_blobs(self, store: RunDir) -> tuple[dict[str, dict], list[str], int]:
        """Store every snapshot as a blob; return when all new blobs and their directories are
        durable. Returns the manifest entry of every group (the previous one for groups not
        saved now), the groups whose bytes were new, and their bytes."""
        batch = BlobBatch()
        groups: dict[str, dict] = {}
        written, nbytes = [], 0
        for g in self.ck.groups:
            if g not in self.snaps:
                groups[g] = self.prev_entries[g]
                continue
            payload = BlobPayload.build(self.snaps[g], {
                "format": BLOB_FORMAT, "format_version": str(BLOB_FORMAT_VERSION), "group": g})
            try:
                rec = store.put_blob(payload, self._maybe_duplicate(g), batch)
            except BaseException:
                _finish_quietly(batch)
                raise
            groups[g] = self._entry(g, rec)
            if rec.written:
                written.append(g)
                nbytes += rec.nbytes
        batch.finish()
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
