import math
import threading

import pytest
import torch

from layerwise.models.adapter import DecoderAdapter
from layerwise.models.registry import get_flavor
from layerwise.optim import _kernel, quant
from layerwise.optim.adamw import AdamWConfig, HostAdamW
from layerwise.optim.adamw8bit import (
    AdamW8bit,
    HostAdamW8bit,
    is_8bit_state,
    state_to_8bit,
    state_to_fp32,
)
from layerwise.optim.clip import clip_coefficient, clip_or_skip, global_norm, sq_norm
from layerwise.store import HostStore


def _reference_step(p, g, state, lr, betas, eps, wd, decay_end, clip, block):
    """Dequantise, textbook AdamW in float64, requantise (the straightforward way)."""
    step = int(state["step"]) + 1
    m = quant.dequantize_signed(state["exp_avg_codes"], state["exp_avg_scales"], block).double()
    v = quant.dequantize_sq(state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], block).double()
    gd = g.double() * clip
    m = betas[0] * m + (1 - betas[0]) * gd
    v = betas[1] * v + (1 - betas[1]) * gd * gd
    pd = p.double().clone()
    pd[:decay_end] *= 1 - lr * wd
    denom = (v / (1 - betas[1] ** step)).sqrt() + eps
    pd -= lr / (1 - betas[0] ** step) * m / denom
    new = {"step": torch.tensor(float(step))}
    new["exp_avg_codes"], new["exp_avg_scales"] = quant.quantize_signed(m.float(), block)
    new["exp_avg_sq_codes"], new["exp_avg_sq_scales"] = quant.quantize_sq(v.float(), block)
    return pd.float(), new


def _random_8bit_state(n, block, seed):
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * 1e-3
    v = (torch.randn(n, generator=gen) * 1e-3) ** 2
    s = state_to_8bit({"exp_avg": m, "exp_avg_sq": v, "step": torch.tensor(3.0)}, block)
    return s


@pytest.mark.parametrize("block", [128, 256])
@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_one_step_equals_reference(kernel, block, monkeypatch):
    if kernel == "numba" and not _kernel.numba_available():
        pytest.skip("numba not installed")
    monkeypatch.setenv("LAYERWISE_OPTIM_KERNEL", kernel)
    n = block * 40 + 5
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    state = _random_8bit_state(n, block, 1)
    lr, betas, eps, wd, clip, decay_end = 1e-2, (0.9, 0.95), 1e-8, 0.1, 0.6, 1000
    ref_p, ref_s = _reference_step(p, g, state, lr, betas, eps, wd, decay_end, clip, block)
    k = _kernel.StepScalars.of(lr, *betas, eps, wd, 4, grad_mul=clip)
    _kernel.fused_step(p, g, state["exp_avg_codes"], state["exp_avg_scales"],
                       state["exp_avg_sq_codes"], state["exp_avg_sq_scales"], block, decay_end, k)
    torch.testing.assert_close(p, ref_p, rtol=1e-5, atol=1e-6)
    for key in ("exp_avg_scales", "exp_avg_sq_scales"):
        torch.testing.assert_close(state[key], ref_s[key], rtol=1e-5, atol=0)
    for key in ("exp_avg_codes", "exp_avg_sq_codes"):
        diff = (state[key].int() - ref_s[key].int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3  # fp32 vs fp64 ties only


@pytest.mark.skipif(not _kernel.numba_available(), reason="numba not installed")
def test_numba_and_torch_kernels_agree(monkeypatch):
    n, block = 70_001, 256
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(n, generator=gen)
    out = {}
    for kernel in ("numba", "torch"):
        monkeypatch.setenv("LAYERWISE_OPTIM_KERNEL", kernel)
        p = torch.ones(n)
        s = _random_8bit_state(n, block, 4)
        for step in (4, 5, 6):
            k = _kernel.StepScalars.of(1e-3, 0.9, 0.999, 1e-8, 0.01, step, grad_mul=0.5)
            _kernel.fused_step(p, g * step, s["exp_avg_codes"], s["exp_avg_scales"],
                               s["exp_avg_sq_codes"], s["exp_avg_sq_scales"], block, n // 3, k,
                               num_threads=2)
        out[kernel] = (p, s)
    # a rounding tie may flip one code by 1; that moves its element by << lr
    diff_p = (out["numba"][0] - out["torch"][0]).abs()
    assert diff_p.max() < 0.05 * 1e-3 and (diff_p > 1e-6).float().mean() < 1e-3
    for key in ("exp_avg_codes", "exp_avg_sq_codes"):
        diff = (out["numba"][1][key].int() - out["torch"][1][key].int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))


