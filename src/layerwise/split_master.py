"""An fp32 value as its bf16 part plus a signed 16-bit remainder, exactly.

Master and copy source in 4 bytes per parameter instead of 6, every update bit-identical to an
fp32 master's. ``hi`` rounds **ties away from zero**: then every bf16 pattern has exactly 2^16
fp32 preimages, so ``lo`` (int16) tells them apart (torch's half-to-even gives an even mantissa
2^16 + 1). Every non-NaN fp32 round-trips bit for bit; a NaN stays a quiet NaN (payload lost).

``split_torch``/``join_torch`` are the reference for the numba helpers ``split_bits``/``join_bits``
(no fast-math: exact however it vectorises). After editing them clear ``optim/__pycache__/*.nb*``
too: numba keys a cache on its own file only."""

from __future__ import annotations

import torch

try:  # numba is optional: the torch path computes the same bits
    import llvmlite.ir as _ir
    import numba as _nb
    import numpy as _np
    from numba import types as _nbt
    from numba.extending import intrinsic as _intrinsic
    from numba.extending import overload as _overload

    from .util.simd import wide_vectors
except Exception:  # pragma: no cover - depends on the environment
    _nb = None

__all__ = ["join", "join_torch", "numba_available", "round_bf16_", "split_", "split_torch"]

_TORCH_CHUNK = 1 << 16
"""Elements per chunk of the torch path (its int32 temporaries stay in L2)."""

_DEVICE_CHUNK = 1 << 22
"""Elements per chunk brought over from another device (a GPU's values into a host store)."""

_ABS = 0x7FFFFFFF
_INF = 0x7F800000
_HALF = 0x8000
_QUIET = 0x0040


