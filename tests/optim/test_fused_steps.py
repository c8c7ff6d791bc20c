"""Many tensors in one kernel call (``_kernel.fused_steps``) and the drop-in's grouped step.

The grouped call must give bit for bit what one call per tensor gives (each row is its own
update, whatever the thread split), and both must match the float64 textbook step.
"""

import gc

import pytest
import torch

from layerwise.optim import _kernel, quant
from layerwise.optim.adamw8bit import AdamW8bit, HostSteps, state_to_8bit

from .test_adamw8bit import _reference_step

needs_numba = pytest.mark.skipif(not _kernel.numba_available(), reason="numba not installed")


def _row(n, block, seed):
    """(p, g, 8-bit state) of ``n`` elements."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-3
    g[: n // 7] = 0.0  # some zero gradients: w may stay 0 (code 0 must survive)
    m = torch.randn(n, generator=gen) * 1e-3
    v = (torch.randn(n, generator=gen) * 1e-3) ** 2
    m[: n // 9] = 0.0
    v[: n // 9] = 0.0
    s = state_to_8bit({"exp_avg": m, "exp_avg_sq": v, "step": torch.tensor(3.0)}, block)
    return p, g, s


# (numel, block, lr, clip, decay_end as a fraction of numel, betas)
ROWS = [
    (256 * 37 + 5, 256, 1e-2, 0.6, 0.5, (0.9, 0.95)),  # partial last block, decay mid-block
    (1, 256, 1e-3, 1.0, 1.0, (0.9, 0.999)),            # one element
    (256 * 8, 256, 0.0, 1.0, 1.0, (0.9, 0.999)),       # lr == 0: moments move, p does not
    (10_007, 128, 3e-3, 1e-20, 0.0, (0.8, 0.99)),      # clip too small to fold: torch path
    (5000, 256, 3e-3, 2e-7, 0.0, (0.9, 0.999)),        # a small clip the kernel still folds
    (4096 * 3 + 1, 4096, 1e-3, 0.3, 1.0, (0.9, 0.95)),  # the largest block on the stack
    (9000, 8192, 1e-3, 0.5, 1.0, (0.9, 0.95)),         # too large for numba: torch path
    (256 * 64, 64, 2e-3, 1.0, 0.25, (0.0, 0.5)),       # beta1 = 0
]


def _steps(seed=0):
    out = []
    for i, (n, block, lr, clip, frac, betas) in enumerate(ROWS):
        p, g, s = _row(n, block, seed + i)
        s["step"] = torch.tensor(float(3 + i))  # the reference steps to 4 + i
        k = _kernel.StepScalars.of(lr, *betas, 1e-8, 0.1, 4 + i, grad_mul=clip)
        out.append((_kernel.FlatStep(p, g, s["exp_avg_codes"], s["exp_avg_scales"],
                                     s["exp_avg_sq_codes"], s["exp_avg_sq_scales"], block,
                                     int(n * frac), k), s, lr, betas, clip))
    return out


def _clone(step: _kernel.FlatStep) -> _kernel.FlatStep:
    return step._replace(**{f: getattr(step, f).clone() for f in step._fields[:6]})


def _tensors(step: _kernel.FlatStep):
    return [step.p, step.exp_avg_codes, step.exp_avg_scales, step.exp_avg_sq_codes,
            step.exp_avg_sq_scales]


@needs_numba
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_grouped_call_equals_one_call_per_tensor(threads, monkeypatch):
    """Mutations that fail it: the scalar row of row 0 used for every row (``scal[0]``), a
    row's first global block not advanced (``first += nb`` dropped), a task's block range cut
    short by one."""
    monkeypatch.setattr(_kernel, "_MIN_BLOCKS_PER_TASK", 1)  # split inside tensors too
    base = [s for s, *_ in _steps()]
    single = [_clone(s) for s in base]
    for s in single:
        _kernel.fused_steps([s], num_threads=1)
    grouped = [_clone(s) for s in base]
    _kernel.fused_steps(grouped, num_threads=threads)
    for a, b in zip(single, grouped):
        for x, y in zip(_tensors(a), _tensors(b)):
            assert torch.equal(x, y)
    assert not torch.equal(single[0].p, base[0].p)


@needs_numba
def test_grouped_call_matches_the_reference_step():
    """Each row against the float64 textbook step: the folded scalars, lr == 0, a clip below
    the fold's floor, the decay boundary inside a block, every block size."""
    steps = _steps(seed=10)
    on_numba = [_kernel._numba_ok(s) and s.k.folded() is not None for s, *_ in steps]
    assert on_numba == [True, True, True, False, True, True, False, True]
    grouped = [_clone(s) for s, *_ in steps]
    _kernel.fused_steps(grouped, num_threads=2)
    for out, (s, state, lr, betas, clip) in zip(grouped, steps):
        ref_p, ref_s = _reference_step(s.p, s.g, state, lr, betas, 1e-8, 0.1, s.decay_end,
                                       clip, s.block_size)
        if lr == 0.0:
            assert torch.equal(out.p, s.p)
        torch.testing.assert_close(out.p, ref_p, rtol=1e-5, atol=1e-6)
        for key, t in (("exp_avg_scales", out.exp_avg_scales),
                       ("exp_avg_sq_scales", out.exp_avg_sq_scales)):
            torch.testing.assert_close(t, ref_s[key], rtol=1e-5, atol=1e-30)
        for key, t in (("exp_avg_codes", out.exp_avg_codes),
                       ("exp_avg_sq_codes", out.exp_avg_sq_codes)):
            diff = (t.int() - ref_s[key].int()).abs()
            assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, key
        # a positive second moment never gets code 0, a zero one keeps it
        assert torch.equal(out.exp_avg_sq_codes == 0, ref_s["exp_avg_sq_codes"] == 0)


