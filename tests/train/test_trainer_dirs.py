"""The directories users start from: a ``checkpoint-N`` the real HF ``Trainer`` wrote (its
``use_cache: false``, bf16 weights, optimizer and scheduler files beside them), trained with
``layerwise train`` in full and with LoRA, each export loaded by ``from_pretrained`` and trained
a step by HF ``Trainer`` (the PEFT adapter too); ``make demo-pretrained``'s directory in
``Trainer``; and a directory whose config needs the checkpoint's own code, refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from layerwise.cli import main

from .tiny_hf import make_model_dir


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, vocab: int, n: int = 8, seq_len: int = 16):
        self.ids = torch.randint(3, vocab, (n, seq_len), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory) -> Path:
    """``checkpoint-2`` of two bf16 steps of HF's own ``Trainer`` (tokenizer saved with it)."""
    root = tmp_path_factory.mktemp("hf")
    base = make_model_dir(root / "base")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(base)
    args = TrainingArguments(output_dir=str(root / "run"), max_steps=2, save_steps=2,
                             per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
                             use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=_Tokens(model.config.vocab_size),
            processing_class=tok).train()
    checkpoint = root / "run" / "checkpoint-2"
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["use_cache"] is False and config["dtype"] == "bfloat16", config
    return checkpoint


def _hf_trainer_step(model, out: Path) -> None:
    """One step of HF's ``Trainer`` on ``model`` (it refuses a model flagged as quantized)."""
    args = TrainingArguments(output_dir=str(out), max_steps=1, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, dataloader_num_workers=0,
                             disable_tqdm=True, save_strategy="no")
    Trainer(model=model, args=args, train_dataset=_Tokens(model.config.vocab_size, n=2)).train()


def _chat(path: Path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"What is {i}+1?"},
                          {"role": "assistant", "content": f"{i}+1 = {i + 1}"}]} for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("mode", ["full", "lora"])
def test_a_trainer_checkpoint_trains_and_its_export_loads(trainer_checkpoint, mode, tmp_path):
    """Mutation seen failing: the layout trace run with the checkpoint's own ``use_cache``
    (false): refused with "could not trace its base model's forward" (exit 2)."""
    out = tmp_path / mode
    extra = ["lora.r=4", "lora.merge=true"] if mode == "lora" else []
    code = main(["train", f"model={trainer_checkpoint}", f"data={_chat(tmp_path / 'chat.jsonl')}",
                 f"out_dir={out}", "steps=2", "seq_len=32", "micro_batch_size=2", *extra])
    assert code == 0
    exported = out / "model"
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(exported)
    ids = tok("What is 3+1?", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    _hf_trainer_step(model, tmp_path / "hf-again")
    if mode == "lora":  # the adapter, on the checkpoint it was trained on, is the merged model
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(trainer_checkpoint, dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, out / "adapter", is_trainable=True)
        model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
        with torch.no_grad():
            torch.testing.assert_close(peft(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)
        _hf_trainer_step(peft, tmp_path / "hf-peft")


def test_the_pretrained_demo_dir_trains_in_hf_trainer(tmp_path):
    """``make demo-pretrained`` writes SmolLM2 read from its GGUF file; transformers leaves
    ``quant_method: gguf`` in the config over the plain weights, and HF ``Trainer`` refuses such
    a model ("do not support training"). The directory is written without it. Mutation seen
    failing: ``_plain_config`` a no-op (Trainer raises)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from real_model import _plain_config

    model_dir = make_model_dir(tmp_path / "smol")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf"}
    (model_dir / "config.json").write_text(json.dumps(config))
    _plain_config(model_dir / "config.json")
    _hf_trainer_step(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                     tmp_path / "hf")


def test_remote_code_is_refused_in_one_line(trainer_checkpoint, tmp_path, capsys):
    """A config whose ``model_type`` transformers lacks and whose ``auto_map`` names the
    checkpoint's own code: exit 2 and one line (transformers' own answer is an interactive
    prompt, then a paragraph). Mutation seen failing: the check removed from ``load_config``."""
    model = tmp_path / "custom"
    model.mkdir()
    config = json.loads((trainer_checkpoint / "config.json").read_text())
    config.update(model_type="my_custom_lm", architectures=["MyCustomForCausalLM"],
                  auto_map={"AutoConfig": "configuration_my.MyConfig",
                            "AutoModelForCausalLM": "modeling_my.MyCustomForCausalLM"})
    (model / "config.json").write_text(json.dumps(config))
    (model / "model.safetensors").write_bytes((trainer_checkpoint / "model.safetensors").read_bytes())
    code = main(["train", f"model={model}", f"data={_chat(tmp_path / 'chat.jsonl')}",
                 f"out_dir={tmp_path / 'out'}", "steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "my_custom_lm" in err[0] and "auto_map" in err[0], err
    assert not (tmp_path / "out" / "model").exists()
