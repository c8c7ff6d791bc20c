"""Weight-only formats of a frozen base: NF4 (4-bit, block-wise absmax) and int8 (per-row absmax).

Each format packs one weight matrix into one byte region (``packed_nbytes``), so a frozen unit
is a single flat buffer the engine streams like any other; ``dequantize`` turns the region back
into the matrix in the compute dtype where the op runs (on the device, inside the frozen linear's
forward and backward). Quantisation happens once, when the base is loaded.

- ``nf4``: bitsandbytes' NF4 layout without double quantisation: the flattened weight in blocks
  of ``NF4_BLOCK`` (64) elements, each block's absmax in fp32, each element the nearest of the 16
  NF4 levels of ``x / absmax``, two codes a byte (the first element in the high nibble). Region:
  codes (``ceil(n / 64) * 32`` bytes) then the absmax values; 0.5 + 4/64 = 0.5625 B/param.
- ``int8``: symmetric per output row: ``round(127 * w / absmax_row)``; region: the codes then the
  fp32 row scales (on a 4-byte boundary); 1 + 4/in_features B/param.
"""

from __future__ import annotations

import torch

NF4_BLOCK = 64
"""Elements per NF4 absmax block (bitsandbytes' default for NF4)."""

NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
"""The 16 NF4 levels (normal-distribution quantiles scaled to [-1, 1]), as bitsandbytes has them."""

QUANT_FORMATS = ("int8", "nf4")


def _pad4(nbytes: int) -> int:
    """Codes are followed by fp32 scales, which start on a 4-byte boundary."""
    return -(-nbytes // 4) * 4


def _nf4_blocks(numel: int) -> int:
    return -(-numel // NF4_BLOCK)


def packed_nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of one ``shape`` weight packed in ``fmt``."""
    numel = shape[0] * shape[1]
    if fmt == "nf4":
        blocks = _nf4_blocks(numel)
        return blocks * NF4_BLOCK // 2 + 4 * blocks
    if fmt == "int8":
        return _pad4(numel) + 4 * shape[0]
    raise ValueError(f"unknown weight format {fmt!r}; use one of {QUANT_FORMATS}")


def quantize_into(fmt: str, weight: torch.Tensor, out: torch.Tensor) -> None:
    """Pack ``weight`` (2-D, any float dtype) into the uint8 region ``out``."""
    w = weight.detach().to(torch.float32)
    if fmt == "nf4":
        n = w.numel()
        blocks = _nf4_blocks(n)
        flat = torch.zeros(blocks * NF4_BLOCK, dtype=torch.float32)
        flat[:n] = w.reshape(-1)
        flat = flat.view(blocks, NF4_BLOCK)
        absmax = flat.abs().amax(dim=1)
        scaled = flat / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
        codes = (scaled.reshape(-1, 1) - levels).abs().argmin(dim=1).to(torch.uint8)
        packed = (codes[0::2] << 4) | codes[1::2]
        ncodes = packed.numel()
        out[:ncodes].copy_(packed)
        out[ncodes:].view(torch.float32).copy_(absmax)
        return
    if fmt == "int8":
        rows = w.shape[0]
        absmax = w.abs().amax(dim=1)
        scale = absmax.clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        codes = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        n = codes.numel()
        out[:n].view(torch.int8).copy_(codes.reshape(-1))
        out[_pad4(n):_pad4(n) + 4 * rows].view(torch.float32).copy_(scale)
        return
    raise ValueError(f"unknown weight format {fmt!r}; use one of {QUANT_FORMATS}")


_NF4_PAIRS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _nf4_pairs(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: the two levels each byte encodes (high nibble first), so decoding is one gather."""
    key = (device, dtype)
    t = _NF4_PAIRS.get(key)
    if t is None:
        levels = torch.tensor(NF4_LEVELS, dtype=torch.float32)
        byte = torch.arange(256)
        t = torch.stack([levels[byte >> 4], levels[byte & 15]], dim=1).to(device=device, dtype=dtype)
        _NF4_PAIRS[key] = t
    return t


def dequantize(fmt: str, packed: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype
               ) -> torch.Tensor:
    """The ``shape`` weight in ``dtype`` from its packed region (on ``packed``'s device). The
    products are taken in fp32 and rounded once, so every dtype sees the same values."""
    numel = shape[0] * shape[1]
    if fmt == "nf4":
        blocks = _nf4_blocks(numel)
        ncodes = blocks * NF4_BLOCK // 2
        codes, absmax = packed[:ncodes], packed[ncodes:ncodes + 4 * blocks].view(torch.float32)
        levels = _nf4_pairs(packed.device, torch.float32)[codes.int()].view(blocks, NF4_BLOCK)
        w = (levels * absmax[:, None]).view(-1)[:numel]
        return w.view(shape).to(dtype)
    if fmt == "int8":
        codes = packed[:numel].view(torch.int8).view(shape)
        scale = packed[_pad4(numel):_pad4(numel) + 4 * shape[0]].view(torch.float32)
        return (codes.to(torch.float32) * scale[:, None]).to(dtype)
    raise ValueError(f"unknown weight format {fmt!r}; use one of {QUANT_FORMATS}")
