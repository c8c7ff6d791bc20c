"""A new user's first hour with ``layerwise train``: each friction point of the
list that the config, the Trainer, runs that lose nothing and errors that say what to do cover,
reproduced and now passing. Runs are tiny (the 0.9M ``llama-demo`` on 20k tokens of the built-in
corpus); the ones that must be separate processes (a lock held by another process, SIGINT) are.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import layerwise
from layerwise import config
from layerwise.ckpt import RunDir
from layerwise.cli import COMMANDS, build_parser, main
from layerwise.train.config import TrainConfig
from layerwise.train.loop import train
from layerwise.train.schedule import Schedule, lr_at

SRC = str(Path(layerwise.__file__).resolve().parents[1])
TINY = ["seq_len=32", "micro_batch_size=2", "data.corpus_tokens=20000", "eval.batches=1",
        "eval.every=0", "log.every=1", "log.track_every=0", "log.progress=lines"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"  # runs compared bit for bit take one thread each
    return env


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "layerwise.cli", *argv]


def _tiny(out: Path, *extra: str) -> TrainConfig:
    return config.apply_overrides(TrainConfig(), [*TINY, f"out_dir={out}", *extra])


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted((out / "model").glob("*.safetensors")):
        tensors.update(load_file(f))
    assert tensors
    return tensors


# ----- the command: fast help, every key discoverable ------------------------------------------


def test_help_imports_neither_torch_nor_transformers():
    """Friction: each ``--help`` took 4-5 s (torch and transformers imported to print it).
    Mutation seen failing: ``train/cli.py`` importing ``.loop`` at the top again."""
    probe = ("import sys\nfrom layerwise.cli import main\nfor argv in (['--help'], "
             "['train', '--help'], ['train', '--help-all']):\n    try:\n        main(argv)\n"
             "    except SystemExit:\n        pass\nprint(sorted(m for m in ('torch', "
             "'transformers', 'numpy') if m in sys.modules), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", probe], env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "[]"
    assert "optimizer.lr=0.002" in out.stdout and "ckpt.save_total_limit=none" in out.stdout
    assert "[ckpt]" in out.stdout and "schedule.min_lr_ratio=0.1" in out.stdout  # --help-all


def test_the_command_table_matches_what_each_module_registers():
    """``layerwise --help`` lists the commands from ``cli.COMMANDS`` without importing their
    modules; this keeps that table equal to what the modules register."""
    for name, (modules, summary) in COMMANDS.items():
        parser = build_parser(name)
        sub = next(a for a in parser._actions if a.dest == "command")
        helps = {a.dest: a.help for a in sub._choices_actions}
        assert helps.get(name) == summary, (name, helps)


def test_print_config_shows_the_resolved_settings(capsys, tmp_path):
    """Friction: config could not be discovered. ``--print-config`` prints what a run would
    use, as YAML that ``--config`` reads back; nothing is created."""
    out = tmp_path / "run"
    assert main(["train", "--print-config", f"out_dir={out}", "optimizer.lr=2e-5",
                 "ckpt.policy=filter", "ckpt.threshold=1e-2"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "c.yaml"
    path.write_text(text)
    cfg = config.load(TrainConfig, path)
    assert cfg.optimizer.lr == 2e-5 and cfg.ckpt.threshold == 0.01 and not out.exists()


# ----- errors that say what to do -------------------------------------------------------------


def test_user_errors_are_one_line_and_exit_2_the_traceback_only_with_debug(tmp_path, capsys):
    """Friction: ``device=cuda`` on the CPU torch the Makefile installs ended in a raw
    traceback ("Torch not compiled with CUDA enabled"). Now one line that says how to install a
    CUDA build; ``--debug`` shows the traceback."""
    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA")
    out = tmp_path / "run"
    assert main(["train", "device=cuda", f"out_dir={out}", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "CPU-only build" in err and "--index-url https://download.pytorch.org/whl/" in err
    assert not out.exists()  # nothing left behind (the lock's directory is removed again)
    with pytest.raises(ValueError, match="CPU-only build"):
        main(["train", "device=cuda", f"out_dir={out}", "--debug"])


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 as the Hub serves it (``Gemma3ForConditionalGeneration``, vision inside),
    made once for the module's tests (they only read it: each trains into its own out_dir)."""
    return _gemma3_multimodal_dir(tmp_path_factory.mktemp("gemma3") / "gemma3")


