"""Core layer-wise checkpoint behaviour: groups, policies round trip, composites, resume, dedupe."""

from __future__ import annotations

import json

import pytest
import torch

from layerwise.ckpt import (
    POLICIES,
    BasePolicy,
    CheckpointCorruptError,
    Checkpointer,
    RunDir,
    open_run_step,
)
from layerwise.models.names import group_of, groups_of_model
from layerwise.ckpt.provider import ModuleStateProvider

from test_core_helpers import assert_group_equal, make_training, snapshot, tiny_llama, train_step


def test_group_names():
    assert group_of("model.embed_tokens.weight") == "embed"
    assert group_of("model.layers.11.self_attn.q_proj.weight") == "layers.11"
    assert group_of("model.norm.weight") == "norm"
    assert group_of("lm_head.weight") == "lm_head"
    assert group_of("lm_head.weight", tied=True) == "embed"
    assert group_of("model.vision_tower.proj.bias") == "model.vision_tower.proj"
    untied = groups_of_model(tiny_llama())
    assert list(untied) == ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"]
    tied = groups_of_model(tiny_llama(flavor="llama-debug-tied"))
    assert "lm_head" not in tied and tied["embed"] == ["model.embed_tokens.weight"]
    assert sum(len(v) for v in untied.values()) == len(list(tiny_llama().parameters()))


@pytest.mark.parametrize("policy,options", [
    ("full", {}),
    ("parity", {}),
    ("filter", {"threshold": 0.02, "max_staleness": 2}),
    ("topk", {"k": 2, "max_staleness": 3}),
    ("budget", {"budget_fraction": 0.3, "full_every": 3}),
])
def test_round_trip_every_policy(tmp_path, policy, options):
    assert policy in POLICIES
    model, opt, sched = make_training()
    ck = Checkpointer(tmp_path / "run", model, opt, sched, policy=policy, **options)
    snaps = {}
    for step in range(1, 9):
        train_step(model, opt, sched)
        if step % 2 == 0:
            ck.save(step, extra={"note": f"s{step}"}, data_position=step * 7)
            snaps[step] = snapshot(model, opt)
    ck.wait()
    rs = open_run_step(tmp_path / "run")
    assert rs.step == 8 and rs.policy == policy
    # The policy shows up in what was written.
    written = [json.loads((ck.store.manifest_path(s)).read_text())["groups_written"] for s in snaps]
    if policy == "full":
        assert all(len(w) == 7 for w in written)
    else:
        assert any(len(w) < 7 for w in written[1:]), written
    # Load into a differently initialised model: every group equals the version it was saved at.
    model2, opt2, sched2 = make_training(seed=1)
    res = Checkpointer(tmp_path / "run", model2, opt2, sched2, policy=policy, **options).load()
    assert res.step == 8 and res.extra == {"note": "s8"} and res.data_position == 56
    got = snapshot(model2, opt2)
    for g, e in rs.entries.items():
        assert_group_equal(got[g], snaps[e.saved_step][g], f"{policy}/{g}@{e.saved_step}")
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]


class ScriptedPolicy(BasePolicy):
    """Writes exactly the groups scripted for each checkpoint (tests pluggability)."""

    name = "scripted"

    def __init__(self, script):
        super().__init__()
        self.script = script

    def choose(self, ctx, forced):
        return set(self.script.get(ctx.step, ()))


def test_composite_of_three_partial_saves(tmp_path):
    model, opt, sched = make_training()
    script = {10: ["layers.0", "embed"], 20: ["layers.1", "norm"], 30: ["layers.0", "lm_head"]}
    ck = Checkpointer(tmp_path / "run", model, opt, sched, policy=ScriptedPolicy(script))
    snaps = {}
    for step in (0, 10, 20, 30):
        train_step(model, opt, sched)
        ck.save(step)
        snaps[step] = snapshot(model, opt)
    ck.wait()
    expected = {"embed": 10, "layers.0": 30, "layers.1": 20, "layers.2": 0, "layers.3": 0,
                "norm": 20, "lm_head": 30}
    rs = open_run_step(tmp_path / "run", 30)
    assert {g: e.saved_step for g, e in rs.entries.items()} == expected
    # The state at a step that was not checkpointed is the newest version <= it.
    assert open_run_step(tmp_path / "run", 25).step == 20
    model2, opt2, sched2 = make_training(seed=3)
    Checkpointer(tmp_path / "run", model2, opt2, sched2).load(30)
    got = snapshot(model2, opt2)
    for g, s in expected.items():
        assert_group_equal(got[g], snaps[s][g], f"{g}@{s}")
        assert_group_equal(rs.load_group(g), snaps[s][g], f"source {g}@{s}")
    # A partial save writes only its groups' bytes.
    m20 = json.loads(ck.store.manifest_path(20).read_text())
    assert sorted(m20["groups_written"]) == ["layers.1", "norm"]


