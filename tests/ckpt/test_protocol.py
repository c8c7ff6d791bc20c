"""Both checkpointers (and the DeepSpeed wrapper) answer to ``CheckpointerProtocol``: the same
verbs with the same parameters, one save report and one load result, and ``latest()`` that
says the newest committed step.

Mutations seen failing: ``ShardedCheckpointer.latest()`` returning the oldest committed step
(``test_latest_is_the_newest_committed_step``); ``DeepSpeedCheckpointer.load`` without its
``step`` default (``test_every_checkpointer_takes_the_protocols_parameters``)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from layerwise.ckpt import Checkpointer, CheckpointerProtocol, DictStateProvider, LoadResult, SaveReport
from layerwise.ckpt.sharded_checkpointer import FlatShard, ShardedCheckpointer
from layerwise.interop.hooks.deepspeed_loop import DeepSpeedCheckpointer

CLASSES = [Checkpointer, ShardedCheckpointer, DeepSpeedCheckpointer]
VERBS = [name for name, v in vars(CheckpointerProtocol).items()
         if inspect.isfunction(v) and not name.startswith("_")]


def state() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {name: {f"param/{name}.w": torch.randn(4, 3, generator=g),
                   f"exp_avg/{name}.w": torch.randn(4, 3, generator=g)}
            for name in ("layers.0", "layers.1")}


class WholeShards:
    """A ``ShardProvider`` of one process: every tensor whole, as one flat shard."""

    def __init__(self, tensors: dict[str, dict[str, torch.Tensor]]):
        self.tensors = tensors

    def group_names(self) -> list[str]:
        return list(self.tensors)

    def shards(self, group: str) -> list[FlatShard]:
        return [FlatShard(k, t.reshape(-1), 0, tuple(t.shape)) for k, t in self.tensors[group].items()]

    def load_shards(self, group: str, reader) -> None:
        for k, t in self.tensors[group].items():
            t.copy_(reader.read(k).reshape(t.shape))

    def model_config(self):
        return None


def make(kind: str, run) -> CheckpointerProtocol:
    if kind == "plain":
        return Checkpointer(run, provider=DictStateProvider(state()), async_save=False)
    return ShardedCheckpointer(run, WholeShards(state()))


def test_every_checkpointer_takes_the_protocols_parameters():
    """Each verb of the protocol, with each of its parameters (name, kind, default) accepted;
    a class's own further parameters have defaults, so a call through the protocol works."""
    assert VERBS == ["save", "load", "latest", "close"]
    for cls in CLASSES:
        for verb in VERBS:
            want = inspect.signature(getattr(CheckpointerProtocol, verb)).parameters
            got = inspect.signature(getattr(cls, verb)).parameters
            for name, p in want.items():
                assert name in got, (cls.__name__, verb, name)
                assert (got[name].kind, got[name].default) == (p.kind, p.default), (cls.__name__, verb, name)
            extra = [q for n, q in got.items() if n not in want and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL)]
            assert all(q.default is not q.empty for q in extra), (cls.__name__, verb, extra)


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_latest_is_the_newest_committed_step(tmp_path, kind):
    """Empty run: ``latest()`` is None and ``load()`` None; after saves of steps 3 and 5 it
    is 5, for this checkpointer and a new one on the run; the reports are ``SaveReport``s with
    the policy's view of every group, the load a ``LoadResult``."""
    ck = make(kind, tmp_path / "run")
    assert isinstance(ck, CheckpointerProtocol)
    assert ck.latest() is None and ck.load() is None
    first = ck.save(3, {"note": kind})
    assert type(first) is SaveReport
    assert first.selected == ["layers.0", "layers.1"]
    assert first.changes == {"layers.0": math.inf, "layers.1": math.inf}  # never saved before
    assert first.snapshot_bytes == 2 * 2 * 12 * 4 and first.bytes_written > 0
    assert type(ck.save(5)) is SaveReport
    assert ck.latest() == 5
    ck.close()
    again = make(kind, tmp_path / "run")
    assert again.latest() == 5
    loaded = again.load(3)
    assert type(loaded) is LoadResult and loaded.step == 3 and loaded.extra == {"note": kind}
    assert loaded.world_size_saved == (1 if kind == "sharded" else None)
    again.close()
