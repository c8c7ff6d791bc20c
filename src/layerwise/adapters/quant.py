"""Weight-only formats of a frozen base: what a LoRA run holds its base's matmul weights in.

Each packs one weight into one byte region, so a frozen unit is a single flat buffer streamed
like any other: ``nf4`` (bitsandbytes, block 64, no double quantisation), ``int8`` (per row),
``fp8-<B>`` (DeepSeek-V3's block-wise e4m3), ``mxfp4`` (gpt-oss's). Each is the release's own
arithmetic, so a base read from a release packs back to its values (checked: ``roundtrips``)."""

from __future__ import annotations

import math

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

FP8_BLOCK = 128
"""DeepSeek-V3's and Qwen3-FP8's ``weight_block_size`` (square)."""
FP8_MAX = 448.0
MX_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

QUANT_FORMATS = ("int8", "nf4", "fp8", "mxfp4")


def is_packed(fmt: str) -> bool:
    """Whether ``fmt`` is one of these formats (``float``: a plain dtype)."""
    return fmt in QUANT_FORMATS or fmt.startswith("fp8-")


def fp8_format(block: int) -> str:
    return "fp8" if block == FP8_BLOCK else f"fp8-{block}"


def _kind(fmt: str) -> tuple[str, int]:
    if fmt.startswith("fp8-") and fmt[4:].isdigit() and int(fmt[4:]) > 0:
        return "fp8", int(fmt[4:])
    if fmt in QUANT_FORMATS:
        return fmt, FP8_BLOCK
    raise ValueError(f"unknown weight format {fmt!r}; use one of {', '.join(QUANT_FORMATS)}")


