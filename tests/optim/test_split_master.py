"""The split fp32 master (bf16 high half + int16 remainder): exact encoding, exact updates.

The encoding is checked over adversarial bit patterns (every low half under a spread of high
halves: ties of both parities, the carries into the exponent, subnormals, signed zeros, the
largest finite values, infinities, NaNs), both implementations (numba, torch) against each
other; the updates by whole training runs that must end bit-identical to the fp32 master's.
"""

import pytest
import torch

from layerwise import split_master as sm
from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.optim import adamw, adamw8bit
from layerwise.optim.adamw import AdamWConfig
from layerwise.plan import Plan
from layerwise.store import HostStore


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32)


def _adversarial() -> torch.Tensor:
    """fp32 bit patterns: all 2^16 low halves under high halves that cover every class."""
    highs = [0x0000, 0x0001, 0x0002, 0x007F, 0x0080, 0x0081,  # zero, subnormals, the normal edge
             0x3F80, 0x3F81, 0x3FFF, 0x4000, 0x3F7F,  # around 1, mantissas all ones
             0x7F7E, 0x7F7F,  # the largest finite: its upper half rounds to inf
             0x7F80, 0x7F81, 0x7FC0, 0x7FFF]  # inf, signalling and quiet NaNs
    highs += [h | 0x8000 for h in highs]  # and their negatives (-0, -inf, ...)
    low = torch.arange(1 << 16, dtype=torch.int32)
    pats = torch.cat([(torch.tensor(h, dtype=torch.int32) << 16) | low for h in highs])
    rnd = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), generator=torch.Generator().manual_seed(0),
                        dtype=torch.int64).to(torch.int32)
    return torch.cat([pats, rnd]).view(torch.float32)


def test_split_is_exact_and_rounds_to_nearest_over_adversarial_bits():
    """Every non-NaN fp32 pattern (±0, subnormals, ties, carries, ±inf, the values that round
    to inf) is ``join(split(x))`` bit for bit; the high half is a nearest bf16 and differs from
    torch's round-half-to-even only on exact ties, by one ulp; a NaN keeps its sign and top
    bits as a quiet NaN.

    Mutation that fails it: rounding ties to even in ``split_torch`` (``hm = (a + 0x7FFF +
    ((a >> 16) & 1)) >> 16``: the remainder +0x8000 of an even tie does not fit and wraps)."""
    x = _adversarial()
    nan = torch.isnan(x)
    hi, lo = sm.split_torch(x)
    back = sm.join_torch(hi, lo)
    assert torch.equal(_bits(back)[~nan], _bits(x)[~nan])
    # NaN: a quiet NaN of the same sign, nothing else to recover
    assert torch.isnan(hi[nan].float()).all() and not lo[nan].any()
    assert torch.equal(torch.signbit(hi[nan].float()), torch.signbit(x[nan]))

    # nearest: no bf16 is closer than hi (ties: equally close); compared in fp64, exactly
    fin = torch.isfinite(x) & torch.isfinite(hi.float())
    ref = x.to(torch.bfloat16)  # torch: round half to even
    err = (hi.float().double() - x.double()).abs()
    ref_err = (ref.float().double() - x.double()).abs()
    assert torch.equal(err[fin], ref_err[fin])
    differs = fin & (_bits(hi.float()) != _bits(ref.float()))
    tie = (_bits(x) & 0xFFFF) == 0x8000
    assert differs.any() and not (differs & ~tie).any()  # only on ties
    assert not ((_bits(hi.float()) != _bits(ref.float())) & ~tie & ~nan).any()  # ±inf, ±0 too
    # the values within half an ulp of the top round to inf, as torch's cast does
    big = (_bits(x) & 0x7FFFFFFF) >= 0x7F7F8000
    assert torch.isinf(hi[big & ~nan].float()).all()


@pytest.mark.skipif(not sm.numba_available(), reason="numba not installed")
def test_numba_and_torch_split_and_join_agree_bit_for_bit():
    """Mutation that fails it: no NaN case in ``split_master._split_i16`` (a NaN's rounding add
    carries into the sign bit)."""
    x = _adversarial()
    hi, lo = torch.empty(x.numel(), dtype=torch.bfloat16), torch.empty(x.numel(), dtype=torch.int16)
    sm.split_(x, hi, lo)
    rhi, rlo = sm.split_torch(x)
    assert torch.equal(hi.view(torch.int16), rhi.view(torch.int16)) and torch.equal(lo, rlo)
    assert torch.equal(_bits(sm.join(hi, lo)), _bits(sm.join_torch(hi, lo)))
    copy = torch.empty_like(hi)
    sm.round_bf16_(x, copy)
    assert torch.equal(copy.view(torch.int16), rhi.view(torch.int16))


def test_split_from_bf16_and_other_devices_is_exact():
    """A bf16 source (a checkpoint or HF tensor in bf16) splits to itself and a zero remainder."""
    x = torch.randn(5000, dtype=torch.bfloat16)
    hi, lo = torch.empty(5000, dtype=torch.bfloat16), torch.empty(5000, dtype=torch.int16)
    sm.split_(x, hi, lo)
    assert torch.equal(hi.view(torch.int16), x.view(torch.int16)) and not lo.any()


def test_wrong_dtypes_are_a_clear_error():
    with pytest.raises(ValueError, match="bfloat16.*int16"):
        sm.split_(torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.int16))


# ----- updates on the split form ------------------------------------------------------------

