"""Layer-wise checkpoints of the streaming engine's HostStore: save, resume, composites."""

import torch

from layerwise.ckpt.checkpointer import Checkpointer
from layerwise.ckpt.store_provider import HostStoreStateProvider
from layerwise.engine import StreamingEngine
from layerwise.models import get_flavor
from layerwise.store import init_store
from layerwise.plan import Plan
from layerwise.engine.batch import Batch


def data(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 11), generator=g)
        out.append(Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def fresh(flavor="llama-debug-tied", seed=0):
    cfg = get_flavor(flavor).build_config()
    adapter, store = init_store(cfg, seed=seed)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 2))
    return engine, HostStoreStateProvider(store, engine.optimizers)


def test_groups_follow_the_checkpoint_naming():
    engine, provider = fresh("llama-debug")
    assert list(provider.group_names()) == ["embed", "layers.0", "layers.1", "layers.2", "layers.3",
                                            "norm", "lm_head"]
    engine.close()
    engine, provider = fresh("llama-debug-tied")
    assert "lm_head" not in provider.group_names()
    engine.close()


def test_full_resume_is_bit_identical(tmp_path):
    batches = data(96, 8)
    engine, provider = fresh()
    ck = Checkpointer(tmp_path / "run", provider=provider, policy="full", async_save=True)
    losses = []
    for k, b in enumerate(batches):
        losses.append(engine.train_step([b]).loss)
        if k == 3:
            engine.synchronize()
            ck.save(k + 1)
    engine.synchronize()
    ck.wait()
    final = {n: t.clone() for n, t in engine.store.state_dict().items()}
    engine.close()

    engine2, provider2 = fresh(seed=123)  # different init: everything must come from the ckpt
    ck2 = Checkpointer(tmp_path / "run", provider=provider2, policy="full")
    assert ck2.load().step == 4
    resumed = [engine2.train_step([b]).loss for b in batches[4:]]
    engine2.synchronize()
    assert resumed == losses[4:]
    for n, t in engine2.store.state_dict().items():
        assert torch.equal(t, final[n]), n
    engine2.close()


def test_partial_saves_compose_the_newest_version_of_each_group(tmp_path):
    batches = data(96, 6)
    engine, provider = fresh("llama-debug")
    ck = Checkpointer(tmp_path / "run", provider=provider, policy="parity", async_save=False)
    snapshots = {}
    for k, b in enumerate(batches):
        engine.train_step([b])
        engine.synchronize()
        rep = ck.save(k + 1)
        snapshots[k + 1] = ({g: {n: t.clone() for n, t in provider.params(g).items()}
                             for g in rep.selected})
    engine.close()
    engine2, provider2 = fresh("llama-debug", seed=5)
    Checkpointer(tmp_path / "run", provider=provider2, policy="parity").load()
    for g in provider2.group_names():
        newest = max(s for s, groups in snapshots.items() if g in groups)
        for n, t in provider2.params(g).items():
            assert torch.equal(t, snapshots[newest][g][n]), (g, newest)
    engine2.close()


def test_a_save_reads_each_group_once_for_its_size(tmp_path, monkeypatch):
    """A live save (no copy: as a store with state on NVMe saves) reads each group twice: its
    size, once for the policy's statuses and the snapshot's bytes, then its write. Reading a
    group stages a unit on NVMe and decodes a split master's weights.

    Mutations seen failing (each group read three times): ``_group_nbytes`` without its per-save
    ``sizes`` memo; ``GroupsOnDemand`` without ``__contains__`` (``Mapping``'s reads the group
    to answer ``g in snaps``)."""
    engine, provider = fresh()
    engine.train_step(data(96, 1))
    engine.synchronize()
    reads: dict[str, int] = {}
    params = provider.params

    def counted(group):
        reads[group] = reads.get(group, 0) + 1
        return params(group)
    monkeypatch.setattr(provider, "params", counted)
    ck = Checkpointer(tmp_path / "run", provider=provider, policy="full", async_save=False,
                      sync_copy=False)  # live: as a store with state on NVMe saves
    ck.save(1)
    ck.wait()
    engine.close()
    assert reads == {g: 2 for g in provider.group_names()}
