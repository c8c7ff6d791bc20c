"""8-bit moments stay 8-bit in layer-wise checkpoints: stored as codes and scales, resumed bit
for bit, converted to fp32 only for formats that need it (Trainer export, runs of format < 3)."""

from __future__ import annotations

import json

import pytest
import torch

from layerwise.ckpt import FORMAT_VERSION, RunDir
from layerwise.ckpt.checkpointer import Checkpointer
from layerwise.ckpt.errors import StateModifiedError
from layerwise.ckpt.moments import fp32_moments, unit_part, write_unit_part
from layerwise.ckpt.resolve import open_run_step
from layerwise.ckpt.store_provider import HostStoreStateProvider
from layerwise.ckpt.tracker import UpdateTracker
from layerwise.engine import StreamingEngine
from layerwise.interop.recipes.merge import merge
from layerwise.interop.hf.trainer_checkpoint import TrainerCheckpointSource
from layerwise.models import get_flavor
from layerwise.optim import quant
from layerwise.optim.adamw8bit import AdamW8bit, state_to_fp32
from layerwise.plan import Plan
from layerwise.store import init_store

from test_core_deferred import held_helper  # noqa: F401  (fixture)
from test_core_helpers import tiny_llama
from test_engine_store_ckpt import data


ODD = dict(vocab_size=97, hidden_size=40, intermediate_size=72)
"""Sizes whose parameters do not start on 256-element block edges, and whose untied head shares a
block between lm_head (97 x 40 = 3880 elements) and the final norm."""


def fresh(moments, flavor="llama-debug", seed=0, **overrides):
    cfg = get_flavor(flavor).build_config(**(overrides or ODD) if flavor == "llama-debug" else overrides)
    adapter, store = init_store(cfg, seed=seed)
    plan = Plan.every_k(adapter.num_layers, 2, moments=moments(adapter.num_layers))
    engine = StreamingEngine(adapter, store, plan)
    return engine, HostStoreStateProvider(store, engine.optimizers)


def all_8bit(n):
    return ["8bit"] * (n + 2)


def mixed(n):  # embed fp32, layers alternating, head 8-bit
    return ["fp32"] + ["8bit" if i % 2 == 0 else "fp32" for i in range(n)] + ["8bit"]


def unit_states(engine):
    return {b.name: {k: v.clone() for k, v in b.state.items()} for b in engine.store}


def blob_bytes(run, step):
    m = RunDir.open(run).read_manifest(step)
    return sum((run / e["blob"]).stat().st_size for e in m["groups"].values())


def run_and_resume(tmp_path, moments, flavor="llama-debug", steps=6, save_at=3, **overrides):
    """Train ``steps`` steps saving at ``save_at``; resume a fresh engine (another init) from the
    save and train the rest. Returns (losses, resumed losses, final states, resumed states,
    final weights, resumed weights, engine for inspection of the run)."""
    batches = data(97, steps)
    engine, provider = fresh(moments, flavor, **overrides)
    ck = Checkpointer(tmp_path / "run", provider=provider, policy="full", async_save=True)
    losses = []
    for k, b in enumerate(batches):
        losses.append(engine.train_step([b]).loss)
        if k + 1 == save_at:
            engine.synchronize()
            ck.save(save_at)
    engine.synchronize()
    ck.close()
    final = (unit_states(engine), {n: t.clone() for n, t in engine.store.state_dict().items()})
    engine.close()
    engine2, provider2 = fresh(moments, flavor, seed=123, **overrides)
    Checkpointer(tmp_path / "run", provider=provider2, policy="full").load()
    resumed = [engine2.train_step([b]).loss for b in batches[save_at:]]
    engine2.synchronize()
    got = (unit_states(engine2), {n: t.clone() for n, t in engine2.store.state_dict().items()})
    engine2.close()
    return losses[save_at:], resumed, final, got


def assert_same_state(final, got):
    (states, weights), (states2, weights2) = final, got
    for n, t in weights.items():
        assert torch.equal(weights2[n], t), n
    for u, st in states.items():
        assert st.keys() == states2[u].keys(), u
        for k, t in st.items():
            assert torch.equal(states2[u][k], t), (u, k)


def test_an_8bit_run_resumes_bit_identical_from_codes_and_scales(tmp_path):
    """Train, save, load into a fresh store and engine, continue: losses, weights and the 8-bit
    codes and scales equal an uninterrupted run's bit for bit; every stored group holds codes
    and scales (no fp32 moments).

    Mutations this fails on (each made once, by hand): the step count's copy dropped from
    ``_load_8bit_exact``; the scales written to the wrong blocks (``scales[b0:b1] =
    new_scales.flip(0)`` in ``write_unit_part``).

    Not a mutation this catches: loading through the fp32 conversion instead. Re-quantising
    dequantised moments gives the same codes (a block's largest code decodes to exactly its
    scale), so that path resumes bit-identically too; what storing codes buys is the bytes
    (``test_bytes_per_parameter_on_disk``)."""
    want, got, final, resumed = run_and_resume(tmp_path, all_8bit)
    assert got == want
    assert_same_state(final, resumed)
    rs = open_run_step(tmp_path / "run")
    for g in rs.groups():
        keys = rs.load_group(g)
        assert not any(k.startswith("exp_avg/") for k in keys), g
        assert any(k.startswith("exp_avg_codes/") for k in keys), g
    assert json.loads((tmp_path / "run" / "format.json").read_text())["format_version"] == FORMAT_VERSION