def _grads(model, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * scale


def _groups(model, **kw):
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [dict(params=w, lr=3e-3, weight_decay=0.1, **kw),
            dict(params=b, lr=1e-3, weight_decay=0.0, betas=(0.8, 0.99), **kw)]


def test_fp32_mode_equals_clip_grad_norm_plus_torch_adamw():
    ours, ref = _model(), _model()
    opt = AdamW8bit(_groups(ours), moments="fp32", max_grad_norm=1.0, betas=(0.9, 0.95))
    ref_opt = torch.optim.AdamW(_groups(ref), betas=(0.9, 0.95))
    for step in range(5):
        scale = 10.0 if step % 2 else 0.01  # clip active on odd steps only
        _grads(ours, step, scale)
        _grads(ref, step, scale)
        total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        opt.step()
        assert math.isclose(opt.last_grad_norm, float(total), rel_tol=1e-6)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref_opt.state[b]["exp_avg_sq"],
                                   rtol=1e-6, atol=1e-12)


def test_8bit_tracks_torch_adamw():
    ours, ref = _model(), _model()
    opt = AdamW8bit(_groups(ours), min_8bit_numel=0, block_size=64, max_grad_norm=1.0)
    ref_opt = torch.optim.AdamW(_groups(ref))
    start = [p.detach().clone() for p in ref.parameters()]
    for step in range(10):
        _grads(ours, step)
        _grads(ref, step)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        opt.step()
    for a, b, s in zip(ours.parameters(), ref.parameters(), start):
        assert is_8bit_state(opt.state[a])
        moved = (b - s).norm()
        assert (a - b).norm() < 0.02 * moved  # same trajectory up to quantisation noise


def test_size_threshold_and_state_bytes():
    model = _model()
    opt = AdamW8bit(model.parameters(), min_8bit_numel=1000)
    _grads(model, 0)
    opt.step()
    for p in model.parameters():
        st = opt.state[p]
        assert is_8bit_state(st) == (p.numel() >= 1000)
        if is_8bit_state(st):
            nbytes = sum(st[k].numel() * st[k].element_size() for k in st if k != "step")
            assert nbytes / p.numel() <= 2.1


def test_hybrid_groups_choose_their_moment_format():
    model = _model()
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    opt = AdamW8bit([dict(params=w[:1], moments="fp32"), dict(params=w[1:])], min_8bit_numel=0)
    _grads(model, 0)
    opt.step()
    assert not is_8bit_state(opt.state[w[0]]) and opt.state[w[0]]["exp_avg"].dtype == torch.float32
    assert is_8bit_state(opt.state[w[1]])


@pytest.mark.cuda
def test_cuda_matches_cpu():
    cpu, gpu = _model(), _model().cuda()
    opts = [AdamW8bit(m.parameters(), min_8bit_numel=0, max_grad_norm=1.0) for m in (cpu, gpu)]
    for step in range(3):
        _grads(cpu, step)
        for a, b in zip(cpu.parameters(), gpu.parameters()):
            b.grad = a.grad.cuda()
        for o in opts:
            o.step()
    for a, b in zip(cpu.parameters(), gpu.parameters()):
        diff = (a - b.cpu()).abs()
        assert diff.max() < 0.05 * 1e-3 and (diff > 1e-6).float().mean() < 1e-2


def _state_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_state_dict_round_trip_is_exact():
    model = _model()
    opt = AdamW8bit(_groups(model), min_8bit_numel=500, max_grad_norm=1.0)
    for step in range(3):
        _grads(model, step)
        opt.step()
    sd = opt.state_dict()
    codes = [v for s in sd["state"].values() for k, v in s.items() if k.endswith("codes")]
    assert codes and all(c.dtype in (torch.int8, torch.uint8) for c in codes)

    twin = _model(seed=1)
    with torch.no_grad():
        for a, b in zip(twin.parameters(), model.parameters()):
            a.copy_(b)
    opt2 = AdamW8bit(_groups(twin), min_8bit_numel=500, max_grad_norm=1.0)
    opt2.load_state_dict(sd)
    for a, b in zip(model.parameters(), twin.parameters()):
        _state_equal(opt.state[a], opt2.state[b])
    for m in (model, twin):
        _grads(m, 99)
    opt.step()
    opt2.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
        _state_equal(opt.state[a], opt2.state[b])