def _gemma3_multimodal_dir(path: Path) -> Path:
    """A tiny Gemma 3 as the Hub serves it (``Gemma3ForConditionalGeneration``, vision inside)."""
    from transformers import AutoModelForImageTextToText, Gemma3Config

    cfg = Gemma3Config(
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=28, patch_size=14),
        mm_tokens_per_image=4)
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(cfg).save_pretrained(path)
    return path


def test_a_lora_adapter_of_a_multimodal_model_targets_its_language_model_only(gemma3_dir, tmp_path):
    """Friction: the adapter's ``target_modules`` named the linears by their last names
    (``q_proj`` …), which the vision tower has too: PEFT made LoRA modules there and warned of
    missing adapter keys. The targets are now a regex under the language model's layers.
    Mutation seen failing: the last names as the targets again."""
    import warnings

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText

    model_dir = gemma3_dir
    out = tmp_path / "run"
    assert main(["train", f"model={model_dir}", f"out_dir={out}", "steps=2", "lora.r=4",
                 *TINY]) == 0
    base = AutoModelForImageTextToText.from_pretrained(model_dir)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        peft = PeftModel.from_pretrained(base, out / "adapter")
    assert not [w for w in seen if "missing adapter keys" in str(w.message)]
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    made = [n for n, _ in peft.named_parameters() if ".lora_" in n]
    assert len(made) == len(saved) and not [n for n in made if "vision_tower" in n]


def _assert_the_whole_multimodal_model(model_dir: Path, written: Path) -> None:
    """``written`` has the names, shapes and dtypes of ``model_dir``'s weights, and its vision
    tower and projector bit for bit."""
    before = load_file(model_dir / "model.safetensors")
    after = load_file(written / "model.safetensors")
    assert {k: (v.shape, v.dtype) for k, v in before.items()} == \
        {k: (v.shape, v.dtype) for k, v in after.items()}
    vision = [k for k in before if "vision_tower" in k or "multi_modal_projector" in k]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)


def test_a_merged_lora_of_a_multimodal_model_is_the_whole_model(gemma3_dir, tmp_path):
    """Friction: ``lora.merge=true`` on a multimodal directory ended the run with "group
    'model.language_model.embed_tokens' has parameter …, which the model in config.json does not
    have" (the merged export wrote the text config and no vision tower). Now the merged model has
    the names, shapes and dtypes of the source directory, its vision tensors bit for bit, and
    loads as the image-text class. Mutation seen failing: the merged source without the base
    directory's passthrough group ("the source lacks 34 parameter(s)")."""
    from transformers import AutoModelForImageTextToText

    model_dir = gemma3_dir
    out = tmp_path / "run"
    assert main(["train", f"model={model_dir}", f"out_dir={out}", "steps=2", "lora.r=4",
                 "lora.merge=true", *TINY]) == 0
    _assert_the_whole_multimodal_model(model_dir, out / "model")
    assert type(AutoModelForImageTextToText.from_pretrained(out / "model")).__name__ == \
        "Gemma3ForConditionalGeneration"


def test_a_multimodal_checkpoint_fine_tunes_its_language_model_and_keeps_its_vision_tower(
        gemma3_dir, tmp_path, capsys):
    """Friction: a multimodal directory (Gemma 3 as the Hub serves it) ended in a traceback
    (``'Gemma3Config' object has no attribute 'num_hidden_layers'``), then was refused. Now
    ``layerwise train`` trains its language model on text and exports the same multimodal model:
    the language model's weights moved, the vision tower and projector bit for bit as they were.
    Mutation seen failing: the store not keeping what it does not train (the export: "the source
    lacks 34 parameter(s)")."""
    from safetensors.torch import load_file

    model_dir = gemma3_dir
    capsys.readouterr()  # save_pretrained's progress bar
    out = tmp_path / "run"
    assert main(["train", f"model={model_dir}", f"out_dir={out}", "steps=2", "optimizer.lr=1e-2",
                 *TINY]) == 0
    before = load_file(model_dir / "model.safetensors")
    after = load_file(out / "model" / "model.safetensors")
    assert before.keys() == after.keys()
    vision = [k for k in before if "vision_tower" in k or "multi_modal_projector" in k]
    assert vision and all(torch.equal(before[k], after[k]) for k in vision)
    layers = [k for k in before if ".layers." in k and "vision_tower" not in k]
    assert all(not torch.equal(before[k], after[k]) for k in layers if k.endswith("proj.weight"))
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["model_type"] == "gemma3" and "vision_config" in config


