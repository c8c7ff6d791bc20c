"""The repository speaks of the product, not of how it was written: no file in it (tracked, or
new and not ignored; outside ``.git``, ``.venv*`` and caches) cites the development diary's
numbered milestones, the machines it ran on or their loan terms, and no file under ``src/`` or
``docs/`` cites an issue number (a commit message may). The docs stay small
enough to read: ``docs/`` at most 2,500 lines in all, ``docs/results.md`` (one row per claim)
at most 200.

The patterns are built from pieces so that this file does not match them itself.

Mutations seen failing: a comment ``# st`` + ``op 3 measured this`` (joined) added to ``src/layerwise/util/simd.py``
(the first test names the file and line); ``see issue 12`` added to ``docs/results.md`` (the
second); 400 lines appended to ``docs/results.md`` (the third); the machine-kinds file's name in
a new, not yet added ``benchmarks/gpu_check/NOTE.md`` (the first)."""

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


SKIPPED_PARTS = re.compile(r"^(\.venv.*|__pycache__|\.pytest_cache|\.mypy_cache|\.ruff_cache|.*\.egg-info)$")
"""Folders never read, ignored or not: virtual environments and caches."""


def _repository_text_files(root: Path = ROOT) -> dict[str, list[str]]:
    """Every file of the repository that reads as text (no NUL byte, UTF-8), by path: what
    ``git ls-files`` lists, tracked or new and not ignored (a file not yet committed counts)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=root, capture_output=True, check=True).stdout
    files = {}
    for name in filter(None, names.decode().split("\0")):
        path = root / name
        if any(SKIPPED_PARTS.match(part) for part in Path(name).parts):
            continue
        if not path.is_file() or path.is_symlink():  # deleted in the working tree; a link
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


def test_no_file_speaks_of_the_development_diary():
    files = _repository_text_files()
    assert len(files) > 100  # the walk found the repository
    hits = _hits(files, FORBIDDEN)
    assert not hits, "diary words in the repository:\n" + "\n".join(hits)


def test_the_walk_reads_new_files_and_skips_environments_and_caches(tmp_path):
    """A file not yet added is read (it would be tracked the moment it is); ignored files, a
    virtual environment (even a link one that ``.gitignore`` misses) and caches are not."""
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    for name in ("tracked.py", "new.md", "ignored.log", ".venv-x/lib.py", "a/__pycache__/m.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    (tmp_path / ".gitignore").write_text("*.log\n")
    (tmp_path / ".venv").symlink_to(tmp_path / ".venv-x")
    subprocess.run(["git", "add", "tracked.py"], cwd=tmp_path, check=True)
    assert sorted(_repository_text_files(tmp_path)) == [".gitignore", "new.md", "tracked.py"]


def test_no_issue_numbers_in_src_or_docs():
    files = {n: lines for n, lines in _repository_text_files().items() if n.startswith(("src/", "docs/"))}
    assert any(n.startswith("src/") for n in files) and any(n.startswith("docs/") for n in files)
    hits = _hits(files, [ISSUE])
    assert not hits, "issue numbers cited in src/ or docs/:\n" + "\n".join(hits)


def test_the_docs_stay_readable_in_size():
    docs = {p.name: len(p.read_bytes().splitlines()) for p in (ROOT / "docs").rglob("*") if p.is_file()}
    assert "results.md" in docs
    assert docs["results.md"] <= RESULTS_MAX_LINES, docs
    assert sum(docs.values()) <= DOCS_MAX_LINES, docs
