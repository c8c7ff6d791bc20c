"""The training data: the built-in corpus (the Python standard library's source, sorted, so runs
are reproducible on one machine) or local data files, split, packed and cached next to the run.
Nothing is downloaded."""

from __future__ import annotations

import logging
import hashlib
import json
import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine.batch import IGNORE_INDEX, Batch
from ..util.atomic import atomic_write
from ..util.safe_load import load_data_file
from .data_files import (NO_TRAINABLE, BadExample, BadInputLedger, data_files, files_digest,
                         read_records)
from .formats import check_format_name, check_tokenizer_for, detect_format, encode_example
from .packing import Example, Rows, eval_batches, pack_examples, row_batches, shift
from .tokenizer import ByteTokenizer, Tokenizer

_log = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 2
"""Version of ``out_dir/data_cache/<key>.pt`` (docs/formats.md)."""

__all__ = ["ByteTokenizer", "DataSpec", "TrainData", "batches", "corpus_tokens", "pack",
           "iter_stdlib_files", "prepare_data", "stdlib_files"]


_NOT_CORPUS = frozenset({"site-packages", "test", "tests"})


def iter_stdlib_files(root: str | Path | None = None) -> Iterator[Path]:
    """``stdlib_files`` lazily, in the same (sorted) order: the walk prunes the excluded
    directories and goes only as far as the reader reads, so a small corpus costs a few files,
    not a walk through all the interpreter's library holds. ``ValueError`` if there is none."""
    root = Path(root or sysconfig.get_paths()["stdlib"])

    def walk(d: Path) -> Iterator[Path]:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return
        for e in entries:
            if e.is_dir():  # follows links to directories, as ``rglob`` does
                if e.name not in _NOT_CORPUS:
                    yield from walk(d / e.name)
            elif e.name.endswith(".py") and e.is_file():
                yield d / e.name

    found = False
    if not _NOT_CORPUS.intersection(root.parts):
        for path in walk(root):
            found = True
            yield path
    if not found:
        raise ValueError(f"no .py files under {root}; pass a directory of text files instead")


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library (tests and site-packages excluded)."""
    return list(iter_stdlib_files(root))


def corpus_tokens(max_tokens: int, root: str | Path | None = None,
                  tokenizer: Tokenizer | None = None) -> torch.Tensor:
    """The first ``max_tokens`` tokens of the corpus, files joined with BOS/EOS."""
    tok = tokenizer or ByteTokenizer()
    out: list[int] = []
    for path in iter_stdlib_files(root):
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
    return row_batches(x, y, batch_size, seed=seed, start=start)


# ----- data files ------------------------------------------------------------------------------


@dataclass
class DataSpec:
    """What ``prepare_data`` reads; the loop fills it from ``TrainConfig``."""

    data: str | None = None
    data_format: str = "auto"
    eval_data: str | None = None
    eval_fraction: float = 0.05
    seq_len: int = 128
    pack: bool = True
    skip_bad: bool = False
    seed: int = 0
    cache: bool = True
    corpus: str | None = None
    corpus_tokens: int = 2_000_000


@dataclass
class TrainData:
    """Train and eval rows, ready for the engine, and what was done to get them."""

    train: Rows
    eval: Rows
    key: str
    """Identifies the data + tokenizer + settings (the cache key; kept in checkpoints)."""
    report: dict = field(default_factory=dict)
    """Counts for the start-of-training summary (examples, truncations, skips, packing)."""

    def batches(self, batch_size: int, seed: int, start: int = 0) -> Iterator[Batch]:
        """The endless, deterministic training stream from micro-batch ``start``."""
        return row_batches(self.train.input_ids, self.train.labels, batch_size, seed, start,
                           self.train.segment_ids)

    def eval_set(self, batch_size: int, num_batches: int, seed: int) -> list[Batch]:
        return eval_batches(self.eval.input_ids, self.eval.labels, batch_size, num_batches, seed,
                            self.eval.segment_ids)

    def summary(self) -> list[str]:
        """Lines for the log at the start of training."""
        r = self.report
        if r.get("source") == "corpus":
            return [f"data: built-in corpus ({r['files']}), {r['tokens']} tokens, "
                    f"{len(self.train)} train / {len(self.eval)} eval rows of {r['seq_len']}"]
        lines = [f"data: {r['train_examples']} train / {r['eval_examples']} eval examples, format "
                 f"{r['format']}{' (assistant spans: ' + r['chat_spans'] + ')' if r.get('chat_spans') else ''}"
                 f", from {r['files']} file(s) in {r['data']}"
                 + (f" + {r['eval_files']} eval file(s) in {r['eval_data']}" if r.get("eval_data") else "")]
        t = r["train_pack"]
        fill = t["positions"] / max(1, t["rows"] * r["seq_len"])
        lines.append(
            f"data: {len(self.train)} train rows / {len(self.eval)} eval rows of {r['seq_len']} "
            f"({'packed' if r['pack'] else 'one example a row'}, {fill:.0%} filled), "
            f"{self.train.num_target_tokens} train target tokens; truncated {r['truncated']} "
            f"example(s) ({r['truncated_positions']} positions cut); "
            f"{t['split_examples']} long text(s) split across rows")
        bad = r["bad"]
        if bad["counts"]:
            kinds = ", ".join(f"{k} {n}" for k, n in sorted(bad["counts"].items()))
            lines.append(f"data: skipped {sum(bad['counts'].values())} bad example(s) "
                         f"(data.skip_bad=true): {kinds}; first: {' | '.join(bad['first'])}")
        lines.append(f"data: tokenization {r['cache']}")
        return lines


def prepare_data(spec: DataSpec, tok: Tokenizer, out_dir: Path) -> TrainData:
    """The run's data: the built-in corpus without ``spec.data``, else the data files tokenized,
    split, packed, and cached under ``out_dir/data_cache`` (loaded from there when the files,
    tokenizer and settings are the same)."""
    if spec.data is None:
        if spec.eval_data is not None:
            raise ValueError("eval_data needs data=PATH (the built-in corpus holds out its last 5%)")
        return _corpus_data(spec, tok)
    check_format_name(spec.data_format)
    if spec.eval_data is None and not 0 < spec.eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1) without eval_data, got {spec.eval_fraction}")
    files = data_files(spec.data)
    eval_files = data_files(spec.eval_data) if spec.eval_data is not None else []
    key = _cache_key(spec, tok, files, eval_files)
    cache = out_dir / "data_cache" / f"{key}.pt"
    if spec.cache and cache.is_file():
        try:
            data = _load_cache(cache, key)
            data.report["cache"] = f"loaded from {cache}"
            return data
        except (OSError, RuntimeError, KeyError, ValueError) as e:
            _log.warning(f"data: cache {cache} unreadable ({e}); tokenizing again")
    data = _tokenize_files(spec, tok, files, eval_files, key)
    if spec.cache:
        _save_cache(cache, data)
        data.report["cache"] = f"cached in {cache}"
    else:
        data.report["cache"] = "not cached (data.cache=false)"
    return data


def _corpus_data(spec: DataSpec, tok: Tokenizer) -> TrainData:
    tokens = corpus_tokens(spec.corpus_tokens, spec.corpus, tok)
    split = int(tokens.numel() * 0.95)
    x, y = pack(tokens[:split], spec.seq_len)
    ex, ey = pack(tokens[split:], spec.seq_len)
    report = {"source": "corpus", "files": spec.corpus or "Python stdlib source",
              "tokens": tokens.numel(), "seq_len": spec.seq_len}
    key = hashlib.sha256(json.dumps([spec.corpus, spec.corpus_tokens, spec.seq_len,
                                     tok.fingerprint()]).encode()).hexdigest()[:20]
    return TrainData(Rows(x, y), Rows(ex, ey), key=f"corpus-{key}", report=report)


def _cache_key(spec: DataSpec, tok: Tokenizer, files: list[Path], eval_files: list[Path]) -> str:
    parts = {"version": CACHE_FORMAT_VERSION, "data": files_digest(files),
             "eval_data": files_digest(eval_files) if eval_files else None,
             "tokenizer": tok.fingerprint(), "format": spec.data_format, "seq_len": spec.seq_len,
             "pack": spec.pack, "eval_fraction": None if eval_files else spec.eval_fraction,
             "seed": spec.seed, "skip_bad": spec.skip_bad}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def _read_examples(files: list[Path], fmt: str, tok: Tokenizer, seq_len: int,
                   ledger: BadInputLedger, counts: dict) -> list[Example]:
    """Every usable example of ``files`` in order; bad ones go to the ledger."""
    out = []
    for rec in read_records(files):
        if rec.value is None:
            ledger.add(rec.where, "malformed", rec.error or "unreadable")
            continue
        try:
            t = encode_example(rec.value, fmt, tok)
            if not any(t.mask[1:]):
                raise BadExample(NO_TRAINABLE, "no token carries loss")
            ex, cut = shift(t.ids, t.mask, seq_len, t.splittable)
            if all(v == IGNORE_INDEX for v in ex.targets):
                raise BadExample(NO_TRAINABLE, f"no trainable tokens within seq_len={seq_len} "
                                 f"(the example has {len(t.ids)} tokens, its first target at "
                                 f"{t.mask.index(True, 1)}); raise seq_len or shorten the prompt")
        except BadExample as e:
            ledger.add(rec.where, e.kind, e.reason)
            continue
        counts["truncated"] += cut > 0
        counts["truncated_positions"] += cut
        out.append(ex)
    return out


def _first_format(files: list[Path]) -> str:
    """``auto``: the format of the first readable record."""
    for rec in read_records(files):
        if rec.value is not None:
            fmt = detect_format(rec.value)
            if fmt is None:
                raise ValueError(f"{rec.where}: data.format=auto found none of the known fields "
                                 "('messages'; 'prompt'+'completion'; 'instruction'+'output'; "
                                 f"'text') in {sorted(rec.value)}; set data_format or fix the data")
            return fmt
    raise ValueError(f"no readable record in {files[0] if len(files) == 1 else str(len(files)) + ' files'}")


def _tokenize_files(spec: DataSpec, tok: Tokenizer, files: list[Path], eval_files: list[Path],
                    key: str) -> TrainData:
    fmt = spec.data_format if spec.data_format != "auto" else _first_format(files)
    chat_spans = check_tokenizer_for(fmt, tok)
    ledger = BadInputLedger(skip=spec.skip_bad)
    counts = {"truncated": 0, "truncated_positions": 0}
    examples = _read_examples(files, fmt, tok, spec.seq_len, ledger, counts)
    if not examples:
        raise ValueError(f"no usable examples in {spec.data} (data.format={fmt}"
                         f"{', %d skipped as bad' % ledger.skipped if ledger.skipped else ''})")
    g = torch.Generator().manual_seed(spec.seed)
    order = torch.randperm(len(examples), generator=g).tolist()
    if eval_files:
        held = _read_examples(eval_files, fmt, tok, spec.seq_len, ledger, counts)
        if not held:
            raise ValueError(f"no usable examples in eval_data {spec.eval_data}")
        train = [examples[i] for i in order]
    else:
        n_eval = math.ceil(spec.eval_fraction * len(examples))
        if len(examples) - n_eval < 1:
            raise ValueError(f"{spec.data} has {len(examples)} usable example(s), too few to hold "
                             f"out data.eval_fraction={spec.eval_fraction}; add data or pass data.eval_path")
        held = [examples[i] for i in sorted(order[:n_eval])]
        train = [examples[i] for i in order[n_eval:]]
    pad_id = getattr(tok, "pad_id", 0)
    train_rows, train_stats = pack_examples(train, spec.seq_len, pad_id, spec.pack)
    eval_rows, eval_stats = pack_examples(held, spec.seq_len, pad_id, spec.pack)
    report = {"source": "files", "format": fmt, "chat_spans": chat_spans, "data": spec.data,
              "files": len(files), "eval_data": spec.eval_data, "eval_files": len(eval_files),
              "train_examples": len(train), "eval_examples": len(held), "seq_len": spec.seq_len,
              "pack": spec.pack, **counts, "bad": ledger.to_json(),
              "train_pack": train_stats.to_json(), "eval_pack": eval_stats.to_json()}
    return TrainData(train_rows, eval_rows, key, report)


def _save_cache(path: Path, data: TrainData) -> None:
    obj = {"format_version": CACHE_FORMAT_VERSION, "key": data.key,
           "report": json.dumps({k: v for k, v in data.report.items() if k != "cache"}),
           "train_input_ids": data.train.input_ids.to(torch.int32),
           "train_labels": data.train.labels.to(torch.int32),
           "eval_input_ids": data.eval.input_ids.to(torch.int32),
           "eval_labels": data.eval.labels.to(torch.int32),
           "train_segment_ids": data.train.segment_ids.to(torch.int32),
           "eval_segment_ids": data.eval.segment_ids.to(torch.int32)}
    atomic_write(path, lambda f: torch.save(obj, f))


def _load_cache(path: Path, key: str) -> TrainData:
    obj = load_data_file(path)
    if obj.get("format_version") != CACHE_FORMAT_VERSION or obj.get("key") != key:
        raise ValueError("written by another version or for other data")
    return TrainData(Rows(obj["train_input_ids"].long(), obj["train_labels"].long(),
                          obj["train_segment_ids"]),
                     Rows(obj["eval_input_ids"].long(), obj["eval_labels"].long(),
                          obj["eval_segment_ids"]),
                     key, json.loads(obj["report"]))