def _mixed_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(),
                                torch.nn.Linear(96, 48), torch.nn.Linear(48, 8))
    with torch.no_grad():  # a non-contiguous weight: the kernel updates a copy, copied back
        model[2].weight = torch.nn.Parameter(torch.randn(48, 96).t().contiguous().t())
    assert not model[2].weight.is_contiguous()
    return model


def _mixed_opt(model, threads):
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return AdamW8bit([dict(params=w, lr=3e-3, weight_decay=0.1),
                      dict(params=b, lr=1e-3, weight_decay=0.0, betas=(0.8, 0.99),
                           block_size=64)],
                     min_8bit_numel=50, max_grad_norm=0.5, num_threads=threads)


def _set_grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for i, p in enumerate(model.parameters()):
        g = torch.randn(p.shape, generator=gen)
        p.grad = g.t().contiguous().t() if i == 0 else g  # one non-contiguous gradient


@needs_numba
def test_dropin_one_step_matches_reference_per_tensor(monkeypatch):
    """One ``AdamW8bit.step`` over two groups (different lr, betas, wd, block size), a
    non-contiguous weight and gradient, fp32 small tensors and a clip, against the textbook
    step per tensor. Mutation that fails it: the copy back of a non-contiguous parameter
    dropped."""
    monkeypatch.setattr(_kernel, "_MIN_BLOCKS_PER_TASK", 1)
    model = _mixed_model()
    opt = _mixed_opt(model, threads=2)
    _set_grads(model, 0)
    opt.step()  # state exists now; the second step is the one compared
    _set_grads(model, 1)
    before = {p: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
              for p in model.parameters()}
    coef = min(1.0, 0.5 / (opt.grad_norm() + 1e-6))
    opt.step()
    checked = 0
    for group in opt.param_groups:
        for p in group["params"]:
            p0, s0 = before[p]
            if "exp_avg_codes" not in s0:
                continue
            ref_p, ref_s = _reference_step(
                p0.reshape(-1), p.grad.reshape(-1), s0, group["lr"], group["betas"],
                group["eps"], group["weight_decay"], p.numel(), coef, group["block_size"])
            torch.testing.assert_close(p.detach().reshape(-1), ref_p, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(opt.state[p]["exp_avg_sq_scales"],
                                       ref_s["exp_avg_sq_scales"], rtol=1e-5, atol=0)
            checked += 1
    assert checked == 4 and not model[2].weight.is_contiguous()


@needs_numba
def test_dropin_is_the_same_on_any_thread_count(monkeypatch):
    monkeypatch.setattr(_kernel, "_MIN_BLOCKS_PER_TASK", 1)
    models = [_mixed_model() for _ in range(3)]
    opts = [_mixed_opt(m, threads) for m, threads in zip(models, (1, 2, 4))]
    for step in range(3):
        for m, o in zip(models, opts):
            _set_grads(m, step)
            o.step()
    for ps in zip(*(m.parameters() for m in models)):
        for p in ps[1:]:
            assert torch.equal(p, ps[0])


def test_host_steps_never_trusts_a_recycled_id():
    """Entries are keyed by ``id``; a new tensor that reuses a dead one's id must be read,
    not counted from the dead one's entry. Mutation that fails it: the weak reference's
    identity check dropped."""
    steps = HostSteps()
    a = torch.zeros(())
    steps.seed(a, 0)
    assert steps.advance(a) == 1 and float(a) == 1.0
    key = id(a)
    del a
    gc.collect()
    assert key not in steps._counts  # the callback dropped the dead entry
    # force the worst case: an entry whose tensor died but whose id is live again
    b = torch.full((), 41.0)
    c = torch.zeros(())
    steps.seed(c, 7)
    steps._counts[id(b)] = steps._counts[id(c)]  # c's entry (version 0, count 7) under b's id
    assert steps.advance(b) == 42 and float(b) == 42.0
    assert steps.advance_many([b, c]) == [43, 8]


def test_kernel_quant_maps_agree_with_quant_module():
    """The kernel's requantisation of an unchanged moment (g = 0, beta = 1 - tiny) is the
    reference map (``quant.quantize_*``) within one code."""
    n, block = 4096, 256
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(n, generator=gen) * 1e-2
    v = (torch.randn(n, generator=gen) * 1e-2) ** 2
    s = state_to_8bit({"exp_avg": m, "exp_avg_sq": v, "step": torch.tensor(1.0)}, block)
    codes_m, codes_v = s["exp_avg_codes"].clone(), s["exp_avg_sq_codes"].clone()
    k = _kernel.StepScalars.of(0.0, 1.0 - 1e-7, 1.0 - 1e-7, 1e-8, 0.0, 1)
    _kernel.fused_step(torch.zeros(n), torch.zeros(n), s["exp_avg_codes"], s["exp_avg_scales"],
                       s["exp_avg_sq_codes"], s["exp_avg_sq_scales"], block, n, k)
    assert (s["exp_avg_codes"].int() - codes_m.int()).abs().max() <= 1
    assert (s["exp_avg_sq_codes"].int() - codes_v.int()).abs().max() <= 1
    ref = quant.dequantize_signed(codes_m, quant.quantize_signed(m, block)[1], block)
    got = quant.dequantize_signed(s["exp_avg_codes"], s["exp_avg_scales"], block)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=1e-6)


