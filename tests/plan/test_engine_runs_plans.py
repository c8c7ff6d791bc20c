"""Every plan the planner emits runs in the engine (CPU, fp32) with gradients equal to autograd."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import layerwise.engine as engine

from layerwise.models import DecoderAdapter, get_flavor  # noqa: E402
from layerwise.models.init import build_hf_model  # noqa: E402
from layerwise.planner.cost import CostModel  # noqa: E402
from layerwise.plan.shape import ModelShape  # noqa: E402
from layerwise.planner.presets import PRESETS  # noqa: E402
from layerwise.plan.plan import Plan  # noqa: E402
from layerwise.planner.search import SearchConfig, search  # noqa: E402
from layerwise.planner.simulator import simulate  # noqa: E402
from layerwise.store import HostStore  # noqa: E402
from layerwise.engine.batch import IGNORE_INDEX, Batch  # noqa: E402

SEQ, MBS, BATCH = 32, 2, 4


def _profiles(shape: ModelShape):
    """Machines scaled to a tiny model so that every tier gets used by some plan."""
    base = replace(PRESETS["rtx3090"], compute_dtype_bytes=4, peak_tflops=1e-3, efficiency=1.0,
                   h2d_gbps=1e-4, d2h_gbps=1e-4)
    c = CostModel(shape, base, MBS, SEQ)
    a = c.boundary_bytes
    floor = simulate(Plan(["host"] * shape.num_layers, micro_batch_size=MBS, seq_len=SEQ), shape, base).peak_device_bytes
    dev = base.device_reserved_bytes + floor
    # the store with 8-bit moments everywhere: the MILP may switch units to 8-bit to make room,
    # so host memory is tight only above the smallest store
    store = base.host_reserved_bytes + c.host_store_bytes(["8bit"] * len(shape.unit_names()))
    return {
        "roomy": base,
        # (the floor already holds the two fetch slots an offloading plan needs)
        "device-tight": replace(base, device_mem_bytes=dev + 4 * a),
        "host-tight": replace(base, device_mem_bytes=dev + 4 * a, host_mem_bytes=store + 1 * a),
        "all-tight": replace(base, device_mem_bytes=dev + 5 * a, host_mem_bytes=store + 3 * a,
                             nvme_capacity_bytes=4 * a),
        # compute-bound (copies fast): internals kept where they fit, on the device or the host
        "compute-bound": replace(base, h2d_gbps=1e-1, d2h_gbps=1e-1),
        "compute-bound-device-tight": replace(base, h2d_gbps=1e-1, d2h_gbps=1e-1,
                                              device_mem_bytes=dev + 3 * c.layer_workspace_bytes),
    }


@pytest.mark.parametrize("flavor", ["llama-debug", "qwen2-debug"])
def test_engine_runs_every_emitted_plan_exactly(flavor, tmp_path):
    cfg = get_flavor(flavor).build_config(num_hidden_layers=8)
    shape = ModelShape.from_config(cfg, name=flavor)
    plans = {}
    for name, hw in _profiles(shape).items():
        res = search(shape, hw, SEQ, SearchConfig(global_batch=BATCH, micro_batch_sizes=(MBS,)))
        plans[name] = res.plan
    used = {t for p in plans.values() for t in p.boundary_tiers}
    assert used == {"device", "host", "nvme", "recompute"}, used
    kept = {t for p in plans.values() for t in p.internal_tiers}
    assert kept == {"device", "host", "recompute"}, kept

    model = build_hf_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=g)
    labels[0, :5] = IGNORE_INDEX
    model.zero_grad()
    logits = model(ids).logits
    ref_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}

    adapter = DecoderAdapter(cfg)
    for name, plan in plans.items():
        plan.validate(adapter.num_layers)
        m = plan.micro_batch_size
        batches = [Batch(ids[k:k + m], labels[k:k + m]) for k in range(0, BATCH, m)]
        assert len(batches) == plan.num_micro_batches
        store = HostStore(adapter)
        store.copy_from_model(model)
        eng = engine.StreamingEngine(adapter, store, plan, engine.EngineConfig(spill_dir=str(tmp_path)))
        try:
            loss, _ = eng.compute_grads(batches)
        finally:
            eng.close()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-5), name
        got = {}
        for buf in store:
            views = buf.layout.views(buf.grad)
            for p in buf.unit.params:
                got[p.hf_name] = views[p.local]
        if adapter.tied:
            got["lm_head.weight"] = got["model.embed_tokens.weight"]
        for pname, gref in ref.items():
            rel = ((got[pname] - gref).norm() / gref.norm().clamp_min(1e-30)).item()
            assert rel <= 1e-5, f"{name} plan {plan.boundary_tiers}: {pname} relative error {rel:.2e}"
