"""Every command and snippet of README.md, run, so that the README cannot drift from the code.

The README's fenced blocks are read in order: ``sh`` lines are commands, ``python`` blocks are
snippets, a ``yaml`` block whose first line is ``# NAME.yaml...`` is a file the commands use.
They run in one scratch directory, in README order (later commands read what earlier ones
wrote: ``runs/ft``), with tiny sizes in place of the large ones (``SUBSTITUTIONS``: a tiny Llama
with its own tokenizer for ``/path/to/hf_model``, a few steps, short sequences, a batch of 4 for
the planner's, the CPU for CUDA), ``steps=2`` for a ``layerwise train`` that names no length and
``TINY_TRAIN`` appended to every ``layerwise train``. What cannot run here is checked as far
as it can be: ``make demo`` / ``make test`` as targets of the Makefile (``make -n``: they would
set up a venv and run this suite), ``layerwise calibrate`` parsed by the command's own parser
(it measures the machine for minutes), ``torchrun ... train ...`` as torchrun present and its
``train`` run in one process.

Mutations seen failing: the README's ``optimizer.lr=2e-5`` written ``optimizer.learning_rate=2e-5``
(``layerwise train`` refuses the key, exit 2); ``ckpt show runs/ft --step 200`` written
``--steps 200`` (argparse refuses it); the Checkpointer snippet without ``import torch``.
"""

from __future__ import annotations

import glob
import importlib.util
import re
import shlex
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from layerwise.cli import build_parser, main

from .train.test_finetune import _chat_file
from .train.tiny_hf import make_model_dir

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

SUBSTITUTIONS = [
    (r"/path/to/hf_model", "{model}"),
    (r"device=cuda", "device=cpu"),
    (r"steps=500\b", "steps=4"), (r"steps=600\b", "steps=6"),
    (r"seq_len=\d+", "seq_len=64"), (r"--seq-len \d+", "--seq-len 64"),
    (r"--step 200\b", "--step 2"), (r"@200\b", "@2"),
    (r"--model qwen2\.5-\d+b", "--model {model}"),
    (r"--out plan\.json", "--batch 4 --out plan.json"),  # not the 1,024 rows an H200 would take
    (r"layer_range: \[0, 16\]", "layer_range: [0, 2]"),
    (r"layer_range: \[16, 32\]", "layer_range: [2, 4]"),
    (r'device="cuda"', 'device="cpu"'), (r"torch\.bfloat16", "torch.float32"),
]
"""README text -> what runs here: the tiny model (4 layers, as ``layer_range`` assumes 32)."""

TINY_TRAIN = ["micro_batch_size=2", "grad_accum=1", "eval.batches=1", "eval.every=0",
              "ckpt.every=2", "log.progress=lines", "log.every=100", "plan_time_limit_s=1"]
"""Appended to every ``layerwise train`` (later keys win): a step of 2 rows, a save every 2."""


def readme_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced block, in order."""
    return [(m.group(1), textwrap.dedent(m.group(2))) for m in
            re.finditer(r"^ *```(\w*)\n(.*?)^ *```", text, flags=re.S | re.M)]


def commands_of(body: str) -> list[str]:
    """The commands of an ``sh`` block: one a line, comments dropped."""
    lines = [line.split(" #")[0].strip() for line in body.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def substitute(text: str, model: Path) -> str:
    for pattern, repl in SUBSTITUTIONS:
        text = re.sub(pattern, repl.format(model=model), text)
    return text


def _argv(words: list[str]) -> list[str]:
    out: list[str] = []
    for w in words:
        out += sorted(glob.glob(w)) or [w] if "*" in w else [w]
    return out


def run_command(line: str) -> tuple[str, int]:
    """Run one README command here; (what was run, exit code)."""
    words = shlex.split(line)
    if words[0] == "make":
        proc = subprocess.run(["make", "-n", "-C", str(ROOT), *words[1:]], capture_output=True,
                              text=True, timeout=60)
        return f"make -n {' '.join(words[1:])}", proc.returncode
    if words[0] == "torchrun":
        assert importlib.util.find_spec("torch.distributed.run") is not None
        words = ["layerwise", *words[words.index("train"):]]
    assert words[0] == "layerwise", f"a README command this test does not know: {line}"
    argv = _argv(words[1:])
    if argv[0] == "calibrate":
        build_parser("calibrate").parse_args(argv)
        return "parsed: " + " ".join(argv), 0
    if argv[0] == "train":
        if not any(a.startswith(("steps=", "num_train_epochs=")) for a in argv) \
                and "--print-config" not in argv:
            argv.append("steps=2")  # the default (60 steps) is a real run's length, not a test's
        argv += TINY_TRAIN
    return " ".join(argv), main(argv)


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """The scratch directory the README runs in, with the tiny model and a chat file."""
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = make_model_dir(tmp_path / "hf_model")
    _chat_file(tmp_path / "chat.jsonl", n=200)
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    yield tmp_path, model
    torch.set_num_threads(threads)


def test_every_readme_command_and_snippet_runs(scratch, capsys):
    """README order, tiny sizes (module docstring); each command exits 0, each snippet runs."""
    tmp_path, model = scratch
    ran: list[str] = []
    blocks = [(lang, substitute(body, model)) for lang, body in readme_blocks(README.read_text())]
    for lang, body in blocks:  # the files first: a recipe is shown after the command that reads it
        if lang == "yaml" and re.match(r"# [\w.-]+\.yaml", body):
            (tmp_path / body.split()[1].rstrip(":")).write_text(body)
    for lang, body in blocks:
        if lang == "sh":
            for line in commands_of(body):
                what, code = run_command(line)
                assert code == 0, f"README command failed ({code}): {line}\nran: {what}\n" \
                                  + capsys.readouterr().err[-2000:]
                ran.append(line)
        elif lang == "python":
            exec(compile(body, "README.md snippet", "exec"), {"__name__": "readme"})
            ran.append(body.splitlines()[0])
    made = {p.name for p in (tmp_path / "runs").iterdir()}
    assert {"ft", "ft-step200", "engine", "loop", "merged", "imported", "trainer"} <= made, made
    assert len(ran) >= 20


def test_every_example_config_loads(scratch, capsys):
    """Each ``examples/*.yaml`` is a valid ``layerwise train --config`` file (every key known,
    every value allowed) for its model, and names a real model of a family layerwise has."""
    from layerwise.models.families import FAMILIES

    tmp_path, _ = scratch
    files = sorted((ROOT / "examples").glob("*.yaml"))
    assert {f.name for f in files} >= {"llama-3.1-8b.yaml", "qwen2.5-14b.yaml"}
    for f in files:
        capsys.readouterr()
        assert main(["train", "--config", str(f), "--print-config"]) == 0, f
        printed = capsys.readouterr().out
        name = re.search(r"^  name: (\S+)", printed, flags=re.M).group(1)
        assert "/" in name and f"layerwise train --config examples/{f.name}" in f.read_text()
    families = {re.match(r"[a-z]+", f.name).group(0) for f in files}
    assert families == {"llama", "qwen", "mistral"} and {"llama", "mistral"} <= set(FAMILIES)