def test_a_multimodal_run_s_checkpoint_merges_into_the_whole_model_and_resumes(gemma3_dir, tmp_path, capsys):
    """Friction: ``layerwise ckpt merge`` of a multimodal run was refused ("the source lacks 34
    parameter(s) of the model"): the checkpoint held the language model only. The vision tower
    and projector are now a checkpoint group of their own (``store_provider.PASSTHROUGH``,
    written by the first save), so the merge has the names, shapes and dtypes of the model
    directory, the vision tensors bit for bit, and the same command with more steps resumes.
    Mutation seen failing: the provider without the passthrough group (the refusal again)."""
    model_dir = gemma3_dir
    out = tmp_path / "run"
    args = ["train", f"model={model_dir}", f"out_dir={out}", "ckpt.every=2", *TINY]
    assert main([*args, "steps=4"]) == 0
    capsys.readouterr()
    assert main(["ckpt", "merge", str(out / "ckpt"), "--out", str(tmp_path / "merged")]) == 0
    _assert_the_whole_multimodal_model(model_dir, tmp_path / "merged")
    assert main([*args, "steps=6"]) == 0
    resumed = capsys.readouterr().out
    assert "step 6/6" in resumed and "step 1/6" not in resumed  # continued, not started again


def test_a_model_dir_layerwise_cannot_train_is_refused_in_one_line(tmp_path, capsys):
    """A BLOOM directory (its base model normalises the embeddings, which the engine's
    weight-free embedding backward cannot): one line, exit 2, before any work."""
    from transformers import AutoModelForCausalLM, BloomConfig

    model_dir = tmp_path / "bloom"
    AutoModelForCausalLM.from_config(BloomConfig(n_layer=1, hidden_size=32, n_head=2,
                                                 vocab_size=300)).save_pretrained(model_dir)
    capsys.readouterr()  # save_pretrained's progress bar
    out = tmp_path / "run"
    assert main(["train", f"model={model_dir}", f"out_dir={out}", *TINY]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.search("runs word_embeddings_layernorm", err), err


def test_an_unwritable_out_dir_is_refused_before_any_work(tmp_path):
    """Friction: a read-only ``out_dir`` failed with 13 frames, after tokenizing. Now the
    command refuses it before it even imports torch (so before any data is read), one line,
    exit 2: a directory under a file, and (as root too) a read-only sysfs directory."""
    (tmp_path / "file").write_text("x")
    probe = ("import sys\nfrom layerwise.cli import main\ncode = main(sys.argv[1:])\n"
             "print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)\n"
             "sys.exit(code)\n")
    targets = [str(tmp_path / "file" / "run")]
    if Path("/sys/kernel").is_dir():  # sysfs: no new files there, whoever asks
        targets.append("/sys/kernel")
    for target in targets:
        res = subprocess.run([sys.executable, "-c", probe, "train", f"out_dir={target}",
                              "data=/nonexistent.jsonl"], env=_env(), capture_output=True,
                             text=True, timeout=120)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2, res.stderr
        assert lines[-1] == "no torch" and len(lines) == 2, res.stderr
        assert f"out_dir {target} " in lines[0] and ("not writable" in lines[0]
                                                    or "cannot be created" in lines[0])


def test_a_hub_id_names_the_local_cache_route(tmp_path, capsys, monkeypatch):
    """Friction: a Hub id gave no way forward. Not cached: one line naming ``hf download`` and
    ``model=PATH``. In the local Hugging Face cache: used as it is, nothing downloaded."""
    import huggingface_hub.constants as hf_constants
    from transformers import AutoModelForCausalLM

    from layerwise.models import get_flavor

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["train", "model=someorg/tiny-llama", f"out_dir={tmp_path / 'a'}", *TINY]) == 2
    err = capsys.readouterr().err
    assert "hf download someorg/tiny-llama --local-dir models/tiny-llama" in err
    assert "model=models/tiny-llama" in err and err.count("\n") == 1
    snap = cache / "models--someorg--tiny-llama" / "snapshots" / "0123abcd"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(get_flavor("llama-debug").build_config(vocab_size=258)) \
        .save_pretrained(snap)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("0123abcd")
    assert main(["train", "model=someorg/tiny-llama", f"out_dir={tmp_path / 'b'}", "steps=1",
                 "export=false", *TINY]) == 0
    assert f"model someorg/tiny-llama: from the local Hugging Face cache, {snap}" in \
        capsys.readouterr().out


