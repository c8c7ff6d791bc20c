"""The repository speaks of the product, not of how it was written: no tracked file cites the
development diary's numbered milestones, the machines it ran on or their loan terms, and no file
under ``src/`` or ``docs/`` cites an issue number (a commit message may). The docs stay small
enough to read: ``docs/`` at most 2,500 lines in all, ``docs/results.md`` (one row per claim)
at most 200.

The patterns are built from pieces so that this file does not match them itself.

Mutations seen failing: a comment ``# st`` + ``op 3 measured this`` (joined) added to ``src/layerwise/util/simd.py``
(the first test names the file and line); ``see issue 12`` added to ``docs/results.md`` (the
second); 400 lines appended to ``docs/results.md`` (the third)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_S, _N = "st" + "op", r"[0-9]+"
FORBIDDEN = [
    re.compile(r"(?i)\b" + _S + " " + _N + r"\b"),
    re.compile(r"\b" + "le" + "ase" + r"\b"),
    re.compile("KIN" + r"DS\.md"),
    re.compile("dev" + "ice " + "call"),
    re.compile(r"\b" + "sand" + "box" + r"\b"),
]
"""Words of the development diary: its numbered milestones, the loaned machines and their terms."""

ISSUE = re.compile(r"(?i)\b" + "iss" + "ue" + r" #?" + _N + r"\b")
"""An issue cited by number (only ``src/`` and ``docs/`` are held to it)."""

DOCS_MAX_LINES = 2500
RESULTS_MAX_LINES = 200


def _tracked_text_files() -> dict[str, list[str]]:
    """Every file ``git ls-files`` lists that reads as text (no NUL byte, UTF-8), by path."""
    names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = {}
    for name in filter(None, names.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            files[name] = data.decode("utf-8").splitlines()
        except UnicodeDecodeError:
            continue
    return files


def _hits(files: dict[str, list[str]], patterns: list[re.Pattern]) -> list[str]:
    return [f"{name}:{i}: {line.strip()[:120]}" for name, lines in files.items()
            for i, line in enumerate(lines, 1) if any(p.search(line) for p in patterns)]


def test_no_tracked_file_speaks_of_the_development_diary():
    files = _tracked_text_files()
    assert len(files) > 100  # the walk found the repository
    hits = _hits(files, FORBIDDEN)
    assert not hits, "diary words in tracked files:\n" + "\n".join(hits)


def test_no_issue_numbers_in_src_or_docs():
    files = {n: lines for n, lines in _tracked_text_files().items() if n.startswith(("src/", "docs/"))}
    assert any(n.startswith("src/") for n in files) and any(n.startswith("docs/") for n in files)
    hits = _hits(files, [ISSUE])
    assert not hits, "issue numbers cited in src/ or docs/:\n" + "\n".join(hits)


def test_the_docs_stay_readable_in_size():
    docs = {p.name: len(p.read_bytes().splitlines()) for p in (ROOT / "docs").rglob("*") if p.is_file()}
    assert "results.md" in docs
    assert docs["results.md"] <= RESULTS_MAX_LINES, docs
    assert sum(docs.values()) <= DOCS_MAX_LINES, docs
