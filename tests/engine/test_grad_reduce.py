"""Gradients reduced on the device before they leave (data parallel, ``dist.grad_reduce=device``),
checked in one process with a stand-in reducer on every CPU backend.

``DoublingReducer`` plays two ranks whose gradients are equal: its collective doubles the
device tensor in place (exact in fp32, so the owner's host gradient must be exactly twice
autograd's) and records what it read. It owns half the units; the others must never land (their
host gradients stay NaN) and never be copied out (the D2H lane's byte counter).

Mutations seen failing (each by hand):
- the collective not behind the backward (``GradSink._out`` without ``after=[after]``):
  ``test_the_reduction_runs_between_the_backward_and_the_copy[compute]`` (it reads the slot
  before compute wrote it);
- the owner's copy not behind the collective (``_send(..., after)`` instead of
  ``self._reduced``): ``[reduce]`` (the host gets the gradient undoubled);
- a non-owner's slot free after the backward instead of the collective (``return after``):
  ``[reduce]`` (the next backward overwrites the slot the collective has not read yet);
- ``GradSink._drain`` not waiting for the step's last collective: ``[reduce]`` (the step ends
  with collectives still to run).
"""

from __future__ import annotations

import math

import pytest
import torch

from layerwise.engine import AsyncCpuBackend, EngineConfig, StreamingEngine, executor
from layerwise.engine.reduce import LocalReducer
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.plan import Plan
from layerwise.store import HostStore

from .test_gradients import make_batch, reference

LAYERS = 6
OWNERSHIPS = {
    "head-and-some-layers": {"head", "layers.0", "layers.3", "layers.4"},
    "embed-and-the-others": {"embed", "layers.1", "layers.2", "layers.5"},
}


class DoublingReducer(LocalReducer):
    """Two ranks with equal gradients, as one process sees them: the collective doubles in
    place; ``seen`` is every collective's (unit, sum of what it read), in issue order."""

    on_device = True

    def __init__(self, store: HostStore, mine: set[str]):
        super().__init__(store)
        self.mine = mine
        self.seen: list[tuple[str, float]] = []

    def owns(self, unit: str) -> bool:
        return unit in self.mine

    def update_done(self, unit: str, wait: bool) -> bool:
        return True  # no updates here: the other rank's weights are those of the store

    def reduce_on_device(self, unit: str, grad: torch.Tensor):
        self.seen.append((unit, float(grad.double().sum())))
        grad.mul_(2)
        return None


@pytest.fixture(scope="module")
def setup():
    cfg = get_flavor("llama-debug-tied").build_config(num_hidden_layers=LAYERS)
    model = build_hf_model(cfg, seed=0)
    batches = [make_batch(cfg.vocab_size, batch=2, seq=16, seed=s) for s in (1, 2)]
    _, ref_grads = reference(model, batches)
    return cfg, model, batches, ref_grads


def _run(setup, mine: set[str], device: str, monkeypatch=None, slow_lane: str | None = None,
         seed: int | None = None):
    cfg, model, batches, _ = setup
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    for buf in store:
        buf.grad.fill_(math.nan)  # a unit that lands is overwritten (its first landing writes)
    if slow_lane is not None:
        monkeypatch.setattr(executor, "make_backend",
                            lambda device, seed: AsyncCpuBackend(lane_delays_s={slow_lane: 0.02}))
    reducer = DoublingReducer(store, mine)
    engine = StreamingEngine(adapter, store, Plan.every_k(LAYERS, 2),  # no offloads: D2H is grads
                             EngineConfig(device=device, async_seed=seed), reducer=reducer)
    try:
        engine.compute_grads(batches)
        return store, list(reducer.seen), engine.backend.copied_bytes["d2h"]  # as the step ends
    finally:
        engine.close()


def _expected_d2h_bytes(store: HostStore, mine: set[str], micro_batches: int) -> int:
    """fp32 compute: 4 bytes an element; the tied embedding leaves twice per micro-batch (the
    head's part of its gradient, then its own backward's)."""
    per_mb = sum(b.layout.numel * 4 * (2 if b.name == "embed" else 1) for b in store if b.name in mine)
    return micro_batches * per_mb


@pytest.mark.parametrize("owned", OWNERSHIPS)
def test_only_the_owner_lands_the_reduced_gradient(setup, owned):
    """Synchronous CPU backend: the owner's host gradient is exactly twice autograd's, the other
    units' are untouched (NaN: no landing) and only the owned units' bytes were copied out;
    every unit's gradient was reduced once per micro-batch part.

    Mutation seen failing: ``GradSink._out`` taking every unit as this rank's (``mine =
    True``): the units it does not own land too (not NaN) and their bytes are copied out."""
    mine = OWNERSHIPS[owned]
    store, seen, d2h = _run(setup, mine, "cpu")
    ref = reference_by_unit(setup, store)
    for buf in store:
        if buf.name in mine:
            assert torch.allclose(buf.grad, 2 * ref[buf.name], rtol=1e-5, atol=1e-7), buf.name
        else:
            assert bool(buf.grad.isnan().all()), f"{buf.name} landed on a rank that does not own it"
    assert d2h == _expected_d2h_bytes(store, mine, 2)
    per_mb = LAYERS + 3  # layers, head, the tied embedding's two parts
    assert len(seen) == 2 * per_mb
    assert {u for u, _ in seen} == {b.name for b in store}


@pytest.mark.parametrize("slow_lane", ["compute", "reduce", "d2h"])
def test_the_reduction_runs_between_the_backward_and_the_copy(setup, slow_lane, monkeypatch):
    """One lane of the asynchronous backend far behind the others: the collectives read what
    the synchronous backend's read, in the same order, and the owner's host gradients equal
    it (the module docstring names the wait each lane exercises)."""
    mine = OWNERSHIPS["embed-and-the-others"] if slow_lane == "d2h" else OWNERSHIPS["head-and-some-layers"]
    want_store, want_seen, want_d2h = _run(setup, mine, "cpu")
    store, seen, d2h = _run(setup, mine, "cpu-async", monkeypatch, slow_lane)
    assert [u for u, _ in seen] == [u for u, _ in want_seen]
    assert [s for _, s in seen] == pytest.approx([s for _, s in want_seen], rel=1e-6)
    for got, want in zip(store, want_store):
        assert torch.equal(got.grad.isnan(), want.grad.isnan()), got.name
        if got.name in mine:
            assert torch.allclose(got.grad, want.grad, rtol=1e-6, atol=1e-9), got.name
    assert d2h == want_d2h


@pytest.mark.parametrize("seed", range(6))
def test_seeded_delay_patterns(setup, seed):
    mine = OWNERSHIPS["head-and-some-layers"]
    want_store, want_seen, _ = _run(setup, mine, "cpu")
    store, seen, _ = _run(setup, mine, "cpu-async", seed=seed)
    assert [s for _, s in seen] == pytest.approx([s for _, s in want_seen], rel=1e-6)
    for got, want in zip(store, want_store):
        if got.name in mine:
            assert torch.allclose(got.grad, want.grad, rtol=1e-6, atol=1e-9), got.name


def reference_by_unit(setup, store: HostStore) -> dict[str, torch.Tensor]:
    """Autograd's gradients in each unit's flat layout."""
    _, _, _, ref_grads = setup
    out = {}
    for buf in store:
        flat = torch.empty(buf.layout.numel)
        views = buf.layout.views(flat)
        for p in buf.unit.params:
            views[p.local].copy_(ref_grads[p.hf_name])
        out[buf.name] = flat
    return out
