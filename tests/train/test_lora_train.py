"""``layerwise train ... lora.r=4``: layer-wise checkpoints of the adapters, a bit-identical
resume, a PEFT adapter PEFT loads with the layerwise model's logits, the merged model, and
``lora.init`` from an adapter directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from layerwise.adapters.config import LoraConfig
from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.plan import Plan
from layerwise.train.config import TrainConfig
from layerwise.train.loop import train
from layerwise.train.lora_run import build_lora
from layerwise.interop.hf.model_dir import load_config

from ..log_lines import logged_lines, on_each_line
from .test_finetune import _chat_file
from .tiny_hf import make_model_dir


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


LORA = dict(r=4, alpha=8, target_modules=["q_proj", "v_proj", "o_proj"])


def _cfg(model_dir: Path, data: Path, out: Path, **lora) -> TrainConfig:
    return TrainConfig(model=str(model_dir), data=str(data), steps=6, seq_len=48,
                       micro_batch_size=2, grad_accum=2, eval={"every": 3, "batches": 1},
                       log={"every": 1}, ckpt={"every": 3, "policy": "full"}, out_dir=str(out),
                       lora=LoraConfig(**{**LORA, **lora}), plan="every-2")


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_lora_run_resumes_bit_identically_and_exports_a_peft_adapter(tmp_path):
    """A LoRA run (dropout on) stopped after its step-3 checkpoint and rerun logs the same losses
    and ends with the same adapter bytes as an uninterrupted one; its checkpoints hold the
    adapters and their moments alone; the exported adapter loads with
    ``PeftModel.from_pretrained`` and gives the logits of the layerwise model started from it
    (``lora.init``); ``lora.merge`` writes a model ``from_pretrained`` loads with those logits.
    Mutation seen failing: the resumed run's dropout draws not set back
    (``resume_dropout`` a no-op: the losses after step 3 differ)."""
    model_dir = make_model_dir(tmp_path / "base")
    data = _chat_file(tmp_path / "chat.jsonl", n=48)
    straight = tmp_path / "straight"
    train(_cfg(model_dir, data, straight, dropout=0.1, merge=True))

    class Stop(Exception):
        pass

    def stop_after_step_3(line: str) -> None:
        if line.startswith("step 3/6"):
            raise Stop

    cut = tmp_path / "cut"
    with pytest.raises(Stop), on_each_line(stop_after_step_3):
        train(_cfg(model_dir, data, cut, dropout=0.1, merge=True))
    with logged_lines() as lines:
        train(_cfg(model_dir, data, cut, dropout=0.1, merge=True))
    assert any(x.startswith("resumed from layer-wise checkpoint step 3") for x in lines)
    assert _losses(cut) == _losses(straight)
    assert ((cut / "adapter" / "adapter_model.safetensors").read_bytes()
            == (straight / "adapter" / "adapter_model.safetensors").read_bytes())

    # the checkpoint: the layers' groups, each the adapters + AdamW moments (12 B/param) alone
    blobs = [f for f in (straight / "ckpt" / "blobs").rglob("*.safetensors")]
    adapter_params = 4 * (4 * (32 + 32) + 4 * (32 + 16) + 4 * (32 + 32))
    assert len(blobs) == 2 * 4  # two saves x four layer groups (no embed, norm, lm_head)
    payload = sum(f.stat().st_size for f in blobs)
    assert 2 * 12 * adapter_params <= payload < 2 * 12 * adapter_params + len(blobs) * 4096

    # PEFT loads the adapter; its logits are the layerwise model's started from that adapter
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), straight / "adapter")
    peft.eval()
    with torch.no_grad():
        want = peft(ids).logits
    cfg = _cfg(model_dir, data, tmp_path / "unused", init=str(straight / "adapter"))
    adapter, store = build_lora(str(model_dir), load_config(model_dir), cfg, torch.float32)
    engine = StreamingEngine(adapter.eval(), store, Plan.every_k(adapter.num_layers, 1), EngineConfig())
    got = engine.forward_logits(ids)
    engine.close()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5), (got - want).abs().max()
    merged = AutoModelForCausalLM.from_pretrained(straight / "model")
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="lora.r=8"):
        build_lora(str(model_dir), load_config(model_dir),
                   _cfg(model_dir, data, tmp_path / "unused", r=8, init=str(straight / "adapter")),
                   torch.float32)