def test_a_mixed_run_resumes_bit_identical(tmp_path):
    """Some units fp32, some 8-bit (the demo's plan shape): each group stores its unit's own
    form, and the resume is bit-identical."""
    want, got, final, resumed = run_and_resume(tmp_path, mixed)
    assert got == want
    assert_same_state(final, resumed)
    rs = open_run_step(tmp_path / "run")
    assert any(k.startswith("exp_avg/") for k in rs.load_group("embed"))
    assert any(k.startswith("exp_avg_codes/") for k in rs.load_group("layers.0"))
    assert any(k.startswith("exp_avg/") for k in rs.load_group("layers.1"))


def test_bytes_per_parameter_on_disk(tmp_path):
    """An all-8-bit run's checkpoint, measured from the blob files on disk: <= 6.2 bytes per
    parameter (fp32 weights 4 + two 1-byte codes + 8 bytes of scales per 256 elements + the
    headers); the same run with fp32 moments is ~12.

    Mutation this fails on (made once, by hand): ``_blob_content`` converting every blob to fp32
    moments (as before format 3): ~12 bytes/param."""
    sizes = {}
    for name, moments in (("8bit", all_8bit), ("fp32", lambda n: ["fp32"] * (n + 2))):
        engine, provider = fresh(moments, "llama-demo")
        for b in data(1024, 1):
            engine.train_step([b])
        engine.synchronize()
        with Checkpointer(tmp_path / name, provider=provider, policy="full", async_save=False) as ck:
            ck.save(1)
        num_params = sum(b.layout.numel for b in engine.store)
        sizes[name] = blob_bytes(tmp_path / name, 1) / num_params
        engine.close()
    assert sizes["8bit"] <= 6.2, sizes
    assert 11.9 < sizes["fp32"] < 12.3, sizes


def test_plan_changes_convert_and_export_needs_fp32(tmp_path):
    """An 8-bit checkpoint loads into fp32 units as its dequantised moments (and an fp32 one into
    8-bit units, quantised); a Trainer export of the 8-bit run has fp32 moments equal to the
    dequantised codes.

    Mutation this fails on (made once, by hand): ``blocks_of`` giving lead 0 (parameters that
    start inside a block are dequantised with the wrong scales)."""
    engine, provider = fresh(all_8bit)
    for b in data(97, 2):
        engine.train_step([b])
    engine.synchronize()
    with Checkpointer(tmp_path / "q8", provider=provider, policy="full", async_save=False) as ck:
        ck.save(2)
    deq = {b.name: state_to_fp32(b.state) for b in engine.store}
    engine.close()

    fp, prov_fp = fresh(lambda n: ["fp32"] * (n + 2), seed=7)
    Checkpointer(tmp_path / "q8", provider=prov_fp).load()
    for b in fp.store:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(b.state[k], deq[b.name][k]), (b.name, k)
    with Checkpointer(tmp_path / "fp", provider=prov_fp, policy="full", async_save=False) as ck:
        ck.save(2)
    fp.close()
    q8, prov_q8 = fresh(all_8bit, seed=9)
    Checkpointer(tmp_path / "fp", provider=prov_q8).load()
    for b in q8.store:  # fp32 -> 8-bit: what the optimizer's own conversion gives
        again = state_to_fp32(b.state)
        assert torch.allclose(again["exp_avg"], deq[b.name]["exp_avg"], atol=1e-3 * deq[b.name]["exp_avg"].abs().max())
    q8.close()

    merge(tmp_path / "q8", tmp_path / "trainer", "trainer")
    src = TrainerCheckpointSource(tmp_path / "trainer")
    stored = open_run_step(tmp_path / "q8")
    for g in ("layers.0", "lm_head"):
        want = fp32_moments(stored.load_group(g))
        got = src.load_group(g)
        for k, t in want.items():
            if k.startswith(("exp_avg/", "exp_avg_sq/")):
                assert torch.equal(got[k], t), k


