"""Plan: what the engine obeys. JSON-serialisable; produced by a rule or by the planner.

Fields and tiers: ``docs/formats.md``. Boundary ``i`` is the activation entering layer ``i``
(0: the embedding output); the head's input is consumed at once by the chunked loss, never
stored. A layer keeping its internals needs no boundary ``i`` in its backward. Weights are never
among the kept tensors: the backward streams them in again (unless resident)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..util.atomic import atomic_write_text

TIERS = ("device", "host", "nvme", "recompute")
STORED_TIERS = ("device", "host", "nvme")
INTERNAL_TIERS = ("device", "host", "recompute")
MOMENT_KINDS = ("fp32", "8bit")
STATE_TIERS = ("ram", "nvme", "nvme-all")
NVME_STATE_SLOTS = 3
"""Units whose NVMe state is staged in RAM at once: one being updated, one read ahead, one being
written back (the RAM an ``nvme`` state tier still needs, beside the units in ``ram``)."""
NVME_SOURCE_SLOTS = 3
"""Units whose copy source on NVMe (``nvme-all``) is staged in RAM at once: one being copied to
the device, one read ahead, one being written back by its update."""
NVME_GRAD_SLOTS = 2
"""Units whose gradient on NVMe (``nvme-all``) is staged in RAM at once: one landing, one being
written back (or read by its update)."""
FORMAT_VERSION = 4
"""The one plan file format this layerwise writes and reads; a file of another version is
refused (``refuse_version``)."""


def refuse_version(version: object, where: str | None = None) -> None:
    """Refuse, in one line, a plan of a format version other than this layerwise's (``where``:
    its file)."""
    if version != FORMAT_VERSION:
        raise ValueError(f"{where + ': ' if where else ''}plan format_version {version}; this layerwise reads "
                         f"{FORMAT_VERSION}: write it again with `layerwise plan ... --out FILE`")


@dataclass
class Plan:
    boundary_tiers: list[str]
    """Tier of each layer-input boundary, length ``num_layers``."""
    internal_tiers: list[str] | None = None
    """Tier of each layer's internals (saved tensors), length ``num_layers``; None (read as all
    ``recompute``) is replaced by the list in ``__post_init__``."""
    micro_batch_size: int = 1
    """Sequences per micro-batch."""
    num_micro_batches: int = 1
    """Micro-batches accumulated into one optimizer step."""
    seq_len: int | None = None
    """Sequence length the plan was made for (None: any)."""
    prefetch_depth: int = 1
    """How many layers ahead weights are streamed in (1 = double buffering)."""
    micro_batches_per_load: int = 1
    """Micro-batches run through each op before the next one (1: micro-batch-major, each
    micro-batch runs the whole program; > 1: layer-major, they share each weight load and a
    unit's gradient is summed over them on the device and sent once)."""
    resident_layers: list[int] = field(default_factory=list)
    """Decoder layers whose weights stay on the device for the run (refreshed once per step)."""
    head_chunk_tokens: int = 1024
    """Tokens per lm_head + loss chunk; bounds the logits held at once."""
    moments: list[str] | None = None
    """Per unit (embed, layers..., head): optimizer moments ``fp32`` or ``8bit``; None = all fp32."""
    state_tiers: list[str] | None = None
    """Per unit (embed, layers..., head): ``ram``, ``nvme`` or ``nvme-all`` (see above); None =
    all ``ram``."""
    source: str = "manual"
    """Which rule or solver produced the plan."""
    predicted: dict[str, Any] = field(default_factory=dict)
    """The planner's predictions (step time, peak bytes, ...), informational."""
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.internal_tiers is None:
            self.internal_tiers = ["recompute"] * len(self.boundary_tiers)
        self.validate()

    @property
    def num_layers(self) -> int:
        return len(self.boundary_tiers)

    @property
    def layer_major(self) -> bool:
        return self.micro_batches_per_load > 1

    def lands_once(self, num_micro_batches: int | None = None) -> bool:
        """Every unit's gradient reaches the host once per step (a tied embedding's two parts
        aside): one micro-batch, or all of them sharing each weight load. Then nothing is
        summed on the host, and a bf16 gradient can land as the device computed it."""
        n = self.num_micro_batches if num_micro_batches is None else num_micro_batches
        return n <= self.micro_batches_per_load

    def validate(self, num_layers: int | None = None) -> None:
        bad = [t for t in self.boundary_tiers if t not in TIERS]
        if bad:
            raise ValueError(f"plan has unknown boundary tiers {sorted(set(bad))}; allowed: {TIERS}")
        bad = [t for t in self.internal_tiers if t not in INTERNAL_TIERS]
        if bad:
            raise ValueError(f"plan has unknown internal tiers {sorted(set(bad))}; allowed: {INTERNAL_TIERS}")
        if len(self.internal_tiers) != len(self.boundary_tiers):
            raise ValueError(
                f"plan has {len(self.internal_tiers)} internal tiers but {len(self.boundary_tiers)} "
                "boundary tiers; give one of each per layer")
        if num_layers is not None and len(self.boundary_tiers) != num_layers:
            raise ValueError(
                f"plan is for {len(self.boundary_tiers)} layers but the model has {num_layers}; "
                "make a plan for this model (layerwise plan --model ...)"
            )
        for name in ("micro_batch_size", "num_micro_batches", "prefetch_depth", "head_chunk_tokens",
                     "micro_batches_per_load"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan.{name} must be >= 1, got {getattr(self, name)}")
        n = self.num_layers
        bad = [i for i in self.resident_layers if not isinstance(i, int) or not 0 <= i < n]
        if bad or len(set(self.resident_layers)) != len(self.resident_layers):
            raise ValueError(f"plan.resident_layers must be distinct layer indices in [0, {n}), got "
                             f"{self.resident_layers}")
        if self.moments is not None:
            if num_layers is not None and len(self.moments) != num_layers + 2:
                raise ValueError(
                    f"plan.moments has {len(self.moments)} entries; expected num_layers + 2 = "
                    f"{num_layers + 2} (embed, every layer, head)"
                )
            if any(m not in MOMENT_KINDS for m in self.moments):
                raise ValueError(f"plan.moments entries must be one of {MOMENT_KINDS}")
        if self.state_tiers is not None:
            if num_layers is not None and len(self.state_tiers) != num_layers + 2:
                raise ValueError(
                    f"plan.state_tiers has {len(self.state_tiers)} entries; expected num_layers + 2 "
                    f"= {num_layers + 2} (embed, every layer, head)")
            if any(t not in STATE_TIERS for t in self.state_tiers):
                raise ValueError(f"plan.state_tiers entries must be one of {STATE_TIERS}")
        refuse_version(self.format_version)

    def nvme_units(self, unit_names: list[str], source: bool = False) -> list[str]:
        """The units of ``unit_names`` (embed, layers..., head) whose state the plan puts on
        NVMe; ``source``: those whose copy source too (``nvme-all``)."""
        on = ("nvme-all",) if source else ("nvme", "nvme-all")
        return [u for u, t in zip(unit_names, self.state_tiers or ()) if t in on]

    # ----- rules --------------------------------------------------------------------------

    @classmethod
    def every_k(cls, num_layers: int, k: int, **kw: Any) -> Plan:
        """MegaTrain's rule: keep every k-th boundary on the device, recompute the rest."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        tiers = ["device" if i % k == 0 else "recompute" for i in range(num_layers)]
        return cls(tiers, source=f"every-{k}", **kw)

    @classmethod
    def recompute_all(cls, num_layers: int, **kw: Any) -> Plan:
        return cls(["recompute"] * num_layers, source="recompute-all", **kw)

    @classmethod
    def keep_all(cls, num_layers: int, tier: str = "device", **kw: Any) -> Plan:
        return cls([tier] * num_layers, source=f"keep-all-{tier}", **kw)

    @classmethod
    def keep_internals(cls, num_layers: int, tier: str = "device", **kw: Any) -> Plan:
        """Every layer's forward graph kept for its backward: nothing recomputed (``keep_all``
        keeps the boundaries but runs each layer's forward again in its backward)."""
        return cls(["recompute"] * num_layers, [tier] * num_layers, source=f"keep-internals-{tier}", **kw)

    # ----- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str | None = None) -> Plan:
        """The plan ``d`` describes; one of another format version is refused (``where``: its
        file, for that refusal)."""
        refuse_version(d.get("format_version"), where)
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"plan has unknown keys {sorted(unknown)}")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"plan file {path} does not exist") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"plan file {path} is not valid JSON: {e}") from None
        return cls.from_dict(d, str(path))

