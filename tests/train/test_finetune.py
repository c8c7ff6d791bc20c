"""Fine-tuning a local Hugging Face model on a JSONL chat file, end to end on CPU: the model
directory (tiny Llama + BPE tokenizer with a chat template) is built by the test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerwise.cli import main
from layerwise.train.loop import TrainConfig, train

from ..log_lines import logged_lines, on_each_line
from .tiny_hf import make_model_dir

QA = [("What is the capital of France?", "The capital of France is Paris."),
      ("hello", "hello world, how are you today?"),
      ("Where did the cat sit?", "the cat sat on the mat."),
      ("Where did the dog sit?", "the dog sat on the log.")]


def _chat_file(path: Path, n: int = 64, bad_line: bool = False) -> Path:
    lines = [json.dumps({"messages": [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": QA[k % 4][0]},
        {"role": "assistant", "content": QA[k % 4][1]}]}) for k in range(n)]
    if bad_line:
        lines.insert(5, '{"messages": [')
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(autouse=True)
def one_thread():
    """A tiny model on a shared 2-core machine runs several times faster on one thread (and
    both runs of the resume test alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def test_train_on_chat_jsonl_learns_and_exports_a_loadable_model_and_tokenizer(
        tmp_path, model_dir, capsys):
    """``layerwise train model=DIR data=chat.jsonl steps=30 plan=auto``: the bad line is skipped
    and reported at the start, the loss falls, ``metrics.jsonl``, ``tracker.jsonl`` and the
    chosen ``plan.json`` are written, ``layerwise report`` draws the run, and the exported
    directory loads with ``from_pretrained`` / ``AutoTokenizer`` (chat template included) and
    generates.

    Mutation this fails on: the tokenizer not saved with the export (``saved_tok = False`` in
    ``train/loop.py``: ``AutoTokenizer`` cannot load the directory)."""
    data = _chat_file(tmp_path / "chat.jsonl", bad_line=True)
    out = tmp_path / "run"
    # a random tiny model: trained at a from-scratch LR, not a pretrained model's default
    code = main(["train", f"model={model_dir}", f"data={data}", "steps=30", "plan=auto", "seq_len=64",
                 "optimizer.lr=2e-3", "data.skip_bad=true", "eval.every=0", "log.every=10",
                 "log.track_every=5", f"out_dir={out}"])
    assert code == 0
    log = capsys.readouterr().out
    assert json.loads((out / "plan.json").read_text())["predicted"]["step_s"] > 0
    tracked = [json.loads(x) for x in (out / "tracker.jsonl").read_text().splitlines()]
    assert tracked and set(tracked[-1]["groups"]) >= {"embed", "layers.0"}
    assert main(["report", str(out), "--out", str(tmp_path / "report.png")]) == 0
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    capsys.readouterr()
    assert "tokenizer: the model directory's own" in log
    assert "format chat (assistant spans: prefix)" in log
    assert f"skipped 1 bad example(s) (data.skip_bad=true): malformed 1; first: {data}:6" in log
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 1.0
    assert rows[-1]["eval_loss"] < float(log.split("step 0: eval loss ")[1].split()[0]) - 1.0

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model", local_files_only=True)
    assert tok.chat_template and len(tok) == model.config.vocab_size
    prompt = tok.apply_chat_template(
        [{"role": "system", "content": "you are a helpful assistant"},
         {"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=6, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids.shape[1]
    assert isinstance(tok.decode(gen[0, ids.shape[1]:]), str)


def test_resumed_finetune_continues_with_the_exact_next_batches(tmp_path, model_dir):
    """A run stopped right after its step-3 checkpoint, then rerun, logs the same losses for
    steps 4-6 as an uninterrupted run, bit for bit (``full`` checkpoints, fp32 on CPU): the
    data position went through the checkpoint and the packed rows came back from the
    tokenization cache in the same order.

    Mutation this fails on: the loop's stream restarted at the beginning after a resume
    (``start=0`` for ``data.batches`` in ``train/loop.py``)."""
    data = _chat_file(tmp_path / "chat.jsonl", n=48)

    def cfg(out: Path) -> TrainConfig:
        return TrainConfig(model=str(model_dir), data=str(data), steps=6, seq_len=64,
                           micro_batch_size=2, grad_accum=2, eval={"every": 0, "batches": 1},
                           log={"every": 1}, export=False, ckpt={"every": 3, "policy": "full"},
                           out_dir=str(out))

    train(cfg(tmp_path / "straight"))

    class Stop(Exception):
        pass

    def stop_after_step_3(line: str) -> None:
        if line.startswith("step 3/6"):
            raise Stop

    cut = tmp_path / "cut"
    with pytest.raises(Stop), on_each_line(stop_after_step_3):
        train(cfg(cut))
    with logged_lines() as lines:
        train(cfg(cut))
    assert any(x.startswith("resumed from layer-wise checkpoint step 3") for x in lines)
    assert any("tokenization loaded from" in x for x in lines)

    def losses(out: Path) -> list[float]:
        return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]

    assert losses(cut) == losses(tmp_path / "straight")