@pytest.mark.parametrize("kernel", ["numba", "torch"])
def test_positive_second_moment_keeps_a_nonzero_code(kernel, monkeypatch):
    """A block whose maximum jumps (one huge gradient): an element whose v is still positive
    but now below the smallest code keeps code 1; exact zeros keep code 0. Mutation that fails
    it: the numba kernel's ``max(si, min(bits(x), 1))`` dropped."""
    if kernel == "numba" and not _kernel.numba_available():
        pytest.skip("numba not installed")
    monkeypatch.setenv("LAYERWISE_OPTIM_KERNEL", kernel)
    n = 256
    v = torch.zeros(n)
    v[0], v[1] = 1e-20, 1.0
    s = state_to_8bit({"exp_avg": torch.zeros(n), "exp_avg_sq": v, "step": torch.tensor(1.0)})
    assert s["exp_avg_sq_codes"][0] == 1 and s["exp_avg_sq_codes"][2:].eq(0).all()
    g = torch.zeros(n)
    g[1] = 1e3
    k = _kernel.StepScalars.of(1e-3, 0.9, 0.999, 1e-8, 0.0, 2)
    _kernel.fused_step(torch.zeros(n), g, s["exp_avg_codes"], s["exp_avg_scales"],
                       s["exp_avg_sq_codes"], s["exp_avg_sq_scales"], n, n, k)
    codes = s["exp_avg_sq_codes"]
    assert codes[0] == 1 and codes[1] == 255 and codes[2:].eq(0).all()


@needs_numba
@pytest.mark.parametrize("threads", [1, 2])
def test_a_bf16_gradient_steps_as_its_fp32_widening_does(threads):
    """The kernel widens a bf16 gradient itself (no fp32 copy anywhere): every row stepped
    with a bf16 gradient ends bit for bit as with that gradient widened to fp32 first — the
    same kernel on the same values (a bf16 is the top half of an fp32), so order-identical.

    Mutation seen failing: the widening shifted by 15 bits instead of 16 (every update off)."""
    bf16, wide = [], []
    for step, *_ in _steps(seed=5):
        g16 = step.g.to(torch.bfloat16)
        bf16.append(_clone(step)._replace(g=g16))
        wide.append(_clone(step)._replace(g=g16.float()))
    _kernel.fused_steps(bf16, threads)
    _kernel.fused_steps(wide, threads)
    for a, b in zip(bf16, wide):
        for f in a._fields[2:6] + ("p",):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