def test_torch_adamw_interop_both_ways():
    model = _model()
    opt = AdamW8bit(_groups(model), min_8bit_numel=500)
    for step in range(3):
        _grads(model, step)
        opt.step()
    exported = opt.torch_adamw_state_dict()
    ref_opt = torch.optim.AdamW(_groups(model))
    ref_opt.load_state_dict(exported)
    for g_ours, g_ref in zip(opt.param_groups, ref_opt.param_groups):
        assert g_ref["lr"] == g_ours["lr"] and g_ref["betas"] == g_ours["betas"]
    for p in model.parameters():
        st, rs = opt.state[p], ref_opt.state[p]
        assert rs["exp_avg"].shape == p.shape and float(rs["step"]) == 3.0
        back = state_to_fp32(st, 256, p.shape)
        assert torch.equal(back["exp_avg"], rs["exp_avg"])
        assert torch.equal(back["exp_avg_sq"], rs["exp_avg_sq"])
    ref_opt.step()  # torch can keep training from it

    # and back: a torch AdamW state dict loads into AdamW8bit, quantised where 8-bit
    opt3 = AdamW8bit(_groups(model), min_8bit_numel=500)
    opt3.load_state_dict(ref_opt.state_dict())
    for p in model.parameters():
        st, rs = opt3.state[p], ref_opt.state[p]
        if p.numel() >= 500:
            assert is_8bit_state(st)
            codes, scales = quant.quantize_signed(rs["exp_avg"].reshape(-1), 256)
            assert torch.equal(st["exp_avg_codes"], codes) and torch.equal(
                st["exp_avg_scales"], scales)
        else:
            assert torch.equal(st["exp_avg"], rs["exp_avg"])
    assert opt3.param_groups[0]["moments"] == "8bit"
    _grads(model, 5)
    opt3.step()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("moments", ["8bit", "fp32"])
def test_nonfinite_gradient_skips_step(bad, moments):
    model = _model()
    opt = AdamW8bit(model.parameters(), moments=moments, min_8bit_numel=0, max_grad_norm=1.0)
    _grads(model, 0)
    opt.step()
    before_p = [p.detach().clone() for p in model.parameters()]
    before_s = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    _grads(model, 1)
    next(model.parameters()).grad[0, 0] = bad
    opt.step()
    assert opt.last_step_skipped and opt.skipped_steps == 1
    assert not math.isfinite(opt.last_grad_norm)
    for p, bp, bs in zip(model.parameters(), before_p, before_s):
        assert torch.equal(p, bp)
        _state_equal(opt.state[p], bs)
    _grads(model, 2)
    opt.step()
    assert not opt.last_step_skipped and opt.skipped_steps == 1
    assert float(opt.state[next(model.parameters())]["step"]) == 2.0
    assert clip_or_skip(float("nan"), 1.0) is None and clip_or_skip(3.0, 1.0) == pytest.approx(
        1 / 3, rel=1e-5)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="moments"):
        AdamW8bit(_model().parameters(), moments="4bit")
    with pytest.raises(ValueError, match="block_size"):
        AdamW8bit(_model().parameters(), block_size=0)
    s = _random_8bit_state(1000, 128, 0)
    with pytest.raises(ValueError, match="block_size=256"):
        state_to_fp32(s, 256)


# ----- the per-unit face over a HostStore ---------------------------------------------------

@pytest.fixture(scope="module")
def store_factory():
    adapter = DecoderAdapter(get_flavor("llama-debug").build_config())

    def make(seed=0):
        store = HostStore(adapter, pin=False)
        gen = torch.Generator().manual_seed(seed)
        for b in store:
            b.master.copy_(torch.randn(b.master.shape, generator=gen) * 0.02)
        return store

    return make


def _fill_grads(store, seed):
    gen = torch.Generator().manual_seed(seed)
    for b in store:
        b.grad.copy_(torch.randn(b.grad.shape, generator=gen) * 1e-2)


