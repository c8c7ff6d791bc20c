"""DeepSpeed ZeRO checkpoints (stages 1, 2, 3; 2 ranks, real DeepSpeed on CPU) as sources."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

import multiproc
from layerwise.ckpt.resolve import open_run_step
from layerwise.interop.recipes.import_checkpoints import import_checkpoints
from layerwise.interop.layout import EXP_AVG
from layerwise.interop.recipes.merge import merge
from layerwise.interop.recipes.recipe import load_recipe
from layerwise.interop.sources import open_source
from layerwise.interop.hf.trainer_checkpoint import TrainerCheckpointSource
from layerwise.interop.deepspeed.zero_checkpoint import ZeroCheckpointSource
from layerwise.models.registry import FAMILIES
from zero_helpers import BIG_LAYERS, NUM_LAYERS, SAVE_STEPS, WS1_STEPS, big_config, config

STAGES = (1, 2, 3)


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

    # rank 1's file from the stage-3 save beside stage 2's rank 0: the stages disagree
    mixed = shutil.copytree(src, tmp_path / "mixed")
    stage3 = zero_dir / "zero3" / f"global_step{SAVE_STEPS[1]}"
    shutil.copy(next(stage3.glob("zero_pp_rank_1_*optim_states.pt")), next(mixed.glob("zero_pp_rank_1_*optim_states.pt")))
    with pytest.raises(ValueError, match="optimizer files have ZeRO stages"):
        ZeroCheckpointSource(mixed, config=config)

    # rank 1's record of where a parameter's fragment sits, moved by one element: refused, not
    # read by index (mutation seen failing: ``_check_fragments`` returning at once)
    moved = shutil.copytree(src, tmp_path / "moved")
    rank1 = next(moved.glob("zero_pp_rank_1_*optim_states.pt"))
    sd = torch.load(rank1, weights_only=False)  # the test's own DeepSpeed save: trusted
    frags = sd["optimizer_state_dict"]["param_slice_mappings"][0]
    name = next(iter(frags))
    frags[name] = dataclasses.replace(frags[name], start=frags[name].start + 1)
    torch.save(sd, rank1)
    with pytest.raises(ValueError, match="is not where param_shapes puts it"):
        moved_src = ZeroCheckpointSource(moved, config=config)
        for group in moved_src.groups():
            moved_src.load_group(group)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


def test_zero_file_that_would_run_code_is_refused(zero_dir, tmp_path):
    """The rank files are pickles; reading allows only tensors and four DeepSpeed classes.
    Mutation seen failing: ``weights_only=False`` in ``load_data_file`` (the marker appears)."""
    evil = tmp_path / "evil"
    shutil.copytree(zero_dir / "zero2" / f"global_step{SAVE_STEPS[1]}", evil)
    target = next(evil.glob("zero_pp_rank_0_*optim_states.pt"))
    marker = tmp_path / "ran"
    torch.save({"optimizer_state_dict": _RunsCode(marker)}, target)
    config = json.loads((zero_dir / "zero2" / "config.json").read_text())
    with pytest.raises(ValueError, match="needs posix.system to load"):
        ZeroCheckpointSource(evil, config=config)
    assert not marker.exists()


@pytest.mark.parametrize("stage", STAGES)
def test_deepspeed_resumes_from_a_merged_recipe(zero_dir, stage):
    """``merge --format deepspeed`` of a recipe (layers 0..1 from step 2, the rest from step 4),
    loaded by DeepSpeed's own ``load_checkpoint`` into a fresh 2-rank engine (``zero_helpers``):
    DeepSpeed then holds exactly the recipe's weights and moments, and trains on. Mutation seen
    failing: the writer skipping ``exp_avg_sq`` (19 mismatches a stage: the template's own moments
    of the early layers stay)."""
    run = zero_dir / f"zero{stage}"
    resumed = torch.load(run / "resumed.pt", weights_only=True)
    early, late = (torch.load(run / f"reference_step{s}.pt", weights_only=True) for s in SAVE_STEPS)
    half = NUM_LAYERS // 2
    for name, got in resumed.items():
        layer = int(name.split(".")[2]) if ".layers." in name else None
        want = early if name.startswith("model.embed_tokens") or (layer is not None and layer < half) else late
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[kind], want[name][kind]), (name, kind)
    assert math.isfinite(json.loads((run / "resumed_loss.json").read_text())["loss"])
    merged = ZeroCheckpointSource(run / "merged")
    assert merged.extra_state()["step"] == SAVE_STEPS[1]  # counters from the template (the newest save)


def test_deepspeed_format_needs_a_template(tmp_path):
    model_dir = tmp_path / "hf"
    torch.manual_seed(0)
    FAMILIES["llama"].model_class(config()).save_pretrained(model_dir)
    with pytest.raises(ValueError, match="needs --template"):
        merge(model_dir, tmp_path / "out", format="deepspeed")
    assert not (tmp_path / "out").exists()


def _rss_anon_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def _merge_peak(rank: int, src: str, out: str, fmt: str, result: str) -> None:
    """In a child of its own: the merge, with its RssAnon sampled every millisecond from just
    before the source is opened; ``{"base", "peak"}`` written to ``result``."""
    base, peak, done = _rss_anon_bytes(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss_anon_bytes())
            time.sleep(0.001)

    t = threading.Thread(target=sample)
    t.start()
    merge(open_source(src), out, format=fmt)
    done.set()
    t.join()
    Path(result).write_text(json.dumps({"base": base, "peak": peak[0]}))


@pytest.mark.parametrize("fmt", ["hf", "trainer"])
def test_zero_merge_peak_memory_is_about_one_group(zero_dir, tmp_path, fmt):
    """Converting an 8-layer ZeRO-3 save (2 ranks) reads one group at a time from memory-mapped
    rank files: the merge's peak anonymous memory (RssAnon, sampled every millisecond from
    /proc, from before the source is opened) stays under two groups' bytes (weights + both
    moments, fp32) plus 16 MiB, where the whole state is 8 groups. Mutation seen failing:
    ``mmap=False`` in ``load_zero_file`` (every rank's partitions in memory: the whole state)."""
    src = zero_dir / "big"
    cfg = big_config()
    layer_params = sum(p.numel() for p in FAMILIES["llama"].model_class(cfg).model.layers[0].parameters())
    group_bytes = 3 * 4 * layer_params
    result = tmp_path / "peak.json"
    multiproc.run(_merge_peak, (str(src), str(tmp_path / "out"), fmt, str(result)), 1,
                  log=tmp_path / "merge", stores=[], timeout_s=300)
    mem = json.loads(result.read_text())
    grew = mem["peak"] - mem["base"]
    assert grew <= 2 * group_bytes + 16 * 2**20, (grew / 2**20, group_bytes / 2**20)
    print(f"peak RssAnon growth {grew / 2**20:.1f} MiB; a group {group_bytes / 2**20:.1f} MiB; "
          f"the state {BIG_LAYERS * group_bytes / 2**20:.0f} MiB+")


def test_import_of_zero_saves_resolves_to_each_save(zero_dir, tmp_path):
    """``ckpt import`` takes ZeRO saves (step from their ``global_steps``): each step of the run
    resolves to that save's weights and moments exactly."""
    run = zero_dir / "zero3"
    saves = [run / f"global_step{s}" for s in reversed(SAVE_STEPS)]  # given newest first
    import_checkpoints(saves, tmp_path / "run", policy="full")
    for step in SAVE_STEPS:
        want = as_state(open_source(run / f"global_step{step}"))
        got = as_state(open_run_step(tmp_path / "run", step))
        assert set(got) == set(want)
        for name, kinds in want.items():
            for kind, t in kinds.items():
                assert torch.equal(got[name][kind], t), (step, name, kind)


@pytest.mark.parametrize("stage", (2, 3))
def test_two_rank_save_resumes_at_world_size_one(zero_dir, stage):
    """World size 2 -> 1: the 2-rank step-4 save merged into a 1-rank run's template and loaded
    by DeepSpeed at world size 1 holds exactly the 2-rank save's weights and moments."""
    resumed = torch.load(zero_dir / "ws1" / f"zero{stage}" / "resumed.pt", weights_only=True)
    want = torch.load(zero_dir / f"zero{stage}" / f"reference_step{SAVE_STEPS[1]}.pt", weights_only=True)
    assert set(resumed) == set(want)
    for name, kinds in want.items():
        for kind, t in kinds.items():
            assert torch.equal(resumed[name][kind], t), (name, kind)


@pytest.mark.parametrize("stage", (2, 3))
def test_one_rank_save_resumes_at_world_size_two(zero_dir, stage):
    """World size 1 -> 2: a 1-rank step-3 save merged into the 2-rank run's step-2 save (the
    template) and loaded by DeepSpeed in 2 processes holds exactly the 1-rank save's state."""
    resumed = torch.load(zero_dir / f"zero{stage}" / "resumed_from_ws1.pt", weights_only=True)
    want = torch.load(zero_dir / "ws1" / f"zero{stage}" / f"reference_step{WS1_STEPS[1]}.pt",
                      weights_only=True)
    assert set(resumed) == set(want)
    for name, kinds in want.items():
        for kind, t in kinds.items():
            assert torch.equal(resumed[name][kind], t), (name, kind)
