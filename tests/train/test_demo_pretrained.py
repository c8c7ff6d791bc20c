"""``layerwise demo --pretrained DIR``: a tiny chat model directory as ``save_pretrained`` writes
it (``tiny_hf.py``) here; SmolLM2-135M-Instruct behind the opt-in ``real_model`` marker."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from layerwise.ckpt import RunDir
from layerwise.cli import main
from layerwise.train.demo_pretrained import (CAPITALS, HELD_OUT, PretrainedDemoConfig, chats,
                                             run_pretrained_demo)

from .tiny_hf import make_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from real_model import smollm2_dir  # noqa: E402


def test_held_out_countries_are_not_in_the_training_chats():
    """The side-by-side answers are about countries training never saw."""
    trained = json.dumps(chats(CAPITALS[HELD_OUT:]))
    for country, capital in CAPITALS[:HELD_OUT]:
        assert country not in trained and capital not in trained


def test_the_demo_trains_exports_a_peft_adapter_and_answers_before_and_after(tmp_path):
    model = make_model_dir(tmp_path / "chat-model")
    out = tmp_path / "demo"
    (out / "demo.json").parent.mkdir()
    (out / "demo.json").write_text("{}")  # an earlier demo's: replaced, as `layerwise demo` does
    run_pretrained_demo(PretrainedDemoConfig(str(model), str(out), steps=2, max_new_tokens=4))
    info = json.loads((out / "demo.json").read_text())
    assert info["finished"] and len(info["questions"]) == len(info["before"]) == len(info["after"]) == HELD_OUT
    assert all(isinstance(a, str) for a in info["before"] + info["after"])
    assert (out / "adapter" / "adapter_config.json").is_file()
    assert (out / "data" / "train.jsonl").read_text().count("\n") == len(chats(CAPITALS[HELD_OUT:]))
    assert RunDir.open(out / "ckpt").committed_steps() == [2]  # the layer-wise save at the end


def test_a_directory_that_is_not_a_model_is_refused_in_one_line(tmp_path, capsys):
    assert main(["demo", "--pretrained", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "make demo-pretrained" in err


@pytest.mark.real_model
@pytest.mark.sweep  # minutes on a CPU: `make test-all` (or `pytest -m real_model`) runs it
@pytest.mark.skipif(smollm2_dir(fetch=False) is None,
                    reason="no SmolLM2 directory: run `python benchmarks/real_model.py` once")
def test_smollm2_answers_held_out_questions_in_the_trained_voice(tmp_path):
    """Before: plain answers; after 12 LoRA steps: the pirate's sentence, on countries it never
    saw (the before answers lack the voice, so an adapter left out fails it)."""
    out = tmp_path / "demo"
    assert main(["demo", "--pretrained", str(smollm2_dir(fetch=False)), "--out", str(out)]) == 0
    info = json.loads((out / "demo.json").read_text())
    assert not any("matey" in a for a in info["before"])
    assert sum("matey" in a for a in info["after"]) >= HELD_OUT - 1, info["after"]
