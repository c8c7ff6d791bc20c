"""A tiny Hugging Face model directory built on the spot: a byte-level BPE tokenizer trained
with ``tokenizers`` on a few strings, wrapped in ``PreTrainedTokenizerFast`` with a ChatML-style
chat template, saved with ``save_pretrained`` next to a tiny Llama made from a config. Nothing
is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from layerwise.models import get_flavor

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""ChatML without ``{% generation %}`` marks: assistant spans come from rendering prefixes."""

CHAT_TEMPLATE_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""The same rendering with ``{% generation %}`` marks around the assistant content + end."""

TRAIN_TEXT = [
    "hello world, how are you today? I am fine, thank you.",
    "the cat sat on the mat. the dog sat on the log.",
    "What is the capital of France? The capital of France is Paris.",
    "Below is an instruction that describes a task. Write a response. ### Instruction: ### Response:",
    "system user assistant you are a helpful assistant",
    "def add(a, b):\n    return a + b\n",
]


def make_tokenizer(chat_template: str = CHAT_TEMPLATE, vocab_size: int = 320,
                   specials: tuple[str, ...] = (), **special_roles: str) -> PreTrainedTokenizerFast:
    """``specials``: a family's own special tokens (more than ChatML's); ``special_roles``:
    e.g. ``bos_token="<bos>"``, which its template reads."""
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS + list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(TRAIN_TEXT * 4, trainer)
    roles = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **special_roles}
    return PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=chat_template, **roles)


def make_model_dir(path: Path, chat_template: str = CHAT_TEMPLATE, vocab_size: int | None = None,
                   with_tokenizer: bool = True, specials: tuple[str, ...] = (),
                   **special_roles: str) -> Path:
    """``path`` with a tiny Llama (``llama-debug`` shape) and, by default, the tokenizer."""
    tok = make_tokenizer(chat_template, specials=specials, **special_roles)
    torch.manual_seed(0)
    config = get_flavor("llama-debug").build_config(
        vocab_size=vocab_size or len(tok), eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    if with_tokenizer:
        tok.save_pretrained(path)
    return path
