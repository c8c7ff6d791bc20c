"""The commit of a save and the bookkeeping of committed versions (from which the policy sees
every group's age), shared by ``Checkpointer`` and ``ShardedCheckpointer``; what a load checks
and reports."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..models.names import group_sort_key, joined_group
from .policies import GroupStatus, Policy, PolicyContext, select_with_reasons
from .reports import LoadResult
from .resolve import ResolvedStep
from .run_dir import RunDir
from .run_format import FORMAT_VERSION
from .step_state import StepState

MANIFEST_FORMAT = "layerwise-ckpt-manifest"


@dataclass
class CommittedVersions:
    """Every group's committed version (its manifest entry) and the index the next save takes."""

    entries: dict[str, dict]
    next_index: int = 0

    @classmethod
    def newest(cls, store: RunDir) -> CommittedVersions:
        """The versions of the newest committed step (none in a new run)."""
        latest = store.latest_step()
        return cls({}) if latest is None else cls.of(store.read_manifest(latest))

    @classmethod
    def of(cls, manifest: dict) -> CommittedVersions:
        return cls({g: dict(e) for g, e in manifest["groups"].items()},
                   int(manifest.get("save_index", 0)) + 1)

    def adopt(self, manifest: dict) -> None:
        """The versions of ``manifest`` (a step just committed or loaded) become current."""
        adopted = self.of(manifest)
        self.entries, self.next_index = adopted.entries, adopted.next_index

    def saved(self, save_index: int, entries: dict[str, dict] | None) -> None:
        """A save that took ``save_index`` is written: the next save takes the next index, and
        ``entries`` (its manifest's groups; None where another rank committed) are current."""
        self.next_index = save_index + 1
        if entries is not None:
            self.entries = {g: dict(e) for g, e in entries.items()}

    def copy_entries(self) -> dict[str, dict]:
        return {g: dict(e) for g, e in self.entries.items()}

    def status(self, group: str, position: int, nbytes: int,
               change: Callable[[], float]) -> GroupStatus:
        """What the policy sees of ``group``: ``change()`` is asked only of a group saved before
        (a new group has changed infinitely), and its age counts saves since its version."""
        e = self.entries.get(group)
        if e is None:
            return GroupStatus(group, nbytes, math.inf, None, position)
        return GroupStatus(group, nbytes, change(), self.next_index - int(e.get("saved_index", -1)),
                           position)

    def select(self, policy: Policy, step: int, statuses: list[GroupStatus],
               groups: list[str]) -> dict[str, str]:
        """The policy's choice plus every group never saved (a composite is complete), in
        model order, each with why it was chosen (``policies.REASONS``)."""
        return select_with_reasons(policy, PolicyContext(step, self.next_index, statuses),
                                   groups, self.entries)


@dataclass(frozen=True)
class ManifestHeader:
    """What a manifest says about the save as a whole, besides its groups and files."""

    save_index: int
    policy: str
    policy_config: dict
    tied: bool
    world_size: int | None = None
    """Sharded saves only: the number of ranks that wrote it."""

    @classmethod
    def of(cls, save_index: int, policy: Policy, provider: object,
           world_size: int | None = None) -> ManifestHeader:
        config = policy.config() if hasattr(policy, "config") else {}
        return cls(save_index, policy.name, config, bool(getattr(provider, "tied", False)),
                   world_size)


def commit_step(store: RunDir, step: int, header: ManifestHeader, state: StepState,
                groups: dict[str, dict], written: list[str], blob_bytes: int) -> dict:
    """Commit ``step`` (every blob ``groups`` names already durable): a committed step saved
    again is uncommitted before its files are overwritten, so a failure here leaves the previous
    commit loadable; then the step's files, then the manifest. Returns the manifest."""
    store.uncommit(step)
    files = state.write(store, step)
    manifest = {
        "format": MANIFEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "hash": store.hash_name,
        "step": step,
        "save_index": header.save_index,
        "created_unix_s": round(time.time(), 3),
        "policy": header.policy,
        "policy_config": header.policy_config,
        "tied": header.tied,
        **({"world_size": header.world_size} if header.world_size is not None else {}),
        "bytes_written": blob_bytes + sum(f["nbytes"] for f in files.values()),
        "groups_written": written,
        "files": files,
        "groups": groups,
    }
    store.commit(step, manifest)
    return manifest


def written_step(prev: dict | None, same_bytes: bool, step: int) -> int:
    """The step whose save first wrote the bytes of a group's new version: ``prev``'s (the
    committed entry) when they are the same bytes, else ``step``."""
    return prev["written_step"] if prev is not None and same_bytes else step


def regrouped(versions: CommittedVersions, groups: list[str]) -> CommittedVersions:
    """``versions`` for a checkpointer of ``groups``: none (every group written at the next
    save) when they are the same layers grouped otherwise (``ckpt.expert_groups`` switched), so
    that a layer's old whole version and new expert slices never mix in one manifest."""
    stored = set(versions.entries)
    if stored and stored != set(groups) and _joined(stored) == _joined(groups):
        return CommittedVersions({}, versions.next_index)
    return versions


def _joined(groups) -> set[str]:
    return {joined_group(g) for g in groups}


def check_groups_match(rs: ResolvedStep, groups: list[str], strict: bool = True,
                       strict_hint: str = "") -> None:
    """Refuse to load ``rs`` into a model whose groups differ (``strict``: every model group
    must be stored; ``strict_hint`` tells how to relax that). Compared as layers: a layer's
    expert groups joined (a run saved with or without ``ckpt.expert_groups`` loads either way)."""
    stored, model = rs.groups(), sorted(_joined(groups), key=group_sort_key)
    missing = [g for g in model if g not in stored]
    unknown = [g for g in stored if g not in model]
    if unknown or (strict and missing):
        raise ValueError(
            f"checkpoint step {rs.step} does not match the model: groups missing from the "
            f"checkpoint {missing}, groups unknown to the model {unknown}; load into the model "
            f"it was saved from{strict_hint}"
        )


def load_result(rs: ResolvedStep, state: dict) -> LoadResult:
    """What loading ``rs`` returns, from its ``state.json`` (``restore_step_state``)."""
    return LoadResult(
        step=rs.step, extra=state.get("extra"), data_position=state.get("data_position"),
        trainer_state=state.get("trainer_state"),
        stale_groups={g: e.saved_step for g, e in rs.entries.items() if e.saved_step < rs.step},
        world_size_saved=rs.manifest.get("world_size"))
