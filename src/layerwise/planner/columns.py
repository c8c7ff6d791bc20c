"""A linear program written by name: blocks of columns and rows turned into one ``HighsLp``.
Blocks allocate column indices, so no constraint computes one by hand; rows keep their group."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

INF = float("inf")


class Block:
    """``count`` consecutive columns, or ``count`` x ``len(labels)`` of them (row-major), by index:
    ``block[i]``, or ``block[i, label]`` when the block has labels."""

    __slots__ = ("name", "start", "count", "labels", "_pos", "_at")

    def __init__(self, name: str, start: int, count: int, labels: tuple[str, ...] | None = None):
        self.name, self.start, self.count, self.labels = name, start, count, labels
        self._pos = {t: k for k, t in enumerate(labels or ())}
        self._at: dict[str | None, list[int]] = {}

    @property
    def size(self) -> int:
        return self.count * (len(self.labels) if self.labels else 1)

    def __getitem__(self, key: Any) -> int:
        if self.labels is None:
            assert 0 <= key < self.count, f"{self.name}[{key}] out of range"
            return self.start + key
        i, label = key
        assert 0 <= i < self.count, f"{self.name}[{i}] out of range"
        return self.start + i * len(self.labels) + self._pos[label]

    def at(self, label: str | None = None) -> list[int]:
        """Every ``i``'s column (of ``label``, in a labelled block), for rows that sum over ``i``."""
        cols = self._at.get(label)
        if cols is None:
            cols = self._at[label] = [self[i] if label is None else self[i, label] for i in range(self.count)]
        return cols


class ColumnMap:
    """The columns of a model: bounds, objective cost and integrality, allocated in named blocks."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.cost: list[float] = []
        self.integer: list[bool] = []
        self.blocks: dict[str, Block] = {}

    @property
    def count(self) -> int:
        return len(self.lower)

    def add(self, name: str, count: int = 1, labels: tuple[str, ...] | None = None, *, lower: float = 0.0,
            upper: float = 1.0, integer: bool = False) -> Block:
        """Allocate the next ``count`` (x ``len(labels)``) columns, all with these bounds."""
        assert name not in self.blocks, f"column block {name!r} allocated twice"
        block = Block(name, self.count, count, labels)
        n = block.size
        self.lower += [lower] * n
        self.upper += [upper] * n
        self.cost += [0.0] * n
        self.integer += [integer] * n
        self.blocks[name] = block
        return block

    def bound(self, col: int, lower: float | None = None, upper: float | None = None) -> None:
        if lower is not None:
            self.lower[col] = lower
        if upper is not None:
            self.upper[col] = upper


class Rows:
    """Constraint rows ``lower <= sum(coef * x[col]) <= upper``, in the order they were added."""

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.coefs: list[dict[int, float]] = []
        self.groups: list[str] = []

    def add(self, group: str, lower: float, upper: float, coefs: dict[int, float]) -> None:
        self.lower.append(lower)
        self.upper.append(upper)
        self.coefs.append(coefs)
        self.groups.append(group)

    def __len__(self) -> int:
        return len(self.coefs)


def to_lp(highspy: Any, cols: ColumnMap, rows: Rows, offset: float) -> Any:
    """One ``HighsLp`` (row-wise matrix, coefficients in each row's insertion order)."""
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = cols.count, len(rows)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cols.cost, cols.lower, cols.upper
    lp.row_lower_, lp.row_upper_ = rows.lower, rows.upper
    starts = [0, *accumulate(len(coefs) for coefs in rows.coefs)]
    index = [c for coefs in rows.coefs for c in coefs]
    value = [v for coefs in rows.coefs for v in coefs.values()]
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = starts, index, value
    kinds = highspy.HighsVarType
    lp.integrality_ = [kinds.kInteger if i else kinds.kContinuous for i in cols.integer]
    lp.offset_ = offset
    return lp
