"""The fp32-moment AdamW update in one pass per element, for every form the host keeps (plain or
split master, fp32 or bf16 gradient, clip folded into the read): each byte touched once.

``torch.optim.AdamW``'s arithmetic element by element without fast-math, so the result does not
depend on the thread split and a split master ends bit-identical to a plain one (within round-off
of torch's fused kernel, not equal)."""

from __future__ import annotations

import torch

from ..util.threads import run_split

try:  # numba is optional: adamw.py falls back to torch's fused AdamW
    import numba as _nb
    import numpy as _np

    from ..split_master import as_f32, join_bits, split_bits
    from ..util.simd import wide_vectors
except Exception:  # pragma: no cover - depends on the environment
    _nb = None

_MIN_PER_TASK = 1 << 16
"""Fewest elements a thread takes (some 100 µs of work)."""


if _nb is not None:
    _jit = dict(nogil=True, cache=True, error_model="numpy", boundscheck=False)

    @_nb.njit(inline="always", **_jit)
    def _moments(g, m, v, j, b1, c1, b2, c2, gm):  # pragma: no cover - compiled
        gi = as_f32(g[j]) * gm
        mj = b1 * m[j] + c1 * gi
        vj = b2 * v[j] + c2 * (gi * gi)
        m[j] = mj
        v[j] = vj
        return mj, vj

    # Each loop runs over slices from 0: with ``range(lo, hi)`` numba keeps its negative-index
    # wrap-around check, and LLVM then leaves the loop scalar (3x slower).
    @_nb.njit(**_jit)
    def _step_plain(p, g, m, v, lo, hi, decay_end, sc):  # pragma: no cover - compiled
        wide_vectors()
        b1, c1, b2, c2, gm, dm, ss, ib, eps = sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], \
            sc[7], sc[8]
        for a, b, d in ((lo, min(hi, max(lo, decay_end)), dm),
                        (max(lo, decay_end), hi, _np.float32(1.0))):
            pp, gg, mm, vv = p[a:b], g[a:b], m[a:b], v[a:b]
            for j in range(b - a):
                mj, vj = _moments(gg, mm, vv, j, b1, c1, b2, c2, gm)
                pp[j] = pp[j] * d - ss * (mj / (_np.sqrt(vj) * ib + eps))

    @_nb.njit(**_jit)
    def _step_split(hi_, lo_, g, m, v, lo, hi, decay_end, sc):  # pragma: no cover - compiled
        wide_vectors()
        b1, c1, b2, c2, gm, dm, ss, ib, eps = sc[0], sc[1], sc[2], sc[3], sc[4], sc[5], sc[6], \
            sc[7], sc[8]
        for a, b, d in ((lo, min(hi, max(lo, decay_end)), dm),
                        (max(lo, decay_end), hi, _np.float32(1.0))):
            hh, ll, gg, mm, vv = hi_[a:b], lo_[a:b], g[a:b], m[a:b], v[a:b]
            for j in range(b - a):
                mj, vj = _moments(gg, mm, vv, j, b1, c1, b2, c2, gm)
                x = join_bits(hh[j], ll[j])
                h, r = split_bits(x * d - ss * (mj / (_np.sqrt(vj) * ib + eps)))
                hh[j] = _np.int16(h)
                ll[j] = _np.int16(r)


def takes(master: torch.Tensor, grad: torch.Tensor, remainder: torch.Tensor | None) -> bool:
    """Whether the kernel can step these CPU tensors (else the caller's torch path does)."""
    ok_p = (master.dtype == torch.float32 if remainder is None else
            master.dtype == torch.bfloat16 and remainder.dtype == torch.int16
            and remainder.is_contiguous() and remainder.device.type == "cpu")
    return (_nb is not None and ok_p and grad.dtype in (torch.float32, torch.bfloat16)
            and master.device.type == "cpu" and grad.device.type == "cpu"
            and master.is_contiguous() and grad.is_contiguous())


def step(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
         *, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
         decay_end: int, grad_mul: float = 1.0, remainder: torch.Tensor | None = None,
         threads: int = 1) -> None:
    """One AdamW step of flat ``master`` (fp32, or with ``remainder`` the bf16 half of a split
    fp32) from ``grad * grad_mul``; elements before ``decay_end`` take ``weight_decay``.
    Updates ``master`` (and ``remainder``), ``exp_avg``, ``exp_avg_sq`` in place."""
    n = master.numel()
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    sc = _np.array([beta1, 1.0 - beta1, beta2, 1.0 - beta2, grad_mul, 1.0 - lr * weight_decay,
                    lr / bc1, 1.0 / bc2 ** 0.5, eps], dtype=_np.float32)
    g = grad.view(-1)
    g = (g.view(torch.int16) if g.dtype == torch.bfloat16 else g).numpy()
    m, v = exp_avg.view(-1).numpy(), exp_avg_sq.view(-1).numpy()
    if remainder is None:
        p = master.view(-1).numpy()
        run = lambda a, b: _step_plain(p, g, m, v, a, b, decay_end, sc)  # noqa: E731
    else:
        h = master.view(-1).view(torch.int16).numpy()
        r = remainder.view(-1).numpy()
        run = lambda a, b: _step_split(h, r, g, m, v, a, b, decay_end, sc)  # noqa: E731
    run_split(run, n, threads, _MIN_PER_TASK)
