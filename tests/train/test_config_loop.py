"""Config loading/overrides and a short end-to-end training run."""

import json
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import multiproc
from layerwise import config
from layerwise.ckpt import RunDir, open_run_step
from layerwise.cli import main
from layerwise.models import get_flavor
from layerwise.train.loop import TrainConfig, _open_metrics, train
from layerwise.train.schedule import lr_at


def test_overrides_are_typed_and_nested():
    cfg = config.apply_overrides(TrainConfig(), ["steps=7", "optimizer.lr=0.01", "plan=every-3",
                                                 "optimizer.betas=[0.8, 0.9]"])
    assert cfg.steps == 7 and cfg.optimizer.lr == 0.01 and cfg.plan == "every-3"
    assert cfg.optimizer.betas == (0.8, 0.9)
    with pytest.raises(ValueError, match="steps: expected int"):
        config.apply_overrides(TrainConfig(), ["steps=abc"])
    with pytest.raises(ValueError, match="unknown key"):
        config.apply_overrides(TrainConfig(), ["stepz=3"])


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\noptimizer:\n  lr: 0.5\n")
    cfg = config.load(TrainConfig, path, ["steps=4"])
    assert cfg.steps == 4 and cfg.optimizer.lr == 0.5
    path.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="mapping"):
        config.load(TrainConfig, path)


def test_schedule_warms_up_then_decays_to_floor():
    lrs = [lr_at(s, 1.0, 4, 20, 0.1) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] >= 0.1 and lr_at(20, 1.0, 4, 20, 0.1) == pytest.approx(0.1)


def test_short_training_run_learns_and_exports(tmp_path):
    cfg = TrainConfig(steps=12, seq_len=64, micro_batch_size=4, grad_accum=2, plan="every-3",
                      data={"corpus_tokens": 200_000}, eval={"every": 0, "batches": 2},
                      out_dir=str(tmp_path), log={"every": 100})
    result = train(cfg)
    assert result.eval_loss_end < result.eval_loss_start - 0.5
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 13))
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert model.config.num_hidden_layers == get_flavor("llama-demo").build_config().num_hidden_layers
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[256, 100, 101]])).logits).all()


def test_cli_reports_bad_plan_without_traceback(tmp_path, capsys):
    code = main(["train", f"out_dir={tmp_path}", "plan=every-x", "steps=1"])
    assert code == 2
    assert "every-K with an integer K" in capsys.readouterr().err


# ----- a `layerwise train` killed with SIGKILL, then resumed ---------------------------------

KILL_STEPS = 24  # long enough (~1 s on a laptop) to kill the run between two checkpoints


def _tiny_llama_dir(path: Path) -> Path:
    """The ``llama-debug`` shape with the byte tokenizer's vocabulary, as an HF model dir."""
    from layerwise.models import get_flavor

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(get_flavor("llama-debug").build_config(vocab_size=258)) \
        .save_pretrained(path)
    return path


NVME_STATE = ["host_mem_gb=0.0008"]
"""The test model's store with most units' optimizer state on NVMe (``out_dir/nvme-state``)."""


def _train_argv(model_dir: Path, out_dir: Path, extra: list[str] = ()) -> list[str]:
    return ["train", f"model={model_dir}", *extra,
            f"steps={KILL_STEPS}", "seq_len=32", "micro_batch_size=2", "grad_accum=2",
            "data.corpus_tokens=50000", "eval.every=0", "eval.batches=1", "log.every=1",
            "export=false", "ckpt.every=1", "ckpt.policy=full", f"out_dir={out_dir}"]


def _cli(rank: int, argv: list[str]) -> None:
    """``layerwise <argv>`` in a child (forked by ``multiproc``: one thread, as both runs are)."""
    code = main(argv)
    if code:
        raise SystemExit(code)


def _train(model_dir: Path, out_dir: Path, log: Path, extra: list[str] = ()) -> multiproc.Launch:
    """``layerwise train`` of the test's run in a child process of its own, output in
    ``<log>.0.log``."""
    return multiproc.start(_cli, (_train_argv(model_dir, out_dir, extra),), 1, log=log, stores=[])


def _output(launch: multiproc.Launch) -> str:
    launch.wait(timeout_s=300)
    return launch[0].log_tail(1_000_000)


