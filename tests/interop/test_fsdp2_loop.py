"""Layer-wise saves of an FSDP2 loop (``interop.fsdp`` on ``ckpt.sharded``), in gloo processes.

One scenario, three launches (module fixture), then checks:

- ``train``: 2 ranks train a tiny Llama (vocabulary 97: the embedding and head shard unevenly,
  49 + 48 rows) for steps 1..4, saving at 1, 2, 3 with ``topk`` (k=2, ``full_every=2``: saves 1
  and 3 write everything, save 2 the two groups that moved most);
- ``one_rank``: 1 rank loads step 3 (written by 2) into a copy of the run, trains to 4 on the
  whole batch, saves step 4 (topk: the two groups that moved most now have one shard, the rest
  keep two);
- ``resume``: 2 fresh ranks load that mixed step 4, then (over it) step 3 of the 2-rank run,
  and train to 4.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import multiproc
from layerwise.ckpt import CheckpointCorruptError, RunDir, open_run_step
from layerwise.interop.torchdist.dcp_checkpoint import DCPCheckpointSource
from layerwise.interop.hooks.fsdp2_loop import fsdp_checkpointer
from layerwise.interop.recipes.merge import merge
from layerwise.interop.recipes.recipe import RecipeSource, parse_recipe
from layerwise.interop.hf.trainer_checkpoint import trainer_param_groups
from layerwise.models.registry import FAMILIES, get_flavor

VOCAB, STEPS, RESUME_AT, BATCH, SEQ = 97, 4, 3, 4, 8
pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]


def _build():
    torch.manual_seed(0)
    model = FAMILIES["llama"].model_class(get_flavor("llama-debug").build_config(vocab_size=VOCAB))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    named = dict(model.named_parameters())
    decay, no_decay = trainer_param_groups(model)
    opt = torch.optim.AdamW([{"params": [named[n] for n in decay], "weight_decay": 0.1},
                             {"params": [named[n] for n in no_decay], "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.8, 0.95))
    return model, opt


def _train_step(model, opt, step: int, rank: int, world: int) -> None:
    """The step's global batch (the same at any world size), this rank's rows of it."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    rows = BATCH // world
    mine = ids[rank * rows:(rank + 1) * rows]
    model(mine, labels=mine).loss.backward()
    opt.step()
    opt.zero_grad()


def _full(t):
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _full_state(model, opt) -> dict[str, torch.Tensor]:
    """Weights, moments and steps, gathered whole (a collective: every rank calls it)."""
    out = {}
    for n, p in model.named_parameters():
        out["param/" + n] = _full(p)
        for k, v in opt.state.get(p, {}).items():
            out[f"{k}/{n}"] = _full(v)
    return out


