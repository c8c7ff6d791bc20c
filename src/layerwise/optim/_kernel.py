"""The fused 8-bit AdamW update: dequantise → update → requantise, one pass over each block.

Two implementations held bit-identical by tests: ``numba`` (CPU) keeps a block's moments in
L1-resident scratch so memory is read and written once, and takes a table of tensors in one
launch per step. ``nogil=True`` on our own pool, not ``parallel=True``: numba's ``workqueue``
aborts when entered from several engine threads. ``torch`` (CUDA, no numba, or
``LAYERWISE_OPTIM_KERNEL=torch``) runs the same maths in cache-sized chunks."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..split_master import join_torch, split_
from ..util.threads import run_split
from .quant import SIGNED_LEVELS, UNSIGNED_LEVELS, num_blocks

try:  # numba is optional: the torch path below computes the same update
    import llvmlite.ir as _ir
    import numba as _nb
    import numpy as _np
    from numba import types as _nbt
    from numba.core import cgutils as _cgutils
    from numba.extending import intrinsic as _intrinsic

    from ..split_master import as_f32, join_bits, split_bits
    from ..util.simd import wide_vectors
except Exception:  # pragma: no cover - depends on the environment
    _nb = None

_TORCH_CHUNK = {"cpu": 1 << 16}
"""Elements per chunk on the torch path, per device type: small on CPU so temporaries stay in
cache, large elsewhere so a GPU gets few big kernels (default ``_TORCH_CHUNK_OTHER``)."""
_TORCH_CHUNK_OTHER = 1 << 24

_MAX_NUMBA_BLOCK = 4096
"""Largest block the numba kernel takes (its two scratch arrays live on the stack); larger
blocks run on the torch path."""

_FOLD_MIN_K1 = 1e-12
_FOLD_MIN_SQRT_K2 = 1e-10
_FOLD_MIN_NUM = 1e-30
"""Where the numba kernel's folded units stay safe in fp32 (see ``StepScalars.folded``):
``mu = m / k1`` and ``w = v / k2`` must not overflow, nor may ``1 / (step_size * k1)``. Only a
clip coefficient below ~1e-8 (a gradient norm 1e8 times the limit) or an ``lr`` below ~1e-29
falls outside; such a step runs on the torch path, which takes any value."""


@dataclass(frozen=True)
class StepScalars:
    """Per-step scalars of one AdamW update (bias correction and clip folded in)."""

    beta1: float
    beta2: float
    grad_mul: float
    """Clip coefficient: the gradient is read as ``grad * grad_mul``."""
    decay_mul: float
    """``1 - lr * weight_decay``, applied to elements before ``decay_end``."""
    step_size: float
    """``lr / (1 - beta1**step)``."""
    inv_sqrt_bc2: float
    """``1 / sqrt(1 - beta2**step)``."""
    eps: float

    @classmethod
    def of(cls, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           step: int, grad_mul: float = 1.0) -> StepScalars:
        assert step >= 1
        return cls(beta1, beta2, grad_mul, 1.0 - lr * weight_decay,
                   lr / (1.0 - beta1 ** step), 1.0 / math.sqrt(1.0 - beta2 ** step), eps)

    def folded(self) -> tuple[float, ...] | None:
        """The numba kernel's scalars, or None where the folded units would leave fp32's safe range.

        Moments are kept as ``mu = m / k1``, ``w = v / k2`` with ``k1 = (1 - beta1) * clip``,
        ``k2 = (1 - beta2) * clip**2``, so the gradient enters with factor 1 and the clip costs nothing;
        the factors move into the block scales and the denominator:
        ``mu / (sqrt(w) * den + eps')``, ``den = sqrt(k2) / (sqrt(bc2) * step_size * k1)``,
        ``eps' = eps / (step_size * k1)``. Float64, rounded once to fp32 by the caller."""
        k1 = (1.0 - self.beta1) * self.grad_mul
        sk2 = math.sqrt(1.0 - self.beta2) * self.grad_mul
        num = self.step_size * k1
        if k1 < _FOLD_MIN_K1 or sk2 < _FOLD_MIN_SQRT_K2 or 0.0 < num < _FOLD_MIN_NUM:
            return None
        upd = num > 0.0
        row = (self.inv_sqrt_bc2 * sk2 / num if upd else 0.0,    # sqrt(w) → denominator
               self.eps / num if upd else 0.0,
               self.decay_mul,
               self.beta1 / SIGNED_LEVELS ** 2 / k1,              # scale → beta1 * mu / c|c|
               math.sqrt(self.beta2) / UNSIGNED_LEVELS ** 2 / sk2,  # scale → sqrt(beta2 w)/c²
               k1,                                                # max |mu| → scale
               sk2,                                               # max sqrt(w) → scale
               1.0 if upd else 0.0)                               # update the parameter?
        if not all(abs(x) < 1e37 for x in row):
            return None
        return row


class FlatStep(NamedTuple):
    """One flat tensor's update: ``fused_steps`` takes a sequence of these."""

    p: torch.Tensor
    """The fp32 parameter, or the bf16 high halves of a split one (``p_lo``)."""
    g: torch.Tensor
    exp_avg_codes: torch.Tensor
    exp_avg_scales: torch.Tensor
    exp_avg_sq_codes: torch.Tensor
    exp_avg_sq_scales: torch.Tensor
    block_size: int
    decay_end: int
    k: StepScalars
    p_lo: torch.Tensor | None = None
    """A split fp32 parameter's int16 remainder (``layerwise.split_master``): ``p`` is its bf16
    part, and the update reads and writes the pair, bit-identical to an update of the fp32."""


# ----- numba --------------------------------------------------------------------------------

if _nb is not None:

    _jit = dict(nogil=True, fastmath=True, cache=True, error_model="numpy", boundscheck=False)

    # raw addresses → typed pointers, so one call can take a table of tensors (a numba list of
    # arrays would cost microseconds per element to build, every step)
    def _ptr_codegen(context, builder, signature, args):  # pragma: no cover - compiled
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    @_intrinsic
    def _f32_at(typingctx, addr):  # pragma: no cover - compiled
        return _nbt.CPointer(_nbt.float32)(_nbt.int64), _ptr_codegen

    @_intrinsic
    def _i8_at(typingctx, addr):  # pragma: no cover - compiled
        return _nbt.CPointer(_nbt.int8)(_nbt.int64), _ptr_codegen

    @_intrinsic
    def _u8_at(typingctx, addr):  # pragma: no cover - compiled
        return _nbt.CPointer(_nbt.uint8)(_nbt.int64), _ptr_codegen

    @_intrinsic
    def _i16_at(typingctx, addr):  # pragma: no cover - compiled
        return _nbt.CPointer(_nbt.int16)(_nbt.int64), _ptr_codegen

    @_intrinsic
    def _u16_at(typingctx, addr):  # pragma: no cover - compiled
        return _nbt.CPointer(_nbt.uint16)(_nbt.int64), _ptr_codegen

    @_intrinsic
    def _stack_scratch(typingctx):  # pragma: no cover - compiled
        # 3 * _MAX_NUMBA_BLOCK fp32 on the stack of the calling function. LLVM knows a local
        # that never escapes aliases none of the tensors, so the loops need no runtime overlap
        # checks against the scratch (from the heap, ~100 instructions per block: -7%)
        def codegen(context, builder, signature, args):
            arr = _cgutils.alloca_once(builder, _ir.ArrayType(_ir.FloatType(),
                                                              3 * _MAX_NUMBA_BLOCK))
            return builder.bitcast(arr, _ir.FloatType().as_pointer())
        return _nbt.CPointer(_nbt.float32)(), codegen

    @_intrinsic
    def _apply(typingctx, x, d, q):  # pragma: no cover - compiled
        # ``x * d - q`` rounded once, as one fused multiply-add, whatever the compiler does around
        # it: a plain and a split parameter (whose loads and stores differ) get the very same
        # bits by construction. (Written as ``x * d - q``, numba's LLVM fused it too, but loop by
        # loop, by its own choice. A CPU without FMA units computes it in libm's ``fmaf``: exact,
        # slower; every x86-64 since 2013 and every ARM64 has them.)
        def codegen(context, builder, signature, args):
            f32 = _ir.FloatType()
            fma = _cgutils.get_or_insert_function(builder.module, _ir.FunctionType(f32, [f32] * 3),
                                                  "llvm.fma.f32")
            return builder.call(fma, [args[0], args[1], builder.fneg(args[2])])
        return _nbt.float32(_nbt.float32, _nbt.float32, _nbt.float32), codegen

    @_nb.njit(inline="always", **_jit)
    def _param_plain(pb, qb, d, cnt):  # pragma: no cover - compiled
        for j in range(cnt):
            pb[j] = _apply(pb[j], d, qb[j])

    @_nb.njit(inline="always", **_jit)
    def _param_split(hb, lb, qb, d, cnt):  # pragma: no cover - compiled
        # a split master (hb, lb: its high and low halves) joined, stepped and split again,
        # exactly; a loop of its own, with no branch in it, so that it vectorises
        for j in range(cnt):
            h, r = split_bits(_apply(join_bits(hb[j], lb[j]), d, qb[j]))
            hb[j] = _np.int16(h)
            lb[j] = _np.int16(r)

    @_nb.njit(inline="always", **_jit)
    def _one_block(gb, qmb, qvb, cnt, am, ar, den, eps, upd,
                   buf_m, buf_r, buf_q):  # pragma: no cover - compiled
        # In folded units (StepScalars.folded): mu' = beta1 mu + g, sqrt(w') = sqrt(beta2 w + g²).
        # The parameter's step goes to buf_q; the caller applies it (_param_plain/_split).
        i32 = _np.int32
        f0 = _np.float32(0.0)
        f1 = _np.float32(1.0)
        half = _np.float32(0.5)
        tiny = _np.float32(1e-30)
        qs = _np.float32(SIGNED_LEVELS)
        qu = _np.float32(UNSIGNED_LEVELS)
        # 1. dequantise, update both moments, the parameter's step and the block maxima (on
        # the float bits: for x >= 0 they order like the values, and an int max-reduction
        # vectorises where a float one does not). The parameter is not read here: this loop's
        # code is the same for a plain and a split parameter, so its fast-math choices are too.
        im = i32(0)
        ir = i32(0)
        for j in range(cnt):
            gi = as_f32(gb[j])
            c = _np.float32(qmb[j])
            m = am * (c * _np.abs(c)) + gi
            c = _np.float32(qvb[j])
            r = ar * (c * c)
            r = _np.sqrt(r * r + gi * gi)
            buf_m[j] = m
            buf_r[j] = r
            if upd:  # a constant after inlining: no branch in the loop
                buf_q[j] = m / (r * den + eps)
            else:
                buf_q[j] = f0
            x = i32(_np.float32(m).view(i32) & i32(0x7FFFFFFF))
            im = x if x > im else im
            x = _np.float32(r).view(i32)
            ir = x if x > ir else ir
        mx_m = i32(im).view(_np.float32)
        mx_r = i32(ir).view(_np.float32)
        km = qs * qs / mx_m if mx_m > f0 else f0
        kr = qu * qu / mx_r if mx_r > f0 else f0
        # 2. requantise: s >= 0, so int(s + 0.5) rounds to nearest; s <= 127 (255) since
        # |m| <= mx_m, so no clamp is needed. Of the three roots per element, two run on the
        # divider (sqrt) and one on the FMA pipes (x * rsqrt(x): fastmath emits an estimate
        # plus one Newton step, ~2 ulp); all three on one unit make it the bottleneck.
        for j in range(cnt):
            m = buf_m[j]
            s = _np.sqrt(_np.abs(m) * km) + half
            qmb[j] = _np.int8(i32(_np.copysign(s, m)))
            x = buf_r[j] * kr
            si = i32(x * (f1 / _np.sqrt(max(x, tiny))) + half)
            # a positive v never gets code 0: x >= 0, so its float bits are > 0 iff x > 0
            qvb[j] = _np.uint8(max(si, min(_np.float32(x).view(i32), i32(1))))
        return mx_m, mx_r

    @_nb.njit(inline="always", **_jit)
    def _blocks(p, pl, g, qm, sm, qv, sv, b0, b1, block, n, decay_end, sc, split,
                buf_m, buf_r, buf_q):  # pragma: no cover - compiled
        f1 = _np.float32(1.0)
        den, eps, decay_mul = sc[0], sc[1], sc[2]
        in_m, in_r, out_m, out_r = sc[3], sc[4], sc[5], sc[6]
        upd = sc[7] != _np.float32(0.0)
        for b in range(b0, b1):
            lo = b * block
            cnt = min(block, n - lo)
            pb = p[lo:lo + cnt]
            lb = pl[lo:lo + cnt]
            gb = g[lo:lo + cnt]
            qmb = qm[lo:lo + cnt]
            qvb = qv[lo:lo + cnt]
            am = sm[b] * in_m
            ar = sv[b] * in_r
            d = decay_mul if lo + cnt <= decay_end else f1
            if lo < decay_end < lo + cnt:  # the block that straddles the decay boundary
                k = decay_end - lo
                buf_q[:k] = _np.float32(0.0)
                if split:
                    _param_split(pb, lb, buf_q, decay_mul, k)
                else:
                    _param_plain(pb, buf_q, decay_mul, k)
            # full blocks of the default size take a copy with a constant trip count (faster)
            if not upd:  # lr == 0: the moments move, the parameter does not
                mx_m, mx_r = _one_block(gb, qmb, qvb, cnt, am, ar, den, eps, False,
                                        buf_m, buf_r, buf_q)
            elif cnt == 256:
                mx_m, mx_r = _one_block(gb, qmb, qvb, 256, am, ar, den, eps, True,
                                        buf_m, buf_r, buf_q)
            else:
                mx_m, mx_r = _one_block(gb, qmb, qvb, cnt, am, ar, den, eps, True,
                                        buf_m, buf_r, buf_q)
            if split:  # per block, not per element
                _param_split(pb, lb, buf_q, d, cnt)
            else:
                _param_plain(pb, buf_q, d, cnt)
            sm[b] = mx_m * out_m
            sv[b] = mx_r * out_r

    @_nb.njit(**_jit)
    def _run_table(tab, scal, b0, b1):  # pragma: no cover - compiled
        # tab[i] = addresses of p, g, qm, sm, qv, sv; numel, decay_end, block size, first
        # global block; the address of a split p's remainder (0: p is fp32); 1 if g is bf16.
        # Runs global blocks [b0, b1) of all rows.
        wide_vectors()
        rows = tab.shape[0]
        scratch = _nb.carray(_stack_scratch(), 3 * _MAX_NUMBA_BLOCK)
        buf_m = scratch[:_MAX_NUMBA_BLOCK]
        buf_r = scratch[_MAX_NUMBA_BLOCK:2 * _MAX_NUMBA_BLOCK]
        buf_q = scratch[2 * _MAX_NUMBA_BLOCK:]
        for i in range(rows):
            n = tab[i, 6]
            block = tab[i, 8]
            first = tab[i, 9]
            nbk = (n + block - 1) // block
            lo = max(b0, first)
            hi = min(b1, first + nbk)
            if lo >= hi:
                continue
            qm = _nb.carray(_i8_at(tab[i, 2]), n)
            sm = _nb.carray(_f32_at(tab[i, 3]), nbk)
            qv = _nb.carray(_u8_at(tab[i, 4]), n)
            sv = _nb.carray(_f32_at(tab[i, 5]), nbk)
            b_lo, b_hi, dec, sc = lo - first, hi - first, tab[i, 7], scal[i]
            if tab[i, 11] != 0:
                _run_row(tab[i, 0], tab[i, 10], _nb.carray(_u16_at(tab[i, 1]), n), qm, sm, qv, sv,
                         b_lo, b_hi, block, n, dec, sc, buf_m, buf_r, buf_q)
            else:
                _run_row(tab[i, 0], tab[i, 10], _nb.carray(_f32_at(tab[i, 1]), n), qm, sm, qv, sv,
                         b_lo, b_hi, block, n, dec, sc, buf_m, buf_r, buf_q)

    @_nb.njit(inline="always", **_jit)
    def _run_row(p_addr, lo_addr, g, qm, sm, qv, sv, b_lo, b_hi, block, n, dec, sc,
                 buf_m, buf_r, buf_q):  # pragma: no cover - compiled
        # one row's blocks, its parameter plain fp32 or split (a remainder address), for a
        # gradient of either dtype (compiled once per dtype)
        if lo_addr != 0:
            _blocks(_nb.carray(_i16_at(p_addr), n), _nb.carray(_i16_at(lo_addr), n), g, qm, sm,
                    qv, sv, b_lo, b_hi, block, n, dec, sc, True, buf_m, buf_r, buf_q)
        else:
            p = _nb.carray(_f32_at(p_addr), n)
            _blocks(p, p, g, qm, sm, qv, sv, b_lo, b_hi, block, n, dec, sc, False,
                    buf_m, buf_r, buf_q)

_MIN_BLOCKS_PER_TASK = 64
"""Blocks a thread takes at least (64 blocks of 256: 16k elements, some 25 µs of work)."""


def numba_available() -> bool:
    return _nb is not None


def kernel_name(device: torch.device) -> str:
    """Which implementation ``fused_step`` uses for tensors on ``device``."""
    forced = os.environ.get("LAYERWISE_OPTIM_KERNEL", "")
    if forced == "torch" or device.type != "cpu" or _nb is None:
        return "torch"
    return "numba"


def fused_step(p: torch.Tensor, g: torch.Tensor, qm: torch.Tensor, sm: torch.Tensor,
               qv: torch.Tensor, sv: torch.Tensor, block_size: int, decay_end: int,
               k: StepScalars, num_threads: int | None = None,
               p_lo: torch.Tensor | None = None) -> None:
    """One AdamW step of flat ``p`` from flat ``g`` (read only), moments as 8-bit codes + block
    scales; updates ``p``, ``p_lo``, ``qm``, ``sm``, ``qv``, ``sv`` in place."""
    fused_steps([FlatStep(p, g, qm, sm, qv, sv, block_size, decay_end, k, p_lo)], num_threads)


_F32, _I8, _U8, _BF16, _I16 = torch.float32, torch.int8, torch.uint8, torch.bfloat16, torch.int16


def _numba_ok(s: FlatStep) -> bool:
    """The numba kernel reads raw addresses: CPU, the exact dtypes, contiguous; and its scratch
    holds ``_MAX_NUMBA_BLOCK`` elements."""
    p, g, qm, sm, qv, sv = s.p, s.g, s.exp_avg_codes, s.exp_avg_scales, \
        s.exp_avg_sq_codes, s.exp_avg_sq_scales
    lo = s.p_lo
    p_ok = (p.dtype is _F32 if lo is None else
            p.dtype is _BF16 and lo.dtype is _I16 and lo.is_cpu and lo.is_contiguous())
    return (0 < s.block_size <= _MAX_NUMBA_BLOCK and p_ok and g.dtype in (_F32, _BF16)
            and qm.dtype is _I8
            and qv.dtype is _U8 and sm.dtype is _F32 and sv.dtype is _F32
            and p.is_cpu and g.is_cpu and qm.is_cpu and qv.is_cpu and sm.is_cpu and sv.is_cpu
            and p.is_contiguous() and g.is_contiguous() and qm.is_contiguous()
            and qv.is_contiguous() and sm.is_contiguous() and sv.is_contiguous())


def fused_steps(steps: Sequence[FlatStep], num_threads: int | None = None) -> None:
    """``fused_step`` for many tensors at once, the blocks of all split evenly over ``num_threads``;
    tensors the kernel cannot take run on the torch path. ``p`` contiguous, ``g`` as many elements.
    """
    use_numba = _nb is not None and os.environ.get("LAYERWISE_OPTIM_KERNEL", "") != "torch"
    rows, scal, folded = [], [], {}
    first = 0
    for s in steps:
        p = s.p
        n = p.numel()
        block = s.block_size
        nb = (n + block - 1) // block
        assert p.is_contiguous(), "p is updated in place as a flat tensor: make it contiguous"
        assert s.g.numel() == s.exp_avg_codes.numel() == s.exp_avg_sq_codes.numel() == n
        assert s.p_lo is None or (s.p_lo.numel() == n and p.dtype is _BF16), "split p: bf16 + lo"
        assert s.exp_avg_scales.numel() == s.exp_avg_sq_scales.numel() == nb
        f = None
        if use_numba and _numba_ok(s):
            f = folded.get(id(s.k), False)  # callers share one StepScalars per step count
            if f is False:
                f = folded[id(s.k)] = s.k.folded()
        if f is None:
            _fused_step_torch(p.view(-1), s.g.reshape(-1), s.exp_avg_codes.view(-1),
                              s.exp_avg_scales, s.exp_avg_sq_codes.view(-1),
                              s.exp_avg_sq_scales, block, s.decay_end, s.k,
                              None if s.p_lo is None else s.p_lo.view(-1))
            continue
        if n == 0:
            continue
        rows.append((p.data_ptr(), s.g.data_ptr(), s.exp_avg_codes.data_ptr(),
                     s.exp_avg_scales.data_ptr(), s.exp_avg_sq_codes.data_ptr(),
                     s.exp_avg_sq_scales.data_ptr(), n, min(max(s.decay_end, 0), n),
                     block, first, 0 if s.p_lo is None else s.p_lo.data_ptr(),
                     int(s.g.dtype is _BF16)))
        scal.append(f)
        first += nb
    if rows:
        tab = _np.array(rows, dtype=_np.int64)
        sc = _np.array(scal, dtype=_np.float32)
        # the tensors stay referenced by ``steps`` until every task below has returned
        run_split(lambda lo, hi: _run_table(tab, sc, lo, hi), first,
                  num_threads or torch.get_num_threads(), _MIN_BLOCKS_PER_TASK)


# ----- torch --------------------------------------------------------------------------------

def _fused_step_torch(p, g, qm, sm, qv, sv, block_size, decay_end, k, p_lo=None):
    # ``p_lo``: ``p`` is a split master's bf16 part; each chunk is joined to fp32, updated and
    # split back (exact), so no fp32 copy of the whole tensor exists
    n = p.numel()
    target = _TORCH_CHUNK.get(p.device.type, _TORCH_CHUNK_OTHER)
    chunk = max(block_size, target // block_size * block_size)
    in_m = 1.0 / SIGNED_LEVELS ** 2
    in_r = 1.0 / UNSIGNED_LEVELS ** 2
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        b_lo, b_hi = lo // block_size, num_blocks(hi, block_size)
        cnt = hi - lo
        nbk = b_hi - b_lo
        pad = nbk * block_size - cnt

        def blocks(x: torch.Tensor) -> torch.Tensor:  # [nbk, block] view, zero-padded tail
            x = x.float()
            if pad:
                x = torch.nn.functional.pad(x, (0, pad))
            return x.view(nbk, block_size)

        gi = blocks(g[lo:hi]).mul(k.grad_mul)
        c = blocks(qm[lo:hi])
        m = c.mul_(c.abs()).mul_(sm[b_lo:b_hi, None] * in_m)
        c = blocks(qv[lo:hi])
        r = c.mul_(c).mul_(sv[b_lo:b_hi, None] * in_r)
        m.mul_(k.beta1).add_(gi, alpha=1.0 - k.beta1)
        v = r.mul_(r).mul_(k.beta2).addcmul_(gi, gi, value=1.0 - k.beta2)
        r = v.sqrt_()
        denom = r.mul(k.inv_sqrt_bc2).add_(k.eps)
        upd = torch.div(m, denom).mul_(k.step_size).view(-1)[:cnt]
        pc = p[lo:hi] if p_lo is None else join_torch(p[lo:hi], p_lo[lo:hi])
        split = min(max(decay_end - lo, 0), cnt)
        if split and k.decay_mul != 1.0:
            pc[:split].mul_(k.decay_mul)
        pc.sub_(upd.to(pc.dtype))
        if p_lo is not None:
            split_(pc, p[lo:hi], p_lo[lo:hi])
        # requantise
        mx_m = m.abs().amax(dim=1)
        mx_r = r.amax(dim=1)
        km = torch.where(mx_m > 0, SIGNED_LEVELS ** 2 / mx_m, torch.zeros_like(mx_m))
        kr = torch.where(mx_r > 0, UNSIGNED_LEVELS ** 2 / mx_r, torch.zeros_like(mx_r))
        s = m.abs().mul_(km[:, None]).sqrt_().add_(0.5).floor_().clamp_(max=SIGNED_LEVELS)
        qm[lo:hi] = torch.copysign(s, m).view(-1)[:cnt].to(torch.int8)
        s = r.mul(kr[:, None]).sqrt_().add_(0.5).floor_().clamp_(max=UNSIGNED_LEVELS)
        s = torch.where(r > 0, s.clamp(min=1.0), s)
        qv[lo:hi] = s.view(-1)[:cnt].to(torch.uint8)
        sm[b_lo:b_hi] = mx_m
        sv[b_lo:b_hi] = mx_r