def test_full_resume_is_bit_identical(tmp_path):
    def run(n, model, opt, sched):
        for _ in range(n):
            train_step(model, opt, sched)

    torch.manual_seed(123)
    ref = make_training(seed=0)
    torch.manual_seed(123)
    run(6, *ref)

    torch.manual_seed(123)
    a = make_training(seed=0)
    torch.manual_seed(123)
    run(3, *a)
    with Checkpointer(tmp_path / "run", *a, policy="full") as ck:
        ck.save(3)
    torch.manual_seed(999)  # the resumed process starts from unrelated RNG and weights
    b = make_training(seed=7)
    assert Checkpointer(tmp_path / "run", *b, policy="full").load().step == 3
    run(3, *b)
    want, got = snapshot(ref[0], ref[1]), snapshot(b[0], b[1])
    for g in want:
        assert_group_equal(got[g], want[g], g)
    assert b[2].state_dict() == ref[2].state_dict()
    assert b[1].param_groups[0]["lr"] == ref[1].param_groups[0]["lr"]


def test_frozen_layers_are_stored_once(tmp_path):
    model, opt, sched = make_training()
    for p in model.model.layers[1].parameters():
        p.requires_grad_(False)
    ck = Checkpointer(tmp_path / "run", model, opt, sched, policy="full", async_save=False)
    reports = []
    for step in range(4):
        train_step(model, opt, sched)
        reports.append(ck.save(step))
    assert "layers.1" in reports[0].written
    assert all("layers.1" in r.selected and "layers.1" not in r.written for r in reports[1:])
    blobs = {e.blob for s in range(4) for g, e in open_run_step(tmp_path / "run", s).entries.items()
             if g == "layers.1"}
    assert len(blobs) == 1
    rs = open_run_step(tmp_path / "run")
    assert rs.entries["layers.1"].written_step == 0 and rs.entries["layers.1"].saved_step == 3
    n_files = sum(1 for _ in (tmp_path / "run" / "blobs").rglob("*.safetensors"))
    assert n_files == 7 + 3 * 6  # every other group is new at every step


def test_flipped_byte_is_caught_by_verify_and_load(tmp_path):
    model, opt, sched = make_training()
    with Checkpointer(tmp_path / "run", model, opt, sched) as ck:
        train_step(model, opt, sched)
        ck.save(1)
    store = RunDir.open(tmp_path / "run")
    assert store.verify().ok
    blob = open_run_step(tmp_path / "run").entries["layers.2"].blob_path
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    rep = store.verify()
    assert not rep.ok and any("layers.2" in f and "checksum" in f for f in rep.faults)
    model2, opt2, sched2 = make_training(seed=1)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        Checkpointer(tmp_path / "run", model2, opt2, sched2).load()


def test_gc_keeps_every_blob_a_kept_step_needs(tmp_path):
    model, opt, sched = make_training()
    ck = Checkpointer(tmp_path / "run", model, opt, sched, policy="parity")
    for step in range(6):
        train_step(model, opt, sched)
        ck.save(step)
    ck.wait()
    store = RunDir.open(tmp_path / "run")
    before = sum(1 for _ in (tmp_path / "run" / "blobs").rglob("*.safetensors"))
    rep = store.gc(keep=2)
    assert rep.kept_steps == [4, 5] and rep.dropped_steps == [0, 1, 2, 3] and rep.removed_blobs > 0
    after = sum(1 for _ in (tmp_path / "run" / "blobs").rglob("*.safetensors"))
    assert after == before - rep.removed_blobs
    assert store.verify().ok and store.committed_steps() == [4, 5]
    for s in (4, 5):
        rs = open_run_step(tmp_path / "run", s)
        for g in rs.groups():
            rs.load_group(g)
    with pytest.raises(ValueError, match="at least 1"):
        store.gc(keep=0)


