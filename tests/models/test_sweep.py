"""Coverage by sweep: every ``model_type`` of transformers' causal-LM auto mapping, shrunk to a
tiny config by one generic rule (``tests/sweep_cases.py``), saved with ``save_pretrained``.

For each type that builds here: the directory loads, the engine's loss and every gradient equal
plain HF autograd (fp32, CPU), and the export holds exactly the names and shapes
``save_pretrained`` wrote and reloads with equal logits — or layerwise refuses the type with one
line that says why (a ``ValueError``: another decoder layout, an attention type it does not run).
A type that trains with numbers other than HF's fails. Types whose tiny config does not build are
skipped with the reason the build gave. ``make test`` runs one plan for a stated sample of the
types (``SAMPLE``); the ``sweep`` set (``make test-all``) runs every type under every-1,
every-2 and recompute-all.

Beside that: each type's config varied (every boolean field flipped, every window field set),
each variant equal to HF or refused in one line; and each type in bf16, as close to HF's fp32
autograd as HF's own bf16 model is.

``python tests/sweep_cases.py`` prints the outcome of every type and the counts.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from family_cases import assert_grads_close, engine_grads, engine_loss, hf_reference, make_batch
from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.interop.hf.model_dir import load_store
from layerwise.interop.recipes.store_export import export_store
from layerwise.plan import Plan
from layerwise.store import HostStore
from matrix import subset
from sweep_cases import (MAX_PARAMS, REFUSALS, VOCAB, build, causal_lm_types, saved_and_loaded,
                         saved_tensors, tiny_config)

SAMPLE = (
    # the types that guarded a named mutation (below)
    "smollm3", "diffllama", "cohere", "granite", "ctrl",
    # one of each layout: dense decoders, MoE as the Hub stores them, a conv hybrid (LFM2) and
    # a state-space one (Jamba, where its tiny config builds), sliding windows and soft-capping,
    # learned positions, refused layouts
    # (the table's families have tests of their own: tests/models/test_families.py)
    "llama", "qwen3", "phi3", "gemma2", "gemma3_text", "gpt2", "bloom", "mixtral", "qwen3_moe",
    "deepseek_v3", "gpt_oss", "granitemoe", "jamba", "lfm2", "bart", "bert",
)
"""Of ``causal_lm_types()``: what ``make test`` runs (``tests/matrix.py``)."""

PLANS = {"every-1": lambda n: Plan.every_k(n, 1), "every-2": lambda n: Plan.every_k(n, 2),
         "recompute-all": Plan.recompute_all}


VARIANTS = ("saved", "trained")
"""How the directory is written: ``saved`` as ``save_pretrained`` writes a fresh fp32 model;
``trained`` as a training run leaves it (HF Trainer's ``checkpoint-N``): ``use_cache`` false
and bf16 weights, ``dtype`` bfloat16 in its config."""


def _variant(model_type: str, variant: str):
    """(config, model) of the type as ``variant`` writes it, the model being the reference
    (for ``trained``: the bf16 weights in fp32, as ``from_pretrained(dtype=float32)`` reads
    them)."""
    cfg, model = build(model_type)
    if cfg is None or variant == "saved":
        return cfg, model
    cfg = copy.deepcopy(cfg)
    cfg.use_cache = False
    model = copy.deepcopy(model)
    model.config.use_cache = False
    return cfg, model.to(torch.bfloat16)


def _check(model_type: str, plans: list[str], tmp_path, variant: str = "saved") -> None:
    hub = tmp_path / "hub"
    cfg, model, adapter, store = saved_and_loaded(model_type, _variant(model_type, variant), hub)
    if variant == "trained":
        assert json.loads((hub / "config.json").read_text())["use_cache"] is False
        model = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32).eval()
    batch = make_batch(cfg.vocab_size)
    ref_loss, ref_grads = hf_reference(model, cfg, [batch])
    for name in plans:
        store.zero_grads()
        loss = engine_loss(adapter, store, PLANS[name](adapter.num_layers), [batch])
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert_grads_close(engine_grads(store), ref_grads)
    out = export_store(store, tmp_path / "out")
    # name for name and shape for shape; the dtype is the fp32 master's (bf16 in a ``trained`` hub)
    assert {k: v[0] for k, v in saved_tensors(out).items()} == \
        {k: v[0] for k, v in saved_tensors(hub).items()}
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation=adapter.attn_implementation,
                                                    dtype=torch.float32)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1))
    try:
        got = engine.forward_logits(batch.input_ids)
    finally:
        engine.close()
    with torch.no_grad():
        torch.testing.assert_close(got, reloaded(batch.input_ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_type", subset(causal_lm_types(), SAMPLE, strict=False))
def test_every_causal_lm_type_trains_as_hf_or_is_refused(model_type, variant, tmp_path):
    """Mutations seen failing: one template shared by layers whose modules differ in a plain
    attribute (SmolLM3's ``use_rope``, DiffLlama's ``lambda_init``: layer 1's gradients off by
    60-75%); the head's logit scaling left out (Cohere, Granite); ``HubLayout.to_model`` not
    converting (33 MoE types fail with "weights missing", which is not a refusal); the weight-free
    backward of a plain token embedding used where the base model adds more (CTRL: its embedding's
    gradient off by 14%, the scale and position table missed); the layout trace run with the
    config's own ``use_cache`` (every ``trained`` directory refused: "could not trace its base
    model's forward", transformers' mask code reading the meta position ids' values: a
    refusal not among ``sweep_cases.REFUSED_DECODERS`` fails)."""
    _check(model_type, ["every-1"], tmp_path, variant)


@pytest.mark.sweep
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("model_type", causal_lm_types())
def test_every_causal_lm_type_under_every_plan(model_type, variant, tmp_path):
    _check(model_type, list(PLANS), tmp_path, variant)


OUTPUT_FLAGS = frozenset({
    "return_dict", "output_hidden_states", "output_attentions", "output_router_logits", "use_cache",
    "torchscript", "is_decoder", "is_encoder_decoder", "add_cross_attention", "tie_encoder_decoder",
    "tie_word_embeddings", "use_bfloat16", "tf_legacy_loss"})
"""Boolean config fields that choose what a forward returns or keeps, or the weights' sharing
(the export tests cover that), not what it computes."""
WINDOW_FIELDS = ("window", "chunk")
"""Integer (or unset) config fields with these in their names are set to a few positions, less
than the test batch's sequence, so that a window or chunk actually cuts it."""
VARIANT_SAMPLE = ("falcon", "afmoe", "gemma3_text", "minimax", "qwen3", "gpt2", "mixtral")
"""Of ``causal_lm_types()``: what ``make test`` varies (the four found wrong, and a few others)."""


