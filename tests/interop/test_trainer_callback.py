"""HF Trainer end to end: train with the layer-wise callback, merge to `trainer` format, resume."""

from __future__ import annotations

import json

import pytest
import torch
from layerwise.interop.hooks.trainer_callback import LayerwiseCheckpointCallback
from layerwise.interop.recipes.merge import merge
from trainer_helpers import losses, make_trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cb")
    cb = LayerwiseCheckpointCallback(root / "run", policy="full", every=2)
    trainer = make_trainer(root / "hf", max_steps=6, callbacks=[cb])
    trainer.train()
    return trainer, cb, root


def test_callback_writes_layerwise_steps_with_trainer_state(trained):
    from layerwise.ckpt.resolve import open_run_step

    trainer, cb, root = trained
    assert cb.saved_steps == [2, 4, 6] and cb.checkpointer is None  # closed at train end
    rs = open_run_step(root / "run", 4)
    assert rs.step == 4
    extra = rs.extra_state()
    assert extra["trainer_state"]["global_step"] == 4
    assert extra["scheduler"]["last_epoch"] == 4
    assert [g["weight_decay"] for g in extra["optimizer_param_groups"]] == [0.1, 0.0]


def test_merge_to_trainer_format_matches_trainers_own_checkpoint(trained, tmp_path):
    trainer, cb, root = trained
    out = tmp_path / "checkpoint-4"
    summary = merge(root / "run", out, format="trainer", step=4)
    assert summary["step"] == 4 and summary["rng_state"]
    native = root / "hf" / "checkpoint-4"
    ours = torch.load(out / "optimizer.pt", weights_only=True)
    theirs = torch.load(native / "optimizer.pt", weights_only=True)
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for i, st in theirs["state"].items():
        for k, v in st.items():
            assert torch.equal(ours["state"][i][k], v), (i, k)
    assert torch.load(out / "scheduler.pt", weights_only=True) == torch.load(native / "scheduler.pt", weights_only=True)
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 4 and state["max_steps"] == 6


def test_trainer_resumes_from_merged_layerwise_step(trained, tmp_path):
    from layerwise.interop.hooks.trainer_callback import export_for_resume

    trainer, cb, root = trained
    out = export_for_resume(root / "run", tmp_path / "resumed", step=5)  # resolves to step 4
    assert out == str(tmp_path / "resumed" / "checkpoint-4")
    resumed = make_trainer(tmp_path / "resumed", max_steps=6)
    resumed.train(resume_from_checkpoint=out)
    assert resumed.state.global_step == 6
    assert losses(resumed)[5] == losses(trainer)[5] and losses(resumed)[6] == losses(trainer)[6]
    # The resumed run trained steps 5 and 6 only (earlier entries are the restored log history).
    assert [h["step"] for h in resumed.state.log_history if "loss" in h and h["step"] > 3] == [5, 6]
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n


def test_merge_hf_from_layerwise_run_gives_same_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer, cb, root = trained
    out = tmp_path / "hf"
    merge(root / "run", out, format="hf")  # latest step (6) = the trained model
    model = AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, 96, (2, 10))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, trainer.model(x).logits)


def test_ckpt_merge_cli(trained, tmp_path, capsys):
    from layerwise.cli import main

    _, _, root = trained
    out = tmp_path / "exported"
    rc = main(["ckpt", "merge", str(root / "run"), "--step", "4", "--out", str(out), "--format", "trainer", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ok"] and summary["step"] == 4 and summary["format"] == "trainer"
    assert (out / "optimizer.pt").is_file()
    # A second export to the same place is refused (nothing overwritten without --overwrite).
    rc = main(["ckpt", "merge", str(root / "run"), "--out", str(out)])
    assert rc == 2 and "not empty" in capsys.readouterr().err
    rc = main(["ckpt", "merge", str(root / "run"), "--out", str(out), "--json"])
    err = json.loads(capsys.readouterr().out)
    assert rc == 2 and err["ok"] is False and "not empty" in err["error"]


def test_recipe_mixes_layerwise_steps_and_a_trainer_checkpoint(trained, tmp_path):
    import yaml

    from layerwise.interop.recipes.recipe import load_recipe
    from layerwise.ckpt.resolve import open_run_step
    from layerwise.interop.hf.trainer_checkpoint import TrainerCheckpointSource

    _, _, root = trained
    run, native = root / "run", root / "hf" / "checkpoint-6"
    (tmp_path / "r.yaml").write_text(yaml.safe_dump({
        "slices": [
            {"sources": [{"model": f"{run}@2", "layer_range": [0, 2]}]},
            {"sources": [{"model": str(native), "layer_range": [2, 4]}]},
        ],
        "pre_weights": [{"model": f"{run}@2"}],
        "post_weights": [{"model": f"{run}@4"}],
        "state_from": f"{run}@4",
    }))
    out = tmp_path / "checkpoint-4"
    summary = merge(load_recipe(tmp_path / "r.yaml").open(), out, format="trainer")
    assert summary["step"] == 4
    got = TrainerCheckpointSource(out)
    at2, at4, n6 = open_run_step(run, 2), open_run_step(run, 4), TrainerCheckpointSource(native)
    for group, src in [("embed", at2), ("layers.0", at2), ("layers.1", at2), ("layers.2", n6),
                       ("layers.3", n6), ("norm", at4), ("lm_head", at4)]:
        have, want = got.load_group(group), src.load_group(group)
        assert have.keys() == want.keys(), group
        assert all(torch.equal(have[k], want[k]) for k in want), group
    resumed = make_trainer(tmp_path / "resumed", max_steps=6)
    resumed.train(resume_from_checkpoint=str(out))
    assert resumed.state.global_step == 6


def test_callback_rejects_bad_interval(tmp_path):
    with pytest.raises(ValueError, match="every must be a positive"):
        LayerwiseCheckpointCallback(tmp_path / "run", every=0)
