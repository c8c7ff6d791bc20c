"""Checkpoints of a split-master store hold the fp32 master, exactly, in the plain format."""

import torch

from layerwise.ckpt.checkpointer import Checkpointer
from layerwise.ckpt.store_provider import HostStoreStateProvider
from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.models import get_flavor
from layerwise.plan import Plan
from layerwise.store import init_store


def _engine(split: bool, seed: int):
    cfg = get_flavor("llama-debug").build_config()
    adapter, store = init_store(cfg, seed=seed, compute_dtype=torch.bfloat16, pin=False,
                                split_master=split)
    plan = Plan.every_k(adapter.num_layers, 2, moments=["8bit"] * len(adapter.units))
    engine = StreamingEngine(adapter, store, plan, EngineConfig(compute_dtype=torch.bfloat16))
    return engine, HostStoreStateProvider(store, engine.optimizers)


def _masters(store) -> torch.Tensor:
    return torch.cat([b.read_master() for b in store]).view(torch.int32)


def _copies(store) -> torch.Tensor:
    return torch.cat([b.compute for b in store]).view(torch.int16)


def test_a_split_master_saves_and_loads_its_fp32_master_bit_for_bit(tmp_path):
    """Saved from a split store, loaded into a fresh split store and into a plain fp32-master
    one: the same fp32 bits (remainders included), copy sources with them, and the saved weights
    are fp32 tensors; the resumed step is the same.

    Mutation that fails it: ``params`` serving the bf16 copy (``buf.compute``, widened) instead
    of ``read_master`` in ``HostStoreStateProvider``: the remainder is lost on save."""
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, 96, (2, 11), generator=g) for _ in range(3)]
    batches = [Batch(i[:, :-1], i[:, 1:]) for i in ids]
    engine, provider = _engine(True, 0)
    for b in batches[:2]:
        engine.train_step([b])
    engine.synchronize()
    saved, saved_copies = _masters(engine.store), _copies(engine.store)
    assert (saved & 0xFFFF).any(), "the weights must have remainders to lose"
    ck = Checkpointer(tmp_path / "run", provider=provider, policy="full")
    ck.save(2)
    ck.wait()
    params = provider.params("layers.0")
    assert all(t.dtype == torch.float32 for t in params.values())
    loss_next = engine.train_step([batches[2]]).loss
    engine.synchronize()
    after = _masters(engine.store)
    engine.close()

    for split in (True, False):
        engine2, provider2 = _engine(split, 123)  # different init: all from the checkpoint
        assert Checkpointer(tmp_path / "run", provider=provider2, policy="full").load().step == 2
        assert torch.equal(_masters(engine2.store), saved)
        assert torch.equal(_copies(engine2.store), saved_copies)  # split or refreshed: the same
        assert engine2.train_step([batches[2]]).loss == loss_next
        engine2.synchronize()
        assert torch.equal(_masters(engine2.store), after)
        engine2.close()
