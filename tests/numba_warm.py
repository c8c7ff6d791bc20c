"""Compile layerwise's numba kernels once, into their ``cache=True`` files (``__pycache__``
beside each module), so that the test processes after it load the machine code (~1 s) instead of
each compiling it (tens of seconds on a loaded 2-core box, paid by every pytest-xdist worker
and every multi-process test's child of a fresh clone). ``tests/conftest.py`` runs it on the
pytest-xdist controller before the workers start; ``python tests/numba_warm.py`` runs it alone.
Each call below takes the argument types the library passes (a signature it misses still
compiles on first use, as before)."""

from __future__ import annotations

import time


def warm() -> float:
    """Run every kernel once on tiny tensors; returns the seconds it took (0 without numba)."""
    t0 = time.perf_counter()
    import torch

    from layerwise.optim import _kernel, _kernel_fp32, grad_accum
    from layerwise import split_master

    if not (_kernel.numba_available() and grad_accum.numba_available()
            and split_master.numba_available()):
        return 0.0
    n = 512
    x = torch.randn(n)
    hi, lo = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    split_master.split_(x, hi, lo)
    split_master.round_bf16_(x, torch.empty(n, dtype=torch.bfloat16))
    split_master.join(hi, lo)
    for src in (torch.randn(n), torch.randn(n).bfloat16()):
        for first in (True, False):
            grad_accum.accumulate(torch.zeros(n), src, first=first)
    for g in (torch.randn(n), torch.randn(n).bfloat16()):
        m, v = torch.zeros(n), torch.zeros(n)
        kw = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1, decay_end=n)
        _kernel_fp32.step(torch.randn(n), g, m, v, **kw)
        _kernel_fp32.step(hi.clone(), g, m, v, remainder=lo.clone(), **kw)
    block = 256
    k = _kernel.StepScalars.of(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, step=1)
    steps = []
    for g in (torch.randn(n), torch.randn(n).bfloat16()):
        for p, p_lo in ((torch.randn(n), None), (hi.clone(), lo.clone())):
            steps.append(_kernel.FlatStep(p, g, torch.zeros(n, dtype=torch.int8),
                                          torch.zeros(n // block), torch.zeros(n, dtype=torch.uint8),
                                          torch.zeros(n // block), block, n, k, p_lo))
    _kernel.fused_steps(steps, num_threads=1)
    return time.perf_counter() - t0


if __name__ == "__main__":
    print(f"numba kernels warm in {warm():.1f} s")
