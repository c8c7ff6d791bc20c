"""Which tokens carry loss, per data format, with the model directory's own tokenizer (a tiny
BPE with a ChatML template built by the test), through the whole data path: file -> records ->
ids and mask -> shifted rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from layerwise.engine.batch import IGNORE_INDEX
from layerwise.train.data import DataSpec, prepare_data
from layerwise.train.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT
from layerwise.train.tokenizer import ByteTokenizer, check_vocab, load_tokenizer

from .tiny_hf import CHAT_TEMPLATE, CHAT_TEMPLATE_GENERATION, make_model_dir

CONVERSATION = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hello world, how are you today?"},
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"prefix": make_model_dir(root / "plain", CHAT_TEMPLATE),
            "generation": make_model_dir(root / "gen", CHAT_TEMPLATE_GENERATION)}


def _one_example_rows(tmp_path: Path, model_dir: Path, record: dict, fmt: str = "auto",
                      seq_len: int = 256):
    """The single example of ``record`` as (tokenizer, inputs, labels) of its row (unpacked)."""
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(record) + "\n")
    tok, _ = load_tokenizer("auto", str(model_dir))
    data = prepare_data(DataSpec(data=str(path), eval_data=str(path), data_format=fmt,
                                 seq_len=seq_len, pack=False, cache=False), tok, tmp_path)
    assert len(data.train) == 1
    return tok, data.train.input_ids[0].tolist(), data.train.labels[0].tolist(), data


def _expected_chat(tok, messages):
    """Oracle, independent of the code under test: ChatML piece by piece (special tokens bound
    every piece, so the pieces tokenize as the whole does); loss on each assistant message's
    content + ``<|im_end|>\\n``, nothing else."""
    ids, mask = [], []
    for m in messages:
        head = tok.tok(f"<|im_start|>{m['role']}\n", add_special_tokens=False)["input_ids"]
        body = tok.tok(f"{m['content']}<|im_end|>\n", add_special_tokens=False)["input_ids"]
        ids += head + body
        mask += [False] * len(head) + [m["role"] == "assistant"] * len(body)
    return ids, mask


@pytest.mark.parametrize("spans", ["prefix", "generation"])
def test_chat_loss_only_on_assistant_turns_and_their_end_token(tmp_path, model_dirs, spans):
    """System and user turns and the assistant header are masked; each assistant turn's content
    and its ``<|im_end|>`` are targets, for both ways of finding the spans (prefix rendering;
    the template's ``{% generation %}`` marks).

    Mutations this fails on: the prefix before an assistant turn rendered without the generation
    prompt (``_render(tok, messages[:i], False)``: the ``<|im_start|>assistant\\n`` header becomes
    a target); the span cut at the end of the content (``len(before) + len(m["content"])``: the
    end-of-turn token loses its loss)."""
    tok, inputs, labels, data = _one_example_rows(tmp_path, model_dirs[spans], {"messages": CONVERSATION})
    assert data.report["chat_spans"] == spans
    ids, mask = _expected_chat(tok, CONVERSATION)
    n = len(ids) - 1
    assert inputs[:n] == ids[:-1]
    assert labels[:n] == [t if m else IGNORE_INDEX for t, m in zip(ids[1:], mask[1:])]
    assert set(labels[n:]) == {IGNORE_INDEX}  # padding
    trained = tok.decode([t for t in labels if t != IGNORE_INDEX])
    assert trained == ("The capital of France is Paris.<|im_end|>\n"
                       "hello world, how are you today?<|im_end|>\n")


def test_prompt_completion_loss_on_completion_and_eos_only(tmp_path, model_dirs):
    """Mutation this fails on: the prompt's mask ``[True] * len(p)`` in ``encode_example``."""
    tok, inputs, labels, _ = _one_example_rows(
        tmp_path, model_dirs["prefix"], {"prompt": "What is the capital of France?",
                                         "completion": " Paris."})
    p = tok.encode("What is the capital of France?", bos=True, eos=False)
    c = tok.encode(" Paris.", bos=False, eos=True)
    assert inputs[:len(p) + len(c) - 1] == (p + c)[:-1]
    assert labels[:len(p) - 1] == [IGNORE_INDEX] * (len(p) - 1)
    assert labels[len(p) - 1:len(p) + len(c) - 1] == c
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == " Paris.<|im_end|>"


@pytest.mark.parametrize("inp", ["", "the cat"])
def test_instruction_loss_on_output_and_eos_only(tmp_path, model_dirs, inp):
    """Alpaca: the prompt template (with or without the input section) is masked."""
    tok, inputs, labels, _ = _one_example_rows(
        tmp_path, model_dirs["prefix"], {"instruction": "Where did it sit?", "input": inp,
                                         "output": "on the mat"})
    prompt = (ALPACA_PROMPT if inp else ALPACA_PROMPT_NO_INPUT).format(
        instruction="Where did it sit?", input=inp)
    p = tok.encode(prompt, bos=True, eos=False)
    assert tok.decode(inputs[:len(p)]) == prompt
    assert labels[:len(p) - 1] == [IGNORE_INDEX] * (len(p) - 1)
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == "on the mat<|im_end|>"


def test_text_every_token_after_the_first_is_a_target(tmp_path, model_dirs):
    tok, inputs, labels, _ = _one_example_rows(tmp_path, model_dirs["prefix"],
                                               {"text": "the cat sat on the mat."})
    ids = tok.encode("the cat sat on the mat.")
    assert inputs[:len(ids) - 1] == ids[:-1] and labels[:len(ids) - 1] == ids[1:]


def test_auto_picks_the_format_by_fields(tmp_path, model_dirs):
    for record, fmt in [({"messages": CONVERSATION, "text": "x"}, "chat"),
                        ({"prompt": "a", "completion": "b"}, "prompt_completion"),
                        ({"instruction": "a", "output": "b"}, "instruction"),
                        ({"text": "a b"}, "text")]:
        *_, data = _one_example_rows(tmp_path, model_dirs["prefix"], record)
        assert data.report["format"] == fmt


def test_chat_needs_a_chat_template(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    with pytest.raises(ValueError, match="chat template"):
        prepare_data(DataSpec(data=str(path), eval_data=str(path), cache=False), ByteTokenizer(),
                     tmp_path)


def test_tokenizer_auto_byte_path_and_vocab_check(tmp_path, model_dirs):
    """``auto`` takes the model dir's tokenizer, or bytes for a dir without one / a flavor; a
    model vocabulary smaller than the tokenizer's is refused with both numbers. Mutation this
    fails on: the old fixed check (``vocab_size < 258``), which lets a 300-row model through
    with a 320-token tokenizer."""
    tok, line = load_tokenizer("auto", str(model_dirs["prefix"]))
    assert len(tok) == 320 and "own" in line
    bare = make_model_dir(tmp_path / "bare", with_tokenizer=False)
    assert isinstance(load_tokenizer("auto", str(bare))[0], ByteTokenizer)
    assert isinstance(load_tokenizer("auto", "llama-debug")[0], ByteTokenizer)
    assert isinstance(load_tokenizer("byte", str(model_dirs["prefix"]))[0], ByteTokenizer)
    assert len(load_tokenizer(str(model_dirs["generation"]), "llama-debug")[0]) == 320
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(str(bare), "llama-debug")
    check_vocab(320, tok)
    with pytest.raises(ValueError, match=r"vocab_size 300 is smaller than the tokenizer's 320"):
        check_vocab(300, tok)
