"""The fused 8-bit AdamW update: dequantise → update → requantise, one pass over each block.

Two implementations of the same arithmetic (maps in ``quant.py``):

- ``numba`` (CPU, fp32, contiguous): per block, one vectorised loop dequantises, updates both
  moments and the parameter; a second finds the block maxima; a third requantises. The block's
  new moments wait in two ``block_size`` scratch arrays (L1-resident), so memory is read and
  written once. Compiled with ``nogil=True`` and run on a small thread pool (ours, not
  numba's), so it is safe to call from several engine worker threads at once. Cold start:
  ~1.7 s to compile on first use in a fresh environment; ``cache=True`` keeps the machine code
  in ``__pycache__``, and later processes load it in ~0.3 s.
- ``torch`` (any device, any float dtype): the same maths as a few dozen elementwise ops over
  chunks of ``_TORCH_CHUNK`` elements, so the temporaries stay in cache. Used on CUDA, when
  numba is missing, or when ``LAYERWISE_OPTIM_KERNEL=torch``.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .quant import SIGNED_LEVELS, UNSIGNED_LEVELS, num_blocks

try:  # numba is optional: the torch path below computes the same update
    import numba as _nb
    import numpy as _np
except Exception:  # pragma: no cover - depends on the environment
    _nb = None

_TORCH_CHUNK = {"cpu": 1 << 16}
"""Elements per chunk on the torch path, per device type: small on CPU so temporaries stay in
cache, large elsewhere so a GPU gets few big kernels (default ``_TORCH_CHUNK_OTHER``)."""
_TORCH_CHUNK_OTHER = 1 << 24


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


# ----- numba --------------------------------------------------------------------------------

if _nb is not None:

    _jit = dict(nogil=True, fastmath=True, cache=True, error_model="numpy", boundscheck=False)

    @_nb.njit(inline="always", **_jit)
    def _one_block(pb, gb, qmb, qvb, cnt, am, ar, d, k1, k2, step_size, inv_sqrt_bc2, eps,
                   buf_m, buf_r, buf_mi, buf_ri, bits):  # pragma: no cover - compiled
        f0 = _np.float32(0.0)
        half = _np.float32(0.5)
        qs = _np.float32(SIGNED_LEVELS)
        qu = _np.float32(UNSIGNED_LEVELS)
        for j in range(cnt):  # dequantise, update both moments and the parameter
            gi = gb[j]
            c = _np.float32(qmb[j])
            m = am * c * _np.abs(c) + k1 * gi
            c = _np.float32(qvb[j])
            r = ar * c * c
            r = _np.sqrt(r * r + k2 * (gi * gi))
            buf_m[j] = m
            buf_r[j] = r
            pb[j] = pb[j] * d - step_size * m / (r * inv_sqrt_bc2 + eps)
        # block maxima on the float bits: for x >= 0 they order like the values, and an int
        # max-reduction vectorises where a float one (NaN rules) does not
        im = _np.int32(0)
        ir = _np.int32(0)
        for j in range(cnt):
            x = buf_mi[j] & _np.int32(0x7FFFFFFF)
            im = x if x > im else im
            x = buf_ri[j]
            ir = x if x > ir else ir
        bits[0] = im
        bits[1] = ir
        mx = bits.view(_np.float32)
        mx_m = mx[0]
        mx_r = mx[1]
        km = qs * qs / mx_m if mx_m > f0 else f0
        kr = qu * qu / mx_r if mx_r > f0 else f0
        # requantise: x >= 0, so int(x + 0.5) rounds to nearest; x <= 127 (255) since
        # |m| <= mx_m, so no clamp is needed
        for j in range(cnt):
            m = buf_m[j]
            si = _np.int32(_np.sqrt(_np.abs(m) * km) + half)
            qmb[j] = _np.int8(-si if m < f0 else si)
            r = buf_r[j]
            si = _np.int32(_np.sqrt(r * kr) + half)
            si = max(si, _np.int32(1)) if r > f0 else si
            qvb[j] = _np.uint8(si)
        return mx_m, mx_r

    @_nb.njit(**_jit)
    def _blocks_numba(p, g, qm, sm, qv, sv, b0, b1, block, n, decay_end,
                      k1, k2, decay_mul, step_size, inv_sqrt_bc2, eps,
                      in_m, in_r):  # pragma: no cover - compiled
        # k1 = (1 - beta1) * clip, k2 = (1 - beta2) * clip**2: the clip costs no extra op;
        # in_m = beta1 / 127**2 and in_r = sqrt(beta2) / 255**2 fold the decay into the scales.
        # A few short loops per block over few arrays: LLVM vectorises each (AVX2/AVX-512); one
        # loop doing everything does not vectorise and is 2.5x slower. Full blocks of the
        # default size take a copy of the block code with a constant trip count (~15% faster).
        f1 = _np.float32(1.0)
        buf_m = _np.empty(block, _np.float32)
        buf_r = _np.empty(block, _np.float32)
        buf_mi = buf_m.view(_np.int32)
        buf_ri = buf_r.view(_np.int32)
        bits = _np.empty(2, _np.int32)
        for b in range(b0, b1):
            lo = b * block
            cnt = min(block, n - lo)
            pb = p[lo:lo + cnt]
            gb = g[lo:lo + cnt]
            qmb = qm[lo:lo + cnt]
            qvb = qv[lo:lo + cnt]
            am = sm[b] * in_m
            ar = sv[b] * in_r
            d = decay_mul if lo + cnt <= decay_end else f1
            if lo < decay_end < lo + cnt:  # the block that straddles the decay boundary
                for j in range(decay_end - lo):
                    pb[j] *= decay_mul
            if cnt == 256:
                mx_m, mx_r = _one_block(pb, gb, qmb, qvb, 256, am, ar, d, k1, k2, step_size,
                                        inv_sqrt_bc2, eps, buf_m, buf_r, buf_mi, buf_ri, bits)
            else:
                mx_m, mx_r = _one_block(pb, gb, qmb, qvb, cnt, am, ar, d, k1, k2, step_size,
                                        inv_sqrt_bc2, eps, buf_m, buf_r, buf_mi, buf_ri, bits)
            sm[b] = mx_m
            sv[b] = mx_r


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_MIN_BLOCKS_PER_TASK = 256


def _get_pool(workers: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="adamw8bit")
        return _pool


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
               k: StepScalars, num_threads: int | None = None) -> None:
    """One AdamW step of flat ``p`` from flat ``g``, moments as 8-bit codes + block scales.

    Updates ``p``, ``qm``, ``sm``, ``qv``, ``sv`` in place; ``g`` is only read.
    """
    assert p.dim() == 1 and p.shape == g.shape == qm.shape == qv.shape
    assert sm.numel() == sv.numel() == num_blocks(p.numel(), block_size)
    if (kernel_name(p.device) == "numba" and p.dtype == torch.float32
            and g.dtype == torch.float32 and p.is_contiguous() and g.is_contiguous()):
        _fused_step_numba(p, g, qm, sm, qv, sv, block_size, decay_end, k, num_threads)
    else:
        _fused_step_torch(p, g, qm, sm, qv, sv, block_size, decay_end, k)


def _fused_step_numba(p, g, qm, sm, qv, sv, block_size, decay_end, k, num_threads):
    n = p.numel()
    nb = sm.numel()
    arrays = [t.detach().numpy() for t in (p, g, qm, sm, qv, sv)]
    f = _np.float32
    scalars = (f((1.0 - k.beta1) * k.grad_mul), f((1.0 - k.beta2) * k.grad_mul ** 2),
               f(k.decay_mul), f(k.step_size), f(k.inv_sqrt_bc2), f(k.eps),
               f(k.beta1 / SIGNED_LEVELS ** 2), f(math.sqrt(k.beta2) / UNSIGNED_LEVELS ** 2))

    def run(b0: int, b1: int) -> None:
        _blocks_numba(*arrays, b0, b1, block_size, n, decay_end, *scalars)

    workers = num_threads or torch.get_num_threads()
    tasks = max(1, min(workers, nb // _MIN_BLOCKS_PER_TASK))
    if tasks == 1:
        run(0, nb)
        return
    edges = [nb * i // tasks for i in range(tasks + 1)]
    pool = _get_pool(tasks - 1)
    futures = [pool.submit(run, edges[i], edges[i + 1]) for i in range(1, tasks)]
    run(edges[0], edges[1])
    for fut in futures:
        fut.result()


# ----- torch --------------------------------------------------------------------------------

def _fused_step_torch(p, g, qm, sm, qv, sv, block_size, decay_end, k):
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
        pc = p[lo:hi]
        split = min(max(decay_end - lo, 0), cnt)
        if split and k.decay_mul != 1.0:
            pc[:split].mul_(k.decay_mul)
        pc.sub_(upd.to(p.dtype))
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