def test_a_block_shared_by_two_groups_stays_consistent():
    """An untied head whose lm_head size is not a multiple of the block size shares a block with
    the final norm. Both groups from one save load exactly in either order; from two saves,
    each group's elements keep their own values (the earlier-loaded group's few elements in the
    shared block re-encoded under the later scale, within the quantisation error).

    Mutation this fails on (made once, by hand): the re-encode in ``write_unit_part`` removed
    (the earlier group's codes are read under the other version's scale: far off)."""
    block, split, total = 256, 300, 520  # groups A = [0, 300), B = [300, 520); block 1 shared
    gen = torch.Generator().manual_seed(0)

    def state(scale):
        m = torch.randn(total, generator=gen) * scale
        v = torch.rand(total, generator=gen) * scale ** 2
        mc, ms = quant.quantize_signed(m, block)
        vc, vs = quant.quantize_sq(v, block)
        return {"exp_avg_codes": mc, "exp_avg_scales": ms, "exp_avg_sq_codes": vc,
                "exp_avg_sq_scales": vs}

    def part(st, name, off, n):
        return {kind + name: t.clone() for kind, t in unit_part(st, off, n, block).items()}

    def load(target, st_a, st_b, order):
        for which in order:
            st, off, n = (st_a, 0, split) if which == "a" else (st_b, split, total - split)
            owned = torch.zeros(total, dtype=torch.bool)
            owned[off:off + n] = True
            write_unit_part(target, part(st, which, off, n), which, off, n, block, owned)

    def deq(st):
        return (quant.dequantize_signed(st["exp_avg_codes"], st["exp_avg_scales"], block),
                quant.dequantize_sq(st["exp_avg_sq_codes"], st["exp_avg_sq_scales"], block))

    one = state(1.0)
    for order in ("ab", "ba"):
        target = {k: torch.zeros_like(t) for k, t in one.items()}
        load(target, one, one, order)
        assert all(torch.equal(target[k], one[k]) for k in one), order

    a, b = state(1.0), state(3.0)  # two versions; b's shared-block scale is larger
    target = {k: torch.zeros_like(t) for k, t in a.items()}
    load(target, a, b, "ab")
    (m, v), (ma, va), (mb, vb) = deq(target), deq(a), deq(b)
    assert torch.equal(m[split:], mb[split:]) and torch.equal(v[split:], vb[split:])
    assert torch.equal(m[:block], ma[:block]) and torch.equal(v[:block], va[:block])
    scale = target["exp_avg_scales"][1]
    bound = quant.signed_error_bound(ma[block:split], scale.expand(split - block))
    assert ((m[block:split] - ma[block:split]).abs() <= bound + 1e-6).all()


def test_drop_in_adamw8bit_state_round_trips_and_defers(tmp_path, held_helper):
    """``AdamW8bit`` in a plain loop: its per-tensor codes and scales are stored with their block
    geometry and load back bit for bit; the deferred snapshot copies the codes as they were at
    ``save`` (the next step waits for it) and a code tensor written in place before the
    snapshot fails the save (``StateModifiedError``), as for fp32 state.

    Mutation this fails on (made once, by hand): ``ModuleStateProvider._moments_for`` keeping
    the codes only when the live state already holds codes (a fresh optimizer, i.e. a resume,
    gets fp32 moments and steps them in fp32 from then on)."""
    model = tiny_llama(0)
    opt = AdamW8bit(model.parameters(), lr=1e-2, min_8bit_numel=256)
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))

    def step():
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    step()
    ck = Checkpointer(tmp_path / "run", model, opt, policy="full", tracker_log=False)
    ck.save(1)
    want = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    step()  # waits for the deferred snapshot of step 1
    ck.wait()
    assert ck.reports[-1].deferred
    keys = open_run_step(tmp_path / "run").load_group("layers.0")
    assert any(k.startswith("q8_blocks/") for k in keys)

    for stepped in (False, True):  # a fresh optimizer (a resume), one with state of its own
        model2 = tiny_llama(5)
        opt2 = AdamW8bit(model2.parameters(), lr=1e-2, min_8bit_numel=256)
        if stepped:
            x2 = torch.randint(0, 96, (2, 4))
            model2(input_ids=x2, labels=x2).loss.backward()
            opt2.step()
        Checkpointer(tmp_path / "run", model2, opt2, policy="full").load()
        for p, p2 in zip(model.parameters(), model2.parameters()):
            assert opt2.state[p2].keys() == want[id(p)].keys()
            for k, t in want[id(p)].items():
                assert torch.equal(opt2.state[p2][k], t), k

    step()
    held_helper.clear()
    ck.save(2)
    codes = next(s["exp_avg_codes"] for s in opt.state.values() if "exp_avg_codes" in s)
    codes.add_(1)  # in place, not by the (held) optimizer step
    with pytest.raises(StateModifiedError):
        ck.wait()
    ck.close()


def test_tracker_norms_of_8bit_moments_are_of_their_fp32_values():
    """``tracker.jsonl``'s moment norms for an 8-bit unit are those of the dequantised moments
    (the provider now serves codes, not fp32).

    Mutation this fails on (made once, by hand): ``UpdateTracker.observe`` reading ``lv.optim``
    without ``fp32_moments`` (the norms are 0: no ``exp_avg/`` keys)."""
    engine, provider = fresh(mixed)
    engine.train_step(data(97, 1))
    engine.synchronize()
    stats = UpdateTracker(provider).observe(1)
    for buf in engine.store:
        fp32 = state_to_fp32(buf.state)
        groups = [g for g in provider.group_names() if provider._units(g) == {buf.name: buf}]
        for g in groups:
            names = provider.group_names()[g]
            want = torch.linalg.vector_norm(torch.cat(
                [buf.layout.views(fp32["exp_avg"])[provider._where[n][1]].reshape(-1) for n in names]))
            assert stats[g]["exp_avg_norm"] == pytest.approx(float(want), rel=1e-5), g
    engine.close()
