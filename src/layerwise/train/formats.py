"""One record -> token ids and the tokens that carry loss, per data format.

| format              | fields                            | loss on                                  |
|---------------------|-----------------------------------|------------------------------------------|
| `text`              | `text` (or a plain text file)     | every token (split across rows if long)  |
| `chat`              | `messages` (OpenAI/HF chat shape) | assistant turns, their end-of-turn token |
| `prompt_completion` | `prompt`, `completion`            | the completion and EOS                   |
| `instruction`       | `instruction`, `input`?, `output` | the output and EOS (Alpaca prompt)       |

Chat masking: the template's own ``{% generation %}`` marks when it has them; else each
assistant span is the text between renderings of ``messages[:i]`` (with the generation prompt)
and ``messages[:i+1]``, which may differ from the whole only in how the turn is closed (gpt-oss's
``<|return|>`` vs ``<|end|>``). A template that rewrites the turn itself (Qwen3's empty
``<think>`` block) is refused. Tokenized once; a token is trained when its first character lies
in a span, so a merge at a boundary cannot shift the mask. A template without a system role gets
the system text folded into the first user turn, as Gemma 3's does."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .data_files import MALFORMED, MISSING_FIELD, NO_TRAINABLE, BadExample
from .tokenizer import HFTokenizer, Tokenizer

FORMATS = ("text", "chat", "prompt_completion", "instruction")
FIELDS = {"chat": ("messages",), "prompt_completion": ("prompt", "completion"),
          "instruction": ("instruction", "output"), "text": ("text",)}

ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides "
                 "further context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that "
                          "appropriately completes the request.\n\n"
                          "### Instruction:\n{instruction}\n\n### Response:\n")

_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


@dataclass
class Tokenized:
    ids: list[int]
    mask: list[bool]
    """``mask[i]``: token ``i`` is a target (its prediction from the tokens before carries loss)."""
    splittable: bool
    """A long example may be split across rows (text) instead of truncated (supervised)."""


def check_format_name(name: str) -> None:
    if name != "auto" and name not in FORMATS:
        raise ValueError(f"data_format {name!r} is not auto, {', '.join(FORMATS)}")


def detect_format(value: dict[str, Any]) -> str | None:
    """The format whose fields ``value`` has (chat first), or None."""
    for fmt in ("chat", "prompt_completion", "instruction", "text"):
        if all(k in value for k in FIELDS[fmt]):
            return fmt
    return None


def check_tokenizer_for(fmt: str, tok: Tokenizer) -> str | None:
    """Refuse a tokenizer that cannot serve ``fmt``; return how chat spans are found."""
    if fmt != "chat":
        if isinstance(tok, HFTokenizer):
            tok.require_eos()  # every example ends with it
        return None
    if not isinstance(tok, HFTokenizer) or not tok.chat_template:
        raise ValueError(f"data.format=chat needs a tokenizer with a chat template; {tok.name} has "
                         "none (use the model directory's own tokenizer, or model.tokenizer=PATH to one "
                         "with a chat template)")
    if not getattr(tok.tok, "is_fast", False):
        raise ValueError(f"data.format=chat needs a fast tokenizer (tokenizer.json) to map the "
                         f"assistant turns to tokens; {tok.name} is a slow one")
    return "generation" if _GENERATION_TAG.search(tok.chat_template) else "prefix"


def encode_example(value: dict[str, Any], fmt: str, tok: Tokenizer) -> Tokenized:
    """Token ids and loss mask of one record; BadExample when it cannot be used."""
    missing = [k for k in FIELDS[fmt] if k not in value]
    if missing:
        raise BadExample(MISSING_FIELD, f"missing field {', '.join(map(repr, missing))} for "
                         f"data.format={fmt} (has {', '.join(map(repr, value)) or 'no fields'})")
    if fmt == "text":
        text = _string(value, "text")
        if not text.strip():
            raise BadExample(NO_TRAINABLE, "empty 'text'")
        ids = tok.encode(text, bos=True, eos=True)
        return Tokenized(ids, [True] * len(ids), splittable=True)
    if fmt == "chat":
        return _encode_chat(value["messages"], tok)
    if fmt == "prompt_completion":
        prompt, completion = _string(value, "prompt"), _string(value, "completion")
    else:
        inp = value.get("input") or ""
        if not isinstance(inp, str):
            raise BadExample(MISSING_FIELD, f"field 'input' must be a string, got {type(inp).__name__}")
        template = ALPACA_PROMPT if inp.strip() else ALPACA_PROMPT_NO_INPUT
        prompt = template.format(instruction=_string(value, "instruction"), input=inp)
        completion = _string(value, "output")
    p = tok.encode(prompt, bos=True, eos=False)
    c = tok.encode(completion, bos=False, eos=True)
    return Tokenized(p + c, [False] * len(p) + [True] * len(c), splittable=False)


def _string(value: dict[str, Any], key: str) -> str:
    v = value[key]
    if not isinstance(v, str):
        raise BadExample(MISSING_FIELD, f"field {key!r} must be a string, got {type(v).__name__}")
    return v


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise BadExample(MISSING_FIELD, "field 'messages' must be a non-empty list of "
                         "{'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or "content" not in m:
            raise BadExample(MISSING_FIELD, f"messages[{i}] must be an object with a string 'role' "
                             f"and a 'content', got {m!r:.80}")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadExample(NO_TRAINABLE, "no assistant turn in 'messages', nothing to train on")
    return messages


def _render(tok: HFTokenizer, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tok.tok.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=generation_prompt)
    except Exception as e:  # noqa: BLE001  (jinja's errors, incl. the template's raise_exception)
        raise BadExample(MALFORMED, f"the chat template rejected the messages: {e}") from None


def _render_empty_prompt(tok: HFTokenizer) -> str:
    """The generation prompt alone (a conversation that opens with an assistant turn); ""
    for a template that cannot render no messages."""
    try:
        return _render(tok, [], True)
    except BadExample:
        return ""


def _fit_system_turn(tok: HFTokenizer, messages: list[dict]) -> tuple[list[dict], str]:
    """(messages, their whole rendering), a leading system message folded into the first user
    turn when the template rejects it (a template without a system role)."""
    try:
        return messages, _render(tok, messages, False)
    except BadExample as refused:
        if (len(messages) < 2 or messages[0]["role"] != "system" or messages[1]["role"] != "user"
                or not all(isinstance(m["content"], str) for m in messages[:2])):
            raise
        merged = [{**messages[1], "content": f"{messages[0]['content']}\n\n{messages[1]['content']}"},
                  *messages[2:]]
        try:
            return merged, _render(tok, merged, False)
        except BadExample:
            raise refused from None


def _turn_end(full: str, upto: str, before: str, message: dict, i: int) -> int:
    """Where assistant turn ``i`` (rendered alone: ``upto``) ends in the whole rendering: the end
    of ``upto`` when it is a prefix, else where the two part, provided the turn's content lies
    before that (only its closing differs)."""
    if full.startswith(upto):
        return len(upto)
    end = len(before)
    limit = min(len(full), len(upto))
    while end < limit and full[end] == upto[end]:
        end += 1
    content = message["content"].strip() if isinstance(message["content"], str) else None
    if content and content in full[len(before):end]:
        return end
    raise BadExample(MALFORMED, f"the chat template renders assistant turn {i} differently as the "
                     f"last message ({upto[len(before):][:60]!r}) and inside the conversation "
                     f"({full[len(before):][:60]!r}), so what the model generated cannot be "
                     "located; give the template {% generation %} marks or end the examples at "
                     "this turn")


def _encode_chat(messages: Any, tok: Tokenizer) -> Tokenized:
    assert isinstance(tok, HFTokenizer)  # check_tokenizer_for ran first
    messages = _check_messages(messages)
    messages, full = _fit_system_turn(tok, messages)
    if _GENERATION_TAG.search(tok.chat_template or ""):
        try:
            out = tok.tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              return_assistant_tokens_mask=True)
        except Exception as e:  # noqa: BLE001
            raise BadExample(MALFORMED, f"the chat template rejected the messages: {e}") from None
        return Tokenized(list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]],
                         splittable=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tok, messages[:i], True) if i else _render_empty_prompt(tok)
        upto = _render(tok, messages[:i + 1], False)
        if not (upto.startswith(before) and full.startswith(before)):
            raise BadExample(MALFORMED, f"the chat template renders the conversation before turn {i} "
                             "differently from the start of the whole conversation, so the "
                             "assistant turn cannot be located; give the template {% generation %} "
                             "marks")
        spans.append((len(before), _turn_end(full, upto, before, m, i)))
    enc = tok.tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(a <= start < b for a, b in spans) for start, _end in enc["offset_mapping"]]
    return Tokenized(list(enc["input_ids"]), mask, splittable=False)