def split_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` of fp32 ``x``: bf16 rounded to nearest, ties away from zero, and the int16
    remainder (see the module docstring). The reference the kernels are tested against."""
    b = x.detach().to(torch.float32).contiguous().view(torch.int32)
    a = b & _ABS
    nan = a > _INF
    a = torch.clamp(a, max=_INF)  # a NaN's magnitude would overflow the rounding add
    hm = (a + _HALF) >> 16
    lo = a - (hm << 16)
    hi = torch.where(b < 0, hm - (1 << 15), hm)  # the signed int16 value of sign | hm
    hi = torch.where(nan, (b >> 16) | _QUIET, hi)
    lo = torch.where(nan, torch.zeros_like(lo), lo)
    return hi.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def join_torch(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``(hi, lo)``: the bit pattern ``(hi << 16) + lo``."""
    bits = (hi.view(torch.int16).to(torch.int32) << 16) + lo.to(torch.int32)
    return bits.view(torch.float32)


if _nb is not None:
    _jit = dict(nogil=True, cache=True, error_model="numpy", boundscheck=False)

    # split and join as LLVM i32 code: numba types int32 arithmetic as int64, which vectorises
    # at half the lanes (and 64-bit min/compare on AVX-512 at a third of the speed)
    def _i32(v):
        return _ir.Constant(_ir.IntType(32), v)

    @_intrinsic
    def _split_i16(typingctx, x):  # pragma: no cover - compiled
        # For a non-NaN x (|x| <= inf, so the rounding add cannot carry into the sign), the
        # module's (hi, lo) are the top half of ``bits + 0x8000`` and the low half of ``bits``:
        # ``lo = |x| - (hm << 16)`` is ``(|x| + 0x8000) mod 2^16 - 0x8000``, the low 16 bits of
        # ``|x|`` read as signed
        def codegen(context, builder, signature, args):
            i16 = _ir.IntType(16)
            b = builder.bitcast(args[0], _ir.IntType(32))
            top = builder.lshr(b, _i32(16))
            hi = builder.lshr(builder.add(b, _i32(_HALF)), _i32(16))
            nan = builder.icmp_unsigned(">", builder.and_(b, _i32(_ABS)), _i32(_INF))
            hi = builder.select(nan, builder.or_(top, _i32(_QUIET)), hi)
            lo = builder.select(nan, _i32(0), b)
            return context.make_tuple(builder, signature.return_type,
                                      [builder.trunc(hi, i16), builder.trunc(lo, i16)])
        return _nbt.UniTuple(_nbt.int16, 2)(_nbt.float32), codegen

    @_intrinsic
    def _join_f32(typingctx, hi, lo):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            i32 = _ir.IntType(32)
            h = builder.shl(builder.sext(args[0], i32), _i32(16))
            return builder.bitcast(builder.add(h, builder.sext(args[1], i32)), _ir.FloatType())
        return _nbt.float32(_nbt.int16, _nbt.int16), codegen

    @_intrinsic
    def _widen_bf16(typingctx, x):  # pragma: no cover - compiled
        def codegen(context, builder, signature, args):
            w = builder.shl(builder.zext(args[0], _ir.IntType(32)), _i32(16))
            return builder.bitcast(w, _ir.FloatType())
        return _nbt.float32(_nbt.uint16), codegen

    @_nb.njit(inline="always", **_jit)
    def split_bits(x):  # pragma: no cover - compiled
        """fp32 ``x`` → ``(hi, lo)`` as int16 values (``hi``: the bf16's bit pattern)."""
        return _split_i16(_np.float32(x))

    def as_f32(x):  # pragma: no cover - replaced by the overload below in compiled code
        raise NotImplementedError

    @_overload(as_f32, inline="always")
    def _as_f32_impl(x):  # pragma: no cover - compiled
        """A gradient element as fp32: an fp32 as it is, a bf16 (its bits as int16 or uint16)
        widened exactly (a bf16 is the top half of an fp32), so a bf16 gradient needs no fp32
        copy anywhere."""
        if isinstance(x, _nbt.Float):
            return lambda x: x
        return lambda x: _widen_bf16(_np.uint16(x))

    @_nb.njit(inline="always", **_jit)
    def join_bits(hi, lo):  # pragma: no cover - compiled
        """``(hi, lo)`` (int16 values) → the fp32 value."""
        return _join_f32(_np.int16(hi), _np.int16(lo))

    @_nb.njit(**_jit)
    def _split_kernel(x, hi, lo):  # pragma: no cover - compiled
        wide_vectors()
        for j in range(x.size):
            h, r = split_bits(x[j])
            hi[j] = _np.int16(h)
            lo[j] = _np.int16(r)

    @_nb.njit(**_jit)
    def _hi_kernel(x, hi):  # pragma: no cover - compiled
        wide_vectors()
        for j in range(x.size):
            h, _ = split_bits(x[j])
            hi[j] = _np.int16(h)

    @_nb.njit(**_jit)
    def _join_kernel(hi, lo, out):  # pragma: no cover - compiled
        wide_vectors()
        for j in range(out.size):
            out[j] = join_bits(hi[j], lo[j])


def numba_available() -> bool:
    return _nb is not None


def _check(hi: torch.Tensor, lo: torch.Tensor, n: int) -> None:
    if hi.dtype != torch.bfloat16 or lo.dtype != torch.int16:
        raise ValueError(f"split master: hi must be bfloat16 and lo int16, got {hi.dtype}, {lo.dtype}")
    if hi.numel() != n or lo.numel() != n:
        raise ValueError(f"split master: {hi.numel()} / {lo.numel()} elements for {n} values")


def _numba_ok(*ts: torch.Tensor) -> bool:
    return _nb is not None and all(t.device.type == "cpu" and t.is_contiguous() for t in ts)


def split_(x: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> None:
    """Write the values of ``x`` (any float dtype, any device, read flat) into ``hi`` (bf16)
    and ``lo`` (int16), flat, in place; non-fp32 ``x`` (or ``x`` on another device) is widened
    (brought over) chunk by chunk, exactly."""
    n = x.numel()
    _check(hi, lo, n)
    x, h, l_ = x.detach().reshape(-1), hi.view(-1), lo.view(-1)
    if x.dtype == torch.float32 and _numba_ok(x, h, l_):
        _split_kernel(x.numpy(), h.view(torch.int16).numpy(), l_.numpy())
        return
    chunk = _TORCH_CHUNK if x.device == h.device else _DEVICE_CHUNK
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        xc = x[s:e].to(h.device, torch.float32)
        if _numba_ok(xc, h, l_):
            _split_kernel(xc.numpy(), h[s:e].view(torch.int16).numpy(), l_[s:e].numpy())
            continue
        a, b = split_torch(xc)
        h[s:e].copy_(a)
        l_[s:e].copy_(b)


def round_bf16_(x: torch.Tensor, hi: torch.Tensor) -> None:
    """Write ``x`` (fp32, read flat) rounded as ``split_`` rounds it (ties away from zero) into
    ``hi`` (bf16): the compute copy of an fp32 master, the same bits a split master holds."""
    n = x.numel()
    if hi.dtype != torch.bfloat16 or hi.numel() != n or x.dtype != torch.float32:
        raise ValueError(f"round_bf16_: {n} fp32 values into {hi.numel()} bf16, got {x.dtype} "
                         f"into {hi.dtype}")
    x, h = x.detach().reshape(-1), hi.view(-1)
    if _numba_ok(x, h):
        _hi_kernel(x.numpy(), h.view(torch.int16).numpy())
        return
    for s in range(0, n, _TORCH_CHUNK):
        e = min(s + _TORCH_CHUNK, n)
        h[s:e].copy_(split_torch(x[s:e])[0])


def join(hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of ``(hi, lo)``, flat: into ``out`` (fp32, as many elements, returned)
    or a new tensor."""
    n = hi.numel()
    _check(hi, lo, n)
    if out is None:
        out = torch.empty(n, dtype=torch.float32)
    if out.dtype != torch.float32 or out.numel() != n:
        raise ValueError(f"join: out must be {n} fp32 elements, got {out.numel()} {out.dtype}")
    h, l_, o = hi.view(-1), lo.view(-1), out.view(-1)
    if _numba_ok(h, l_, o):
        _join_kernel(h.view(torch.int16).numpy(), l_.numpy(), o.numpy())
        return out
    for s in range(0, n, _TORCH_CHUNK):
        e = min(s + _TORCH_CHUNK, n)
        o[s:e].copy_(join_torch(h[s:e], l_[s:e]))
    return out
