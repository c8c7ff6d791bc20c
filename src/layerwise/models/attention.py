"""Where the examples of a micro-batch sit in its rows, and the attention masks that keep them
apart.

A packed row's examples each need positions restarting at 0 and causal block-diagonal attention
(sliding: within the window); a recurrent mixer, whose state no mask can cut, runs example by
example (``RowLayout.runs``). One example per row needs no mask. Masks take the implementation's
form: SDPA boolean (``None``: ``is_causal``), eager additive float."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families import CHUNKED_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION


@dataclass(frozen=True)
class RowLayout:
    """How the examples of one micro-batch lie in its rows (host side, from segment ids)."""

    positions: torch.Tensor
    """``[b, s]`` int64 (host): each position's index within its example."""
    packed: bool
    """Some row holds a second example after its first (the block-diagonal mask is needed)."""
    segment_ids: torch.Tensor | None
    """``[b, s]`` (host) when ``packed``, else None."""
    runs: tuple[tuple[int, int, int], ...]
    """``(row, start, end)`` of every example and padding run, row by row, in order."""

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.positions.shape)  # type: ignore[return-value]


def row_layout(shape: tuple[int, int], segment_ids: torch.Tensor | None = None) -> RowLayout:
    """The layout of a ``[b, s]`` micro-batch; ``segment_ids`` None: one example per row."""
    b, s = shape
    if segment_ids is None:
        positions = torch.arange(s, dtype=torch.long).expand(b, s)
        return RowLayout(positions, False, None, tuple((r, 0, s) for r in range(b)))
    seg = segment_ids.to("cpu")
    if tuple(seg.shape) != (b, s):
        raise ValueError(f"segment_ids {tuple(seg.shape)} must have the shape of input_ids {(b, s)}")
    starts = torch.ones(b, s, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    index = torch.arange(s, dtype=torch.long).expand(b, s)
    run_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    positions = index - run_start
    # a second real example in a row: a run that starts past position 0 and is not padding
    packed = bool((starts[:, 1:] & (seg[:, 1:] >= 0)).any())
    runs = []
    for r in range(b):
        cuts = starts[r].nonzero().flatten().tolist() + [s]
        runs.extend((r, a, e) for a, e in zip(cuts[:-1], cuts[1:]))
    return RowLayout(positions, packed, seg if packed else None, tuple(runs))


def attention_masks(layer_types: list[str], windows: tuple[int | None, ...], layout: RowLayout,
                    implementation: str, dtype: torch.dtype, device: torch.device
                    ) -> dict[str, torch.Tensor | None]:
    """The mask of every attention type the layers use (shared by all layers of that type)."""
    b, s = layout.shape
    seg = None
    if layout.packed:
        assert layout.segment_ids is not None
        seg = layout.segment_ids.to(device, non_blocking=True)
    out: dict[str, torch.Tensor | None] = {}
    for kind, window in sorted({(t, w) for t, w in zip(layer_types, windows) if t != LINEAR_ATTENTION},
                               key=lambda tw: tw[0]):
        if kind in (SLIDING_ATTENTION, CHUNKED_ATTENTION) and (window is None or window >= s):
            window = None  # the window (or chunk) covers the whole row: plain causal
        if seg is None and window is None and implementation == "sdpa":
            out[kind] = None  # SDPA's is_causal path
            continue
        q = torch.arange(s, device=device)[:, None]
        k = torch.arange(s, device=device)[None, :]
        allowed = k <= q
        if window is not None and kind == SLIDING_ATTENTION:
            allowed = allowed & (q - k < window)
        allowed = allowed[None, None]
        if window is not None and kind == CHUNKED_ATTENTION:  # chunks of each example's positions
            chunk = layout.positions.to(device, non_blocking=True) // window
            allowed = allowed & (chunk[:, None, :, None] == chunk[:, None, None, :])
        if seg is not None:
            allowed = allowed & (seg[:, None, :, None] == seg[:, None, None, :])
        if implementation == "eager":
            zero = torch.zeros((), dtype=dtype, device=device)
            out[kind] = torch.where(allowed, zero, torch.finfo(dtype).min)
        else:
            out[kind] = allowed
    return out
