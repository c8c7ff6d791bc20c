"""fp32 AdamW over the HostStore, one unit (flat buffer) at a time, so units may be updated on
different worker threads.

With numba one pass of ``_kernel_fp32``; else torch's fused AdamW, a split master stepped in
``SPLIT_CHUNK`` pieces through an L2-sized scratch, each starting a multiple of 64 elements in so
the result is bit-identical to stepping the fp32 master in one call."""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from ..store import UnitBuffers
from ..util.threads import run_split
from . import _kernel_fp32
from .config import AdamWConfig

__all__ = ["AdamWConfig", "HostAdamW", "UnitOptimizer", "state_nbytes"]

SPLIT_CHUNK = 1 << 16
"""Elements of a split master joined per fused call: 256 KiB of fp32 scratch per thread, in L2
(a multiple of 64, see above)."""

_scratch = threading.local()


def chunk_buffer(which: int = 0) -> torch.Tensor:
    """This thread's fp32 scratch number ``which`` (0: weights, 1: gradients) of
    ``SPLIT_CHUNK`` elements."""
    bufs = getattr(_scratch, "bufs", None)
    if bufs is None or bufs[0].numel() < SPLIT_CHUNK:
        bufs = _scratch.bufs = (torch.empty(SPLIT_CHUNK, dtype=torch.float32),
                                torch.empty(SPLIT_CHUNK, dtype=torch.float32))
    return bufs[which]


def state_nbytes(numel: int) -> int:
    """Host bytes of ``HostAdamW``'s state for ``numel`` parameters: two fp32 moments + step."""
    return 8 * numel + 4


class UnitOptimizer(Protocol):
    """Updates one unit's master weights in place from its accumulated gradient."""

    def init_state(self, buf: UnitBuffers) -> None:
        """Create ``buf.state`` (called once per unit before the first step)."""

    def step_unit(self, buf: UnitBuffers, lr: float, clip_coef: float) -> None:
        """One AdamW step of ``buf`` with gradient ``buf.grad * clip_coef``; may clobber ``buf.grad``."""


class HostAdamW:
    """fp32 moments; matches ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) to round-off."""

    def __init__(self, config: AdamWConfig, num_threads: int | None = None):
        self.config = config
        self.num_threads = num_threads
        """Threads one ``step_unit`` call of a split master or bf16 gradient splits its chunks
        over; None: torch's thread count (a plain fp32 step is one torch call, which splits
        itself)."""

    def init_state(self, buf: UnitBuffers) -> None:
        # pageable: only the copy sources are pinned (see layerwise.store)
        # through the store's allocator: shared by the local ranks of a node under torchrun
        n, zeros = buf.layout.numel, buf.alloc.zeros
        buf.state = {
            "exp_avg": zeros(n, torch.float32),
            "exp_avg_sq": zeros(n, torch.float32),
            "step": zeros(1, torch.float32).view(()),
        }

    @staticmethod
    def state_nbytes(numel: int) -> int:
        """Bytes ``init_state`` allocates for a unit of ``numel`` parameters."""
        return state_nbytes(numel)

    def step_unit(self, buf: UnitBuffers, lr: float, clip_coef: float) -> None:
        c = self.config
        s = buf.state
        s["step"] += 1
        p = buf.compute if buf.split else buf.master
        if _kernel_fp32.takes(p, buf.grad, buf.remainder):  # one pass, every form, all threads
            _kernel_fp32.step(p, buf.grad, s["exp_avg"], s["exp_avg_sq"], lr=lr, beta1=c.betas[0],
                              beta2=c.betas[1], eps=c.eps, weight_decay=c.weight_decay,
                              step=int(s["step"].item()), decay_end=buf.layout.decay_numel,
                              grad_mul=clip_coef, remainder=buf.remainder,
                              threads=self.num_threads or torch.get_num_threads())
            return
        split = buf.layout.decay_numel
        scale = torch.tensor(1.0 / clip_coef) if clip_coef != 1.0 else None
        for lo, hi, wd in ((0, split, c.weight_decay), (split, buf.layout.numel, 0.0)):
            if hi <= lo:
                continue
            kw = dict(lr=lr, beta1=c.betas[0], beta2=c.betas[1], weight_decay=wd, eps=c.eps,
                      amsgrad=False, maximize=False, grad_scale=scale, found_inf=None)
            if not buf.split and buf.grad.dtype == torch.float32:
                _fused(buf, lo, hi, s, kw)
                continue
            # chunk edges stay SPLIT_CHUNK multiples from ``lo``: the same chunks as one thread
            run_split(lambda a, b, lo=lo, kw=kw: _chunked(buf, lo + a, lo + b, s, kw), hi - lo,
                      self.num_threads or torch.get_num_threads(), 4 * SPLIT_CHUNK,
                      align=SPLIT_CHUNK)


def _fused(buf: UnitBuffers, lo: int, hi: int, s: dict[str, torch.Tensor], kw: dict) -> None:
    torch._fused_adamw_([buf.master[lo:hi]], [buf.grad[lo:hi]], [s["exp_avg"][lo:hi]],
                        [s["exp_avg_sq"][lo:hi]], [], [s["step"]], **kw)


def _chunked(buf: UnitBuffers, lo: int, hi: int, s: dict[str, torch.Tensor], kw: dict) -> None:
    # a split master joined into scratch (a plain one stepped in place), a bf16 gradient
    # widened into scratch, SPLIT_CHUNK elements at a time
    w_scratch, g_scratch = chunk_buffer(0), chunk_buffer(1)
    wide = buf.grad.dtype == torch.float32
    for a in range(lo, hi, SPLIT_CHUNK):
        b = min(a + SPLIT_CHUNK, hi)
        w = buf.read_master(a, b, out=w_scratch[:b - a] if buf.split else None)
        g = buf.grad[a:b] if wide else g_scratch[:b - a].copy_(buf.grad[a:b])
        torch._fused_adamw_([w], [g], [s["exp_avg"][a:b]], [s["exp_avg_sq"][a:b]],
                            [], [s["step"]], **kw)
        if buf.split:
            buf.write_master(w, a)