def test_user_errors_are_clear(tmp_path):
    model, opt, sched = make_training()
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        Checkpointer(tmp_path / "a", model, opt, policy="nope")
    with pytest.raises(ValueError, match="no option"):
        Checkpointer(tmp_path / "b", model, opt, policy="filter", treshold=0.1)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="not a layerwise checkpoint run"):
        Checkpointer(tmp_path / "c", model, opt)
    with Checkpointer(tmp_path / "d", model, opt) as ck:
        ck.save(0)
    other = tiny_llama(flavor="llama-debug-tied")
    with pytest.raises(ValueError, match="does not match the model"):
        Checkpointer(tmp_path / "d", other, torch.optim.AdamW(other.parameters())).load()
    with pytest.raises(FileNotFoundError):
        open_run_step(tmp_path / "nothing")
    assert ModuleStateProvider(model, opt).model_config()["model_type"] == "llama"


def _norm(ts) -> float:
    return float(torch.stack([t.detach().double().norm() for t in ts]).norm())


def test_tracker_log_and_async_reports(tmp_path):
    """The tracker's statistics equal the norms computed by hand from the model and optimizer.

    Mutations this test was seen to catch: ``change`` measured against the live weights' own
    norm instead of the saved version's; the gradient norm taken over the moments.
    """
    model, opt, sched = make_training()
    ck = Checkpointer(tmp_path / "run", model, opt, sched, policy="filter", threshold=0.0,
                      track_every_steps=2)
    layer0 = list(model.model.layers[0].parameters())
    x = torch.randint(0, 96, (2, 12))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    assert ck.observe(1) is None  # not a tracking step
    stats = ck.observe(2)
    assert set(stats) == set(ck.groups)
    assert stats["layers.0"]["grad_norm"] == pytest.approx(_norm(p.grad for p in layer0), rel=1e-5)
    assert stats["layers.0"]["change"] == float("inf")  # never saved yet
    rep = ck.save(2)
    saved = [p.detach().clone() for p in layer0]
    assert rep.deferred and rep.blocked_s >= rep.wait_s >= 0  # snapshot taken after save()
    ck.wait()
    assert rep.snapshot_bytes > 0 and rep.snapshot_s > 0
    assert rep.write_s > 0 and rep.bytes_written > 0 and sorted(rep.written) == sorted(ck.groups)
    opt.zero_grad()
    train_step(model, opt, sched)
    stats = ck.observe(4)
    assert all(0 < s["change"] < 1 for s in stats.values())
    want = _norm(p - q for p, q in zip(layer0, saved)) / _norm(saved)
    assert stats["layers.0"]["change"] == pytest.approx(want, rel=1e-5)
    assert stats["layers.0"]["exp_avg_norm"] == pytest.approx(
        _norm(opt.state[p]["exp_avg"] for p in layer0), rel=1e-5)
    assert stats["layers.0"]["exp_avg_sq_norm"] == pytest.approx(
        _norm(opt.state[p]["exp_avg_sq"] for p in layer0), rel=1e-5)
    lines = [json.loads(x) for x in (tmp_path / "run" / "tracker.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [2, 4]
    assert lines[0]["groups"]["embed"]["change"] is None and lines[1]["groups"]["embed"]["change"] > 0
    ck.close()


def test_a_failed_resave_of_a_committed_step_leaves_the_previous_commit_loadable(tmp_path, monkeypatch):
    """A resumed run saves a step number again and dies before committing it."""
    from layerwise.ckpt import open_run_step
    from layerwise.ckpt.run_dir import RunDir
    from layerwise.ckpt.provider import DictStateProvider

    def provider(v):
        return DictStateProvider({"layers.0": {"param/layers.0.w": torch.full((8,), float(v))}})

    run = tmp_path / "run"
    with Checkpointer(run, provider=provider(1), policy="full", async_save=False, save_rng=False) as ck:
        ck.save(1, extra={"v": 1})
        ck.save(2, extra={"v": 2})

    class Crash(BaseException):
        pass

    def crash(self, step, manifest):
        raise Crash()

    monkeypatch.setattr(RunDir, "commit", crash)
    ck = Checkpointer(run, provider=provider(5), policy="full", async_save=False, save_rng=False)
    with pytest.raises(Crash):
        ck.save(2, extra={"v": "resumed"})
    monkeypatch.undo()
    store = RunDir.open(run)
    assert store.committed_steps() == [1]
    assert store.verify().faults == []
    rs = open_run_step(run)
    assert rs.step == 1 and rs.state()["extra"] == {"v": 1}
    assert torch.equal(rs.load_group("layers.0")["param/layers.0.w"], torch.full((8,), 1.0))
