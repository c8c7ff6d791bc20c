"""8-bit Adam moments in checkpoint blobs, stored as the optimizer keeps them (codes + scales);
fp32 only where a format needs it. Key layout (blob layout 2): ``docs/formats.md``.

``q8_blocks/n`` = ``(block_size, lead)`` because the engine quantises a unit's whole flat buffer,
whose parameters do not start on block edges. A block straddling two groups (an untied head's
``lm_head`` | ``norm``) may mix saves: ``write_unit_part`` keeps the loaded scale and re-encodes
the other group's elements of that block under it, so a load is exact in any order."""

from __future__ import annotations

import torch

from ..optim import quant

CODES_M, SCALES_M = "exp_avg_codes/", "exp_avg_scales/"
CODES_V, SCALES_V = "exp_avg_sq_codes/", "exp_avg_sq_scales/"
Q8_BLOCKS = "q8_blocks/"
Q8_KINDS = (CODES_M, SCALES_M, CODES_V, SCALES_V, Q8_BLOCKS)
"""The blob keys of one parameter's 8-bit moments (besides ``step/``)."""
UNIT_KEYS = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")
"""The 8-bit optimizers' state keys (``optim.adamw8bit.Q8_KEYS``), in ``Q8_KINDS`` order."""


def has_8bit(tensors: dict[str, torch.Tensor]) -> bool:
    return any(k.startswith(Q8_BLOCKS) for k in tensors)


def blocks_of(offset: int, numel: int, block_size: int) -> tuple[int, int, int]:
    """(first block, end block, lead) of the elements ``[offset, offset + numel)``."""
    b0 = offset // block_size
    return b0, quant.num_blocks(offset + numel, block_size), offset - b0 * block_size


def unit_part(state: dict[str, torch.Tensor], offset: int, numel: int,
              block_size: int) -> dict[str, torch.Tensor]:
    """One parameter's slice of a unit's flat 8-bit state, as views, in ``Q8_KINDS`` keys
    (without the name)."""
    b0, b1, lead = blocks_of(offset, numel, block_size)
    return {
        CODES_M: state["exp_avg_codes"][offset:offset + numel],
        SCALES_M: state["exp_avg_scales"][b0:b1],
        CODES_V: state["exp_avg_sq_codes"][offset:offset + numel],
        SCALES_V: state["exp_avg_sq_scales"][b0:b1],
        Q8_BLOCKS: torch.tensor([block_size, lead], dtype=torch.int64),
    }


def geometry(tensors: dict[str, torch.Tensor], name: str) -> tuple[int, int]:
    """(block_size, lead) of parameter ``name``'s 8-bit moments."""
    block_size, lead = (int(x) for x in tensors[Q8_BLOCKS + name].tolist())
    numel = tensors[CODES_M + name].numel()
    for kind in (SCALES_M, SCALES_V):
        if tensors[kind + name].numel() != quant.num_blocks(lead + numel, block_size):
            raise ValueError(f"8-bit moments of {name}: {tensors[kind + name].numel()} scales do "
                             f"not cover {numel} elements in blocks of {block_size} starting at "
                             f"{lead}; the checkpoint is damaged")
    return block_size, lead


def dequantize(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 (exp_avg, exp_avg_sq) of parameter ``name`` from its 8-bit blob entries."""
    block_size, lead = geometry(tensors, name)

    def deq(codes: torch.Tensor, scales: torch.Tensor, fn) -> torch.Tensor:
        padded = torch.cat([codes.new_zeros(lead), codes.reshape(-1)])  # align to block edges
        return fn(padded, scales, block_size)[lead:]
    m = deq(tensors[CODES_M + name], tensors[SCALES_M + name], quant.dequantize_signed)
    v = deq(tensors[CODES_V + name], tensors[SCALES_V + name], quant.dequantize_sq)
    return m, v


def fp32_moments(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` (a group in blob keys) with every 8-bit moment pair replaced by fp32
    ``exp_avg/…`` and ``exp_avg_sq/…`` (shaped like the weight when the group has it). The same
    dict when there is nothing 8-bit."""
    if not has_8bit(tensors):
        return tensors
    names = [k[len(Q8_BLOCKS):] for k in tensors if k.startswith(Q8_BLOCKS)]
    out = {k: t for k, t in tensors.items() if not k.startswith(Q8_KINDS)}
    for n in names:
        m, v = dequantize(tensors, n)
        w = tensors.get("param/" + n)
        if w is not None:
            m, v = m.view(w.shape), v.view(w.shape)
        out["exp_avg/" + n], out["exp_avg_sq/" + n] = m, v
    return out


def fits_unit(tensors: dict[str, torch.Tensor], name: str, offset: int, numel: int,
              block_size: int) -> bool:
    """Whether ``name``'s 8-bit entries can be copied as they are into a unit that keeps the
    parameter at ``offset`` in blocks of ``block_size``."""
    if Q8_BLOCKS + name not in tensors or tensors[CODES_M + name].numel() != numel:
        return False
    return geometry(tensors, name) == (block_size, blocks_of(offset, numel, block_size)[2])


def write_unit_part(state: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor],
                    name: str, offset: int, numel: int, block_size: int,
                    owned: torch.Tensor) -> None:
    """Copy ``name``'s 8-bit entries into a unit's flat 8-bit state; ``owned`` masks the elements
    this load writes (see the module docstring for boundary blocks)."""
    b0, b1, _ = blocks_of(offset, numel, block_size)
    total = state["exp_avg_codes"].numel()
    for codes_key, scales_key, kc, ks, deq, enc in (
            ("exp_avg_codes", "exp_avg_scales", CODES_M, SCALES_M,
             quant.dequantize_signed, quant.encode_signed),
            ("exp_avg_sq_codes", "exp_avg_sq_scales", CODES_V, SCALES_V,
             quant.dequantize_sq, quant.encode_sq)):
        codes, scales = state[codes_key], state[scales_key]
        new_scales = tensors[ks + name]
        for b in {b0, b1 - 1}:
            lo, hi = b * block_size, min((b + 1) * block_size, total)
            outside = ~owned[lo:hi]
            if outside.any() and scales[b] != new_scales[b - b0]:
                old = deq(codes[lo:hi], scales[b:b + 1], block_size)
                fresh = enc(old, new_scales[b - b0:b - b0 + 1], block_size)
                codes[lo:hi][outside] = fresh[outside]
        codes[offset:offset + numel] = tensors[kc + name].reshape(-1)
        scales[b0:b1] = new_scales
