"""Load a save_pretrained directory, train, export, and reload with transformers."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.interop.recipes.store_export import export_store
from layerwise.interop.hf.model_dir import load_store
from layerwise.models.init import build_hf_model
from layerwise.plan import Plan
from layerwise.engine.batch import Batch


@pytest.fixture
def hf_dir(tmp_path):
    cfg = get_flavor("qwen2-debug-untied").build_config()
    model = build_hf_model(cfg, seed=0)
    path = tmp_path / "in"
    model.save_pretrained(path, max_shard_size="40KB")  # several shards + index
    return path, model


def test_load_train_export_roundtrip(hf_dir, tmp_path):
    path, model = hf_dir
    assert (path / "model.safetensors.index.json").exists()
    adapter, store = load_store(path)
    for name, p in model.state_dict().items():
        assert torch.equal(store.state_dict()[name], p)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 2))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, adapter.vocab_size, (2, 9), generator=g)
        engine.train_step([Batch(ids[:, :-1], ids[:, 1:])])
    engine.synchronize()
    out = export_store(store, tmp_path / "out", max_shard_size=50_000)
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, adapter.vocab_size, (2, 10), generator=g)
    with torch.no_grad():
        ref = reloaded(ids).logits
    got = engine.forward_logits(ids)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, model(ids).logits, atol=1e-4), "training changed nothing"
    engine.close()


def test_export_refuses_non_empty_directory(hf_dir, tmp_path):
    path, _ = hf_dir
    _, store = load_store(path)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not empty"):
        export_store(store, tmp_path / "busy")
    assert (tmp_path / "busy" / "keep.txt").read_text() == "x"


def test_missing_shard_is_reported(hf_dir):
    path, _ = hf_dir
    shard = sorted(path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match="missing"):
        load_store(path)


def test_truncated_shard_is_reported(hf_dir):
    path, _ = hf_dir
    shard = sorted(path.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_store(path)


def test_unsupported_architecture_is_reported(tmp_path):
    with pytest.raises(ValueError, match="unsupported architecture model_type='bloom'"):
        DecoderAdapter(BloomConfig(n_layer=2))
    (tmp_path / "bloom").mkdir()
    BloomConfig(n_layer=2).save_pretrained(tmp_path / "bloom")
    with pytest.raises(ValueError, match="runs word_embeddings_layernorm"):
        load_store(tmp_path / "bloom")


def test_config_mismatch_is_reported(hf_dir):
    path, _ = hf_dir
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="does not match the model config"):
        load_store(path)


def test_plan_over_device_cap_is_refused_before_training():
    cfg = get_flavor("llama-debug").build_config()
    adapter = DecoderAdapter(cfg)
    from layerwise.store import HostStore

    store = HostStore(adapter)
    plan = Plan.every_k(adapter.num_layers, 1)
    probe = StreamingEngine(adapter, store, plan)
    need = probe.predict_memory(2, 64).peak_bytes
    probe.close()
    engine = StreamingEngine(adapter, store, plan, EngineConfig(device_mem_cap_bytes=need - 1))
    before = store["layers.0"].master.clone()
    ids = torch.zeros(2, 64, dtype=torch.long)
    with pytest.raises(ValueError, match="over the cap"):
        engine.train_step([Batch(ids, ids)])
    assert torch.equal(store["layers.0"].master, before)
    assert float(store["layers.0"].grad.abs().sum()) == 0
    # offloading every boundary to the host needs less and fits under the same cap
    cheaper = StreamingEngine(adapter, store, Plan.keep_all(adapter.num_layers, "host"),
                              EngineConfig(device_mem_cap_bytes=need - 1))
    cheaper.check(2, 64)
    engine.close()
    cheaper.close()