@pytest.mark.parametrize("block", [128, 256])  # 256: the kernel's constant-trip-count copy
def test_unit_face_matches_reference_and_is_thread_safe(store_factory, block):
    cfg = AdamWConfig(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=1.0)
    opt = HostAdamW8bit(cfg, block_size=block)
    seq, par, ref = store_factory(), store_factory(), store_factory()
    for st in (seq, par):
        for b in st:
            opt.init_state(b)
            assert b.state["step"].item() == 0 and b.state["exp_avg_codes"].dtype == torch.int8
    ref_state = {}
    for b in ref:
        HostAdamW8bit(cfg, block_size=block).init_state(b)
        ref_state[b.name] = b.state
    for step in range(3):
        for st in (seq, par, ref):
            _fill_grads(st, step)
        norm = global_norm([sq_norm(b.grad) for b in seq])
        coef = clip_coefficient(norm, cfg.max_grad_norm)
        for b in seq:
            opt.step_unit(b, cfg.lr, coef)
        threads = [threading.Thread(target=opt.step_unit, args=(b, cfg.lr, coef)) for b in par]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for b in ref:
            new_p, new_s = _reference_step(b.master, b.grad, ref_state[b.name], cfg.lr,
                                           cfg.betas, cfg.eps, cfg.weight_decay,
                                           b.layout.decay_numel, coef, block)
            b.master.copy_(new_p)
            ref_state[b.name] = new_s
    for a, b, r in zip(seq, par, ref):
        assert torch.equal(a.master, b.master)
        _state_equal(a.state, b.state)
        assert a.state["step"].item() == 3
        # equal to the reference (which decays only [0, decay_numel)) up to rare rounding ties
        diff = (a.master - r.master).abs()
        assert diff.max() < 0.05 * cfg.lr and (diff > 1e-6).float().mean() < 1e-3


def test_unit_state_converts_to_fp32_and_back(store_factory):
    cfg = AdamWConfig(lr=1e-3)
    fp32, q8 = HostAdamW(cfg), HostAdamW8bit(cfg)
    store = store_factory()
    _fill_grads(store, 0)
    b = store["layers.0"]
    fp32.init_state(b)
    fp32.step_unit(b, cfg.lr, 1.0)
    # fp32 → 8-bit: continue training with 8-bit moments
    b.state = q8.from_fp32_state(b.state)
    assert is_8bit_state(b.state) and b.state["step"].item() == 1
    q8.step_unit(b, cfg.lr, 1.0)
    # 8-bit → fp32 → 8-bit is exact (the map is idempotent), and HostAdamW can take over
    as_fp32 = q8.to_fp32_state(b.state)
    assert as_fp32["exp_avg"].shape == b.master.shape
    _state_equal(q8.from_fp32_state(as_fp32), b.state)
    b.state = as_fp32
    fp32.step_unit(b, cfg.lr, 1.0)
    assert b.state["step"].item() == 3 and torch.isfinite(b.master).all()


def test_unit_face_refuses_nonfinite_clip(store_factory):
    store = store_factory()
    opt = HostAdamW8bit(AdamWConfig())
    b = store["embed"]
    opt.init_state(b)
    with pytest.raises(ValueError, match="not finite"):
        opt.step_unit(b, 1e-3, float("nan"))
    assert b.state["step"].item() == 0


@pytest.mark.skipif(not _kernel.numba_available(), reason="numba not installed")
@pytest.mark.parametrize("fastmath", [True, False])
def test_the_parameter_update_rounds_once_whatever_surrounds_it(fastmath):
    """``_kernel._apply`` (``x * d - q``, the parameter's step in the plain and the split loop)
    is one fused multiply-add in a fast-math loop and in a strict one alike: float64 product,
    one rounding to fp32. That is what keeps a plain and a split parameter bit-identical by
    construction rather than by two loops happening to compile alike.

    Mutations seen caught: the negation dropped (``x * d + q``); the codegen as ``fmul`` then
    ``fsub`` (no ``llvm.fma`` in the loops; the fast-math loop fuses the pair itself, the strict
    one rounds twice)."""
    import numba
    import numpy as np

    @numba.njit(fastmath=fastmath)
    def loop(p, d, q):
        for j in range(p.size):
            p[j] = _kernel._apply(p[j], d, q[j])

    rng = np.random.default_rng(0)
    p = (rng.standard_normal(1 << 16) * 0.02).astype(np.float32)
    q = (rng.standard_normal(1 << 16) * 1e-5).astype(np.float32)
    d = np.float32(1 - 1e-6)
    out = p.copy()
    loop(out, d, q)
    once = (p.astype(np.float64) * np.float64(d) - q.astype(np.float64)).astype(np.float32)
    assert np.array_equal(out, once)
    assert "llvm.fma" in loop.inspect_llvm(loop.signatures[0])