def _kill_after_a_commit(model_dir: Path, out_dir: Path, log: Path, extra: list[str],
                         in_step: bool) -> int | None:
    """Start the run; once a checkpoint is committed, SIGKILL it while the next one is being
    written (its step's metrics row is out, ``latest`` still names the step before) or, with
    ``in_step``, while the next step runs (no row for it yet); if that is never seen, halfway
    through the run. Returns the newest committed step it left (None if it ended before the
    kill)."""
    with _train(model_dir, out_dir, log, extra) as launch:
        proc = launch[0]
        ckpt, metrics = out_dir / "ckpt", out_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                latest = int((ckpt / "latest").read_text())
                rows = metrics.read_text().count("\n")
            except (FileNotFoundError, ValueError):
                latest = None  # not started, or a file being replaced right now
            caught = latest is not None and (rows == latest >= 1 if in_step else rows > latest)
            if caught or (latest is not None and latest >= KILL_STEPS // 2):
                break
            time.sleep(0.001)
        proc.kill()
        proc.wait(60)
    if proc.returncode != -signal.SIGKILL:
        return None
    return RunDir.open(ckpt).latest_step()


def _eval_losses(stdout: str) -> str:
    """``A -> B`` of the ``done: eval loss A -> B, …`` line."""
    [done] = [line for line in stdout.splitlines() if line.startswith("done: eval loss ")]
    return re.split(r"[,;]", done[len("done: eval loss "):])[0]


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.dist
@pytest.mark.timeout(600)
@pytest.mark.parametrize("state", ["ram", "nvme"])
def test_killed_train_resumes_from_its_last_checkpoint_bit_exactly(tmp_path, state):
    """``layerwise train`` (a process of its own, a ``full`` checkpoint every step) killed with
    SIGKILL after its first commit (inside the next save; ``nvme``: inside the next step, its
    state files being read and written), then rerun with the same command (while the
    uninterrupted run runs beside it, on the other core): it resumes from the
    newest committed step (not 0), ends at ``steps``, logs every step once, and every loss, the
    start and end eval losses and the final weights and AdamW state (compared as the final
    checkpoint's content-addressed blobs) equal an uninterrupted run's bit for bit: on CPU in
    fp32 with one thread per run the engine is deterministic (per-unit updates on worker
    threads touch disjoint buffers), and a ``full`` checkpoint holds the whole state (a
    ``filter`` one may hold older versions of groups that moved little, so resuming from it is
    close, not exact, by design). ``nvme``: the killed and resumed run keeps most units'
    optimizer state on NVMe (``host_mem_gb``) and still equals the uninterrupted run in RAM;
    the kill leaves its state files behind, and the resumed run starts them afresh.

    Mutations this fails on (each made once, by hand, in ``train/loop.py``): resume ignoring the
    checkpoint (``if False:`` for ``cfg.resume``: restarts at step 0); the data position not
    restored (``start=0`` for the batch iterator: other batches, other losses); the AdamW state
    reset after the load (``init_state`` per unit: other weights); the LR schedule restarted at
    the resumed step (``lr_at(step - start_step, …)``); metrics appended as they are (the step
    logged before the kill but never committed appears twice); ``nvme``: a checkpoint load that
    does not stage its unit for writing (``staged(buf.name)`` in ``load_group``: the loaded
    state stays in the slot and is dropped, the resumed run trains from zeros)."""
    extra = NVME_STATE if state == "nvme" else []
    model_dir = _tiny_llama_dir(tmp_path / "model")
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    with _train(model_dir, straight, tmp_path / "straight") as uninterrupted:
        for attempt in range(3):  # the kill must land before the run ends; retry if it did not
            shutil.rmtree(cut, ignore_errors=True)
            killed_at = _kill_after_a_commit(model_dir, cut, tmp_path / f"killed{attempt}", extra,
                                             in_step=state == "nvme")
            if killed_at is not None:
                break
        assert killed_at is not None, "the run always finished before it could be killed"
        assert 1 <= killed_at < KILL_STEPS
        out = _output(_train(model_dir, cut, tmp_path / "resumed", extra))
        out_straight = _output(uninterrupted)
    assert f"resumed from layer-wise checkpoint step {killed_at} " in out
    if state == "nvme":
        assert "optimizer state of" in out and not (cut / "nvme-state").exists()
    assert _eval_losses(out) == _eval_losses(out_straight)  # start and end of the whole run

    rows_straight, rows_cut = _metrics(straight), _metrics(cut)
    assert [r["step"] for r in rows_cut] == list(range(1, KILL_STEPS + 1))
    assert [r["loss"] for r in rows_cut] == [r["loss"] for r in rows_straight]
    assert rows_cut[-1]["eval_loss"] == rows_straight[-1]["eval_loss"]
    final = {run: RunDir.open(run / "ckpt").read_manifest(KILL_STEPS) for run in (straight, cut)}
    assert {g: e["blob"] for g, e in final[cut]["groups"].items()} == \
        {g: e["blob"] for g, e in final[straight]["groups"].items()}
    assert open_run_step(cut / "ckpt").state()["data_position"] == \
        open_run_step(straight / "ckpt").state()["data_position"]


def test_resume_keeps_the_metrics_rows_up_to_the_resumed_step(tmp_path):
    """A killed run may have logged steps past its last commit, and a line cut mid-write: on
    resume those go; the resumed step's own row comes back from the checkpoint when the kill
    came before it was logged. Mutation this fails on: ``_open_metrics`` appending to the file
    as it is."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 2.0}\n'
                    '{"step": 3, "loss": 3.0}\n{"step": 4, "lo')
    with _open_metrics(path, 2, {"step": 2, "loss": 9.0}) as f:
        f.write('{"step": 3, "loss": 3.5}\n')
    assert [json.loads(x) for x in path.read_text().splitlines()] == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 3.5}]
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "lo')
    _open_metrics(path, 2, {"step": 2, "loss": 2.0}).close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2]
