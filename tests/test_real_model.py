"""On real pretrained weights (SmolLM2-135M-Instruct: Llama, 30 layers, tied embeddings), opt-in:
``python benchmarks/real_model.py`` makes the directory once (``benchmarks/.cache/``); without it
these tests skip and say so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from family_cases import assert_grads_close, engine_grads, hf_reference
from layerwise.engine import StreamingEngine
from layerwise.engine.batch import IGNORE_INDEX, Batch
from layerwise.interop.hf.model_dir import load_store
from layerwise.plan import Plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from real_model import smollm2_dir  # noqa: E402

pytestmark = pytest.mark.real_model
MODEL = smollm2_dir(fetch=False)
needs_model = pytest.mark.skipif(
    MODEL is None, reason="no SmolLM2 directory: run `python benchmarks/real_model.py` once")


@needs_model
@pytest.mark.parametrize("plan", ["every-1", "recompute-all"])
def test_the_engine_equals_hf_autograd_on_real_weights(plan):
    """Loss and every gradient of a real model's directory, as the Hub-style files hold it, equal
    HF autograd (fp32, CPU): real weights have outliers and a 49k vocabulary that random tiny
    models do not."""
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    adapter, store = load_store(MODEL)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, adapter.vocab_size, (2, 32), generator=g)
    labels = ids.clone()
    labels[:, :8] = IGNORE_INDEX
    batch = Batch(ids, labels)
    ref_loss, ref_grads = hf_reference(model, adapter.config, [batch])
    make = {"every-1": lambda n: Plan.every_k(n, 1), "recompute-all": Plan.recompute_all}[plan]
    engine = StreamingEngine(adapter, store, make(adapter.num_layers))
    try:
        loss, _ = engine.compute_grads([batch])
    finally:
        engine.close()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(engine_grads(store), ref_grads)
