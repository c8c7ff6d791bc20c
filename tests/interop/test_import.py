"""``layerwise ckpt import``: ten Trainer checkpoints of one run, whose layers change unevenly,
compacted into a layer-wise run under ``full`` (deduplication only) and ``filter``."""

from __future__ import annotations

import json
import random
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from layerwise.ckpt import RunDir
from layerwise.cli import main
from layerwise.ckpt.resolve import open_run_step
from layerwise.interop.recipes.import_checkpoints import import_checkpoints
from layerwise.interop.recipes.merge import merge
from layerwise.interop.hf.trainer_checkpoint import TrainerCheckpointSource

from ckpt.test_core_helpers import tiny_llama  # tests/ckpt, whichever folder runs first
from trainer_helpers import make_trainer

NUM_CHECKPOINTS = 10
MOVES = {"embed": 0.05, "layers.0": 0.05, "layers.1": 1e-6, "layers.2": 0.0, "layers.3": 0.0,
         "norm": 1e-6, "lm_head": 0.05}
"""Relative weight change per checkpoint of each group; 0: frozen (no optimizer state, the
same bytes in every checkpoint)."""
FILTER = "filter:threshold=0.001"


class MemorySource:
    """A training state in memory as a ``CheckpointSource`` (what ``merge`` writes from)."""

    def __init__(self, groups: dict[str, dict[str, torch.Tensor]], config: dict, step: int):
        self.state, self.config, self.step = groups, config, step

    def groups(self):
        return list(self.state)

    def load_group(self, group):
        return self.state[group]

    def model_config(self):
        return self.config

    def extra_state(self):
        return {"step": self.step, "scheduler": None, "rng": None, "trainer_state": None}


def _state(model) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    names = {"model.embed_tokens": "embed", "model.norm": "norm", "lm_head": "lm_head"}
    g = torch.Generator().manual_seed(1)
    for n, p in model.named_parameters():
        prefix = n.rsplit(".", 1)[0]
        group = names.get(prefix) or ".".join(n.split(".")[1:3])
        ts = out.setdefault(group, {})
        ts["param/" + n] = p.detach().clone()
        if MOVES[group] > 0:
            ts["exp_avg/" + n] = torch.randn(p.shape, generator=g) * 1e-3
            ts["exp_avg_sq/" + n] = torch.rand(p.shape, generator=g) * 1e-6
            ts["step/" + n] = torch.tensor(0.0)
    return out


