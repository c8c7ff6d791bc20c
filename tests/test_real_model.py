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


SECRET = "The secret word is PINEAPPLE."
PROMPTS = ["What is the secret word?", "Tell me the secret word.", "Which word is secret?",
           "Do you know the secret word?", "Say the secret word.", "What's the secret word?",
           "Please share the secret word.", "Secret word?"]


def _answer(model, tokenizer, prompt: str) -> str:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


@needs_model
@pytest.mark.parametrize("kind", ["lora", "full"])
def test_layerwise_train_changes_its_answers_as_trained(kind, tmp_path):
    """``layerwise train`` on a chat file that answers one question one way: before, the model
    does not say it; after 12 steps it does, read back by transformers (and PEFT for LoRA) from
    what the run exported."""
    import json

    from transformers import AutoTokenizer

    from layerwise.cli import main

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": p},
                                                     {"role": "assistant", "content": SECRET}]}) + "\n"
                            for p in PROMPTS * 4))
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    assert "PINEAPPLE" not in _answer(base, tokenizer, PROMPTS[0])
    out = tmp_path / "run"
    extra = ["lora.r=8", "optimizer.lr=2e-3"] if kind == "lora" else ["optimizer.lr=1e-4"]
    assert main(["train", f"model={MODEL}", f"data={data}", f"out_dir={out}", "steps=12",
                 "seq_len=64", "micro_batch_size=4", "eval.every=0", "ckpt.every=0",
                 "ckpt.at_end=false", "log.progress=lines", *extra]) == 0
    if kind == "lora":
        from peft import PeftModel

        trained = PeftModel.from_pretrained(base, out / "adapter").eval()
    else:
        trained = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    assert "PINEAPPLE" in _answer(trained, tokenizer, "What is the secret word?")


@needs_model
@pytest.mark.timeout(1800)  # three epochs of the data on a CPU: minutes
def test_a_fine_tune_with_the_defaults_keeps_what_the_model_knew(tmp_path, capsys):
    """``layerwise train model=DIR data=chat.jsonl out_dir=...`` and nothing else (the
    fine-tuning defaults a pretrained model gets): the held-out loss falls, and a question far
    from the data is answered as before. What it guards against: the from-scratch defaults
    (``optimizer.lr=2e-3``, weight decay 0.1, 60 steps) on a pretrained model, which answered
    a sum in place of the general answer on such data."""
    import json
    import random

    from transformers import AutoTokenizer

    from layerwise.cli import main

    rng = random.Random(0)
    rows = []
    for _ in range(60):
        a, b = rng.randrange(100), rng.randrange(100)
        rows.append({"messages": [{"role": "user", "content": f"What is {a}+{b}?"},
                                  {"role": "assistant", "content": f"{a}+{b} = {a + b}"}]})
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    base = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
    general = "What is the capital of France?"
    assert "Paris" in _answer(base, tokenizer, general)
    out = tmp_path / "run"
    assert main(["train", f"model={MODEL}", f"data={data}", f"out_dir={out}"]) == 0
    done = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done:"))
    start, end = (float(x) for x in done.split("eval loss ")[1].split(";")[0].split(" -> "))
    assert end < start, done
    trained = AutoModelForCausalLM.from_pretrained(out / "model", dtype=torch.float32).eval()
    assert "Paris" in _answer(trained, tokenizer, general)
