"""HF Trainer interop: Trainer checkpoints as sources, `trainer` and `hf` export, recipes of Trainer checkpoints.

One tiny Llama is trained once per module with the real ``transformers.Trainer`` (6 steps,
checkpoints at 2, 4, 6); the tests read, export, mix and resume those checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, Trainer

from layerwise.interop.recipes.merge import merge
from layerwise.interop.recipes.recipe import load_recipe
from layerwise.interop.hf.model_dir import HFModelDirSource
from layerwise.interop.layout import EXP_AVG, EXP_AVG_SQ, PARAM, STEP
from layerwise.interop.sources import open_source
from layerwise.interop.hf.trainer_checkpoint import TrainerCheckpointSource
from layerwise.models.registry import FAMILIES, get_flavor
from trainer_helpers import losses, make_trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Trainer, Path]:
    run = tmp_path_factory.mktemp("hf_run")
    trainer = make_trainer(run, max_steps=6)
    trainer.train()
    return trainer, run


def test_trainer_checkpoint_source_maps_optimizer_state_like_trainer(trained):
    trainer, run = trained
    src = open_source(run / "checkpoint-6")
    assert isinstance(src, TrainerCheckpointSource)
    assert src.groups() == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"]
    live = dict(trainer.model.named_parameters())
    seen = set()
    for group in src.groups():
        tensors = src.load_group(group)
        for key, t in tensors.items():
            kind, _, name = key.partition("/")
            p = live[name]
            if kind == "param":
                torch.testing.assert_close(t, p.detach(), rtol=0, atol=0)
            else:
                # The live optimizer's state of exactly this parameter (norms sit in the no-decay group).
                expect = trainer.optimizer.state[p][kind]
                torch.testing.assert_close(t, expect.to(torch.float32).reshape(t.shape), rtol=0, atol=0)
            seen.add(key)
    for name in live:
        assert {PARAM + name, EXP_AVG + name, EXP_AVG_SQ + name, STEP + name} <= seen
    extra = src.extra_state()
    assert extra["step"] == 6 and extra["trainer_state"]["global_step"] == 6
    assert extra["scheduler"]["last_epoch"] == 6
    assert set(extra["rng"]) >= {"python", "numpy", "cpu"}
    assert [g["weight_decay"] for g in extra["optimizer_param_groups"]] == [0.1, 0.0]


def test_foreign_optimizer_layouts_are_refused(trained, tmp_path):
    import shutil

    _, run = trained
    ckpt = tmp_path / "checkpoint-2"
    shutil.copytree(run / "checkpoint-2", ckpt)
    sd = torch.load(ckpt / "optimizer.pt", weights_only=True)
    # One param group over all parameters: not what Trainer builds, so positions cannot be trusted.
    sd["param_groups"] = [{**sd["param_groups"][0], "params": sorted(sd["state"])}]
    torch.save(sd, ckpt / "optimizer.pt")
    with pytest.raises(ValueError, match=r"param groups of sizes \[39\].*would build \[\d+, \d+\]"):
        TrainerCheckpointSource(ckpt).load_group("layers.0")
    (ckpt / "optimizer.pt").unlink()
    (ckpt / "global_step2").mkdir()
    with pytest.raises(ValueError, match="sharded optimizer state.*DeepSpeed"):
        open_source(ckpt)


def test_trainer_output_dir_is_not_a_source(trained):
    _, run = trained
    with pytest.raises(ValueError, match="looks like a Trainer output dir.*checkpoint-6"):
        open_source(run)


def test_trainer_export_resumes_like_the_original_checkpoint(trained, tmp_path):
    trainer, run = trained
    out = tmp_path / "checkpoint-4"
    summary = merge(run / "checkpoint-4", out, format="trainer")
    assert summary["step"] == 4
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json",
            "config.json"} <= {p.name for p in out.iterdir()}
    # optimizer.pt: same param groups (hyper-parameters, order) and the same state as Trainer wrote.
    ours = torch.load(out / "optimizer.pt", weights_only=True)
    theirs = torch.load(run / "checkpoint-4" / "optimizer.pt", weights_only=True)
    assert ours["param_groups"] == theirs["param_groups"]
    assert ours["state"].keys() == theirs["state"].keys()
    for i, st in theirs["state"].items():
        for k, v in st.items():
            assert torch.equal(ours["state"][i][k], v), (i, k)
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 4

    resumed = make_trainer(tmp_path / "resumed", max_steps=6)
    resumed.train(resume_from_checkpoint=str(out))
    assert resumed.state.global_step == 6
    # Only steps 5 and 6 ran, with exactly the losses of the uninterrupted run.
    assert set(losses(resumed)) >= {5, 6} and 4 not in {h["step"] for h in resumed.state.log_history[-3:]}
    assert losses(resumed)[5] == losses(trainer)[5] and losses(resumed)[6] == losses(trainer)[6]
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n


def test_tied_trainer_checkpoint_round_trips(tmp_path):
    trainer = make_trainer(tmp_path / "run", max_steps=2, flavor="llama-debug-tied")
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoint-2"
    src = TrainerCheckpointSource(ckpt)
    assert "lm_head" not in src.groups()
    emb = trainer.model.model.embed_tokens.weight
    got = src.load_group("embed")
    assert set(got) == {f"{k}model.embed_tokens.weight" for k in (PARAM, EXP_AVG, EXP_AVG_SQ, STEP)}
    assert torch.equal(got[EXP_AVG + "model.embed_tokens.weight"], trainer.optimizer.state[emb]["exp_avg"])
    out = tmp_path / "export"
    merge(ckpt, out, format="trainer")
    ours, theirs = (torch.load(d / "optimizer.pt", weights_only=True) for d in (out, ckpt))
    assert ours["param_groups"] == theirs["param_groups"]
    assert all(torch.equal(ours["state"][i][k], v) for i, st in theirs["state"].items() for k, v in st.items())


def test_hf_export_loads_with_from_pretrained_and_gives_same_logits(trained, tmp_path):
    trainer, run = trained
    out = tmp_path / "hf"
    summary = merge(run / "checkpoint-6", out, format="hf", max_shard_size="50KB")
    assert len(summary["weight_files"]) > 1
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, 96, (2, 12))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(x).logits, trainer.model(x).logits)


def test_tied_model_exports_no_duplicate_head(tmp_path):
    torch.manual_seed(1)
    model = FAMILIES["llama"].model_class(get_flavor("llama-debug-tied").build_config())
    model.save_pretrained(tmp_path / "src")
    out = tmp_path / "out"
    merge(tmp_path / "src", out, format="hf", dtype="bfloat16")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    x = torch.randint(0, 96, (1, 9))
    with torch.no_grad():
        for q in model.parameters():  # weights rounded to bf16 as stored; buffers untouched
            q.copy_(q.bfloat16().float())
    ref = model
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ref(x).logits)


# ----- recipes of Trainer checkpoints ---------------------------------------------------------


def write_recipe(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def test_recipe_mixes_two_trainer_checkpoints_with_their_optimizer_state(trained, tmp_path):
    trainer, run = trained
    a, b = run / "checkpoint-2", run / "checkpoint-6"
    recipe = write_recipe(tmp_path / "r.yaml", {
        "slices": [
            {"sources": [{"model": str(a), "layer_range": [0, 2]}]},
            {"sources": [{"model": str(b), "layer_range": [2, 4]}]},
        ],
        "pre_weights": [{"model": str(a)}],
        "post_weights": [{"name": "model.norm.weight", "model": str(a)}, {"name": "lm_head.weight", "model": str(b)}],
    })
    out = tmp_path / "mixed"
    merged = load_recipe(recipe).open()
    assert merged.describe()["state_from"] == str(b)  # newest step by default
    summary = merge(merged, out, format="trainer")
    assert summary["step"] == 6

    got = TrainerCheckpointSource(out)
    src_a, src_b = TrainerCheckpointSource(a), TrainerCheckpointSource(b)
    expected = {"embed": src_a, "layers.0": src_a, "layers.1": src_a, "layers.2": src_b, "layers.3": src_b,
                "norm": src_a, "lm_head": src_b}
    for group, want_src in expected.items():
        other = src_b if want_src is src_a else src_a
        have, want, not_want = got.load_group(group), want_src.load_group(group), other.load_group(group)
        assert have.keys() == want.keys()
        for k in want:
            assert torch.equal(have[k], want[k]), (group, k)
        # The two checkpoints really differ, so the check above tells the sources apart.
        assert not torch.equal(have[next(k for k in want if k.startswith(EXP_AVG))],
                               not_want[next(k for k in want if k.startswith(EXP_AVG))])
        step_key = next(k for k in have if k.startswith(STEP))
        assert have[step_key].item() == (2.0 if want_src is src_a else 6.0)

    # The Trainer accepts the composite and continues from step 6.
    resumed = make_trainer(tmp_path / "resumed", max_steps=8)
    resumed.train(resume_from_checkpoint=str(out))
    assert resumed.state.global_step == 8 and set(losses(resumed)) >= {7, 8}


def test_recipe_accepts_llmtailor_placeholders_and_cli(trained, tmp_path):
    import argparse

    from layerwise.interop.cli import register

    _, run = trained
    a, b = run / "checkpoint-4", run / "checkpoint-6"
    recipe = write_recipe(tmp_path / "r.yaml", {
        "merge_method": "passthrough",
        "dtype": "bfloat16",
        "slices": [
            {"sources": [{"model": str(a), "layer_range": [0, 0]}]},  # LLMTailor placeholder
            {"sources": [{"model": str(a), "layer_range": [0, 3]}]},
            {"sources": [{"model": str(b), "layer_range": [3, 4]}]},
        ],
        "pre_weights": [{"name": "model.embed_tokens.weight", "model": str(b)}],
        "post_weights": [{"model": str(a)}],
        "state_from": str(a),
    })
    parser = argparse.ArgumentParser(prog="layerwise")
    register(parser.add_subparsers(dest="sub"))
    out = tmp_path / "hf"
    args = parser.parse_args(["ckpt", "merge", "--recipe", str(recipe), "--out", str(out), "--json"])
    assert args.func(args) == 0
    got = HFModelDirSource(out)
    w = got.load_group("layers.3")["param/model.layers.3.mlp.up_proj.weight"]
    assert w.dtype == torch.bfloat16
    assert torch.equal(w, TrainerCheckpointSource(b).load_group("layers.3")["param/model.layers.3.mlp.up_proj.weight"].bfloat16())
    assert torch.equal(got.load_group("embed")["param/model.embed_tokens.weight"],
                       TrainerCheckpointSource(b).load_group("embed")["param/model.embed_tokens.weight"].bfloat16())
    # ... and everything else from checkpoint a (layers 0-2, the final norm, the head)
    src_a, src_b = TrainerCheckpointSource(a), TrainerCheckpointSource(b)
    for group in ("layers.0", "layers.1", "layers.2", "norm", "lm_head"):
        if group not in src_a.groups():
            continue  # a tied model has no lm_head group
        want = {k: v.bfloat16() for k, v in src_a.load_group(group).items() if k.startswith("param/")}
        have = got.load_group(group)
        assert set(have) == set(want), group
        for k in want:
            assert torch.equal(have[k], want[k]), k
            assert not torch.equal(want[k], src_b.load_group(group)[k].bfloat16()), k


BAD_RECIPES = [
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": [0, 3]}]},
                              {"sources": [{"model": b, "layer_range": [2, 4]}]}]},
     "layer 2 is selected twice"),
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": [0, 1]}]},
                              {"sources": [{"model": b, "layer_range": [3, 4]}]}]},
     "layer(s) 1-2 are not covered"),
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": [0, 6]}]}]},
     "reaches past the model's 4 layers"),
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": [0, 4]},
                                           {"model": b, "layer_range": [0, 4]}]}]},
     "several sources in one slice"),
    (lambda a, b: {"merge_method": "slerp", "slices": [{"sources": [{"model": a, "layer_range": [0, 4]}]}]},
     "only 'passthrough'"),
    (lambda a, b: {"slice": []}, "unknown key(s) ['slice']"),
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": [3, 1]}]}]}, "backwards"),
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": "0-4"}]}]}, "layer_range must be"),
    (lambda a, b: {"slices": [{"sources": [{"model": a + "-nope", "layer_range": [0, 4]}]}]}, "cannot open model"),
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": [0, 4]}]}],
                   "post_weights": [{"name": "model.layers.1.mlp.up_proj.weight", "model": b}]},
     "take layers with 'slices'"),
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": [0, 4]}]}],
                   "post_weights": [{"name": "score.weight", "model": b}]},
     "names no part of the model"),
    (lambda a, b: {"slices": [{"sources": [{"model": a, "layer_range": [0, 4]}]}],
                   "post_weights": [{"name": "lm_head", "model": a}, {"name": "lm_head.weight", "model": b}]},
     "'lm_head' is taken from both"),
]


@pytest.mark.parametrize("make,message", BAD_RECIPES)
def test_bad_recipes_fail_clearly_and_write_nothing(trained, tmp_path, make, message):
    _, run = trained
    recipe = write_recipe(tmp_path / "bad.yaml", make(str(run / "checkpoint-2"), str(run / "checkpoint-4")))
    out = tmp_path / "out"
    with pytest.raises(ValueError) as e:
        merge(load_recipe(recipe).open(), out, format="trainer")
    assert message in str(e.value)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["bad.yaml"]


def test_recipe_rejects_mixed_architectures(trained, tmp_path):
    _, run = trained
    torch.manual_seed(0)
    other = FAMILIES["llama"].model_class(get_flavor("llama-debug").build_config(intermediate_size=48))
    other.save_pretrained(tmp_path / "other")
    recipe = write_recipe(tmp_path / "r.yaml", {"slices": [
        {"sources": [{"model": str(run / "checkpoint-2"), "layer_range": [0, 2]}]},
        {"sources": [{"model": str(tmp_path / "other"), "layer_range": [2, 4]}]},
    ]})
    with pytest.raises(ValueError, match="different architectures .*intermediate_size"):
        load_recipe(recipe).open()
