"""The DeepSpeed hook: layer-wise saves written by every rank of a DeepSpeed ZeRO loop (stages
1-3, 2 ranks, real DeepSpeed on CPU), resumed in fresh processes; made by the DeepSpeed session
of ``zero_helpers`` (the ``zero_dir`` fixture)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from safetensors.torch import load_file

from layerwise.ckpt.resolve import open_run_step
from layerwise.ckpt.run_dir import RunDir
from layerwise.interop.recipes.merge import merge
from layerwise.interop.sources import open_source
from layerwise.interop.deepspeed.zero_checkpoint import ZeroCheckpointSource
from zero_helpers import LW_STEP, SAVE_STEPS, TRAINER_STEPS, WORLD_SIZE

pytestmark = [pytest.mark.dist]
KINDS = ("param", "exp_avg", "exp_avg_sq")
STAGES = (1, 2, 3)
END_STEP = max(SAVE_STEPS)


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _assert_same(got: dict, want: dict, tol: float = 1e-6) -> None:
    assert set(got) == set(want)
    for name, kinds in want.items():
        for kind in KINDS:
            diff = (got[name][kind] - kinds[kind]).abs().max().item()
            assert diff <= tol, (name, kind, diff)


@pytest.mark.parametrize("stage", STAGES)
def test_resumed_deepspeed_run_equals_uninterrupted(zero_dir, stage):
    """Saved layer-wise by 2 ranks at step 2, loaded by 2 fresh processes into an engine with
    other initial weights, trained on to step 4: DeepSpeed's fp32 weights and both moments equal
    the uninterrupted run's at step 2 and at step 4 (within 1e-6; they are bit-equal here), and
    the engine's step counter is back. Mutations seen failing: ``load_shards`` not setting the
    flat's ``step`` (step 4 differs: bias correction); stage 2 without ``update_lp_params`` (the
    module keeps its initial weights: step 4 differs); stage 3 without copying the fp32
    partitions into the module's partitions (likewise)."""
    run = zero_dir / f"zero{stage}"
    for step in (LW_STEP, END_STEP):
        _assert_same(_load(run / f"lw_resumed_step{step}.pt"), _load(run / f"reference_step{step}.pt"))
    counters = json.loads((run / "lw_resumed_counters.json").read_text())
    assert counters == {"step": LW_STEP, "global_steps": LW_STEP, "world_size_saved": WORLD_SIZE}


@pytest.mark.parametrize("stage", (2, 3))
def test_two_rank_save_loads_in_one_process(zero_dir, stage):
    """A save by 2 ranks loads into a 1-rank engine (each parameter whole on one rank): the
    state DeepSpeed then holds is the 2-rank run's at the saved step."""
    _assert_same(_load(zero_dir / "ws1" / f"zero{stage}" / f"lw_loaded_step{LW_STEP}.pt"),
                 _load(zero_dir / f"zero{stage}" / f"reference_step{LW_STEP}.pt"))


def _expected_ranges(ds: ZeroCheckpointSource, name: str) -> list[tuple[int, int]]:
    """Each rank's elements of ``name`` by DeepSpeed's own save of the same step: stage 3 cuts
    every parameter in ``ceil(numel / world)`` pieces; stages 1/2 cut the param group's flat
    vector (offsets from its ``param_shapes`` and paddings) in equal partitions."""
    slot = ds._slots[name]
    n, out = slot.numel, []
    for r in range(ds.world_size):
        if ds.stage == 3:
            piece = math.ceil(n / ds.world_size)
            lo, hi = r * piece, min(n, (r + 1) * piece)
        else:
            part = ds._flat(0, slot.group).numel()
            lo = max(0, r * part - slot.offset)
            hi = min(n, (r + 1) * part - slot.offset)
        if hi > lo:
            out.append((lo, hi))
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_manifest_holds_each_ranks_partition(zero_dir, stage):
    """The committed step has, per group, one shard blob per rank that holds elements of it,
    each blob a file of its own, shards come from both ranks, and every tensor's ranges are
    exactly the ranks' ZeRO partition pieces, as DeepSpeed's own save of the same step lays
    them out; ``verify`` passes."""
    run = zero_dir / f"zero{stage}"
    lw = run / "layerwise"
    manifest = RunDir.open(lw).read_manifest(LW_STEP)
    assert manifest["world_size"] == WORLD_SIZE
    ds = ZeroCheckpointSource(run / f"global_step{LW_STEP}")
    both = 0
    for group, entry in manifest["groups"].items():
        shards = entry["shards"]
        assert [s["rank"] for s in shards] == sorted({s["rank"] for s in shards})
        for s in shards:
            assert (lw / s["blob"]).is_file()
        both += len(shards) == WORLD_SIZE and len({s["blob"] for s in shards}) == WORLD_SIZE
        names = {k.split("/", 1)[1] for s in shards for k in s["tensors"]}
        for name in names:
            for kind in KINDS:
                got = [tuple(s["tensors"][f"{kind}/{name}"]["range"]) for s in shards
                       if f"{kind}/{name}" in s["tensors"]]
                assert got == _expected_ranges(ds, name), (group, kind, name)
            assert sum(f"step/{name}" in s["tensors"] for s in shards) == 1
    ranks = {s["rank"] for e in manifest["groups"].values() for s in e["shards"]}
    assert ranks == set(range(WORLD_SIZE))
    # stage 3 splits every parameter over the ranks; stages 1/2 split the param group's flat
    # vector, so most layers lie on one rank and only those at a partition border on both
    assert both == len(manifest["groups"]) if stage == 3 else 1 <= both < len(manifest["groups"])
    report = RunDir.open(lw).verify()
    assert report.ok and report.blobs_checked == sum(len(e["shards"]) for e in manifest["groups"].values())


