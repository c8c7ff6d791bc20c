"""The 8-bit optimizers keep their step count on the host: no tensor is read in the step path.

On CUDA, reading ``state["step"]`` back (``.item()``) is a device sync per tensor; here the
sync cannot be observed, so every way of reading a tensor into Python is made to raise.
"""

import pytest
import torch

from layerwise.models.adapter import DecoderAdapter
from layerwise.models.registry import get_flavor
from layerwise.optim.adamw import AdamWConfig
from layerwise.optim.adamw8bit import AdamW8bit, HostAdamW8bit, HostSteps
from layerwise.store import HostStore

READS = ("item", "tolist", "__float__", "__int__", "__index__", "__bool__")


def _forbid_reads(monkeypatch):
    def read(self, *a, **k):
        raise AssertionError("a tensor was read back to Python in the step path")

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, read)


@pytest.fixture(scope="module")
def adapter():
    return DecoderAdapter(get_flavor("llama-debug").build_config())


def _store(adapter, opt):
    store = HostStore(adapter, pin=False)
    gen = torch.Generator().manual_seed(0)
    for b in store:
        b.master.copy_(torch.randn(b.master.shape, generator=gen) * 0.02)
        opt.init_state(b)
    return store


def _step(store, opt, seed, fresh_counts=False):
    gen = torch.Generator().manual_seed(seed)
    for b in store:
        b.grad.copy_(torch.randn(b.grad.shape, generator=gen) * 1e-2)
        if fresh_counts:  # the reference: forget the host counts, read every step tensor
            opt.steps = HostSteps()
        opt.step_unit(b, lr=1e-3, clip_coef=0.7)


def _same_store(a, b):
    for x, y in zip(a, b):
        assert torch.equal(x.master, y.master)
        for k in x.state:
            assert torch.equal(x.state[k], y.state[k]), k


def test_unit_face_steps_without_reading_the_step_tensor(adapter, monkeypatch):
    """Mutation that fails it: ``int(s["step"].item())`` in ``HostAdamW8bit.step_unit``."""
    cfg = AdamWConfig(weight_decay=0.1)
    opt, ref_opt = HostAdamW8bit(cfg), HostAdamW8bit(cfg)
    store, ref = _store(adapter, opt), _store(adapter, ref_opt)
    for s in range(3):
        _step(ref, ref_opt, s, fresh_counts=True)
    with monkeypatch.context() as m:
        _forbid_reads(m)
        for s in range(3):
            _step(store, opt, s)
    _same_store(store, ref)
    assert all(float(b.state["step"]) == 3.0 and b.state["step"].device.type == "cpu"
               for b in store)


def test_unit_face_sees_a_step_written_from_outside(adapter):
    """A checkpoint load writes the step tensor in place (``copy_``); the next step counts on
    from the loaded value. Mutation that fails it: trusting the host count without comparing
    the tensor's version (the update would use step 3 instead of 11)."""
    cfg = AdamWConfig(weight_decay=0.1)
    opt, ref_opt = HostAdamW8bit(cfg), HostAdamW8bit(cfg)
    store, ref = _store(adapter, opt), _store(adapter, ref_opt)
    for s in range(2):
        _step(store, opt, s)
        _step(ref, ref_opt, s)
    for st in (store, ref):
        for b in st:
            b.state["step"].copy_(torch.tensor(10.0))
    _step(store, opt, 5)
    _step(ref, ref_opt, 5, fresh_counts=True)
    _same_store(store, ref)
    assert all(float(b.state["step"]) == 11.0 for b in store)


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))


def _grads(model, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("fp32_group", [False, True])
def test_torch_face_steps_without_reading_the_step_tensors(monkeypatch, fp32_group):
    """``AdamW8bit.step`` (no clip: the clip reads its one global norm by design) reads no
    tensor; the counts match an optimizer that reads every step tensor, and the 8-bit state's
    step lives on the host. Mutation that fails it: ``int(state["step"].item())`` in
    ``AdamW8bit._step_group``."""
    def make(model):
        w = [p for n, p in model.named_parameters() if n.endswith("weight")]
        b = [p for n, p in model.named_parameters() if n.endswith("bias")]
        return AdamW8bit([dict(params=w), dict(params=b, moments="fp32" if fp32_group else "8bit")],
                         lr=1e-2, weight_decay=0.1, min_8bit_numel=0)

    model, ref = _model(), _model()
    opt, ref_opt = make(model), make(ref)
    for s in range(3):
        _grads(ref, s)
        ref_opt.steps = HostSteps()
        ref_opt.step()
    with monkeypatch.context() as m:
        _forbid_reads(m)
        for s in range(3):
            _grads(model, s)
            opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.equal(a, b)
        sa, sb = opt.state[a], ref_opt.state[b]
        assert float(sa["step"]) == float(sb["step"]) == 3.0
        if "exp_avg_codes" in sa:
            assert sa["step"].device.type == "cpu"

    # a loaded state is read once, then counted on the host again
    twin = _model()
    twin.load_state_dict(model.state_dict())
    opt2 = make(twin)
    opt2.load_state_dict(opt.state_dict())
    for m_, o in ((model, opt), (twin, opt2)):
        _grads(m_, 7)
        o.step()
    with monkeypatch.context() as m:
        _forbid_reads(m)
        for m_, o in ((model, opt), (twin, opt2)):
            _grads(m_, 8)
            o.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
        assert float(opt2.state[b]["step"]) == 5.0


@pytest.mark.parametrize("moments", ["fp32", "8bit"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_a_unit_split_over_threads_steps_as_on_one(moments, grad_dtype):
    """The update is element-wise (8-bit: block-wise), so splitting a unit's range over two
    threads changes nothing, bit for bit, for a split master and either gradient dtype.

    Mutation seen failing: ``util.threads.run_split`` leaving out the last chunk (the tail of
    every unit keeps its old weights and moments)."""
    from layerwise.optim.adamw import HostAdamW

    cfg = get_flavor("llama-debug").build_config(hidden_size=256, intermediate_size=768,
                                                  num_attention_heads=4, num_key_value_heads=2)
    adapter = DecoderAdapter(cfg)
    stores = []
    for threads in (1, 2):
        make = (lambda: HostAdamW(AdamWConfig(weight_decay=0.1), num_threads=threads)) \
            if moments == "fp32" else \
            (lambda: HostAdamW8bit(AdamWConfig(weight_decay=0.1), num_threads=threads))
        opt = make()
        store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False, split_master=True,
                          grad_dtype=grad_dtype)
        gen = torch.Generator().manual_seed(0)
        for b in store:
            b.write_master(torch.randn(b.layout.numel, generator=gen) * 0.02)
            opt.init_state(b)
        for step in range(3):
            gen = torch.Generator().manual_seed(10 + step)
            for b in store:
                b.grad.copy_(torch.randn(b.layout.numel, generator=gen) * 1e-2)
                opt.step_unit(b, lr=1e-3, clip_coef=0.7)
        stores.append(store)
    assert stores[0]["layers.0"].layout.numel > 1 << 17  # big enough for two threads
    for x, y in zip(*stores):
        assert torch.equal(x.compute, y.compute) and torch.equal(x.remainder, y.remainder)
        for k in x.state:
            assert torch.equal(x.state[k], y.state[k]), k
