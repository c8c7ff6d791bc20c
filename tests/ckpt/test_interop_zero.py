"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3; 2 ranks, real DeepSpeed on CPU) as sources."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from layerwise.interop.layout import EXP_AVG, PARAM, STEP
from layerwise.interop.merge import merge
from layerwise.interop.recipe import load_recipe
from layerwise.interop.sources import open_source
from layerwise.interop.trainer import TrainerCheckpointSource
from layerwise.interop.zero import ZeroCheckpointSource
from zero_helpers import NUM_LAYERS, SAVE_STEPS, make_zero_checkpoints

STAGES = (1, 2, 3)


@pytest.fixture(scope="module")
def zero_dir(tmp_path_factory) -> Path:
    return make_zero_checkpoints(tmp_path_factory.mktemp("zero"), STAGES)


def as_state(src) -> dict[str, dict[str, torch.Tensor]]:
    """{hf name: {param|exp_avg|exp_avg_sq|step: tensor}} over every group of a source."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in src.groups():
        for key, t in src.load_group(group).items():
            kind, name = key.split("/", 1)
            out.setdefault(name, {})[kind] = t
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_zero_source_equals_deepspeeds_own_view(zero_dir, stage):
    """Every parameter's fp32 master and both moments, read from the rank files, equal what
    DeepSpeed itself gathers (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``),
    bit for bit, at both saved steps; the weights also equal ``zero_to_fp32``'s. Mutations seen
    failing: stage 3 gathered as contiguous partitions (the stage-1/2 path); ``ceil`` replaced
    by floor division in the stage-3 piece size; ``exp_avg`` read from ``exp_avg_sq``."""
    for step in SAVE_STEPS:
        src = open_source(zero_dir / f"zero{stage}" / f"global_step{step}")
        assert isinstance(src, ZeroCheckpointSource)
        assert (src.stage, src.world_size, src.extra_state()["step"]) == (stage, 2, step)
        ref = torch.load(zero_dir / f"zero{stage}" / f"reference_step{step}.pt", weights_only=True)
        got = as_state(src)
        assert set(got) == set(ref)
        for name, want in ref.items():
            for kind in ("param", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[name][kind], want[kind]), (stage, step, name, kind)
            assert got[name]["step"].item() == step
    weights = get_fp32_state_dict_from_zero_checkpoint(str(zero_dir / f"zero{stage}"))  # latest
    latest = as_state(open_source(zero_dir / f"zero{stage}"))
    assert set(weights) == set(latest)
    for name, t in weights.items():
        assert torch.equal(latest[name]["param"], t), name


@pytest.mark.parametrize("stage", (2, 3))
def test_recipe_of_two_zero_saves_merges_to_a_trainer_checkpoint(zero_dir, stage, tmp_path):
    """Layers 0..1 from step 2, the rest from step 4: the merged Trainer checkpoint holds exactly
    those weights and moments."""
    run = zero_dir / f"zero{stage}"
    a, b = run / f"global_step{SAVE_STEPS[0]}", run / f"global_step{SAVE_STEPS[1]}"
    half = NUM_LAYERS // 2
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "slices": [{"sources": [{"model": str(a), "layer_range": [0, half]}]},
                   {"sources": [{"model": str(b), "layer_range": [half, NUM_LAYERS]}]}]}))
    out = tmp_path / "mixed"
    assert merge(load_recipe(recipe).open(), out, format="trainer")["step"] == SAVE_STEPS[1]
    got, src_a, src_b = TrainerCheckpointSource(out), open_source(a), open_source(b)
    for group in got.groups():
        index = int(group.split(".")[1]) if group.startswith("layers.") else None
        want = src_a if group == "embed" or (index is not None and index < half) else src_b
        other = src_b if want is src_a else src_a
        have, expect = got.load_group(group), want.load_group(group)
        assert have.keys() == expect.keys()
        for k in expect:
            assert torch.equal(have[k], expect[k]), (group, k)
        moment = next(k for k in expect if k.startswith(EXP_AVG))
        assert not torch.equal(have[moment], other.load_group(group)[moment])  # the saves differ


def test_zero_checkpoints_that_do_not_fit_are_refused(zero_dir, tmp_path):
    src = zero_dir / "zero2" / f"global_step{SAVE_STEPS[1]}"
    config = json.loads((zero_dir / "zero2" / "config.json").read_text())
    with pytest.raises(ValueError, match="no config.json"):
        ZeroCheckpointSource(shutil.copytree(src, tmp_path / "run" / "global_step4"))

    missing = shutil.copytree(src, tmp_path / "missing")
    next(missing.glob("zero_pp_rank_1_*optim_states.pt")).unlink()
    with pytest.raises(ValueError, match="partition_count says 2 ranks but there are 1"):
        ZeroCheckpointSource(missing, config=config)

    with pytest.raises(ValueError, match=r"has shape \(\d+, \d+\) in the checkpoint"):
        ZeroCheckpointSource(src, config={**config, "intermediate_size": config["intermediate_size"] * 2})

    # rank 1's file from the stage-3 save beside stage 2's rank 0: the layouts disagree
    mixed = shutil.copytree(src, tmp_path / "mixed")
    stage3 = zero_dir / "zero3" / f"global_step{SAVE_STEPS[1]}"
    shutil.copy(next(stage3.glob("zero_pp_rank_1_*optim_states.pt")), next(mixed.glob("zero_pp_rank_1_*optim_states.pt")))
    with pytest.raises(ValueError, match="do not belong together"):
        ZeroCheckpointSource(mixed, config=config)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


def test_zero_file_that_would_run_code_is_refused(zero_dir, tmp_path):
    """The rank files are pickles; reading allows only tensors and three DeepSpeed classes.
    Mutation seen failing: ``weights_only=False`` in ``load_zero_file`` (the marker appears)."""
    evil = tmp_path / "evil"
    shutil.copytree(zero_dir / "zero2" / f"global_step{SAVE_STEPS[1]}", evil)
    target = next(evil.glob("zero_pp_rank_0_*optim_states.pt"))
    marker = tmp_path / "ran"
    torch.save({"optimizer_state_dict": _RunsCode(marker)}, target)
    config = json.loads((zero_dir / "zero2" / "config.json").read_text())
    with pytest.raises(ValueError, match="refusing to unpickle.*posix.system"):
        ZeroCheckpointSource(evil, config=config)
    assert not marker.exists()
