"""Examples -> fixed-length rows of inputs and already-shifted labels, and the batch order.

An example of n tokens is n - 1 positions, labels masked per its loss mask, so no label points
across an example boundary. ``pack=True`` lays examples end to end (a supervised example is never
split, a text one continues in the next row); ``segment_ids`` (-1: padding) let the engine
restart positions and keep attention block-diagonal, so a packed example trains exactly as it
would alone. A supervised example too long is truncated (counted), or refused if no target is
left."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ..engine.batch import IGNORE_INDEX, Batch


@dataclass
class Example:
    inputs: list[int]
    targets: list[int]
    """Already shifted: ``targets[i]`` is what position ``i`` predicts, or IGNORE_INDEX."""
    splittable: bool


@dataclass
class Rows:
    input_ids: torch.Tensor
    """``[rows, seq_len]`` int64."""
    labels: torch.Tensor
    """``[rows, seq_len]`` int64, IGNORE_INDEX where no loss."""
    segment_ids: torch.Tensor | None = None
    """``[rows, seq_len]`` int32: index of the example each position came from, -1 for padding;
    None for a token stream cut into rows (the built-in corpus), which has no examples."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


@dataclass
class PackStats:
    rows: int = 0
    positions: int = 0
    """Non-padding positions."""
    split_examples: int = 0
    """Text examples that span more than one row."""

    def to_json(self) -> dict:
        return {"rows": self.rows, "positions": self.positions, "split_examples": self.split_examples}


def shift(ids: list[int], mask: list[bool], seq_len: int | None = None,
          splittable: bool = True) -> tuple[Example, int]:
    """The example of ``ids`` (``mask[i]``: token ``i`` is a target), and how many positions a
    non-splittable example lost to truncation at ``seq_len``."""
    inputs = ids[:-1]
    targets = [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
    cut = 0
    if not splittable and seq_len is not None and len(inputs) > seq_len:
        cut = len(inputs) - seq_len
        inputs, targets = inputs[:seq_len], targets[:seq_len]
    return Example(inputs, targets, splittable), cut


def pack_examples(examples: list[Example], seq_len: int, pad_id: int, pack: bool = True
                  ) -> tuple[Rows, PackStats]:
    """Lay ``examples`` out in rows of ``seq_len`` (see the module docstring)."""
    ids, labels, segs = array("q"), array("q"), array("i")
    stats = PackStats()
    used = 0  # positions filled in the current row

    def close_row() -> None:
        nonlocal used
        if used:
            pad = seq_len - used
            ids.extend([pad_id] * pad)
            labels.extend([IGNORE_INDEX] * pad)
            segs.extend([-1] * pad)
            stats.rows += 1
            used = 0

    for k, ex in enumerate(examples):
        n = len(ex.inputs)
        if n == 0:
            continue
        assert ex.splittable or n <= seq_len, "supervised examples are truncated before packing"
        if not pack or (not ex.splittable and used + n > seq_len):
            close_row()
        pos, pieces = 0, 0
        while pos < n:
            if used == seq_len:
                close_row()
            take = min(seq_len - used, n - pos)
            ids.extend(ex.inputs[pos:pos + take])
            labels.extend(ex.targets[pos:pos + take])
            segs.extend([k] * take)
            used += take
            pos += take
            pieces += 1
        stats.split_examples += pieces > 1
        stats.positions += n
        if not pack:
            close_row()
    close_row()

    def as_tensor(buf: array, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(np.frombuffer(buf, dtype=np.int64 if buf.typecode == "q" else np.intc)
                             .copy()) if len(buf) else torch.zeros(0, dtype=torch.int64)
        return t.to(dtype).view(-1, seq_len)

    return Rows(as_tensor(ids, torch.long), as_tensor(labels, torch.long),
                as_tensor(segs, torch.int32)), stats


def _batch(x: torch.Tensor, y: torch.Tensor, seg: torch.Tensor | None, sel: torch.Tensor) -> Batch:
    return Batch(x[sel].clone(), y[sel].clone(), None if seg is None else seg[sel].clone())


def row_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, seed: int = 0,
                start: int = 0, segment_ids: torch.Tensor | None = None) -> Iterator[Batch]:
    """Endless micro-batches of rows, a fresh seeded permutation per epoch (``seed + epoch``);
    ``start`` micro-batches already consumed, so a resume continues at exactly the next one."""
    if x.shape[0] < batch_size:
        raise ValueError(f"the data gives {x.shape[0]} sequences of {x.shape[1]} tokens, fewer than "
                         f"the micro-batch size {batch_size}; add data, lower micro_batch_size or "
                         "seq_len")
    per_epoch = x.shape[0] // batch_size
    index, order, order_epoch = start, None, -1
    while True:
        epoch, pos = divmod(index, per_epoch)
        if epoch != order_epoch:
            g = torch.Generator().manual_seed(seed + epoch)
            order, order_epoch = torch.randperm(x.shape[0], generator=g), epoch
        sel = order[pos * batch_size:(pos + 1) * batch_size]
        yield _batch(x, y, segment_ids, sel)
        index += 1


def eval_batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, num_batches: int,
                 seed: int, segment_ids: torch.Tensor | None = None) -> list[Batch]:
    """Up to ``num_batches`` micro-batches of held-out rows in a fixed seeded order; a small
    eval set gives fewer (and a last, smaller one) rather than none."""
    if x.shape[0] == 0:
        raise ValueError("the eval set is empty")
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
    order = order[:batch_size * num_batches]
    return [_batch(x, y, segment_ids, sel) for sel in order.split(batch_size)]
