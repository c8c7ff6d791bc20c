"""Packed rows keep their examples apart: a packed micro-batch trains exactly as its examples
would, each alone in its row (positions from 0, attention inside the example, a linear-attention
state that starts afresh), and no example's output depends on another example of its row."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from family_cases import assert_grads_close, engine_run, hf_case, hf_reference
from layerwise.engine import StreamingEngine
from layerwise.engine.batch import IGNORE_INDEX, Batch
from layerwise.models import DecoderAdapter
from layerwise.models.attention import row_layout
from sweep_cases import build, tiny_config
from layerwise.plan import Plan
from layerwise.store import HostStore

ROWS = ((5, 4, 3), (6, 3))
"""Example lengths of each packed row (row 1 ends in padding)."""
SEQ = 12


def _examples(vocab: int, seed: int = 11) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (n for row in ROWS for n in row):
        ids = torch.randint(3, vocab, (n,), generator=g)
        labels = torch.randint(0, vocab, (n,), generator=g)
        labels[0] = IGNORE_INDEX  # a prompt token: no loss
        out.append((ids, labels))
    return out


def packed_batch(examples) -> Batch:
    """``ROWS`` end to end, padding (-1) after the last example of a row."""
    ids = torch.zeros(len(ROWS), SEQ, dtype=torch.long)
    labels = torch.full((len(ROWS), SEQ), IGNORE_INDEX)
    seg = torch.full((len(ROWS), SEQ), -1, dtype=torch.long)
    k = 0
    for r, lengths in enumerate(ROWS):
        at = 0
        for n in lengths:
            ids[r, at:at + n], labels[r, at:at + n] = examples[k]
            seg[r, at:at + n] = k
            at, k = at + n, k + 1
    return Batch(ids, labels, seg)


def one_per_row(examples) -> Batch:
    """The same examples, one a row, right-padded to the longest (segment -1 = padding)."""
    width = max(len(i) for i, _ in examples)
    ids = torch.zeros(len(examples), width, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX)
    seg = torch.full((len(examples), width), -1, dtype=torch.long)
    for r, (i, lab) in enumerate(examples):
        ids[r, :len(i)], labels[r, :len(i)], seg[r, :len(i)] = i, lab, 0
    return Batch(ids, labels, seg)


def test_positions_restart_at_each_example_and_runs_cut_at_each():
    """Mutation seen failing: positions not reset (``positions = index``)."""
    layout = row_layout((len(ROWS), SEQ), packed_batch(_examples(96)).segment_ids)
    assert layout.packed
    assert layout.positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert layout.positions[1].tolist()[:9] == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert layout.runs == ((0, 0, 5), (0, 5, 9), (0, 9, 12), (1, 0, 6), (1, 6, 9), (1, 9, 12))
    unpacked = row_layout((2, 6), torch.tensor([[0] * 6, [0] * 4 + [-1] * 2]))
    assert not unpacked.packed and unpacked.segment_ids is None  # trailing padding needs no mask


def _every_2(n: int) -> Plan:
    return Plan.every_k(n, 2)


PACKED_CASES = {
    "llama-debug": (_every_2, "cpu"),  # SDPA with a boolean block-diagonal mask
    "phi3-debug": (_every_2, "cpu"),  # LongRoPE: absolute positions matter
    "gemma2-debug": (Plan.recompute_all, "cpu"),  # eager, soft-capped, sliding window
    "gpt-oss-debug": (_every_2, "cpu-async"),  # sinks, sliding layers, MoE with aux loss
    "qwen3-next-debug": (Plan.recompute_all, "cpu"),  # linear attention run example by example
    # families outside the table, as the sweep builds them (``tests/sweep_cases.py``)
    "gpt2": (_every_2, "cpu"),  # learned positions: the traced embedding, per-example positions
    "mamba": (Plan.recompute_all, "cpu"),  # a causal convolution and a scan, no attention mask
    "lfm2": (_every_2, "cpu"),  # conv layers (a layer type of its own) beside attention layers
}


def _case(flavor: str):
    """(config, HF model, adapter): a named flavor, or a sweep type's tiny model (LFM2's with a
    conv layer first: the generic rule leaves it attention only)."""
    if flavor == "lfm2":
        cfg = tiny_config("lfm2")
        cfg.layer_types = ["conv", "full_attention"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        return cfg, model, DecoderAdapter(cfg)
    if flavor in ("gpt2", "mamba"):
        cfg, model = build(flavor)
        assert cfg is not None, model
        return cfg, model, DecoderAdapter(cfg)
    return hf_case(flavor)


@pytest.mark.parametrize("flavor", list(PACKED_CASES))
def test_packed_batch_equals_its_examples_one_per_row(flavor, tmp_path):
    """The engine's loss and gradients of a packed micro-batch equal HF autograd's of the same
    examples one per row (right-padded, masked), the MoE aux loss over the same real tokens.
    Mutations seen failing: positions not reset (``row_layout``: phi3's LongRoPE switches to its
    long factors); the segment term dropped from the mask (``attention_masks``: every attention
    family); the linear-attention layer run over the whole row (qwen3-next); the traced embedding
    given no positions (gpt2: every example after a row's first embedded at its row position); a
    layer with a causal convolution not run example by example (lfm2's conv layer)."""
    cfg, model, adapter = _case(flavor)
    examples = _examples(cfg.vocab_size)
    ref_loss, ref_grads = hf_reference(model, cfg, [one_per_row(examples)])
    make_plan, device = PACKED_CASES[flavor]
    loss, grads, _ = engine_run(adapter, model, make_plan(adapter.num_layers), [packed_batch(examples)],
                                device, str(tmp_path))
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("flavor", ["llama-debug", "gemma2-debug", "qwen3-next-debug", "gpt2", "lfm2"])
def test_no_example_sees_another_in_its_row(flavor):
    """Changing the first example of a row changes its own logits and nothing of the examples
    after it (and padding changes nothing). Mutations seen failing: the segment term dropped from
    the mask (llama, gemma2); the linear-attention layer run over the whole row (qwen3-next).

    Not bit for bit: changing the first example changes how many tokens each MoE expert gets,
    and a GEMM over another row count rounds differently on some CPUs (1.5e-8 at logit scale
    0.4 seen on an AMD EPYC). A leak moves those logits by ~1e-1, so 1e-5 tells the two apart."""
    cfg, model, adapter = _case(flavor)
    batch = packed_batch(_examples(cfg.vocab_size))
    other = batch.input_ids.clone()
    other[0, :5] = (other[0, :5] + 7) % (cfg.vocab_size - 3) + 3
    other[1, 9:] = 1  # padding
    store = HostStore(adapter)
    store.copy_from_model(model)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1))
    try:
        a = engine.forward_logits(batch.input_ids, batch.segment_ids)
        b = engine.forward_logits(other, batch.segment_ids)
    finally:
        engine.close()
    assert not torch.allclose(a[0, :5], b[0, :5], atol=1e-3)
    torch.testing.assert_close(a[0, 5:], b[0, 5:], rtol=0, atol=1e-5)
    torch.testing.assert_close(a[1, :9], b[1, :9], rtol=0, atol=1e-5)
