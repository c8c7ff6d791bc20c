"""Built-in corpus (the Python standard library's own source), a byte tokenizer, packing.

Nothing is downloaded: the text is whatever ``.py`` files this interpreter ships, read in a
fixed (sorted) order so that runs are reproducible on one machine.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch

from ..engine.batch import Batch



class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus BOS/EOS. Vocabulary 258 (models may be larger)."""

    bos_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library (tests and site-packages excluded)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    ]
    if not files:
        raise ValueError(f"no .py files under {root}; pass a directory of text files instead")
    return sorted(files)


def corpus_tokens(max_tokens: int, root: str | Path | None = None,
                  tokenizer: ByteTokenizer | None = None) -> torch.Tensor:
    """The first ``max_tokens`` tokens of the corpus, files joined with BOS/EOS."""
    tok = tokenizer or ByteTokenizer()
    out: list[int] = []
    for path in stdlib_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.extend(tok.encode(text))
        if len(out) >= max_tokens:
            break
    return torch.tensor(out[:max_tokens], dtype=torch.long)


def pack(tokens: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut a token stream into ``[n, seq_len]`` inputs and next-token labels."""
    n = (tokens.numel() - 1) // seq_len
    if n < 1:
        raise ValueError(f"corpus has {tokens.numel()} tokens, fewer than one sequence of {seq_len}")
    x = tokens[: n * seq_len].view(n, seq_len)
    y = tokens[1: n * seq_len + 1].view(n, seq_len)
    return x, y


def batches(tokens: torch.Tensor, seq_len: int, batch_size: int, seed: int = 0,
            start: int = 0) -> Iterator[Batch]:
    """Endless shuffled batches over packed sequences; ``start`` skips batches (resume)."""
    x, y = pack(tokens, seq_len)
    if x.shape[0] < batch_size:
        raise ValueError(
            f"corpus gives {x.shape[0]} sequences of {seq_len}, fewer than batch size {batch_size}"
        )
    per_epoch = x.shape[0] // batch_size
    index = start
    while True:
        epoch, pos = divmod(index, per_epoch)
        g = torch.Generator().manual_seed(seed + epoch)
        order = torch.randperm(x.shape[0], generator=g)
        sel = order[pos * batch_size:(pos + 1) * batch_size]
        yield Batch(x[sel].clone(), y[sel].clone())
        index += 1