def _pad4(nbytes: int) -> int:
    """Codes are followed by fp32 scales, which start on a 4-byte boundary."""
    return -(-nbytes // 4) * 4


def _matrices(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(matrices, rows, cols) of a weight: a linear is one matrix, an expert tensor E."""
    return math.prod(shape[:-2]), shape[-2], shape[-1]


def _mx_rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, group-dim length) of the matrix MXFP4 groups along."""
    m, r, c = _matrices(shape)
    return (r, c) if len(shape) == 2 else (m * c, r)


def packed_nbytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Bytes of one ``shape`` weight packed in ``fmt``."""
    kind, block = _kind(fmt)
    numel = math.prod(shape)
    if kind == "nf4":
        blocks = -(-numel // NF4_BLOCK)
        return blocks * NF4_BLOCK // 2 + 4 * blocks
    if kind == "int8":
        return _pad4(numel) + 4 * (numel // shape[-1])
    if kind == "fp8":
        m, r, c = _matrices(shape)
        return _pad4(numel) + 4 * m * -(-r // block) * -(-c // block)
    rows, k = _mx_rows(shape)
    groups = -(-k // MX_GROUP)
    return rows * groups * (MX_GROUP // 2 + 1)


def _nearest(x: torch.Tensor, levels: tuple[float, ...]) -> torch.Tensor:
    return (x.reshape(-1, 1) - torch.tensor(levels)).abs().argmin(dim=1).to(torch.uint8)


def _fp8_tiles(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """[m, r, c] zero-padded to whole tiles, as [m, tr, block, tc, block]."""
    m, r, c = w.shape
    tr, tc = -(-r // block), -(-c // block)
    padded = w.new_zeros(m, tr * block, tc * block)
    padded[:, :r, :c] = w
    return padded.view(m, tr, block, tc, block), tr, tc


def quantize_into(fmt: str, weight: torch.Tensor, out: torch.Tensor) -> None:
    """Pack ``weight`` (any float dtype) into the uint8 region ``out``."""
    kind, block = _kind(fmt)
    w = weight.detach().to(torch.float32)
    n = w.numel()
    if kind == "nf4":
        blocks = -(-n // NF4_BLOCK)
        flat = torch.zeros(blocks * NF4_BLOCK, dtype=torch.float32)
        flat[:n] = w.reshape(-1)
        flat = flat.view(blocks, NF4_BLOCK)
        absmax = flat.abs().amax(dim=1)
        codes = _nearest(flat / absmax.clamp_min(torch.finfo(torch.float32).tiny)[:, None], NF4_LEVELS)
        packed = (codes[0::2] << 4) | codes[1::2]
        out[:packed.numel()].copy_(packed)
        out[packed.numel():].view(torch.float32).copy_(absmax)
    elif kind == "int8":
        rows = w.reshape(-1, w.shape[-1])
        scale = rows.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        codes = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        out[:n].view(torch.int8).copy_(codes.reshape(-1))
        out[_pad4(n):_pad4(n) + 4 * rows.shape[0]].view(torch.float32).copy_(scale)
    elif kind == "fp8":
        m, r, c = _matrices(w.shape)
        tiles, tr, tc = _fp8_tiles(w.reshape(m, r, c), block)
        scale = tiles.abs().amax(dim=(2, 4)) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = (tiles / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        codes = codes.view(m, tr * block, tc * block)[:, :r, :c]
        out[:n].copy_(codes.reshape(-1).view(torch.uint8))
        out[_pad4(n):_pad4(n) + 4 * scale.numel()].view(torch.float32).copy_(scale.reshape(-1))
    else:
        rows, k = _mx_rows(w.shape)
        groups = -(-k // MX_GROUP)
        g = w if w.dim() == 2 else w.transpose(-1, -2)
        padded = torch.zeros(rows, groups * MX_GROUP)
        padded[:, :k] = g.reshape(rows, k)
        padded = padded.view(rows, groups, MX_GROUP)
        amax = padded.abs().amax(dim=2)
        exp = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127))
        exp = exp.clamp(-127, 127)
        codes = _nearest((padded / torch.exp2(exp)[..., None]).clamp(-6, 6), E2M1_VALUES)
        codes = codes.view(rows, groups, MX_GROUP)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        body = rows * groups * MX_GROUP // 2
        out[:body].copy_(packed.reshape(-1))
        out[body:body + rows * groups].copy_((exp + 127).to(torch.uint8).reshape(-1))


_LEVEL_PAIRS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _pairs(kind: str, device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two levels each byte encodes, in element order, so decoding is one
    gather (NF4: high nibble first; e2m1: low nibble first)."""
    t = _LEVEL_PAIRS.get((kind, device))
    if t is None:
        levels = torch.tensor(NF4_LEVELS if kind == "nf4" else E2M1_VALUES, dtype=torch.float32)
        byte = torch.arange(256)
        hi, lo = levels[byte >> 4], levels[byte & 15]
        t = torch.stack([hi, lo] if kind == "nf4" else [lo, hi], dim=1).to(device)
        _LEVEL_PAIRS[(kind, device)] = t
    return t


def dequantize(fmt: str, packed: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype
               ) -> torch.Tensor:
    """The ``shape`` weight in ``dtype`` from its packed region (on ``packed``'s device). The
    products are taken in fp32 and rounded once, so every dtype sees the same values."""
    kind, block = _kind(fmt)
    numel = math.prod(shape)
    if kind == "nf4":
        blocks = -(-numel // NF4_BLOCK)
        ncodes = blocks * NF4_BLOCK // 2
        codes, absmax = packed[:ncodes], packed[ncodes:ncodes + 4 * blocks].view(torch.float32)
        levels = _pairs(kind, packed.device)[codes.int()].view(blocks, NF4_BLOCK)
        return (levels * absmax[:, None]).view(-1)[:numel].view(shape).to(dtype)
    if kind == "int8":
        rows = numel // shape[-1]
        codes = packed[:numel].view(torch.int8).view(rows, shape[-1])
        scale = packed[_pad4(numel):_pad4(numel) + 4 * rows].view(torch.float32)
        return (codes.to(torch.float32) * scale[:, None]).view(shape).to(dtype)
    if kind == "fp8":
        m, r, c = _matrices(shape)
        tr, tc = -(-r // block), -(-c // block)
        codes = packed[:numel].view(torch.float8_e4m3fn).view(m, r, c).to(torch.float32)
        scale = packed[_pad4(numel):_pad4(numel) + 4 * m * tr * tc].view(torch.float32).view(m, tr, tc)
        full = scale.repeat_interleave(block, 1)[:, :r].repeat_interleave(block, 2)[:, :, :c]
        return (codes * full).view(shape).to(dtype)
    rows, k = _mx_rows(shape)
    groups = -(-k // MX_GROUP)
    body = rows * groups * MX_GROUP // 2
    values = _pairs(kind, packed.device)[packed[:body].int()].view(rows, groups, MX_GROUP)
    exp = packed[body:body + rows * groups].view(rows, groups).to(torch.float32) - 127
    g = (values * torch.exp2(exp)[..., None]).view(rows, groups * MX_GROUP)[:, :k]
    if len(shape) == 2:
        return g.reshape(shape).to(dtype)
    m, r, c = _matrices(shape)
    return g.view(m, c, r).transpose(-1, -2).reshape(shape).to(dtype)


def roundtrips(fmt: str, weight: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether ``packed`` (``weight`` packed in ``fmt``) gives ``weight`` back, to fp32 rounding
    (a release's scale can differ from the one re-derived by an ulp; a value a different block
    or scale puts on another grid point is off by a quantisation step, 1e-2 or more)."""
    w = weight.detach().to(torch.float32)
    return torch.allclose(dequantize(fmt, packed, tuple(w.shape), torch.float32), w, rtol=1e-6, atol=0)