@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 512 elements (a multiple of the 64 and the 256-element block the chunking
    keeps to), so every unit of a debug model is stepped in several."""
    monkeypatch.setattr(adamw, "SPLIT_CHUNK", 512)


def _run(cfg, split: bool, moments: str, steps: int = 6, micro_batches: int = 1,
         grad_dtype: torch.dtype = torch.float32):
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False, split_master=split,
                      grad_dtype=grad_dtype)
    store.copy_from_model(build_hf_model(cfg, seed=0))
    gen = torch.Generator().manual_seed(1)
    # lr and max_norm so that every step is clipped and the weights move by many remainder ulps
    opt = AdamWConfig(lr=2e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=0.5)
    plan = Plan.every_k(adapter.num_layers, 2, moments=[moments] * len(adapter.units))
    engine = StreamingEngine(adapter, store, plan,
                             EngineConfig(compute_dtype=torch.bfloat16, optimizer=opt))
    clipped = 0
    for _ in range(steps):
        mbs = []
        for _ in range(micro_batches):
            ids = torch.randint(0, adapter.vocab_size, (2, 13), generator=gen)
            mbs.append(Batch(ids[:, :-1], ids[:, 1:]))
        clipped += engine.train_step(mbs).clip_coef < 1.0
    engine.synchronize()
    engine.close()
    assert clipped == steps, "every step should be clipped"
    weights = torch.cat([b.read_master() for b in store])
    copies = torch.cat([b.compute for b in store])
    return weights, copies


@pytest.mark.parametrize("moments", ["fp32", "8bit"])
def test_a_run_with_the_split_master_ends_bit_identical_to_the_fp32_master(moments, small_chunks):
    """Six clipped AdamW steps (weight decay on), fp32 or 8-bit moments: the split master's
    final fp32 weights and bf16 copies are the fp32 master's, bit for bit.

    Mutations that fail it (each seen failing): the remainder dropped in the 8-bit kernel's
    ``_param_split`` (``lb[j] = _np.int16(0)``); the remainder dropped on the fp32-moment path
    (``HostAdamW._split_step`` writing ``w.to(torch.bfloat16)`` back, i.e. ``write_master``
    of the bf16 value); a split master stepped as its bf16 half alone."""
    cfg = get_flavor("llama-debug").build_config()
    w_split, c_split = _run(cfg, True, moments)
    w_plain, c_plain = _run(cfg, False, moments)
    assert torch.equal(_bits(w_split), _bits(w_plain))
    assert torch.equal(c_split.view(torch.int16), c_plain.view(torch.int16))
    # and the remainder matters: the weights are not bf16 values
    assert (_bits(w_split) & 0xFFFF).any()


# ----- one micro-batch: the gradient lands in bf16 ------------------------------------------

@pytest.mark.parametrize("moments", ["fp32", "8bit"])
def test_bf16_host_gradients_end_bit_identical_to_fp32_ones(moments, small_chunks):
    """One micro-batch per step: the layers' (and the untied embedding's) bf16 device gradient
    kept in bf16 on the host gives the very weights of widening it into an fp32 buffer (the
    clip norm and the update read the same values), split master, clipped every step.

    Mutation that fails it (seen failing, 8-bit): the chunked bf16-gradient step of
    ``HostAdamW8bit.step_unit`` passing ``buf.layout.decay_numel`` unshifted (not ``- a``):
    decay reaches the norms of later chunks."""
    cfg = get_flavor("qwen2-debug-untied").build_config()
    w_bf16, c_bf16 = _run(cfg, True, moments, steps=4, grad_dtype=torch.bfloat16)
    w_fp32, c_fp32 = _run(cfg, True, moments, steps=4)
    assert torch.equal(_bits(w_bf16), _bits(w_fp32))
    assert torch.equal(c_bf16.view(torch.int16), c_fp32.view(torch.int16))


def test_bf16_gradients_take_two_bytes_where_the_device_computes_bf16():
    """Layers and the untied embedding 2 bytes, the head 4 (summed over loss chunks in fp32); a
    tied embedding 4; the footprint formula and the cost model equal the live store; a second
    micro-batch is refused.

    Mutation that fails it: ``grad_itemsizes_of`` giving the head 2 bytes."""
    from layerwise.optim.adamw8bit import HostAdamW8bit
    from layerwise.planner.cost import CostModel
    from layerwise.planner.presets import PRESETS
    from layerwise.plan.shape import ModelShape
    from layerwise.store import store_footprint

    for flavor in ("qwen2-debug-untied", "llama-debug"):
        cfg = get_flavor(flavor).build_config()
        adapter = DecoderAdapter(cfg)
        tied = adapter.tied
        store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False,
                          grad_dtype=torch.bfloat16)
        opt = HostAdamW8bit(AdamWConfig())
        for b in store:
            opt.init_state(b)
        for b in store:
            want = torch.float32 if b.name == "head" or (b.name == "embed" and tied) else torch.bfloat16
            assert b.grad.dtype == want, (flavor, b.name)
        state = sum(opt.state_nbytes(b.layout.numel) for b in store)
        live = store.footprint()
        assert store_footprint(adapter, torch.bfloat16, pin=False, state_nbytes=state,
                               grad_dtype=torch.bfloat16) == live
        cm = CostModel(ModelShape.from_config(cfg), PRESETS["h200"], 1, 1)
        assert cm.host_store_bytes(["8bit"] * len(store.units), bf16_grads=True) == live.total
        n = sum(b.layout.numel for b in store)
        assert live.grad < 4 * n and live.total == 4 * n + live.grad + state + live.padding
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1),
                             EngineConfig(compute_dtype=torch.bfloat16))
    ids = torch.randint(0, adapter.vocab_size, (2, 9))
    with pytest.raises(ValueError, match="grad_dtype=torch.float32"):
        engine.train_step([Batch(ids[:, :-1], ids[:, 1:])] * 2)
    engine.close()