def test_seq_len_beyond_the_context_is_refused_unless_rope_scaling_says_so(tmp_path, capsys):
    """Friction: ``seq_len`` beyond ``max_position_embeddings`` ran with rc 0. Refused (a
    llama-debug shape of context 256 here) unless ``model.rope_scaling`` allows it; then the
    run trains and its export carries the scaling."""
    from transformers import AutoModelForCausalLM

    from layerwise.models import get_flavor

    model = tmp_path / "tiny"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(get_flavor("llama-debug").build_config(vocab_size=258)) \
        .save_pretrained(model)
    base = [f"model={model}", "seq_len=512", "micro_batch_size=1", "data.corpus_tokens=20000",
            "eval.batches=1", "steps=1", "log.track_every=0"]
    assert main(["train", f"out_dir={tmp_path / 'a'}", *base]) == 2
    err = capsys.readouterr().err
    assert f"seq_len=512 is beyond {model}'s context of 256" in err and "rope_scaling=2" in err
    assert main(["train", f"out_dir={tmp_path / 'b'}", *base, "model.rope_scaling=2"]) == 0
    exported = json.loads((tmp_path / "b" / "model" / "config.json").read_text())
    rope = exported.get("rope_parameters") or exported.get("rope_scaling")
    assert rope["rope_type"] == "linear" and rope["factor"] == 2.0


def test_a_micro_batch_that_cannot_fit_is_refused_before_the_store_is_built(tmp_path, capsys,
                                                                           monkeypatch):
    """A batch that can't fit is refused before the host store is allocated (minutes for a
    large model), with what to change. Mutation seen failing: ``check_fits`` not called (the
    engine's own check refuses it, after the store was built: ``init_store`` ran)."""
    from layerwise.train import build

    built = []
    monkeypatch.setattr(build, "init_store", lambda *a, **k: built.append(1))
    assert main(["train", f"out_dir={tmp_path / 'run'}", "device_mem_cap_gb=0.001",
                 "micro_batch_size=64", *TINY[:1], *TINY[2:]]) == 2
    err = capsys.readouterr().err
    assert "a micro-batch of 64 x 32 tokens with plan recompute-all needs" in err  # plan=fit: none fits
    assert "lower micro_batch_size" in err and built == []


# ----- runs that lose nothing ---------------------------------------------------------------


