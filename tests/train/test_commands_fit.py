"""Commands that fit together: each friction point a user met in
the commands between a run and its checkpoints, reproduced and now passing. One tiny fine-tune
(a tiny Llama with its own BPE tokenizer, chat template and generation config; 48 chat examples)
is trained to step 4 and resumed to step 6; the tests read it."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import statistics
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from layerwise.cli import main
from layerwise.train.report import _evals, _plot_loss, load_run

from .test_finetune import _chat_file
from .tiny_hf import make_model_dir

GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "max_new_tokens": 77,
              "eos_token_id": 2, "pad_token_id": 0}
"""A generation config no model config would derive (its own sampling settings)."""

RUN = ["seq_len=64", "micro_batch_size=2", "ckpt.every=2", "ckpt.policy=full", "eval.every=2",
       "eval.batches=1", "log.every=1", "log.progress=lines", "log.track_every=0",
       "optimizer.lr=1e-3"]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A fine-tune trained to step 4, then resumed to step 6 (``layerwise train out_dir=OUT``)."""
    root = tmp_path_factory.mktemp("fit")
    model = make_model_dir(root / "model")
    (model / "generation_config.json").write_text(json.dumps(GENERATION))
    data = _chat_file(root / "chat.jsonl", n=48)
    out = root / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    printed = io.StringIO()
    try:
        t0 = time.perf_counter()
        with contextlib.redirect_stdout(printed):
            assert main(["train", f"model={model}", f"data={data}", f"out_dir={out}", "steps=4",
                         *RUN]) == 0
        first_s = time.perf_counter() - t0
        info_first = json.loads((out / "run.json").read_text())
        assert main(["train", f"out_dir={out}", "steps=6"]) == 0
    finally:
        torch.set_num_threads(threads)
    return {"out": out, "model": model, "first_s": first_s, "info_first": info_first,
            "printed": printed.getvalue()}


def _json(capsys, argv: list[str]) -> tuple[int, dict]:
    capsys.readouterr()
    code = main([*argv, "--json"])
    printed = capsys.readouterr().out
    return code, json.loads(printed) if printed.strip() else {}