@pytest.mark.parametrize("stage", STAGES)
def test_layerwise_run_merges_to_hf_like_zero_to_fp32(zero_dir, stage, tmp_path):
    """``merge --format hf`` of the 2-rank layer-wise run gives exactly the fp32 weights that
    DeepSpeed's ``zero_to_fp32`` reads from DeepSpeed's own save of the same step."""
    run = zero_dir / f"zero{stage}"
    merge(open_source(run / "layerwise"), tmp_path / "hf", format="hf")
    got = load_file(tmp_path / "hf" / "model.safetensors")
    want = get_fp32_state_dict_from_zero_checkpoint(str(run), tag=f"global_step{LW_STEP}")
    assert set(got) == set(want)
    for k, t in want.items():
        assert torch.equal(got[k], t), k


@pytest.mark.parametrize("stage", STAGES)
def test_partition_metadata_that_disagrees_is_refused(zero_dir, stage):
    """One parameter's partition metadata moved by one element (stage 3: ``grad_position``;
    stage 2: the fragment's place in the partition), and pieces of two ranks that overlap by
    one element: each refused, naming the parameter. Mutations seen failing: the stage-3 offset
    check removed (the moved metadata is read as given); a cover check that walked the sorted
    pieces and stopped at the first that did not follow on (an overlap at a parameter's end
    passed: the first version of ``check_cover``)."""
    errors = json.loads((zero_dir / f"zero{stage}" / "layout_errors.json").read_text())
    assert "disagrees" in errors["offset"] and "model.layers.0.self_attn.q_proj.weight" in errors["offset"]
    assert "do not cover" in errors["cover"] and "model.embed_tokens.weight" in errors["cover"]


def test_trainer_with_deepspeed_writes_layerwise_shards(zero_dir):
    """``LayerwiseCheckpointCallback`` in an HF Trainer with DeepSpeed ZeRO-3 on 2 ranks: every
    2 steps each rank writes its own pieces; the last step resolves to exactly the state
    DeepSpeed holds at the end of training, and keeps the ``TrainerState`` where
    ``merge --format trainer`` reads it.

    Mutation seen failing: ``ShardedCheckpointer`` writing ``trainer_state: None``."""
    out = zero_dir / "trainer"
    assert json.loads((out / "saved_steps.json").read_text()) == [2, TRAINER_STEPS]
    rs = open_run_step(out / "layerwise", TRAINER_STEPS)
    assert rs.manifest["world_size"] == WORLD_SIZE
    ref = _load(out / "reference.pt")
    got: dict[str, dict[str, torch.Tensor]] = {}
    for group in rs.groups():
        assert {s["rank"] for s in rs.manifest["groups"][group]["shards"]} == {0, 1}
        for key, t in rs.load_group(group).items():
            kind, name = key.split("/", 1)
            got.setdefault(name, {})[kind] = t
    _assert_same(got, ref, tol=0.0)
    assert all(float(got[n]["step"]) == TRAINER_STEPS for n in got)
    assert rs.extra_state()["trainer_state"]["global_step"] == TRAINER_STEPS  # --format trainer
