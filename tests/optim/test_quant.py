import pytest
import torch

from layerwise.optim import quant


def _moments_like(n: int, seed: int = 0) -> torch.Tensor:
    """Values spread over six orders of magnitude, as Adam moments are."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (torch.rand(n, generator=g) * 6 - 6)
    return mag * torch.randn(n, generator=g).sign()


@pytest.mark.parametrize("block_size", [64, 256, 2048])
def test_signed_error_within_per_block_bound(block_size):
    n = 10 * block_size + 37  # a partial last block too
    x = _moments_like(n)
    codes, scale = quant.quantize_signed(x, block_size)
    assert codes.dtype == torch.int8 and codes.numel() == n
    assert scale.numel() == quant.num_blocks(n, block_size)
    xb = torch.nn.functional.pad(x, (0, scale.numel() * block_size - n)).view(-1, block_size)
    assert torch.equal(scale, xb.abs().amax(dim=1))
    assert codes.abs().max() <= 127
    y = quant.dequantize_signed(codes, scale, block_size)
    scale_el = scale.repeat_interleave(block_size)[:n]
    bound = quant.signed_error_bound(x, scale_el)
    err = (x - y).abs()
    assert (err <= bound * (1 + 1e-5) + 1e-30).all()
    # the bound is tight to within a factor ~2 for the worst element of a block
    assert err.max() > 0.4 * bound.max()
    # sign kept, and each block's largest element is exact
    assert ((y == 0) | (y.sign() == x.sign())).all()
    top = (x.abs() == scale_el)
    assert torch.allclose(y[top].abs(), x[top].abs(), rtol=1e-6)


def test_signed_zero_block_and_idempotence():
    x = torch.zeros(300)
    x[256:] = torch.randn(44)
    codes, scale = quant.quantize_signed(x, 256)
    assert scale[0] == 0 and (codes[:256] == 0).all()
    y = quant.dequantize_signed(codes, scale, 256)
    assert (y[:256] == 0).all()
    codes2, scale2 = quant.quantize_signed(y, 256)
    assert torch.equal(codes, codes2) and torch.equal(scale, scale2)


def test_sq_error_bound_and_no_zero_denominator():
    block = 256
    v = _moments_like(5000, seed=1).abs() ** 2  # v spans 12 orders of magnitude
    v[7] = 0.0
    codes, scale = quant.quantize_sq(v, block)
    assert codes.dtype == torch.uint8
    y = quant.dequantize_sq(codes, scale, block)
    r, ry = v.sqrt(), y.sqrt()
    a = scale.repeat_interleave(block)[: v.numel()]
    s = (r / a).sqrt() * 255
    # code 0 is reserved for v == 0, so the smallest values round up to code 1 (error < a/255^2)
    bound = torch.maximum(a * (s + 0.25), a * (1.0 - s * s)) / 255 ** 2
    assert ((r - ry).abs() <= bound * (1 + 1e-5)).all()
    assert y[7] == 0
    pos = v > 0
    assert (y[pos] > 0).all(), "a positive second moment must never decode to zero"
    assert (y[pos] >= 0).all() and torch.isfinite(y).all()


def test_square_law_beats_linear_for_small_values():
    """Why a companding map: relative error on the small half of a block's values."""
    x = _moments_like(256 * 64, seed=2)
    codes, scale = quant.quantize_signed(x, 256)
    y = quant.dequantize_signed(codes, scale, 256)
    xb = x.view(-1, 256)
    lin = (xb / scale[:, None] * 127).round() * scale[:, None] / 127
    small = xb.abs() < scale[:, None] * 1e-2
    rel_sq = ((y.view(-1, 256) - xb).abs() / xb.abs())[small].median()
    rel_lin = ((lin - xb).abs() / xb.abs())[small].median()
    assert rel_sq < 0.5 * rel_lin
