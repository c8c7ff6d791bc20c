"""Expert-level checkpoint groups (``ckpt.expert_groups``): an MoE layer's part and each routed
expert versioned on its own; composites, merge, import and resume with them."""

import json

import pytest
import torch

from layerwise.ckpt import Checkpointer
from layerwise.ckpt.errors import CheckpointCorruptError
from layerwise.ckpt.resolve import open_run_step
from layerwise.ckpt.run_dir import RunDir
from layerwise.ckpt.run_format import FORMAT_VERSION
from layerwise.ckpt.store_provider import HostStoreStateProvider
from layerwise.engine import StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.interop.recipes.import_checkpoints import import_checkpoints
from layerwise.interop.recipes.merge import merge
from layerwise.interop.sources import open_source
from layerwise.models import get_flavor
from layerwise.models.init import build_hf_model
from layerwise.models.registry import FAMILIES
from layerwise.plan import Plan
from layerwise.store import init_store

FLAVOR = "mixtral-debug"  # 2 MoE layers of 4 fused experts
FROZEN = (1, 2, 3)
"""Experts of layer 1 that never move in ``trained`` (their rows are put back after each step)."""


def verify_run(run):
    return RunDir.open(run).verify()


def moe_model(seed=0):
    cfg = get_flavor(FLAVOR).build_config()
    model = build_hf_model(cfg, seed=seed)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)


def train_step(model, opt, seed, freeze=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=g)
    model(input_ids=ids, labels=ids).loss.backward()
    experts = {n: p for n, p in model.named_parameters() if "layers.1.mlp.experts." in n}
    before = {n: [p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}]
              for n, p in experts.items()}
    opt.step()
    opt.zero_grad()
    if freeze:  # weights and moments of the frozen experts as they were
        with torch.no_grad():
            for n, p in experts.items():
                w, st = before[n]
                p[list(FROZEN)] = w[list(FROZEN)]
                for k in ("exp_avg", "exp_avg_sq") if st else ():
                    opt.state[p][k][list(FROZEN)] = st[k][list(FROZEN)]


@pytest.fixture(scope="module")
def filtered_run(tmp_path_factory):
    """Three filter saves of a tiny MoE whose layer-1 experts 1-3 never move after step 0."""
    root = tmp_path_factory.mktemp("eg")
    model, opt = moe_model()
    ck = Checkpointer(root / "run", model, opt, policy="filter", threshold=1e-9,
                      expert_groups=True, async_save=False)
    reports = []
    for step in range(3):
        train_step(model, opt, step, freeze=step > 0)
        reports.append(ck.save(step))
    ck.close()
    return root, model, opt, reports


def test_groups_split_each_moe_layer_into_its_part_and_experts(filtered_run):
    _, _, _, reports = filtered_run
    first = reports[0].selected
    assert first[:7] == ["embed", "layers.0", "layers.0.experts.0", "layers.0.experts.1",
                         "layers.0.experts.2", "layers.0.experts.3", "layers.1"]
    assert first[-2:] == ["norm", "lm_head"] and len(first) == 13


def test_a_filter_save_writes_only_the_experts_that_moved(filtered_run):
    """Mutation seen failing: ``expert_range`` giving every expert the whole fused tensor (each
    expert group's change is then the layer's, and the frozen experts are written)."""
    root, _, _, reports = filtered_run
    for rep in reports[1:]:
        assert "layers.1.experts.0" in rep.selected
        assert not {f"layers.1.experts.{e}" for e in FROZEN} & set(rep.selected)
        assert {f"layers.0.experts.{e}" for e in range(4)} <= set(rep.selected)
    m = RunDir.open(root / "run").read_manifest(2)
    entry = m["groups"]["layers.1.experts.2"]
    assert entry["slice_of"] == "layers.1" and entry["saved_step"] == 0
    rec = entry["shards"][0]["tensors"]["param/model.layers.1.mlp.experts.gate_up_proj"]
    per = 128 * 32
    assert rec["range"] == [2 * per, 3 * per] and rec["shape"] == [4, 128, 32]
    assert m["groups"]["layers.1.experts.0"]["saved_step"] == 2
    assert json.loads((root / "run" / "format.json").read_text())["format_version"] == FORMAT_VERSION


def test_composite_joins_the_newest_version_of_every_expert(filtered_run):
    """The composite at step 2 equals the live model, weights and moments, though 3 of layer
    1's experts were last written at step 0. Mutation seen failing: ``joined_shards`` taking
    each step counter from the oldest slice (the moments' step of expert 0 goes back to 1)."""
    root, model, opt, _ = filtered_run
    rs = open_run_step(root / "run")
    assert "layers.1.experts.0" not in rs.groups() and "layers.1" in rs.groups()
    live = dict(model.named_parameters())
    for g in rs.groups():
        for k, t in rs.load_group(g).items():
            kind, _, name = k.partition("/")
            want = live[name].detach() if kind == "param" else opt.state[live[name]][kind]
            assert torch.equal(t, want.reshape(t.shape)), k
    assert verify_run(root / "run").ok