def test_checkpoints_are_on_and_a_rerun_continues_or_says_why_not(tmp_path, capsys):
    """Frictions: checkpoints were off by default (``resume=true`` quietly started again at
    step 0); a rerun overwrote its out_dir; ``steps=30`` over a step-60 run silently did
    nothing and re-exported; the resolved settings were not in ``run.json``. Now: the run
    checkpoints at its end by default; ``layerwise train out_dir=OUT`` continues it with the
    settings it saved; a run already finished says so (the export untouched); fewer steps, or
    ``resume=false``, or another model into it are refused; ``overwrite=true`` starts afresh.

    Mutation seen failing: ``resolve_config`` ignoring the saved settings (the extension runs
    with the default lr 2e-3)."""
    out = tmp_path / "run"
    argv = ["train", f"out_dir={out}", "steps=3", "optimizer.lr=5e-4", *TINY]
    assert main(argv) == 0
    assert RunDir.open(out / "ckpt").committed_steps() == [3]  # on by default: the end
    info = json.loads((out / "run.json").read_text())
    assert info["config"]["optimizer"]["lr"] == 5e-4 and info["config"]["steps"] == 3
    exported = (out / "model" / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 0
    assert "already finished step 3 of steps=3: nothing to train" in capsys.readouterr().out
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns == exported
    assert main(["train", f"out_dir={out}", "steps=2"]) == 2
    assert "already at step 3, past steps=2" in capsys.readouterr().err
    assert main(["train", f"out_dir={out}", "steps=5"]) == 0  # everything else from run.json
    text = capsys.readouterr()
    assert "resumed from layer-wise checkpoint step 3 " in text.out
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4, 5]
    assert max(r["lr"] for r in _rows(out)) == pytest.approx(5e-4)
    for argv2, message in ([["resume=false"], "resume=false starts afresh only with overwrite=true"],
                           [["model=llama-debug"], "holds a run of model llama-demo, not llama-debug"]):
        assert main(["train", f"out_dir={out}", "steps=6", *argv2]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", f"out_dir={out}", "steps=2", "overwrite=true", *TINY]) == 0
    assert [r["step"] for r in _rows(out)] == [1, 2]
    assert RunDir.open(out / "ckpt").committed_steps() == [2]


def test_extending_a_run_keeps_its_lr_schedule(tmp_path):
    """Friction: extending 40 -> 60 re-warmed the LR (cosine recomputed over the new total).
    A run of 6 steps extended to 9 keeps its 6-step cosine: the LRs of steps 1-6 are those of
    the first run and the rest stay at the floor; ``schedule.total_steps=9`` would stretch it.

    Mutation seen failing: ``_schedule`` ignoring the checkpoint's ``schedule`` (steps 7-9 at
    a re-drawn cosine over 9 steps, above the floor)."""
    out = tmp_path / "run"
    extra = ["schedule.warmup_steps=2", "optimizer.lr=1e-3", "export=false"]
    train(_tiny(out, "steps=6", *extra))
    train(_tiny(out, "steps=9", *extra))
    lrs = [r["lr"] for r in _rows(out)]
    assert lrs == pytest.approx([lr_at(s, 1e-3, 2, 6, 0.1) for s in range(9)])
    assert lrs[6:] == pytest.approx([1e-4] * 3)


def test_schedules_and_warmup_ratio():
    s = Schedule.resolve("linear", 1.0, 10, 0, 0.2, 0.0)
    assert s.warmup_steps == 2 and [s.lr(i) for i in (0, 1, 2, 6, 10)] == pytest.approx(
        [0.5, 1.0, 1.0, 0.5, 0.0])
    c = Schedule.resolve("constant", 1.0, 10, 3, None, 0.1)
    assert [c.lr(i) for i in (0, 2, 3, 9, 20)] == pytest.approx([1 / 3, 1, 1, 1, 1])
    cos = Schedule.resolve("cosine", 1.0, 10, 0, None, 0.1)
    assert cos.lr(5) == pytest.approx(0.55) and cos.lr(10) == pytest.approx(0.1)


def test_epochs_save_total_limit_and_resume_from_checkpoint(tmp_path):
    """``num_train_epochs`` sets the steps from the data (29 rows of 32 from 1,000 tokens, 8 a
    step: 4 steps an epoch); ``save_total_limit=2`` keeps the newest 2 committed steps and a
    clean run directory; ``resume_from_checkpoint=RUN@3`` starts another run from step 3 of
    the first, which then ends with the first one's weights bit for bit (the state, the data
    position and the schedule came with the checkpoint).

    Mutations seen failing: ``prune`` skipped (4 steps kept); the reader's step not passed to
    ``load`` (the new run starts from step 4: other weights)."""
    first = tmp_path / "first"
    overrides = ["data.corpus_tokens=1000", "micro_batch_size=8", "num_train_epochs=2",
                 "ckpt.every=1", "ckpt.policy=full", "ckpt.save_total_limit=2"]
    torch.set_num_threads(1)
    try:
        result = train(_tiny(first, *overrides))
        assert result.steps == 8 and [r["step"] for r in _rows(first)] == list(range(1, 9))
        run = RunDir.open(first / "ckpt")
        assert run.committed_steps() == [7, 8] and run.verify().ok
        second = tmp_path / "second"
        train(_tiny(first, "steps=9", "export=false", "data.corpus_tokens=1000",
                    "micro_batch_size=8", "ckpt.policy=full"))  # first: now at step 9
        with pytest.raises(ValueError, match="step 3 is not committed"):
            train(_tiny(second, f"resume_from_checkpoint={first}@3"))
        train(_tiny(second, f"resume_from_checkpoint={first / 'ckpt'}@8", "steps=9",
                    "data.corpus_tokens=1000", "micro_batch_size=8", "ckpt.policy=full",
                    "export=false"))
    finally:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    a, b = (RunDir.open(d / "ckpt").read_manifest(9)["groups"] for d in (first, second))
    assert {g: e["blob"] for g, e in a.items()} == {g: e["blob"] for g, e in b.items()}
    assert [r["step"] for r in _rows(second)] == [9]


def test_report_to_tensorboard_and_samples_at_eval(tmp_path, monkeypatch):
    """``log.report_to=tensorboard`` without the package: refused before any work with the
    pip line. With it (a stand-in ``SummaryWriter`` here: the package is optional and not
    installed), every step's scalars and the eval samples go to the writer; ``eval.samples``
    also writes ``samples.jsonl``, one row per sample per evaluation."""
    import importlib.util
    import types

    out = tmp_path / "run"
    if importlib.util.find_spec("tensorboard") is None:
        with pytest.raises(ValueError, match="pip install tensorboard"):
            train(_tiny(out, "log.report_to=tensorboard"))
    calls: list[tuple] = []

    class Writer:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append((tag, step))

        def add_text(self, tag, text, step):
            calls.append((tag, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    fake_tb = types.ModuleType("tensorboard")
    fake_tb.__spec__ = importlib.machinery.ModuleSpec("tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboard", fake_tb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard",
                        types.SimpleNamespace(SummaryWriter=Writer))
    train(_tiny(out, "steps=3", "log.report_to=tensorboard", "eval.every=2", "eval.samples=2",
                "eval.sample_tokens=3", "export=false"))
    assert calls[0] == ("init", str(out / "tensorboard")) and calls[-1] == ("close",)
    assert [c[1] for c in calls if c[0] == "train/loss"] == [1, 2, 3]
    assert [c[1] for c in calls if c[0] == "samples"] == [0, 0, 2, 2, 3, 3]
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 2, 2, 3, 3]
    assert all(s["prompt"] and isinstance(s["text"], str) for s in samples)


# ----- separate processes: the lock, SIGINT -----------------------------------------------------


def _wait_for(pred, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_second_run_into_the_same_out_dir_is_refused_at_once(tmp_path, capsys):
    """Friction: two runs into one out_dir both exited 0, their checkpoints interleaved and
    ``metrics.jsonl`` corrupted. The second now exits 2 within 10 s (it does not even import
    torch) naming the first's pid and start time; the first finishes, its checkpoints verify
    clean, ``metrics.jsonl`` has one row per step. Mutation seen failing: ``dirlock.acquire``
    without its ``flock`` (the second trains too: rc 0)."""
    out = tmp_path / "run"
    # the lock is taken before torch is imported: the first is still importing or training
    # while the second (no torch) is refused
    argv = _cli("train", f"out_dir={out}", "steps=12", "ckpt.every=4", "export=false", *TINY)
    first = subprocess.Popen(argv, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        lock = out / ".train.lock"
        _wait_for(lambda: lock.exists() and f'"pid": {first.pid}' in lock.read_text(), first)
        t0 = time.monotonic()
        second = subprocess.run(argv, env=_env(), capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert first.poll() is None, "the first run ended before the second started"
        assert second.returncode == 2 and took < 10, (took, second.stderr)
        assert f"in use by another run (pid {first.pid} on " in second.stderr
        assert ", started 20" in second.stderr and second.stderr.count("\n") == 1
        _, err = first.communicate(timeout=600)
        assert first.returncode == 0, err[-3000:]
    finally:
        first.kill()
    capsys.readouterr()
    assert main(["ckpt", "verify", str(out / "ckpt")]) == 0
    verified = capsys.readouterr().out
    assert verified.startswith("OK"), verified
    assert [r["step"] for r in _rows(out)] == list(range(1, 13))


def test_sigint_saves_says_how_to_resume_and_the_resume_is_exact(tmp_path, capsys):
    """Friction: Ctrl-C printed 30 lines of traceback, no resume hint, no save. Now SIGINT in
    the middle of a run finishes the step, saves it, and exits 130 with one line naming the
    step and the command that resumes; that command (settings from ``run.json``) ends with the
    weights of an uninterrupted run, bit for bit (fp32, one thread) — under a selective policy
    too (parity, saving every 2 steps): the interrupt's save writes every group.

    Mutations seen failing: ``_interrupted`` not saving (the newest checkpoint is older than
    the step the line names, and "checkpoint step N" names the wrong step); the interrupt's save
    following the policy (``every_group=last`` in the loop: half the groups a save older)."""
    args = ["steps=40", "ckpt.every=2", "ckpt.policy=parity", *TINY]
    cut = tmp_path / "cut"
    proc = subprocess.Popen(_cli("train", f"out_dir={cut}", *args), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = cut / "metrics.jsonl"
        _wait_for(lambda: metrics.exists() and metrics.read_text().count("\n") >= 3, proc)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert "Traceback" not in stderr and last.startswith("layerwise train: SIGINT at step ")
    step = int(last.split("SIGINT at step ")[1].split()[0])
    assert 3 <= step < 40 and f"checkpoint step {step} is in {cut / 'ckpt'}" in last
    assert last.endswith(f"resume with: layerwise train out_dir={cut}")
    assert RunDir.open(cut / "ckpt").committed_steps()[-1] == step
    assert json.loads((cut / "run.json").read_text())["interrupted_at_step"] == step
    # the resume and the uninterrupted run in this process (the command the line names, through
    # ``cli.main``), on one thread as the interrupted process was (OMP_NUM_THREADS=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        capsys.readouterr()
        assert main(["train", f"out_dir={cut}"]) == 0
        assert f"resumed from layer-wise checkpoint step {step} " in capsys.readouterr().out
        assert main(["train", f"out_dir={tmp_path / 'straight'}", *args]) == 0
    finally:
        torch.set_num_threads(threads)
    assert [r["step"] for r in _rows(cut)] == list(range(1, 41))
    a, b = _weights(tmp_path / "straight"), _weights(cut)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_same_command_after_a_kill_before_the_first_checkpoint_starts_the_run_again(tmp_path, capsys):
    """Friction: a run SIGKILLed before its first checkpoint commit made the same command refuse
    ("holds a run … that left no checkpoint to continue from") — 2 of 9 restarts in a soak.
    With nothing to lose and the same settings in ``run.json``, the same command starts it
    again and says so; a command with other settings into that out_dir is still refused.

    Mutation seen failing: ``_same_settings`` always False (the same command refused again)."""
    out = tmp_path / "run"
    argv = ["train", f"out_dir={out}", "steps=2", *TINY]
    assert main(argv) == 0
    shutil.rmtree(out / "ckpt")  # as a kill before the first commit leaves it: run.json, no steps
    (out / "ckpt").mkdir()
    capsys.readouterr()
    assert main(["train", f"out_dir={out}", "steps=2", "optimizer.lr=1e-4", *TINY]) == 2
    assert "left no checkpoint to continue from, with other settings" in capsys.readouterr().err
    assert main(argv) == 0
    assert "stopped before its first checkpoint: nothing to lose, starting it again" in capsys.readouterr().out
    assert RunDir.open(out / "ckpt").committed_steps() == [2]
