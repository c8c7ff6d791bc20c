"""Selection policies: which groups a checkpoint writes.

``BasePolicy.select`` holds the rules no policy can break: a never-saved group is written,
``full_every`` writes everything, ``max_staleness`` bounds age. Register a policy with
``@register_policy("name")`` on a ``BasePolicy`` dataclass implementing ``choose``;
``select_reasons`` says why each group was chosen (``REASONS``)."""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

REASONS = ("new", "full_every", "stale", "criterion", "every_group")
"""Why a group is written: never saved before; a ``full_every`` checkpoint; ``max_staleness``
reached; chosen by the policy's own rule (threshold, top-k, budget, parity, full); a save asked
to write every group (a run's last, or an interrupted run's)."""


@dataclass(frozen=True)
class GroupStatus:
    name: str
    nbytes: int
    """Bytes of the group's blob (weights + optimizer state)."""
    change: float
    """Relative L2 change of the weights since the version last saved; ``inf`` if never saved,
    NaN when the policy does not use it (not measured)."""
    age: int | None
    """Checkpoints since the group was last saved (1 = saved by the previous one); None if never."""
    position: int
    """Index of the group in model order."""


@dataclass(frozen=True)
class PolicyContext:
    step: int
    save_index: int
    """0 for the run's first checkpoint, then 1, 2, …"""
    groups: list[GroupStatus]

    @property
    def total_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)


class Policy(Protocol):
    name: str

    def select(self, ctx: PolicyContext) -> set[str]:
        """The groups to write at this checkpoint."""
        ...

    def config(self) -> dict:
        """Options, for the manifest."""
        ...


def select_with_reasons(policy: Policy, ctx: PolicyContext, groups: list[str],
                        saved: Container[str]) -> dict[str, str]:
    """The policy's choice plus every group never saved (so a composite is complete), in the
    order of ``groups``, each with why it was chosen (``REASONS``)."""
    explain = getattr(policy, "select_reasons", None)
    reasons = dict(explain(ctx)) if explain is not None else {g: "criterion" for g in policy.select(ctx)}
    reasons.update({g: "new" for g in groups if g not in saved})
    return {g: reasons[g] for g in groups if g in reasons}