def _variants(model_type: str):
    """(field, config, model) for each boolean field of the type's tiny config flipped and each
    window field set to 4 (with ``use_sliding_window`` on where the config has it), where the
    changed config still builds (within the sweep's size) and survives the JSON round trip."""
    try:
        base = tiny_config(model_type)
    except Exception as e:  # noqa: BLE001 — as ``build``: a type whose tiny config does not build
        pytest.skip(f"{model_type}: its tiny config does not build here ({type(e).__name__})")
    for flag, value in base.to_dict().items():
        window = (value is None or type(value) is int) and any(w in flag for w in WINDOW_FIELDS)
        if not (isinstance(value, bool) or window) or flag in OUTPUT_FLAGS:
            continue
        cfg = copy.deepcopy(base)
        if window:
            setattr(cfg, flag, 4)
            if hasattr(cfg, "use_sliding_window"):
                cfg.use_sliding_window = True
        else:
            setattr(cfg, flag, not value)
        try:
            type(cfg).from_dict(json.loads(cfg.to_json_string()))
            with torch.device("meta"):
                if sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters()) > MAX_PARAMS:
                    continue
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():
                model(torch.randint(3, VOCAB, (1, 8)))
        except Exception:  # noqa: BLE001 — a combination the family does not build
            continue
        yield flag, cfg, model


def _check_variants(model_type: str, tmp_path) -> None:
    for flag, cfg, model in _variants(model_type):
        hub = tmp_path / flag
        model.save_pretrained(hub)
        try:
            adapter, store = load_store(hub)
        except ValueError as e:
            assert "\n" not in str(e).strip() and str(e).startswith(REFUSALS), f"{flag}: {e}"
            continue
        batch = make_batch(cfg.vocab_size)
        ref_loss, ref_grads = hf_reference(model, cfg, [batch])
        loss = engine_loss(adapter, store, Plan.every_k(adapter.num_layers, 1), [batch])
        assert loss == pytest.approx(ref_loss, rel=1e-5), f"{model_type} with {flag}={getattr(cfg, flag)}"
        assert_grads_close(engine_grads(store), ref_grads)


