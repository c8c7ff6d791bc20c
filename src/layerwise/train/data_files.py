"""Records from local data files, each with the place it came from (``file:line`` or
``file row N``), and the ledger of bad input.

Read with the standard library and pyarrow rather than ``datasets.load_dataset``, which fails a
whole JSON file with no line number: a bad line must be reported with its place, or skipped and
counted."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

JSON_SUFFIXES = (".jsonl", ".json")
TEXT_SUFFIXES = (".txt", ".md", ".py")
PARQUET_SUFFIXES = (".parquet",)
SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES

MALFORMED = "malformed"
MISSING_FIELD = "missing field"
NO_TRAINABLE = "no trainable tokens"


@dataclass(frozen=True)
class Record:
    where: str
    """``file:line`` (JSON, text) or ``file row N`` (Parquet), for messages."""
    value: dict[str, Any] | None
    """The parsed object; None when it could not be read (``error`` says why)."""
    error: str | None = None


class BadExample(Exception):
    """One example that cannot be used: ``kind`` is one of MALFORMED, MISSING_FIELD,
    NO_TRAINABLE."""

    def __init__(self, kind: str, reason: str):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


@dataclass
class BadInputLedger:
    """Bad examples: an error naming the place (default), or with ``skip`` a counted skip."""

    skip: bool
    counts: Counter = field(default_factory=Counter)
    first: list[str] = field(default_factory=list)
    """The first few skipped examples, ``where: reason``."""

    def add(self, where: str, kind: str, reason: str) -> None:
        if not self.skip:
            raise ValueError(f"{where}: {reason}. Fix the example, or set data.skip_bad=true to "
                             "skip bad examples (they are counted and reported)")
        self.counts[kind] += 1
        if len(self.first) < 3:
            self.first.append(f"{where}: {reason}")

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict:
        return {"counts": dict(self.counts), "first": list(self.first)}


def data_files(path: str | Path) -> list[Path]:
    """The data files ``path`` names: itself, or every supported file under a directory."""
    p = Path(path)
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise ValueError(f"data file {p}: unsupported type {p.suffix!r}; expected one of "
                             f"{', '.join(SUFFIXES)}")
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        if not files:
            raise ValueError(f"no data files ({', '.join(SUFFIXES)}) under {p}")
        return files
    raise ValueError(f"data {str(path)!r} is neither a file nor a directory")


def files_digest(files: list[Path]) -> str:
    """A hash of the files' names and contents (the tokenization cache's key part)."""
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.resolve()).encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        h.update(b"\1")
    return h.hexdigest()


def read_records(files: list[Path]) -> Iterator[Record]:
    """Every record of ``files`` in order; unreadable ones come with ``error`` set."""
    for f in files:
        suffix = f.suffix.lower()
        if suffix in TEXT_SUFFIXES:
            yield _text_record(f)
        elif suffix in PARQUET_SUFFIXES:
            yield from _parquet_records(f)
        elif suffix == ".json":
            yield from _json_records(f)
        else:
            yield from _jsonl_records(f, f.read_bytes())


def _text_record(f: Path) -> Record:
    try:
        return Record(f"{f}:1", {"text": f.read_text(encoding="utf-8")})
    except UnicodeDecodeError as e:
        return Record(f"{f}:1", None, f"not UTF-8 text ({e.reason} at byte {e.start})")


def _jsonl_records(f: Path, data: bytes) -> Iterator[Record]:
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{f}:{n}"
        try:
            value = json.loads(raw)
        except UnicodeDecodeError as e:
            yield Record(where, None, f"not UTF-8 text ({e.reason})")
            continue
        except json.JSONDecodeError as e:
            yield Record(where, None, f"malformed JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(value, dict):
            yield Record(where, None, f"expected a JSON object, got {type(value).__name__}")
            continue
        yield Record(where, value)


def _json_records(f: Path) -> Iterator[Record]:
    """A JSON array of objects (each reported at the line it starts on), or JSON Lines."""
    data = f.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{f}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    start = len(text) - len(text.lstrip())
    if not text[start:start + 1] == "[":
        yield from _jsonl_records(f, data)  # JSON Lines (or one object) under a .json name
        return
    decoder = json.JSONDecoder()
    pos, index = start + 1, 0
    while True:
        pos = _skip_space(text, pos)
        if text[pos:pos + 1] == "]":
            break
        if index:
            if text[pos:pos + 1] != ",":
                raise ValueError(f"{f}:{_line(text, pos)}: malformed JSON array (expected ',' or "
                                 "']'); a broken JSON array cannot be skipped in part, fix the file")
            pos = _skip_space(text, pos + 1)
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}); a "
                             "broken JSON array cannot be skipped in part, fix the file") from None
        where = f"{f}:{_line(text, pos)}"
        if isinstance(value, dict):
            yield Record(where, value)
        else:
            yield Record(where, None, f"expected a JSON object, got {type(value).__name__}")
        pos, index = end, index + 1


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _parquet_records(f: Path) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq  # optional: only Parquet data needs it
    except ImportError:
        raise ValueError(f"{f}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(f)
    except Exception as e:  # noqa: BLE001  (pyarrow raises several unrelated types)
        raise ValueError(f"{f}: not a readable Parquet file ({e})") from None
    row = 0
    for batch in pf.iter_batches(batch_size=1024):
        for value in batch.to_pylist():
            row += 1
            yield Record(f"{f} row {row}", value)
