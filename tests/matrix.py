"""The stated sample of each test matrix that ``make test`` runs.

A matrix (every model type, every plan, every preset) is parametrized with ``sampled``: the
cases in the sample run in ``make test``; the others carry the ``sweep`` marker, which
``make test-all`` runs too. Each sample is chosen, not drawn: the cases that guarded a named
mutation and one of each distinct layout or path, so that ``make test`` still fails where the
full matrix would fail first.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

import pytest


def sampled(values: Iterable[Any], keep: Collection[str],
            ids: Callable[[Any], str] = str, strict: bool = True) -> list[Any]:
    """``values`` as parameters: those whose id is in ``keep`` plain, the rest marked ``sweep``.

    A name in ``keep`` that is not among the ids is an error (a typo, or a case that left the
    matrix), so a sample never silently shrinks. ``strict=False`` for a matrix that depends on
    the installed transformers (an older one lacks some model types): absent names are let go,
    as long as most of the sample is there."""
    values = list(values)
    names = [ids(v) for v in values]
    _check(names, keep, strict)
    return [pytest.param(v, id=n) if n in keep else
            pytest.param(v, id=n, marks=pytest.mark.sweep) for v, n in zip(values, names)]


def subset(names: Iterable[str], keep: Collection[str], strict: bool = True) -> list[str]:
    """The names of ``keep`` that ``names`` has, in its order (checked as ``sampled`` checks):
    for a matrix whose full run is another test marked ``sweep``."""
    names = list(names)
    _check(names, keep, strict)
    return [n for n in names if n in keep]


def _check(names: list[str], keep: Collection[str], strict: bool) -> None:
    missing = set(keep) - set(names)
    limit = 0 if strict else len(keep) // 2
    assert len(missing) <= limit, f"sample names cases the matrix does not have: {sorted(missing)}"