@dataclass
class BasePolicy:
    max_staleness: int | None = None
    """At most this many checkpoints between two saves of any group (None: unbounded)."""
    full_every: int | None = None
    """Write every group at every N-th checkpoint (None: only the first)."""

    name = "base"
    uses_change = True
    """Whether ``choose`` reads ``GroupStatus.change`` (else the save skips measuring it: NaN)."""

    def __post_init__(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None (got {self.max_staleness})")
        if self.full_every is not None and self.full_every < 1:
            raise ValueError(f"full_every must be >= 1 or None (got {self.full_every})")

    def select(self, ctx: PolicyContext) -> set[str]:
        return set(self.select_reasons(ctx))

    def select_reasons(self, ctx: PolicyContext) -> dict[str, str]:
        """The groups to write, each with the first rule that chose it (``REASONS``, in that
        order: a group the guards force counts for the guard even if the criterion agrees)."""
        if self.full_every is not None and ctx.save_index % self.full_every == 0:
            return {g.name: "new" if g.age is None else "full_every" for g in ctx.groups}
        out = {g.name: "new" for g in ctx.groups if g.age is None}
        if self.max_staleness is not None:
            # Skipped now, this checkpoint would use a version ``age`` checkpoints old.
            out.update({g.name: "stale" for g in ctx.groups
                        if g.age is not None and g.age > self.max_staleness})
        for name in self.choose(ctx, set(out)):
            out.setdefault(name, "criterion")
        return out

    def choose(self, ctx: PolicyContext, forced: set[str]) -> set[str]:
        raise NotImplementedError

    def config(self) -> dict:
        return {"name": self.name, **asdict(self)}


POLICIES: dict[str, type[BasePolicy]] = {}


def register_policy(name: str):
    def deco(cls: type[BasePolicy]) -> type[BasePolicy]:
        cls.name = name
        POLICIES[name] = cls
        return cls
    return deco


def make_policy(policy: str | BasePolicy | Any, **options: Any) -> Policy:
    """A policy from its registry name and options (or pass an instance through)."""
    if not isinstance(policy, str):
        if options:
            raise ValueError("pass options either to the policy instance or here, not both")
        return policy
    name, _, inline = policy.partition(":")
    if inline:  # "filter:threshold=0.01,max_staleness=4"
        for item in inline.split(","):
            k, eq, v = item.partition("=")
            if not eq:
                raise ValueError(f"policy option {item!r} is not key=value (in {policy!r})")
            options.setdefault(k.strip(), parse_policy_value(v.strip()))
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown checkpoint policy {name!r}; known: {sorted(POLICIES)}")
    known = {f.name for f in fields(cls)}
    bad = set(options) - known
    if bad:
        raise ValueError(f"policy {name!r} has no option(s) {sorted(bad)}; options: {sorted(known)}")
    return cls(**options)


def parse_policy_value(v: str) -> Any:
    """A ``key=value`` option's value: None, an int, a float, else the string."""
    if v.lower() in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(v)
        except ValueError:
            pass
    return v


@register_policy("full")
@dataclass
class FullPolicy(BasePolicy):
    """Every group at every checkpoint (what an ordinary checkpoint does, but deduplicated)."""

    uses_change = False

    def choose(self, ctx: PolicyContext, forced: set[str]) -> set[str]:
        return {g.name for g in ctx.groups}


@register_policy("parity")
@dataclass
class ParityPolicy(BasePolicy):
    """Alternate halves: groups at even positions (model order) on even checkpoints, odd on odd.

    Every group is then at most one checkpoint stale, at half the bytes per checkpoint."""

    uses_change = False

    def choose(self, ctx: PolicyContext, forced: set[str]) -> set[str]:
        return {g.name for g in ctx.groups if g.position % 2 == ctx.save_index % 2}


@register_policy("filter")
@dataclass
class FilterPolicy(BasePolicy):
    """The groups whose weights moved more than ``threshold`` since their last saved version.
    ``max_fraction`` caps the bytes per checkpoint (most changed first): layers drift together, and
    the cap spreads their writes so the composite is never stalest everywhere at once."""

    threshold: float = 0.01
    """Relative L2 change ``|w - w_saved| / |w_saved|`` above which a group is written. The
    default is measured (``benchmarks/filter_threshold.py``): between two saves 50 steps apart,
    a fine-tune at LR 2e-5 to 1e-4 moves about a third of its groups more than 1% (and the
    final norm, far less); at 1e-3 every save would write nearly every group."""
    max_fraction: float | None = None
    """Bytes per checkpoint as a fraction of all groups' bytes (None: no cap). When nothing else
    is written, the most changed group over the threshold is, even if it alone is larger."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.threshold >= 0:
            raise ValueError(f"filter threshold must be >= 0 (got {self.threshold})")
        if self.max_fraction is not None and not 0 < self.max_fraction <= 1:
            raise ValueError(f"filter max_fraction must be in (0, 1] or None (got {self.max_fraction})")

    def choose(self, ctx: PolicyContext, forced: set[str]) -> set[str]:
        over = [g for g in ctx.groups if g.change > self.threshold and g.name not in forced]
        if self.max_fraction is None:
            return {g.name for g in over}
        cap = self.max_fraction * ctx.total_bytes
        used = sum(g.nbytes for g in ctx.groups if g.name in forced)
        out: set[str] = set()
        for g in sorted(over, key=lambda g: (-g.change, g.position)):
            if used + g.nbytes <= cap or not (out or forced):
                out.add(g.name)
                used += g.nbytes
        return out


@register_policy("topk")
@dataclass
class TopKPolicy(BasePolicy):
    """The ``k`` groups that changed most (forced groups count towards ``k``)."""

    k: int = 4
    """Groups per checkpoint (at least; more when staleness forces them)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.k < 1:
            raise ValueError(f"topk k must be >= 1 (got {self.k})")

    def choose(self, ctx: PolicyContext, forced: set[str]) -> set[str]:
        room = max(0, self.k - len(forced))
        rest = sorted((g for g in ctx.groups if g.name not in forced and g.change > 0),
                      key=lambda g: (-g.change, g.position))
        return {g.name for g in rest[:room]}


@register_policy("budget")
@dataclass
class BudgetPolicy(BasePolicy):
    """Fill a byte budget per checkpoint greedily by change per byte.

    Forced groups (never saved, too stale) are written even past the budget and use it up first."""

    budget_bytes: int | None = None
    """Bytes per checkpoint; None: ``budget_fraction`` of a full checkpoint."""
    budget_fraction: float = 0.25
    """Budget as a fraction of all groups' bytes, when ``budget_bytes`` is None."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0 (got {self.budget_bytes})")
        if not 0 < self.budget_fraction <= 1:
            raise ValueError(f"budget_fraction must be in (0, 1] (got {self.budget_fraction})")

    def choose(self, ctx: PolicyContext, forced: set[str]) -> set[str]:
        budget = self.budget_bytes if self.budget_bytes is not None else math.floor(
            self.budget_fraction * ctx.total_bytes)
        used = sum(g.nbytes for g in ctx.groups if g.name in forced)
        out = set()
        rest = sorted((g for g in ctx.groups if g.name not in forced and g.change > 0),
                      key=lambda g: (-g.change / max(g.nbytes, 1), g.position))
        for g in rest:
            if used + g.nbytes <= budget:
                out.add(g.name)
                used += g.nbytes
        return out