def _worker(rank: int, world: int, runs: list[str], phase: str, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, opt = _build()
    ck = fsdp_checkpointer(runs[0], model, opt, policy="topk", k=2, full_every=2, timeout_s=60)
    dumps: dict = {}
    start = 1
    if phase == "resume":  # first the mixed run's step 4, then over it this run's step 3
        mixed = fsdp_checkpointer(runs[1], model, opt, policy="topk", k=2, timeout_s=60)
        mixed.load(STEPS)
        dumps["reloaded"] = _full_state(model, opt)
    if phase != "train":
        res = ck.load(RESUME_AT)
        dumps["loaded"] = _full_state(model, opt)
        dumps["world_size_saved"] = res.world_size_saved
        start = res.step + 1
    for step in range(start, STEPS + 1):
        _train_step(model, opt, step, rank, world)
        if phase == "train" and step <= RESUME_AT:
            rep = ck.save(step)
            dumps[f"report{step}"] = {"selected": rep.selected, "changes": rep.changes}
            dumps[f"state{step}"] = _full_state(model, opt)
        if phase == "one_rank" and step == STEPS:
            rep = ck.save(step)
            dumps["report4"] = {"selected": rep.selected, "changes": rep.changes}
    dumps["final"] = _full_state(model, opt)
    if rank == 0:
        torch.save(dumps, out)


def _launch(world: int, runs: list[Path], phase: str, tmp: Path) -> dict:
    out = tmp / f"{phase}.pt"
    multiproc.run(_worker, (world, [str(r) for r in runs], phase, str(out)), world,
                  log=tmp / phase)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    run, mixed = tmp / "run", tmp / "mixed"
    train = _launch(2, [run], "train", tmp)
    # The 1-rank continuation writes step 4 into a copy, so the 2-rank run stays as saved.
    shutil.copytree(run, mixed)
    one = _launch(1, [mixed], "one_rank", tmp)
    resume = _launch(2, [run, mixed], "resume", tmp)
    return dict(run=run, mixed=mixed, train=train, resume=resume, one=one)


def _diff(a: dict, b: dict, atol: float = 0.0) -> list[str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return [k for k in a if not torch.allclose(a[k].float(), b[k].float(), rtol=0, atol=atol)]


def test_resume_at_the_same_world_size_equals_the_uninterrupted_run(scenario):
    """Save at step 3 by 2 ranks, fresh processes load it and train to 4: weights, both moments
    and every step counter equal the uninterrupted run's, bit for bit. Mutation seen failing:
    ``load_shards`` reading ``exp_avg/`` into ``exp_avg_sq`` too. (``local_range`` starting every
    shard at 0 is refused earlier, by the save's cover check: the ranks' ranges overlap.)"""
    assert _diff(scenario["resume"]["loaded"], scenario["train"]["state3"]) == []
    assert _diff(scenario["resume"]["final"], scenario["train"]["final"]) == []


def test_the_manifest_records_each_ranks_range(scenario):
    """Every group of step 3 has one shard per rank; the uneven embedding's ranges are
    torch.chunk's rows (49 + 48 of 97, FSDP2's padding not stored); ``step`` is stored once."""
    m = RunDir.open(scenario["run"]).read_manifest(RESUME_AT)
    assert m["format_version"] == 6 and m["world_size"] == 2
    for g, e in m["groups"].items():
        assert e["world_size"] == 2 and [s["rank"] for s in e["shards"]] == [0, 1], g
    emb = m["groups"]["embed"]["shards"]
    key = "param/model.embed_tokens.weight"
    width = emb[0]["tensors"][key]["shape"][1]
    assert [s["tensors"][key]["range"] for s in emb] == [[0, 49 * width], [49 * width, 97 * width]]
    assert emb[0]["tensors"][key]["shape"] == [VOCAB, width]
    steps = [k for s in emb for k in s["tensors"] if k.startswith("step/")]
    assert steps == ["step/model.embed_tokens.weight"]
    on_disk = sum((scenario["run"] / s["blob"]).stat().st_size for s in emb)
    assert on_disk == m["groups"]["embed"]["nbytes"]


def test_the_policy_sees_the_global_change(scenario):
    """Save 2 (topk, k=2) reports every group's relative change over both ranks: equal to the
    change computed here from the whole tensors (step-1 version in the run vs the gathered step-2
    weights), and it chose the two largest. Mutation seen failing: ``PartialStats.combine``
    summing rank 0's parts only (``parts[:1]``)."""
    rep, now = scenario["train"]["report2"], scenario["train"]["state2"]
    old = open_run_step(scenario["run"], 1)
    want = {}
    for g in old.groups():
        ref = {k: t for k, t in old.load_group(g).items() if k.startswith("param/")}
        num = math.sqrt(sum(float((now[k] - r).norm()) ** 2 for k, r in ref.items()))
        den = math.sqrt(sum(float(r.norm()) ** 2 for r in ref.values()))
        want[g] = num / den
    for g, c in want.items():
        assert rep["changes"][g] == pytest.approx(c, rel=1e-5), g
    top2 = sorted(want, key=want.get, reverse=True)[:2]
    assert sorted(rep["selected"]) == sorted(top2)
    assert open_run_step(scenario["run"], 2).entries[top2[0]].saved_step == 2


def test_two_ranks_to_one_and_one_to_two(scenario):
    """One process loads the 2-rank step 3 exactly and trains on (the whole batch: the same
    step up to reduction order); its step 4 (2 groups rewritten with one shard, the rest still
    two) loads into 2 ranks exactly. Mutation seen failing: ``ShardedGroupReader.read`` copying
    each piece to the start of the output (``out[:hi - lo]``)."""
    one, reloaded = scenario["one"], scenario["resume"]["reloaded"]
    assert one["world_size_saved"] == 2
    assert _diff(one["loaded"], scenario["train"]["state3"]) == []
    assert _diff(one["final"], scenario["train"]["final"], atol=1e-5) == []
    m = RunDir.open(scenario["mixed"]).read_manifest(STEPS)
    sizes = {g: e["world_size"] for g, e in m["groups"].items()}
    assert sorted(one["report4"]["selected"]) == sorted(g for g, w in sizes.items() if w == 1)
    assert len([w for w in sizes.values() if w == 1]) == 2 and 2 in sizes.values()
    # step 4 is a composite: the groups written at 4 as trained by one rank, the rest as of 3
    rs = open_run_step(scenario["mixed"], STEPS)
    for g in rs.groups():
        source = one["final"] if sizes[g] == 1 else scenario["train"]["state3"]
        keys = rs.load_group(g)
        assert _diff({k: reloaded[k] for k in keys}, {k: source[k] for k in keys}) == [], g
    assert set(reloaded) == {k for g in rs.groups() for k in rs.load_group(g)}


def test_ranged_read_opens_only_overlapping_shards(scenario):
    """A range inside rank 0's rows reads only rank 0's shard; one across the boundary reads
    both and equals the whole tensor's slice."""
    rs = open_run_step(scenario["run"], RESUME_AT)
    key = "param/model.embed_tokens.weight"
    whole = scenario["train"]["state3"][key].reshape(-1)
    r = rs.group_reader("embed")
    assert torch.equal(r.read(key, 10, 20), whole[10:20]) and r.shards_read == {0}
    cut = r.layout[key].pieces[0][1]
    assert torch.equal(r.read(key, cut - 5, cut + 5), whole[cut - 5:cut + 5])
    assert r.shards_read == {0, 1}


def test_merge_to_hf_of_an_fsdp2_run(scenario, tmp_path):
    """``merge --format hf`` of the sharded step 3 gives a model dir with the run's weights."""
    merge(open_run_step(scenario["run"], RESUME_AT), tmp_path / "hf", format="hf")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32)
    want = scenario["train"]["state3"]
    for n, p in hf.named_parameters():
        assert torch.equal(p.detach(), want["param/" + n]), n


def _copy(run: Path, tmp: Path) -> Path:
    out = tmp / "copy"
    shutil.copytree(run, out)
    return out


def test_a_corrupt_or_missing_shard_fails_verify_and_load(scenario, tmp_path):
    """One flipped byte in rank 1's shard of ``layers.0`` and rank 0's shard of ``norm``
    deleted: verify names both (group, blob, why); loading either group refuses. Mutation seen
    failing: ``verify`` checking only ``entry_blobs(e)[0]`` (the first shard)."""
    run = _copy(scenario["run"], tmp_path)
    m = RunDir.open(run).read_manifest(RESUME_AT)
    bad = run / m["groups"]["layers.0"]["shards"][1]["blob"]
    data = bytearray(bad.read_bytes())
    data[-3] ^= 0x10
    bad.write_bytes(bytes(data))
    gone = m["groups"]["norm"]["shards"][0]["blob"]
    (run / gone).unlink()
    rep = RunDir.open(run).verify([RESUME_AT])
    assert any("layers.0" in f and "checksum mismatch" in f and bad.name in f for f in rep.faults), rep.faults
    assert any("norm" in f and gone in f and "missing" in f for f in rep.faults), rep.faults
    rs = open_run_step(run, RESUME_AT)
    for g in ("layers.0", "norm"):
        with pytest.raises(CheckpointCorruptError):
            rs.load_group(g)
    rs.load_group("layers.1")  # the others still load


def test_a_manifest_whose_ranges_overlap_or_leave_a_gap_is_refused(scenario, tmp_path):
    """Rank 1's range of a weight moved one element down (overlap) or up (gap): verify reports
    it and loading the group fails, naming the key. Mutation seen failing: the cover check in
    ``shard_layout`` comparing ``start > pos`` only (an overlap passes)."""
    for shift, what in ((-1, "overlaps"), (1, "uncovered")):
        run = tmp_path / f"r{shift}"
        shutil.copytree(scenario["run"], run)
        path = RunDir.open(run).manifest_path(RESUME_AT)
        m = json.loads(path.read_text())
        rec = m["groups"]["layers.0"]["shards"][1]["tensors"]
        key = next(k for k in rec if k.startswith("param/"))
        start, stop = rec[key]["range"]
        rec[key]["range"] = [start + shift, stop]
        path.write_text(json.dumps(m))
        rep = RunDir.open(run).verify([RESUME_AT])
        assert any(what in f and key in f for f in rep.faults), rep.faults
        with pytest.raises(CheckpointCorruptError, match=what):
            open_run_step(run, RESUME_AT).load_group("layers.0")


def test_recipe_of_two_sharded_steps_exports_to_dcp(scenario, tmp_path):
    """An FSDP2 run as a recipe source: layers 0-1 from step 2 (a composite of saves 1 and 2),
    the rest from step 3, written as a DCP dir; read back, every group is its source step's
    reassembled group."""
    run = scenario["run"]
    recipe = parse_recipe({"slices": [{"sources": [{"model": f"{run}@2", "layer_range": [0, 2]}]},
                                      {"sources": [{"model": f"{run}@3", "layer_range": [2, 4]}]}]})
    merge(RecipeSource(recipe), tmp_path / "dcp", format="dcp")
    back = DCPCheckpointSource(tmp_path / "dcp")
    step_of = {"embed": 2, "layers.0": 2, "layers.1": 2, "layers.2": 3, "layers.3": 3, "norm": 3, "lm_head": 3}
    for g, step in step_of.items():
        want = open_run_step(run, step).load_group(g)
        got = back.load_group(g)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), g


def test_gc_keeps_the_shards_of_kept_steps(scenario, tmp_path):
    """``gc --keep 1`` on the 2-rank run keeps exactly the shard blobs step 3 names and drops
    the rest; step 3 still verifies and loads. Mutation seen failing: gc collecting only
    ``e.get("blob")`` of each entry (every shard blob is then removed)."""
    run = _copy(scenario["run"], tmp_path)
    store = RunDir.open(run)
    m = store.read_manifest(RESUME_AT)
    named = {s["blob"] for e in m["groups"].values() for s in e["shards"]}
    rep = store.gc(keep=1)
    assert rep.kept_steps == [RESUME_AT] and rep.removed_blobs > 0
    on_disk = {str(p.relative_to(run)) for p in (run / "blobs").rglob("*.safetensors")}
    assert on_disk == named
    assert store.verify().ok
    got = open_run_step(run).load_group("embed")["param/model.embed_tokens.weight"]
    assert torch.equal(got, scenario["train"]["state3"]["param/model.embed_tokens.weight"])
