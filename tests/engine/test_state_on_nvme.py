"""Units' optimizer-side state on NVMe (``layerwise.state_tier``): the same bits as in RAM, the
state off the page cache, and no more RAM than the staging slots."""

import pytest
import torch

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.optim.adamw import AdamWConfig
from layerwise.plan import Plan
from layerwise.state_tier import NvmeStateTier
from layerwise.store import HostStore


def _batches(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        out.append(Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def _run(cfg, tier, compute_dtype, moments, steps=6, source_tier=None, grad_tier=None,
         engine_device="cpu", groups=1):
    """``groups`` > 1: layer-major, two micro-batches per weight load and ``groups`` loads a
    step, so a gradient lands ``groups`` times (the later landings add to the first)."""
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter, compute_dtype=compute_dtype, state_tier=tier,
                      source_tier=source_tier, grad_tier=grad_tier)
    store.copy_from_model(build_hf_model(cfg, seed=0))
    n = adapter.num_layers
    per_load = 2 if groups > 1 else 1
    plan = Plan.every_k(n, 2, moments=[moments] * (n + 2), micro_batches_per_load=per_load,
                        num_micro_batches=per_load * groups)
    engine = StreamingEngine(adapter, store, plan,
                             EngineConfig(device=engine_device, compute_dtype=compute_dtype,
                                          optimizer=AdamWConfig(lr=3e-3, max_grad_norm=1.0)))
    data = _batches(cfg.vocab_size, steps * plan.num_micro_batches)
    for i in range(steps):
        engine.train_step(data[i * plan.num_micro_batches:(i + 1) * plan.num_micro_batches])
    engine.synchronize()
    out = {}
    for buf in store:
        with store.staged(buf.name):
            out[buf.name] = {"master": buf.read_master().clone(),
                             **{k: v.clone() for k, v in buf.state.items()}}
    return store, engine, out


@pytest.mark.parametrize("compute_dtype,moments,source,groups", [
    (torch.bfloat16, "fp32", False, 1), (torch.float32, "8bit", False, 1),
    (torch.bfloat16, "fp32", True, 1), (torch.float32, "fp32", True, 1),
    (torch.float32, "fp32", True, 2)])
def test_state_on_nvme_trains_the_same_bits_as_in_ram(tmp_path, compute_dtype, moments, source,
                                                      groups):
    """``source``: the copy sources and gradients of the layers on NVMe too (``nvme-all``), on
    the asynchronous CPU backend (which lands gradients in pieces on its landing thread);
    ``groups``: layer-major, each gradient landing twice a step.

    Mutations: write a unit back before its update is done (release without ``write``), or
    read it into a slot whose previous unit's write-back is still in flight (drop ``after``
    from ``_load``); each changes a master or a moment. ``source``: the weight streamer copying
    a source without staging it (``staged = False`` in ``_copy``: it copies a placeholder); a
    gradient landing without writing it back (``write=False`` in ``_land_loop``'s release);
    ``groups``: a later landing staged as an overwrite (``overwrite=True`` in ``_land_loop``:
    it adds to bytes never read)."""
    cfg = get_flavor("llama-debug").build_config()
    _, _, ram = _run(cfg, None, compute_dtype, moments, groups=groups)
    names = [u.name for u in DecoderAdapter(cfg).units]
    tier = NvmeStateTier(tmp_path / "state", names[1:], slots=2)  # the layers and head on NVMe
    sources = NvmeStateTier(tmp_path / "state", names[1:-1], kind="source") if source else None
    grads = NvmeStateTier(tmp_path / "state", names[1:-1], 2, kind="grad") if source else None
    store, engine, nvme = _run(cfg, tier, compute_dtype, moments, source_tier=sources,
                               grad_tier=grads, engine_device="cpu-async" if source else "cpu",
                               groups=groups)
    assert tier.read_bytes > 0 and tier.written_bytes > 0
    for u in names:
        for k, v in ram[u].items():
            assert torch.equal(v, nvme[u][k]), (u, k)
    assert tier.page_cache_bytes() == 0 or not tier.direct
    held = [b for b in store if store.on_nvme(b.name) and b.name not in tier.staged_units()]
    assert held and all(t.device.type == "meta" for b in held for t in b.state.values())
    engine.close()
    store.close()
    assert not (tmp_path / "state").exists()  # the files and the directory made for them