def test_every_ckpt_command_takes_the_out_dir_as_well_as_its_ckpt(run, capsys, tmp_path):
    """Friction: ``ckpt ls/show/verify`` and ``merge`` wanted ``OUT/ckpt`` while ``report``
    wanted ``OUT``. Now each takes either and answers the same.

    Mutation seen failing: ``run_format.locate_run`` returning its argument unchanged
    (``ckpt ls OUT`` exits 2: "not a layerwise checkpoint run")."""
    out = run["out"]
    for argv in (["ckpt", "ls"], ["ckpt", "show"], ["ckpt", "show", "--step", "4"],
                 ["ckpt", "verify"]):
        code_out, by_out = _json(capsys, [*argv[:2], str(out), *argv[2:]])
        code_ckpt, by_ckpt = _json(capsys, [*argv[:2], str(out / "ckpt"), *argv[2:]])
        assert code_out == code_ckpt == 0, argv
        assert by_out == by_ckpt, argv
    assert [s["step"] for s in _json(capsys, ["ckpt", "ls", str(out)])[1]["steps"]] == [2, 4, 6]
    gc_copy = tmp_path / "gc"
    shutil.copytree(out, gc_copy)
    assert _json(capsys, ["ckpt", "gc", str(gc_copy), "--keep", "2"])[1]["kept_steps"] == [4, 6]
    for src in (out, out / "ckpt"):
        dest = tmp_path / f"merged-{src.name}"
        code, summary = _json(capsys, ["ckpt", "merge", str(src), "--step", "4", "--out", str(dest)])
        assert code == 0 and summary["step"] == 4
    a = load_file(tmp_path / "merged-run" / "model.safetensors")
    b = load_file(tmp_path / "merged-ckpt" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_report_takes_the_ckpt_dir_too_and_writes_into_the_out_dir(run, capsys):
    """``layerwise report OUT/ckpt`` reports the whole run (its metrics, not only the
    checkpoint panels) and writes ``OUT/report.png``, as ``report OUT`` does."""
    out = run["out"]
    capsys.readouterr()
    assert main(["report", str(out / "ckpt")]) == 0
    text = capsys.readouterr().out
    assert f"wrote {out / 'report.png'}" in text and "steps: 6 of 6" in text
    assert not (out / "ckpt" / "report.png").exists()


def test_a_merge_writes_the_runs_tokenizer_and_generation_config(run, tmp_path, capsys):
    """Friction: a merged directory had no tokenizer (``AutoTokenizer.from_pretrained(merged)``
    failed) and a generation config derived from the model config, not the model's own. Now the
    run keeps both in ``OUT/tokenizer`` and every merge copies them beside the weights; a
    Checkpointer run (no tokenizer of its own) gets them with ``--tokenizer DIR``.

    Mutation seen failing: ``copy_model_files`` not called in ``merge`` (``AutoTokenizer``
    raises on the merged directory)."""
    out, model = run["out"], run["model"]
    merged = tmp_path / "merged"
    capsys.readouterr()
    assert main(["ckpt", "merge", str(out), "--out", str(merged)]) == 0
    assert f"tokenizer and generation config <- {out / 'tokenizer'}" in capsys.readouterr().out
    want = AutoTokenizer.from_pretrained(model, local_files_only=True)
    got = AutoTokenizer.from_pretrained(merged, local_files_only=True)
    text = "hello world, how are you today?"
    assert got(text)["input_ids"] == want(text)["input_ids"]
    assert got.chat_template == want.chat_template and got.eos_token == want.eos_token
    gen = json.loads((merged / "generation_config.json").read_text())
    assert {k: gen[k] for k in GENERATION} == GENERATION
    # the same checkpoint dir without its out_dir around it: nothing to copy, unless asked
    bare = tmp_path / "bare"
    shutil.copytree(out / "ckpt", bare)
    code, summary = _json(capsys, ["ckpt", "merge", str(bare), "--out", str(tmp_path / "m2")])
    assert code == 0 and summary["tokenizer_from"] is None
    assert not (tmp_path / "m2" / "tokenizer.json").exists()
    code, summary = _json(capsys, ["ckpt", "merge", str(bare), "--out", str(tmp_path / "m3"),
                                   "--tokenizer", str(model)])
    assert code == 0 and summary["tokenizer_from"] == str(model)
    assert AutoTokenizer.from_pretrained(tmp_path / "m3")(text)["input_ids"] == want(text)["input_ids"]
    assert main(["ckpt", "merge", str(bare), "--out", str(tmp_path / "m4"),
                 "--tokenizer", str(tmp_path)]) == 2  # a directory with neither is refused


def test_report_draws_a_resumed_runs_evals_once(run):
    """Friction: after a resume the report drew the start eval (step 0's) again at the step
    the run resumed from: a fake spike in the eval curve. Now every eval is drawn once, at the
    step it was measured: 0, 2, 4 (first invocation), 6 (the resumed one).

    Mutation seen failing: ``_evals`` keying the start eval by ``resumed_from_step`` (where
    the report drew it before): the curve loses its step-0 point."""
    out = run["out"]
    data = load_run(out)
    assert data.info["resumed_from_step"] == 4 and data.info["eval_loss_start_step"] == 0
    rows = {r["step"]: r["eval_loss"] for r in data.metrics if r.get("eval_loss") is not None}
    assert sorted(rows) == [2, 4, 6]
    evals = _evals(data)
    assert evals == [(0, run["info_first"]["eval_loss_start"])] + sorted(rows.items())
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    _plot_loss(ax, data)
    line = next(ln for ln in ax.lines if ln.get_label() == "eval loss")
    steps, losses = line.get_xdata(), line.get_ydata()
    plt.close(fig)
    assert list(steps) == [0, 2, 4, 6]
    assert all(b < a for a, b in zip(losses, losses[1:]))  # no spike: the evals fall


def test_the_end_of_run_tokens_per_s_is_the_per_step_figure_and_says_so(run, capsys):
    """Friction: the end-of-run tokens/s (1,714) disagreed with the per-step figures (8-14k):
    it counted target tokens only (the assistant turns of a chat fine-tune: a small share of
    the rows) over the wall time (evals, checkpoints and the first step's warm-up too), while
    each step counts every token of its rows over the engine's step time. Now the run's figure
    is the median of the steps' own, and the wall-time one counts the same tokens; the last
    line says which is which.

    Mutation seen failing: ``tokens_seen`` summing the target tokens (``stats.tokens``) again:
    the wall time those imply exceeds the time the whole first invocation took."""
    info = run["info_first"]
    rows = [json.loads(x) for x in (run["out"] / "metrics.jsonl").read_text().splitlines()]
    first = [r for r in rows if r["step"] <= 4]
    assert info["tokens_per_s"] == pytest.approx(statistics.median(r["tokens_per_s"] for r in first[1:]))
    assert sum(r["target_tokens"] for r in first) < 0.5 * sum(r["tokens"] for r in first)
    implied_wall_s = sum(r["tokens"] for r in first) / info["tokens_per_s_wall"]
    assert sum(r["step_s"] for r in first) <= implied_wall_s <= run["first_s"]
    done = next(x for x in run["printed"].splitlines() if x.startswith("done: "))
    assert (f"{info['tokens_per_s']:,.0f} tokens/s a step (median of the steps' tokens / engine "
            "step time, as in the progress line)") in done
    assert f"{info['tokens_per_s_wall']:,.0f} tokens/s over the wall time (evals and checkpoints included)" in done


def test_the_filter_default_writes_what_moved_and_the_composite_staleness_is_bounded(
        run, tmp_path, capsys):
    """Friction: the ``filter`` policy's default threshold (1e-3) wrote 7 of 7 groups on every
    save of a fine-tune, and a composite "step N" held groups many steps older than N (the norm
    55 steps) without the README saying so. Now the default (0.01, measured by
    ``benchmarks/filter_threshold.py``) leaves the groups that moved less than 1% since their
    saved version for a later save, ``ckpt.max_staleness`` (4 saves by default) bounds how old
    a composite's groups get, ``ckpt show`` lists each group's age, and the README says both,
    with the numbers of the defaults.

    The same fine-tune (LR 1e-4, a save every 10 steps, ``ckpt.policy=filter``: asked for by
    name, the default is ``full``) under the old threshold writes all
    groups or all but the norm at every save; under the default, some save writes at most half.
    Mutation seen failing: ``FilterPolicy.threshold`` back to 1e-3 (every save writes >= 6)."""
    from layerwise.ckpt import RunDir
    from layerwise.ckpt.policies import FilterPolicy
    from layerwise.train.config import CheckpointConfig

    model, data = run["model"], run["model"].parent / "chat.jsonl"
    common = [f"model={model}", f"data={data}", "steps=40", "seq_len=64", "micro_batch_size=2",
              "ckpt.every=10", "eval.every=0", "eval.batches=1", "log.progress=lines",
              "log.track_every=0", "optimizer.lr=1e-4", "export=false"]
    written = {}
    for name, extra in (("old", ["ckpt.policy=filter", "ckpt.threshold=1e-3",
                                 "ckpt.max_staleness=none"]),
                        ("default", ["ckpt.policy=filter"])):
        assert main(["train", f"out_dir={tmp_path / name}", *common, *extra]) == 0
        store = RunDir.open(tmp_path / name)
        written[name] = [len(store.read_manifest(s)["groups_written"])
                         for s in store.committed_steps()]
    groups = 7  # embed, layers.0-3, norm, lm_head
    assert written["old"][0] == written["default"][0] == groups  # the first save: all are new
    assert all(w >= groups - 1 for w in written["old"][1:]), written
    assert min(written["default"][1:]) <= groups // 2, written
    bound = CheckpointConfig().max_staleness * 10
    code, shown = _json(capsys, ["ckpt", "show", str(tmp_path / "default")])
    assert code == 0 and max(g["staleness_steps"] for g in shown["groups"]) <= bound
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    every = CheckpointConfig().every
    staleness = CheckpointConfig().max_staleness
    assert f"(`ckpt.policy={CheckpointConfig().policy}`)" in readme  # the README names the default
    assert f"moved more than {FilterPolicy().threshold:.0%}" in readme
    assert (f"at most `ckpt.max_staleness={staleness}` saves ({staleness * every} steps at "
            f"`ckpt.every={every}`) older than N") in readme
