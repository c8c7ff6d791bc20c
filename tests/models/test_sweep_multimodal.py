"""Coverage by sweep, multimodal: every ``model_type`` of transformers' image-text-to-text auto
mapping, its text and vision configs shrunk by the generic rule (``tests/sweep_cases.py``),
saved with ``save_pretrained``.

For each type that builds here: the directory loads, with its language model streamed and
everything else (vision tower, projector) carried unchanged; the engine's loss and every
gradient of the language model equal HF autograd of the whole model on text (fp32, CPU); the
export holds exactly the names, shapes and dtypes ``save_pretrained`` wrote, every tensor bit
for bit (no step was taken) — or layerwise refuses the type in one line.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from family_cases import assert_grads_close, engine_grads, engine_loss, hf_reference, make_batch
from layerwise.interop.recipes.store_export import export_store
from layerwise.plan import Plan
from matrix import sampled
from sweep_cases import build_multimodal, image_text_types, saved_and_loaded, saved_tensors

def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


SAMPLE = ("llava", "gemma3", "qwen3_vl", "qwen3_vl_moe", "mllama", "idefics3", "smolvlm",
          "mistral3", "internvl", "fuyu")
"""Of ``image_text_types()``: what ``make test`` runs (``tests/matrix.py``); the ``sweep`` set
runs them all."""


@pytest.mark.parametrize("model_type", sampled(image_text_types(), SAMPLE, strict=False))
def test_every_image_text_type_trains_its_language_model_as_hf_or_is_refused(model_type, tmp_path):
    """Mutations seen failing: the head's copy keeping the vision tower (``functional_call``:
    missing keys of every vision tensor); the tensors outside the language model left out of the
    store (the export lacks them: "the source lacks 34 parameter(s)", Gemma 3)."""
    hub = tmp_path / "hub"

    def unreloadable(hub):
        _, info = AutoModelForImageTextToText.from_pretrained(hub, output_loading_info=True)
        if info["missing_keys"]:  # ShieldGemma 2 as Gemma 3: transformers' own save
            pytest.skip(f"{model_type}: transformers does not reload its own save here "
                        f"({len(info['missing_keys'])} missing keys)")

    _, model, adapter, store = saved_and_loaded(model_type, build_multimodal(model_type), hub,
                                                unreloadable, refusal_expected=False)
    assert adapter.passthrough_names, "a multimodal model has tensors outside its language model"
    batch = make_batch(adapter.vocab_size)
    ref_loss, ref_grads = hf_reference(model, adapter.config, [batch])
    loss = engine_loss(adapter, store, Plan.every_k(adapter.num_layers, 1), [batch])
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    got = engine_grads(store)
    assert_grads_close(got, {k: v for k, v in ref_grads.items() if k in got})
    out = export_store(store, tmp_path / "out")
    assert saved_tensors(out) == saved_tensors(hub)
    before, after = _tensors(hub), _tensors(out)
    assert all(torch.equal(before[k], after[k]) for k in before)
