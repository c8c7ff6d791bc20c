"""``layerwise train`` on a host whose RAM cannot hold a checkpoint's snapshot: its saves write
from the live store (``ckpt.snapshot_fit``), say so once, and store what a copying run stores."""

from __future__ import annotations

import json
from pathlib import Path


from layerwise.ckpt import RunDir
from layerwise.train.config import CheckpointConfig
from layerwise.train.loop import TrainConfig, train

from ..log_lines import logged_lines

LIVE_LINE = "writes straight from the live tensors"


def _train(model_dir: Path, out: Path) -> tuple[list[dict], list[str]]:
    cfg = TrainConfig(model=str(model_dir), plan="every-2", steps=4, seq_len=32,
                      micro_batch_size=2, grad_accum=1, data={"corpus_tokens": 50_000},
                      eval={"every": 0, "batches": 1}, export=False,
                      log={"every": 100, "track_every": 100, "progress": "lines"},
                      ckpt=CheckpointConfig(every=2, policy="full"), resume=False, out_dir=str(out))
    with logged_lines() as lines:
        train(cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return rows, lines


def test_a_run_without_room_for_the_snapshot_saves_live_and_stores_the_same_bytes(
        model_dir, tmp_path, monkeypatch):
    """Enough RAM: the saves copy (``ckpt_snapshot: "copy"``), nothing is said. No RAM left
    (``available_host_memory`` reads 0): both saves write live, one WARNING names the way out,
    and every committed step has the blobs (BLAKE3 names) and the losses of the copying run.

    Mutation this fails on (made once, by hand): ``Trainer.save`` not recording
    ``ckpt_snapshot`` (the row check fails); ``SnapshotFit.decide`` always copying."""
    rows, lines = _train(model_dir, tmp_path / "copy")
    assert [r["ckpt_snapshot"] for r in rows if "ckpt_groups" in r] == ["copy", "copy"]
    assert not [x for x in lines if LIVE_LINE in x]

    monkeypatch.setattr("layerwise.ckpt.snapshot_fit.available_host_memory", lambda: 0)
    live_rows, live_lines = _train(model_dir, tmp_path / "live")
    assert [r["ckpt_snapshot"] for r in live_rows if "ckpt_groups" in r] == ["live", "live"]
    warned = [x for x in live_lines if LIVE_LINE in x]
    assert len(warned) == 1 and "ckpt.policy=parity" in warned[0], live_lines
    assert [r["loss"] for r in live_rows] == [r["loss"] for r in rows]
    stores = [RunDir.open(tmp_path / run / "ckpt") for run in ("copy", "live")]
    assert stores[0].committed_steps() == stores[1].committed_steps() == [2, 4]
    for step in (2, 4):
        a, b = (s.read_manifest(step)["groups"] for s in stores)
        assert {g: e["blob"] for g, e in a.items()} == {g: e["blob"] for g, e in b.items()}
