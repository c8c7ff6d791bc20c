"""The host accumulation kernel is bit-equal to ``dst += src.float()`` (and ``first`` to
``dst = src.float()``) for every bf16 bit pattern, odd sizes and split over threads.

Mutations seen failing (each by hand, once; numba caches a compiled kernel by its own file, so
after editing ``split_master`` remove ``src/layerwise/optim/__pycache__/*.nb*`` first):
- the bf16 widening (``split_master.as_f32``) shifting by 15 instead of 16
  (``test_bf16_add_is_bit_equal_to_torch``);
- ``_copy`` adding instead of writing (``test_first_writes_instead_of_adding``);
- ``run_split``'s workers stopping one element short of each chunk's end
  (``edges[i + 1] - 1``): only the split sizes fail (``...[(1 << 17) * 3 + 5-2]``).
"""

import pytest
import torch

from layerwise.optim import grad_accum
from layerwise.optim.grad_accum import accumulate, kernel_name

SIZES = [1, 7, 2047, 2049, (1 << 17) * 3 + 5]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def every_bf16(n: int, seed: int) -> torch.Tensor:
    """``n`` bf16 values of random bit patterns (NaNs, infinities, subnormals, -0 included),
    the 65536 patterns all present once ``n`` reaches it."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32)
    raw[:min(n, 1 << 16)] = torch.arange(-(1 << 15), (1 << 15), dtype=torch.int32)[:min(n, 1 << 16)]
    return raw.to(torch.int16).view(torch.bfloat16)


def finite_fp32(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    out = torch.randn(n, generator=g) * 3.0
    out[: min(n, 4)] = torch.tensor([0.0, -0.0, 1e-40, -3e38])[: min(n, 4)]
    return out


needs_numba = pytest.mark.skipif(not grad_accum.numba_available(), reason="numba missing")


@needs_numba
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_bf16_add_is_bit_equal_to_torch(n, threads):
    src = every_bf16(n, seed=n)
    dst = finite_fp32(n, seed=n)
    want = dst.clone()
    want += src.float()
    assert kernel_name(dst, src) == "numba"
    accumulate(dst, src, threads=threads)
    assert torch.equal(bits(dst), bits(want))


@needs_numba
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_first_writes_instead_of_adding(n, threads):
    """The first landing of a step overwrites whatever the gradient held (here NaN)."""
    src = every_bf16(n, seed=n + 1)
    dst = torch.full((n,), float("nan"))
    accumulate(dst, src, first=True, threads=threads)
    assert torch.equal(bits(dst), bits(src.float()))
    src32 = finite_fp32(n, seed=n + 2)
    accumulate(dst, src32, first=True, threads=threads)
    assert torch.equal(bits(dst), bits(src32))


@needs_numba
@pytest.mark.parametrize("n", SIZES)
def test_fp32_add_is_bit_equal_to_torch(n):
    src, dst = finite_fp32(n, seed=1), finite_fp32(n, seed=2)
    want = dst + src
    accumulate(dst, src, threads=2)
    assert torch.equal(bits(dst), bits(want))


@pytest.mark.parametrize("first", [False, True])
def test_torch_fallback_is_exact_too(first, monkeypatch):
    """fp16 and strided sources, and numba switched off, take the chunked torch path."""
    monkeypatch.setattr(grad_accum, "_TORCH_CHUNK", 1000)  # several chunks, a ragged last one
    n = 4099
    for src in (every_bf16(n, 3).float().half(), every_bf16(2 * n, 4)[::2]):
        dst = finite_fp32(n, 5)
        want = src.float().clone() if first else dst + src.float()
        assert kernel_name(dst, src) == "torch"
        accumulate(dst, src, first=first)
        assert torch.equal(bits(dst), bits(want))
    monkeypatch.setattr(grad_accum, "_nb", None)
    src, dst = every_bf16(n, 6), finite_fp32(n, 7)
    want = src.float().clone() if first else dst + src.float()
    accumulate(dst, src, first=first)
    assert torch.equal(bits(dst), bits(want))


def test_sizes_must_match():
    with pytest.raises(ValueError, match="3 destination elements for 4 source elements"):
        accumulate(torch.zeros(3), torch.zeros(4, dtype=torch.bfloat16))
