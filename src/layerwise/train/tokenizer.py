"""Tokenizers for training: the model directory's own (Hugging Face, local files only, never
fetched from the hub) or the byte tokenizer of the built-in flavors, behind one small interface.
``train_bpe_tokenizer`` makes a tokenizer directory on the spot (``layerwise demo``)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ..interop.hf.tokenizer_files import TOKENIZER_FILES, has_tokenizer_files


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS/EOS. Vocabulary 258 (models may be larger)."""

    bos_id = 256
    eos_id = 257
    pad_id = 257
    vocab_size = 258
    chat_template = None
    name = "byte"

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        return "byte-v1"

    def save(self, directory: str | Path) -> bool:
        """The byte tokenizer has no Hugging Face form; nothing is written."""
        return False


class HFTokenizer:
    """A ``transformers`` tokenizer loaded from local files, with the calls the data path needs."""

    def __init__(self, tok: Any, source: Path):
        self.tok = tok
        self.source = source
        self.name = str(source)
        self.bos_id: int | None = tok.bos_token_id
        self.eos_id: int | None = tok.eos_token_id
        pad = tok.pad_token_id
        self.pad_id: int = pad if pad is not None else (self.eos_id if self.eos_id is not None else 0)
        self.chat_template: str | None = getattr(tok, "chat_template", None) or None

    def __len__(self) -> int:
        return len(self.tok)

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        """Token ids of ``text``: BOS first when the tokenizer has one and ``bos``, EOS last when
        ``eos`` (the tokenizer's own special-token rules are not applied otherwise)."""
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + list(ids) + ([self.require_eos()] if eos else [])

    def require_eos(self) -> int:
        if self.eos_id is None:
            raise ValueError(f"tokenizer {self.name} has no eos_token; supervised formats end "
                             "every trained answer with it")
        return self.eos_id

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def fingerprint(self) -> str:
        """A hash of the tokenizer files (so a cache built with another tokenizer is not used)."""
        h = hashlib.sha256(type(self.tok).__name__.encode())
        for name in TOKENIZER_FILES:
            path = self.source / name
            if path.is_file():
                h.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        h.update((self.chat_template or "").encode())
        return h.hexdigest()[:16]

    def save(self, directory: str | Path) -> bool:
        """Write the tokenizer (and its chat template) next to an exported model."""
        self.tok.save_pretrained(str(directory))
        return True


Tokenizer = ByteTokenizer | HFTokenizer


def load_hf_tokenizer(directory: str | Path) -> HFTokenizer:
    """``AutoTokenizer.from_pretrained(directory, local_files_only=True)``, never a hub call."""
    d = Path(directory)
    if not has_tokenizer_files(d):
        raise ValueError(f"tokenizer {str(directory)!r}: no tokenizer files "
                         f"({', '.join(TOKENIZER_FILES[:4])}) in that directory; use model.tokenizer=auto "
                         "with a model directory that has them, model.tokenizer=byte, or a directory "
                         "written by tokenizer.save_pretrained")
    try:
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"tokenizer {str(d)!r} could not be loaded from local files: {e}") from e
    return HFTokenizer(tok, d)


def load_tokenizer(spec: str, model: str) -> tuple[Tokenizer, str]:
    """The tokenizer ``spec`` names for ``model``, and a line saying which one was chosen."""
    if spec == "byte":
        return ByteTokenizer(), "tokenizer: byte (258 ids)"
    if spec == "auto":
        if has_tokenizer_files(model):
            tok = load_hf_tokenizer(model)
            return tok, f"tokenizer: the model directory's own ({type(tok.tok).__name__}, {len(tok)} ids)"
        if Path(model).is_dir():
            return ByteTokenizer(), (f"tokenizer: byte (258 ids); the model directory {model} has no "
                                     "tokenizer files (model.tokenizer=PATH to use one)")
        return ByteTokenizer(), "tokenizer: byte (258 ids), the built-in flavors' tokenizer"
    tok = load_hf_tokenizer(spec)
    return tok, f"tokenizer: {spec} ({type(tok.tok).__name__}, {len(tok)} ids)"


END_OF_TEXT = "<|endoftext|>"
"""The one special token of ``train_bpe_tokenizer``'s tokenizers (id 0): EOS and padding."""


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, directory: str | Path) -> HFTokenizer:
    """A byte-level BPE tokenizer learnt from ``texts``, saved to ``directory`` and loaded back, so
    it is exactly what ``model.tokenizer=DIRECTORY`` sees.

    Id 0 is ``<|endoftext|>`` (EOS and padding; no BOS), then the 256 bytes, then merges up to
    ``vocab_size``. Whitespace is kept as is (``clean_up_tokenization_spaces=False``), as code needs."""
    byte_level = tokenizers.pre_tokenizers.ByteLevel
    min_size = len(byte_level.alphabet()) + 1
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (the 256 bytes and {END_OF_TEXT}), "
                         f"got {vocab_size}")
    tk = tokenizers.Tokenizer(tokenizers.models.BPE())
    tk.pre_tokenizer = byte_level(add_prefix_space=False)
    tk.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                             initial_alphabet=byte_level.alphabet(),
                                             show_progress=False)
    tk.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=END_OF_TEXT, pad_token=END_OF_TEXT,
                                  clean_up_tokenization_spaces=False)
    Path(directory).mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(directory))
    return load_hf_tokenizer(directory)


def check_vocab(model_vocab_size: int, tokenizer: Tokenizer) -> None:
    """Refuse a model whose embedding table is smaller than the tokenizer's vocabulary."""
    if model_vocab_size < len(tokenizer):
        raise ValueError(f"model vocab_size {model_vocab_size} is smaller than the tokenizer's "
                         f"{len(tokenizer)} tokens ({tokenizer.name}); use the model's own "
                         "tokenizer (model.tokenizer=auto or model.tokenizer=PATH) or a model with a larger "
                         "vocabulary")