@pytest.mark.parametrize("model_type", subset(causal_lm_types(), VARIANT_SAMPLE, strict=False))
def test_every_flag_and_window_trains_as_hf_or_is_refused(model_type, tmp_path):
    """Each boolean field of the type's config flipped (what it computes, not what it returns)
    and each window field set: the engine equals HF, or layerwise refuses in one line. Found
    wrong before (transformers 5.25), each a mutation seen caught when its fix is undone:
    Falcon's ``alibi`` (folded into the mask; trained without the biases), AFMoE's
    ``mup_enabled`` (the embeddings scaled by ``sqrt(hidden)`` in the base model's forward; loss
    4.58176 against HF's 4.57928), Gemma 3's ``use_bidirectional_attention`` (a two-way mask;
    4.58471 against 4.58719), MiniMax's ``sliding_window`` (it windows the full-attention
    layers; 4.56085 against 4.56064)."""
    _check_variants(model_type, tmp_path)


@pytest.mark.sweep
@pytest.mark.parametrize("model_type", causal_lm_types())
def test_every_flag_and_window_of_every_type(model_type, tmp_path):
    _check_variants(model_type, tmp_path)


BF16_SAMPLE = ("openai-gpt", "xglm", "llama", "gpt2", "qwen3_moe", "gemma3_text")
"""Of ``causal_lm_types()``: what ``make test`` runs in bf16 (the two found failing, and a few)."""


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def _check_bf16(model_type: str, tmp_path) -> None:
    cfg, model, adapter, _ = saved_and_loaded(model_type, build(model_type), tmp_path / "hub")
    batch = make_batch(cfg.vocab_size)
    ref_loss, ref = hf_reference(model, cfg, [batch])
    hf_loss, hf = hf_reference(copy.deepcopy(model).to(torch.bfloat16), cfg, [batch])
    store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False)
    store.copy_from_model(model)
    loss = engine_loss(adapter, store, Plan.every_k(adapter.num_layers, 1), [batch],
                       EngineConfig(compute_dtype=torch.bfloat16))
    assert abs(loss - ref_loss) <= max(4 * abs(hf_loss - ref_loss), 2e-3 * abs(ref_loss)), \
        (loss, hf_loss, ref_loss)
    got = engine_grads(store)
    names = [k for k in got if k in hf]
    flat = {k: torch.cat([d[n].float().flatten() for n in names])
            for k, d in (("got", got), ("hf", hf), ("ref", ref))}
    assert names and _relative(flat["got"], flat["ref"]) <= 3 * _relative(flat["hf"], flat["ref"]) + 0.01
    # each tensor of more than a few elements alike (a scalar's gradient, one long sum with
    # cancellation, is as far off as its summation order makes it in any bf16 run)
    worse = {k: (_relative(got[k], ref[k]), _relative(hf[k], ref[k])) for k in names if got[k].numel() >= 16}
    assert all(e <= 3 * h + 0.02 for e, h in worse.values()), \
        {k: v for k, v in worse.items() if v[0] > 3 * v[1] + 0.02}


@pytest.mark.parametrize("model_type", subset(causal_lm_types(), BF16_SAMPLE, strict=False))
def test_every_causal_lm_type_in_bf16_is_as_close_to_fp32_as_hf_in_bf16(model_type, tmp_path):
    """bf16 compute (a GPU run's; here on the CPU backend) against HF's fp32 autograd: the
    engine's loss and each gradient within a few times what HF's own model cast to bf16 misses
    by. Mutation seen caught: the buffers a model computes at construction left fp32 in a bf16
    step (OpenAI-GPT's causal-mask table promoted its scores: "expected m1 and m2 to have the
    same dtype"; XGLM's position table its embeddings: "mixed dtype (CPU)")."""
    _check_bf16(model_type, tmp_path)


@pytest.mark.sweep
@pytest.mark.parametrize("model_type", causal_lm_types())
def test_every_causal_lm_type_in_bf16(model_type, tmp_path):
    _check_bf16(model_type, tmp_path)
