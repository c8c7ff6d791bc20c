"""The chat templates of the newer families through ``data.format=chat``: Gemma's (no system
role), gpt-oss's harmony format (the last answer closed by ``<|return|>``, earlier ones by
``<|end|>``), and Qwen3's final-answer rewrite, which is refused naming both renderings. The
templates are the families' own rules, written out here (nothing is downloaded): Gemma's is
``google/gemma-2-9b-it``'s verbatim; gpt-oss's and Qwen3's keep the parts that decide the
spans."""

from __future__ import annotations

import json

import pytest

from layerwise.engine.batch import IGNORE_INDEX
from layerwise.train.data import DataSpec, prepare_data
from layerwise.train.tokenizer import load_tokenizer

from .tiny_hf import make_model_dir

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

GPT_OSS = (
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: ' + strftime_now('%Y-%m-%d') + '\n\nReasoning: "
    "medium\n\n# Valid channels: analysis, commentary, final.<|end|>' }}"
    "{%- if messages[0].role == 'system' %}{%- set developer_message = messages[0].content %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set developer_message = '' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{%- if developer_message %}{{- '<|start|>developer<|message|># Instructions\n\n' + "
    "developer_message + '<|end|>' }}{%- endif %}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if loop.last and not add_generation_prompt -%}"
    "{%- if message.thinking -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + "
    "message.thinking + '<|end|>' }}{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + "
    "'<|end|>' }}{%- endif -%}"
    "{%- elif message.role == 'user' -%}{{- '<|start|>user<|message|>' + message.content + "
    "'<|end|>' }}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")
GPT_OSS_SPECIALS = ("<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>")

QWEN3 = (
    "{% for message in messages %}{% if message.role == 'assistant' and loop.last %}"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n{{ message.content }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""Qwen3's rule for the answer after the last user turn: an empty think block before it."""

CONVERSATION = [
    {"role": "system", "content": "you are a helpful assistant"},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hello world, how are you today?"},
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        "gemma": make_model_dir(root / "gemma", GEMMA, specials=("<bos>", "<start_of_turn>",
                                                               "<end_of_turn>"), bos_token="<bos>"),
        "gpt-oss": make_model_dir(root / "gpt-oss", GPT_OSS, specials=GPT_OSS_SPECIALS),
        "qwen3": make_model_dir(root / "qwen3", QWEN3),
    }


def _rows(tmp_path, model_dir, messages):
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"messages": messages}) + "\n")
    tok, _ = load_tokenizer("auto", str(model_dir))
    data = prepare_data(DataSpec(data=str(path), eval_data=str(path), data_format="chat",
                                 seq_len=512, pack=False, cache=False), tok, tmp_path)
    inputs, labels = data.train.input_ids[0].tolist(), data.train.labels[0].tolist()
    return tok, tok.decode([t for t in inputs if t != tok.tok.pad_token_id]), \
        tok.decode([t for t in labels if t != IGNORE_INDEX])


def test_gemma_without_a_system_role_takes_the_system_text_in_the_first_user_turn(tmp_path, model_dirs):
    """Mutation seen failing: the system message passed on to the template as it is (the
    template raises 'System role not supported')."""
    _, text, trained = _rows(tmp_path, model_dirs["gemma"], CONVERSATION)
    assert text.startswith("<bos><start_of_turn>user\nyou are a helpful assistant\n\n"
                           "What is the capital of France?<end_of_turn>\n<start_of_turn>model\n")
    assert trained == ("The capital of France is Paris.<end_of_turn>\n"
                       "hello world, how are you today?<end_of_turn>\n")


def test_gemma_refuses_a_system_message_it_cannot_fold(tmp_path, model_dirs):
    with pytest.raises(ValueError, match="System role not supported"):
        _rows(tmp_path, model_dirs["gemma"], [CONVERSATION[0], CONVERSATION[2]])


def test_gpt_oss_trains_each_answer_with_its_own_end_marker(tmp_path, model_dirs):
    """Earlier answers end in ``<|end|>``, the last in ``<|return|>``, each trained with its
    channel header; the system preamble, developer message and user turns are not. Mutation
    seen failing: the span taken to the end of turn ``i`` rendered alone (``_turn_end``
    returning ``len(upto)``: the first answer's span runs into the next user turn)."""
    _, text, trained = _rows(tmp_path, model_dirs["gpt-oss"], CONVERSATION)
    assert "<|start|>developer<|message|># Instructions\n\nyou are a helpful assistant<|end|>" in text
    assert trained == ("<|channel|>final<|message|>The capital of France is Paris.<|end|>"
                       "<|channel|>final<|message|>hello world, how are you today?<|return|>")


def test_gpt_oss_refuses_earlier_answers_whose_thinking_the_template_drops(tmp_path, model_dirs):
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["thinking"] = "Paris is the capital."
    with pytest.raises(ValueError, match="renders assistant turn 2 differently as the last message"):
        _rows(tmp_path, model_dirs["gpt-oss"], messages)


def test_qwen3_final_answer_rewrite_is_refused_naming_both_renderings(tmp_path, model_dirs):
    with pytest.raises(ValueError, match=r"turn 2 differently as the last message \('<think>"):
        _rows(tmp_path, model_dirs["qwen3"], CONVERSATION)
    _, _, trained = _rows(tmp_path, model_dirs["qwen3"], CONVERSATION[:3])  # one answer: exact
    assert trained == "<think>\n\n</think>\n\nThe capital of France is Paris.<|im_end|>\n"