def _advance(state, step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for group, ts in state.items():
        if MOVES[group] == 0:
            continue
        for k, t in ts.items():
            if k.startswith("param/"):
                t.add_(torch.randn(t.shape, generator=g) * MOVES[group] * t.norm() / t.numel() ** 0.5)
            elif k.startswith("step/"):
                t.fill_(step)
            else:
                t.mul_(0.9).add_(torch.rand(t.shape, generator=g) * 1e-4)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    """Ten ``checkpoint-N`` dirs written by the Trainer writer (``merge --format trainer``)."""
    root = tmp_path_factory.mktemp("trainer_out")
    model = tiny_llama(0)
    config = model.config.to_dict()
    state = _state(model)
    out = []
    for k in range(1, NUM_CHECKPOINTS + 1):
        _advance(state, 10 * k)
        merge(MemorySource(state, config, 10 * k), root / f"checkpoint-{10 * k}", "trainer")
        out.append(root / f"checkpoint-{10 * k}")
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_full_import_dedups_and_resolves_to_the_last_checkpoint(checkpoints, tmp_path):
    """Under ``full`` every step is complete: the composite at the last step equals the last
    checkpoint group by group (weights, moments, step counts), and each earlier step equals its
    checkpoint; frozen layers are stored once; ``verify`` is clean. Checkpoints are given newest
    first and still imported oldest first.

    Mutation this fails on (made once, by hand): ``_ordered`` keeping the order given (the last
    step is then the oldest checkpoint)."""
    run = tmp_path / "full"
    rep = import_checkpoints(list(reversed(checkpoints)), run)
    assert [s.step for s in rep.steps] == [10 * k for k in range(1, NUM_CHECKPOINTS + 1)]
    frozen = {g for g, m in MOVES.items() if m == 0}
    for s in rep.steps[1:]:
        assert set(s.written) == set(MOVES) - frozen, s
    for path, s in zip(checkpoints, rep.steps):
        src, rs = TrainerCheckpointSource(path), open_run_step(run, s.step)
        assert rs.step == s.step
        for g in src.groups():
            assert _equal(rs.load_group(g), src.load_group(g)), (s.step, g)
    assert RunDir.open(run).verify().ok
    blobs = sum(f.stat().st_size for f in (run / "blobs").rglob("*") if f.is_file())
    assert rep.stored_bytes >= blobs
    assert rep.stored_bytes < rep.input_bytes


def test_filter_import_stores_what_moved(checkpoints, tmp_path):
    """Under ``filter`` the groups that barely move (1e-6 per checkpoint, under the threshold)
    are stored only with the first checkpoint; at the last step the picked groups equal the last
    checkpoint and every other group equals the checkpoint of the step it was stored at. Stored
    bytes: less than ``full``'s, which are less than the inputs'.

    Mutation this fails on (made once, by hand): ``ImportProvider.use`` not switching
    ``self.source`` (every step re-imports the first checkpoint: the last step's picked groups
    differ from the last checkpoint)."""
    full = import_checkpoints(checkpoints, tmp_path / "full")
    rep = import_checkpoints(checkpoints, tmp_path / "filter", FILTER)
    moved = {g for g, m in MOVES.items() if m > 1e-3}
    for s in rep.steps[1:]:
        assert set(s.selected) == moved, s
    rs = open_run_step(tmp_path / "filter")
    by_step = {10 * (i + 1): p for i, p in enumerate(checkpoints)}
    for g, e in rs.entries.items():
        want = TrainerCheckpointSource(by_step[e.saved_step]).load_group(g)
        assert _equal(rs.load_group(g), want), g
        assert (e.saved_step == rs.step) == (g in moved), g
    assert RunDir.open(tmp_path / "filter").verify().ok
    assert rep.stored_bytes < full.stored_bytes < full.input_bytes == rep.input_bytes


def test_an_import_in_two_parts_stores_what_one_import_stores(checkpoints, tmp_path):
    """Continuing a run measures changes against its stored versions, so the second part picks
    the groups the single import picks, and the runs end with the same blobs.

    Mutation this fails on (made once, by hand): the tracker references not seeded from the
    run in ``import_checkpoints`` (the second part's first step writes every group)."""
    one = import_checkpoints(checkpoints, tmp_path / "one", FILTER)
    import_checkpoints(checkpoints[:5], tmp_path / "two", FILTER)
    second = import_checkpoints(checkpoints[5:], tmp_path / "two", FILTER)
    assert [s.selected for s in second.steps] == [s.selected for s in one.steps[5:]]
    a, b = open_run_step(tmp_path / "one"), open_run_step(tmp_path / "two")
    assert {g: e.blob for g, e in a.entries.items()} == {g: e.blob for g, e in b.entries.items()}


def test_hf_model_dirs_are_numbered_in_the_order_given(checkpoints, tmp_path):
    dirs = []
    for i in (2, 0):
        merge(checkpoints[i], tmp_path / f"hf-{i}", "hf")
        dirs.append(tmp_path / f"hf-{i}")
    rep = import_checkpoints(dirs, tmp_path / "run")
    assert [(s.step, s.source) for s in rep.steps] == [(1, str(dirs[0])), (2, str(dirs[1]))]
    rs, src = open_run_step(tmp_path / "run", 2), TrainerCheckpointSource(checkpoints[0])
    for g in rs.groups():
        want = {k: t for k, t in src.load_group(g).items() if k.startswith("param/")}
        assert _equal(rs.load_group(g), want), g
    with pytest.raises(ValueError, match="some checkpoints have a step"):
        import_checkpoints([dirs[0], checkpoints[0]], tmp_path / "mixed")


def test_one_group_at_a_time(checkpoints, tmp_path, monkeypatch):
    """An import holds one checkpoint group in memory at a time (two while the next replaces the
    one cached), not the whole checkpoint: every group a source returns is tracked until freed.

    Mutation this fails on (made once, by hand): ``_snapshot_groups`` without its
    ``_GroupsOnDemand`` branch (the save holds every chosen group: 7 at once)."""
    alive, peak = [0], [0]
    load = TrainerCheckpointSource.load_group

    def tracked(self, group):
        out = load(self, group)
        alive[0] += 1
        peak[0] = max(peak[0], alive[0])
        # the storage, not the tensor object: a save holds detached views of the same storage
        weakref.finalize(out[next(iter(out))].untyped_storage(),
                         lambda: alive.__setitem__(0, alive[0] - 1))
        return out
    monkeypatch.setattr(TrainerCheckpointSource, "load_group", tracked)
    import_checkpoints(checkpoints[:3], tmp_path / "run")
    assert peak[0] <= 2, peak


def test_cli_prints_bytes_and_refuses_mistakes(checkpoints, tmp_path, capsys):
    run = tmp_path / "run"
    argv = ["ckpt", "import", *map(str, checkpoints[:3]), "--run", str(run), "--policy", FILTER]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and lines[0].startswith("step       10") and "stored" in lines[-1], lines
    assert main(argv) == 2
    assert "already has step 30" in capsys.readouterr().err
    assert main(["ckpt", "verify", str(run)]) == 0
    capsys.readouterr()
    assert main(["ckpt", "import", str(checkpoints[3]), "--run", str(run), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and [s["step"] for s in rep["steps"]] == [40]
    with pytest.raises(ValueError, match="at step"):
        import_checkpoints([checkpoints[0], checkpoints[0]], tmp_path / "dup")
    with pytest.raises(ValueError, match="unknown checkpoint policy"):
        import_checkpoints(checkpoints, tmp_path / "bad", "filtre")
    assert not (tmp_path / "dup").exists() and not (tmp_path / "bad").exists()


def test_real_trainer_checkpoints_keep_their_state_through_the_run(tmp_path):
    """Checkpoints of a real ``transformers.Trainer`` run: imported, then merged back from the
    run as Trainer checkpoints, they give the same weights, moments, scheduler, RNG states and
    trainer state (the run keeps the checkpoint's RNG, not the importing process's).

    Mutation this fails on (made once, by hand): the ``rng_state`` hook ignored in
    ``Checkpointer._snapshot_state`` (the run stores the importing process's RNG)."""
    out = tmp_path / "hf_run"
    make_trainer(out, max_steps=4).train()
    originals = sorted(out.glob("checkpoint-*"))
    torch.manual_seed(12345)  # the importing process's RNG differs from the checkpoints'
    random.seed(12345)
    np.random.seed(12345)
    import_checkpoints(originals, tmp_path / "run")
    for ck in originals:
        step = int(ck.name.split("-")[1])
        merge(tmp_path / "run", tmp_path / f"back-{step}", "trainer", step=step)
        a, b = TrainerCheckpointSource(ck), TrainerCheckpointSource(tmp_path / f"back-{step}")
        for g in a.groups():
            assert _equal(a.load_group(g), b.load_group(g)), (step, g)
        ea, eb = a.extra_state(), b.extra_state()
        assert ea["scheduler"] == eb["scheduler"] and ea["step"] == eb["step"] == step
        assert ea["trainer_state"]["global_step"] == eb["trainer_state"]["global_step"]
        assert torch.equal(ea["rng"]["cpu"], eb["rng"]["cpu"])
        assert (ea["rng"]["numpy"][1] == eb["rng"]["numpy"][1]).all()
        assert ea["rng"]["python"] == eb["rng"]["python"]
