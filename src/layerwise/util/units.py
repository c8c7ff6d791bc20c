"""Byte counts: of tensors, in human-readable form, and parsed from sizes like ``5GB``."""

from __future__ import annotations

import re

import torch

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def human_bytes(n: float) -> str:
    """``1.23 GB`` (decimal units, as disks and HF shard sizes are quoted)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= 0.1 * scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def parse_size_bytes(size: int | str | None) -> int | None:
    """``5GB``, ``500MB``, ``2GiB`` or a plain byte count; None means no limit."""
    if size is None or isinstance(size, int):
        return size
    m = _SIZE_RE.match(str(size))
    if not m:
        raise ValueError(f"cannot read size {size!r}; write it like 5GB, 500MB, 2GiB or a byte count")
    unit = (m.group(2) or "").upper()
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise ValueError(f"size {size!r} must be positive")
    return n
