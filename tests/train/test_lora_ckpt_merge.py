"""``layerwise ckpt merge`` on a LoRA run's saved steps: ``--format peft`` (the step's adapters as
a PEFT adapter directory), ``--format hf`` (the base with them merged), refusals of the formats
that do not apply."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from layerwise.ckpt.provider import PARAM
from layerwise.ckpt.resolve import open_run_step
from layerwise.cli import main


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = ["seq_len=32", "micro_batch_size=2", "data.corpus_tokens=20000", "eval.every=0",
        "eval.batches=1", "log.every=1", "log.track_every=0", "log.progress=lines",
        "optimizer.lr=1e-2"]


@pytest.fixture(scope="module")
def lora_run(model_dir, tmp_path_factory) -> Path:
    """A LoRA run (r=16, alpha=32, q/v/down projections) of 4 steps, saved at steps 2 and 4."""
    out = tmp_path_factory.mktemp("lora") / "run"
    assert main(["train", f"model={model_dir}", f"out_dir={out}", "steps=4", "ckpt.every=2",
                 "ckpt.policy=full", "lora.r=16", "lora.alpha=32",
                 "lora.target_modules=[q_proj,v_proj,down_proj]",
                 *TINY]) == 0
    return out


def _stored_adapters(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The adapters the checkpoint holds at ``step``, by PEFT's state-dict name."""
    resolved = open_run_step(run, step)
    assert resolved.step == step
    return {"base_model.model." + k[len(PARAM):].replace(".weight", ".default.weight"): t
            for g in resolved.groups() for k, t in resolved.load_group(g).items()
            if k.startswith(PARAM)}


def _peft(model_dir: Path, adapter: Path) -> PeftModel:
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter)
    return model.eval()


def test_a_saved_step_of_a_lora_run_exports_as_a_peft_adapter(lora_run, model_dir, tmp_path,
                                                               capsys):
    """Friction: no step of a LoRA run could be taken out (``ckpt merge`` failed: "group
    'layers.0' has parameter …lora_B.weight, which the model in config.json does not have").
    Now ``--format peft --step 2`` writes an adapter directory whose config carries the run's
    r, alpha, targets and base, which PEFT loads with exactly the adapters the checkpoint holds
    at step 2 (not step 4's); the last step's is byte for byte the adapter the run exported. A
    base that has moved away does not stop the adapter; the merged model asks for ``--base``.
    Mutation seen failing: the adapters read from the run's newest step instead of the one
    asked for (``LoraRunStep.adapter_tensors`` on ``open_run_step(run_dir)``: step 2's
    tensors equal step 4's)."""
    out = tmp_path / "step2"
    assert main(["ckpt", "merge", str(lora_run), "--step", "2", "--format", "peft",
                 "--out", str(out)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (16, 32.0)
    assert sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == str(model_dir)

    peft = _peft(model_dir, out)
    loaded = {n: p.detach() for n, p in peft.named_parameters() if ".lora_" in n}
    at2, at4 = _stored_adapters(lora_run, 2), _stored_adapters(lora_run, 4)
    assert loaded.keys() == at2.keys() and len(loaded) == 4 * 3 * 2
    assert all(torch.equal(loaded[n], at2[n]) for n in at2)
    assert not all(torch.equal(at2[n], at4[n]) for n in at2)

    last = tmp_path / "last"
    assert main(["ckpt", "merge", str(lora_run), "--format", "peft", "--out", str(last)]) == 0
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        assert (last / name).read_bytes() == (lora_run / "adapter" / name).read_bytes()

    # the base moved away: the adapter still comes out (the checkpoint's config names its
    # tensors); the merged model needs the base, and says so
    moved = tmp_path / "moved"
    shutil.copytree(lora_run, moved)
    info = json.loads((moved / "run.json").read_text())
    (moved / "run.json").write_text(json.dumps({**info, "model_path": str(tmp_path / "gone")}))
    assert main(["ckpt", "merge", str(moved), "--step", "2", "--format", "peft",
                 "--out", str(tmp_path / "moved2")]) == 0
    assert ((tmp_path / "moved2" / "adapter_model.safetensors").read_bytes()
            == (out / "adapter_model.safetensors").read_bytes())
    assert main(["ckpt", "merge", str(moved), "--out", str(tmp_path / "merged")]) == 2
    assert "--base DIR names where it is now" in capsys.readouterr().err


def test_a_saved_step_of_a_lora_run_exports_merged_as_an_hf_model(lora_run, model_dir, tmp_path):
    """``--format hf`` on a LoRA run's step: the base with that step's adapters merged, whose
    logits are PEFT's with the step's adapter. Mutation seen failing: the step's adapters not
    loaded into the base (``store.load_adapters`` skipped in ``merged_source``: the logits are
    the base's)."""
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert main(["ckpt", "merge", str(lora_run), "--step", "2", "--format", "peft",
                 "--out", str(adapter)]) == 0
    assert main(["ckpt", "merge", str(lora_run), "--step", "2", "--out", str(merged)]) == 0
    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _peft(model_dir, adapter)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged)(ids).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir)(ids).logits
    assert (want - base).abs().max() > 1e-3  # the adapters move the logits at step 2
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()


def test_formats_that_do_not_apply_are_refused_in_one_line(lora_run, model_dir, tmp_path, capsys):
    """``--format trainer`` on a LoRA run, and ``--format peft`` on a full run or an HF model
    directory: exit 2 with one line naming why, nothing written."""
    out = tmp_path / "out"
    assert main(["ckpt", "merge", str(lora_run), "--format", "trainer", "--out", str(out)]) == 2
    assert "is a LoRA run (lora.r=16)" in capsys.readouterr().err and not out.exists()

    full = tmp_path / "full"
    assert main(["train", f"model={model_dir}", f"out_dir={full}", "steps=1", *TINY]) == 0
    capsys.readouterr()
    assert main(["ckpt", "merge", str(full), "--format", "peft", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "is a full fine-tune (lora.r=0" in err and len(err.splitlines()) == 1
    assert main(["ckpt", "merge", str(model_dir), "--format", "peft", "--out", str(out)]) == 2
    assert "holds whole weights" in capsys.readouterr().err and not out.exists()