def test_merge_to_hf_trainer_dcp_gives_the_live_model(filtered_run, tmp_path):
    root, model, opt, _ = filtered_run
    merge(root / "run", tmp_path / "hf", format="hf")
    cfg = model.config
    back = FAMILIES[cfg.model_type].model_class.from_pretrained(tmp_path / "hf")
    live = dict(model.named_parameters())
    for n, p in back.named_parameters():
        assert torch.equal(p, live[n].detach()), n
    rs = open_run_step(root / "run")
    for fmt in ("trainer", "dcp"):
        merge(root / "run", tmp_path / fmt, format=fmt)
        src = open_source(tmp_path / fmt)
        for g in rs.groups():
            a, b = rs.load_group(g), src.load_group(g)
            assert set(a) == set(b), (fmt, g)
            assert all(torch.equal(a[k], b[k].to(a[k].dtype)) for k in a), (fmt, g)


def test_a_missing_expert_slice_is_a_corrupt_checkpoint(filtered_run, tmp_path):
    """Mutation seen failing: ``joined_shards`` / ``shard_layout`` not checking the cover (a
    layer joined from 3 of its 4 experts would load with a hole)."""
    root, _, _, _ = filtered_run
    import shutil
    run = tmp_path / "run"
    shutil.copytree(root / "run", run)
    path = RunDir.open(run).step_dir(2) / "manifest.json"
    m = json.loads(path.read_text())
    del m["groups"]["layers.1.experts.3"]
    path.write_text(json.dumps(m))
    with pytest.raises(CheckpointCorruptError, match="layers.1"):
        open_run_step(run, 2).load_group("layers.1")
    assert any("expert groups of layers.1" in f for f in verify_run(run).faults)


def test_switching_grouping_rewrites_every_group_once(tmp_path):
    """A run saved with layer groups continues with expert groups (and loads either way): the
    first save after the switch writes every group, so no layer's old whole version and new
    expert slices meet in one manifest."""
    model, opt = moe_model()
    train_step(model, opt, 0)
    with Checkpointer(tmp_path / "run", model, opt, policy="filter", async_save=False) as ck:
        ck.save(0)
    train_step(model, opt, 1)
    with Checkpointer(tmp_path / "run", model, opt, policy="filter", threshold=1e-9,
                      expert_groups=True, async_save=False) as ck:
        rep = ck.save(1)
    assert len(rep.selected) == 13 and verify_run(tmp_path / "run").ok
    other, other_opt = moe_model(seed=5)
    with Checkpointer(tmp_path / "run", other, other_opt) as ck:  # layer groups again
        ck.load()
    for (n, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), n


def test_import_with_expert_groups_stores_only_the_moved_experts(tmp_path):
    """HF model dirs hold a Mixtral's experts one tensor each: each is its expert group's own,
    and the composite of the second import equals the second dir."""
    model, opt = moe_model()
    train_step(model, opt, 0, freeze=False)
    model.save_pretrained(tmp_path / "a")
    train_step(model, opt, 1)
    model.save_pretrained(tmp_path / "b")
    rep = import_checkpoints([tmp_path / "a", tmp_path / "b"], tmp_path / "run",
                             "filter:threshold=1e-9", expert_groups=True)
    second = set(rep.steps[1].selected)
    assert "layers.1.experts.0" in second and not {f"layers.1.experts.{e}" for e in FROZEN} & second
    rs, src = open_run_step(tmp_path / "run"), open_source(tmp_path / "b")
    assert rs.groups() == src.groups()  # HF dirs keep one tensor per expert: whole-tensor slices
    for g in rs.groups():
        a, b = rs.load_group(g), src.load_group(g)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), g


def _engine(seed=0):
    adapter, store = init_store(get_flavor(FLAVOR).build_config(), seed=seed)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1))
    return engine, HostStoreStateProvider(store, engine.optimizers)


def test_engine_resume_with_expert_groups_is_bit_identical(tmp_path):
    """``full`` + expert groups on the engine's host store: resumed losses and final state equal
    an uninterrupted run's. Mutation seen failing: ``joined_shards`` dropping the fused
    tensors' ``step/`` counters (the resumed AdamW restarts its bias correction)."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(6):
        ids = torch.randint(0, 96, (2, 9), generator=g)
        batches.append(Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    engine, provider = _engine()
    ck = Checkpointer(tmp_path / "run", provider=provider, policy="full", expert_groups=True)
    losses = []
    for k, b in enumerate(batches):
        losses.append(engine.train_step([b]).loss)
        if k == 2:
            engine.synchronize()
            ck.save(k + 1)
    engine.synchronize()
    ck.close()
    final = {n: t.clone() for n, t in engine.store.state_dict().items()}
    engine.close()
    assert any(".experts." in g for g in ck.groups)

    engine2, provider2 = _engine(seed=9)
    ck2 = Checkpointer(tmp_path / "run", provider=provider2, policy="full", expert_groups=True)
    assert ck2.load().step == 3
    assert [engine2.train_step([b]).loss for b in batches[3:]] == losses[3:]
    engine2.synchronize()
    for n, t in engine2.store.state_dict().items():
        assert torch.equal(t, final[n]), n
    ck2.close()
    engine2.close()
