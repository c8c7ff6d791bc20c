"""Sharded group versions: a group stored as one blob per writing rank.

A sharded entry has ``shards``: per rank its blob and, per key, the flat range ``[start, stop)``
of the full tensor (with shape, dtype); that covers FSDP2 ``Shard(0)`` (padding never stored) and
ZeRO partitions. Here: checking a layout (every key covered once) and reading a whole group
(``assemble``) or some elements (``ShardedGroupReader``), so a save by N ranks loads at M.
Expert groups use the same records, marked ``slice_of`` (``joined_shards``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..util.safetensors_io import DTYPE_NAMES
from .errors import CheckpointCorruptError

DTYPE_OF_NAME = {v: k for k, v in DTYPE_NAMES.items()}


class ShardLayoutError(CheckpointCorruptError):
    """A sharded group's records do not describe its tensors exactly (gap, overlap, a shape or
    dtype the shards disagree on)."""


@dataclass(frozen=True)
class KeyLayout:
    """One tensor of a sharded group: its full shape and dtype and where its elements are."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    """``(start, stop, shard index)``, sorted, covering ``[0, numel)`` exactly."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def is_sharded(entry: dict) -> bool:
    return "shards" in entry


def shard_layout(group: str, shards: list[dict]) -> dict[str, KeyLayout]:
    """Every tensor key of a sharded group and its pieces, after checking that the records
    cover each tensor exactly once. Raises ``ShardLayoutError`` naming the group, key and fault."""
    out: dict[str, KeyLayout] = {}
    where = f"sharded group {group!r}"
    if not shards:
        raise ShardLayoutError(f"{where} has an empty shard list")
    for i, rec in enumerate(shards):
        tensors = rec.get("tensors")
        if not isinstance(tensors, dict) or not rec.get("blob"):
            raise ShardLayoutError(f"{where}: shard {i} has no blob or no tensors record")
        for key, t in tensors.items():
            try:
                start, stop = (int(x) for x in t["range"])
                shape = tuple(int(d) for d in t["shape"])
                dtype = DTYPE_OF_NAME[t["dtype"]]
            except (KeyError, TypeError, ValueError):
                raise ShardLayoutError(f"{where}: shard {i} key {key!r} has a malformed record "
                                       f"{t!r} (needs range, shape, dtype)") from None
            lay = out.setdefault(key, KeyLayout(shape, dtype))
            if (lay.shape, lay.dtype) != (shape, dtype):
                raise ShardLayoutError(
                    f"{where}: key {key!r} is {list(shape)} {t['dtype']} in shard {i} but "
                    f"{list(lay.shape)} {DTYPE_NAMES[lay.dtype]} in an earlier shard")
            if not 0 <= start < stop <= lay.numel:
                raise ShardLayoutError(f"{where}: key {key!r} range [{start}, {stop}) of shard {i} "
                                       f"is empty or outside the tensor's {lay.numel} elements")
            lay.pieces.append((start, stop, i))
    for key, lay in out.items():
        lay.pieces.sort()
        pos = 0
        for start, stop, i in lay.pieces:
            if start != pos:
                what = "overlaps the previous range" if start < pos else f"leaves [{pos}, {start}) uncovered"
                raise ShardLayoutError(f"{where}: key {key!r} range [{start}, {stop}) of shard {i} {what}")
            pos = stop
        if pos != lay.numel:
            raise ShardLayoutError(f"{where}: key {key!r} is covered up to element {pos} of {lay.numel}")
    return out


ShardLoader = Callable[[dict], dict[str, torch.Tensor]]
"""Reads one shard record's blob (checksum verified) into its 1-D tensors."""


class ShardedGroupReader:
    """Reads elements of a sharded group's tensors, opening (and verifying) each shard blob at
    most once, and only those that hold elements asked for."""

    def __init__(self, group: str, shards: list[dict], load: ShardLoader):
        self.group, self.shards, self._load = group, shards, load
        self.layout = shard_layout(group, shards)
        self._cache: dict[int, dict[str, torch.Tensor]] = {}
        self.shards_read: set[int] = set()
        """Indices of the shards opened so far."""

    def keys(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor key of the group: its full shape and dtype."""
        return {k: (lay.shape, lay.dtype) for k, lay in self.layout.items()}

    def _shard(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self._cache:
            self._cache[i] = self._load(self.shards[i])
            self.shards_read.add(i)
        return self._cache[i]

    def read(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened full tensor ``key`` (1-D, a new tensor)."""
        lay = self.layout.get(key)
        if lay is None:
            raise KeyError(f"sharded group {self.group!r} has no tensor {key!r}; keys: {sorted(self.layout)}")
        stop = lay.numel if stop is None else stop
        if not 0 <= start <= stop <= lay.numel:
            raise ValueError(f"{key}: range [{start}, {stop}) is outside its {lay.numel} elements")
        out = torch.empty(stop - start, dtype=lay.dtype)
        for p_start, p_stop, i in lay.pieces:
            lo, hi = max(start, p_start), min(stop, p_stop)
            if lo >= hi:
                continue
            piece = self._shard(i).get(key)
            if piece is None or piece.numel() != p_stop - p_start or piece.dtype != lay.dtype:
                raise CheckpointCorruptError(
                    f"sharded group {self.group!r}: shard blob {self.shards[i]['blob']} does not hold "
                    f"{key!r} as its manifest record says ({p_stop - p_start} elements of "
                    f"{DTYPE_NAMES[lay.dtype]})")
            out[lo - start:hi - start] = piece.reshape(-1)[lo - p_start:hi - p_start]
        return out

    def assemble(self) -> dict[str, torch.Tensor]:
        """The whole group, each tensor in its full shape (as an unsharded blob holds it)."""
        return {k: self.read(k).reshape(lay.shape) for k, lay in self.layout.items()}


# ----- expert slices (``ckpt.expert_groups``) ---------------------------------------------


def joined_parts(entries: dict[str, dict]) -> dict[str, list[str]]:
    """Layer group -> the expert groups stored as its slices (manifest entries ``slice_of``)."""
    out: dict[str, list[str]] = {}
    for g, e in entries.items():
        if "slice_of" in e:
            out.setdefault(e["slice_of"], []).append(g)
    return out


def joined_shards(parts: list[dict]) -> list[dict]:
    """The shard records of a layer's expert entries as one exact cover of its fused tensors:
    every range once, and each ``step/`` counter from the newest version that holds it."""
    newest: dict[str, int] = {}
    for i, e in enumerate(parts):
        for rec in e["shards"]:
            for k in rec["tensors"]:
                if k.startswith("step/"):
                    j = newest.get(k)
                    if j is None or _age(parts[j]) < _age(e):
                        newest[k] = i
    out = []
    for i, e in enumerate(parts):
        for rec in e["shards"]:
            keep = {k: t for k, t in rec["tensors"].items() if not k.startswith("step/") or newest[k] == i}
            out.append({**rec, "tensors": keep})
    return [r for r in out if r["tensors"]]


def _age(entry: dict) -> tuple[int, int]:
    return int(entry.get("written_step", entry["saved_step"])), int(entry.get("saved_index", -1))
