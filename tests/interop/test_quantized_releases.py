"""Quantized Hub releases: packed in the release's own layout, read dequantized, trained as HF.

Each case builds a tiny model from a flavor's config (nothing is downloaded), saves it as
``save_pretrained`` does and packs its weights the way the release ships them: block-wise FP8
(``weight`` float8_e4m3fn + ``weight_scale_inv``, ``quant_method: fp8``, ``weight_block_size``)
on a dense Qwen3 and on DeepSeek-V3 (MLA + per-expert MoE); gpt-oss MXFP4
(``experts.gate_up_proj_blocks`` / ``_scales``); bitsandbytes NF4 (transformers' own
``save_pretrained`` of a 4-bit model, the unsloth ``-bnb-4bit`` layout). The reference is
HF autograd in fp32 over transformers' own dequantized model; the engine's loss must equal it to
rel 1e-5 and every gradient to ``assert_grads_close``'s 1e-4. Reading the FP8 weights without
their scales (what the loader did before) is off by far more than that, measured on these
cases: the loss by 0.5% (Qwen3) and 1.5% (DeepSeek-V3), the worst gradient's relative error 38
and 80 (a layernorm's); a wrong block size (below) by 1.7e-4 and 0.63.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

from family_cases import assert_grads_close, engine_grads, engine_loss, hf_reference, make_batch
from layerwise.adapters.config import LoraConfig
from layerwise.cli import main
from layerwise.adapters.lora_adapter import LoraAdapter
from layerwise.adapters.lora_store import LoraStore
from layerwise.interop.hf.model_dir import HFModelDirSource, fill_store, load_store
from layerwise.interop.hf.quantized import release_weight_format
from layerwise.interop.recipes.store_export import export_store
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.plan import Plan
from layerwise.util.units import tensor_nbytes

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _saved(flavor: str, out: Path, dtype=torch.bfloat16):
    """(config, model): ``flavor``'s tiny model saved to ``out`` as ``save_pretrained`` writes
    it, in the release's ``dtype``."""
    cfg = get_flavor(flavor).build_config(vocab_size=320)  # room for the byte tokenizer
    model = build_hf_model(cfg, seed=0).to(dtype)
    model.save_pretrained(out)
    return cfg, model


def _write(out: Path, tensors: dict[str, torch.Tensor], quantization_config: dict | None) -> None:
    """Replace ``out``'s weights with ``tensors`` and set config.json's quantization_config."""
    for f in out.glob("model*.safetensors*"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("quantization_config", None)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(cfg, indent=2))


def _fp8_pack(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise e4m3 with one fp32 ``weight_scale_inv`` per block, the grid the ceiling of the
    shape over the block (DeepSeek's ``fp8_cast``: a 576-row weight with 128-row blocks has 5)."""
    bm, bn = block
    rows, cols = w.shape
    pr, pc = -(-rows // bm) * bm, -(-cols // bn) * bn
    padded = torch.zeros(pr, pc)
    padded[:rows, :cols] = w.float()
    tiles = padded.reshape(pr // bm, bm, pc // bn, bn)
    scale_inv = tiles.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(pr, pc)[:rows, :cols].contiguous(), scale_inv


def _fp8_unpack(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    bm, bn = block
    rows, cols = q.shape
    s = scale_inv.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return q.float() * s


def _fp8_release(hub: Path, ref: Path, block: tuple[int, int], scale_dtype) -> dict:
    """Pack every projection of the decoder layers in ``hub`` (the router, norms, embedding and
    head stay bf16, as in the releases); write to ``ref`` the same keys dequantized, plain."""
    plain = load_file(hub / "model.safetensors")
    packed, deq = {}, {}
    for k, v in plain.items():
        if ".layers." in k and k.endswith("proj.weight") or k.endswith("proj_with_mqa.weight"):
            q, s = _fp8_pack(v, block)
            packed[k], packed[k.removesuffix("weight") + "weight_scale_inv"] = q, s.to(scale_dtype)
            deq[k] = _fp8_unpack(q, s.to(scale_dtype), block)
        else:
            packed[k] = deq[k] = v
    qc = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
          "weight_block_size": list(block)}
    ref.mkdir()
    for f in hub.iterdir():
        (ref / f.name).write_bytes(f.read_bytes())
    _write(ref, {k: v.float() for k, v in deq.items()}, None)
    _write(hub, packed, qc)
    return packed


def _mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss's MXFP4 of an ``[experts, in, out]`` parameter: ``blocks`` ``[experts, out, in/32,
    16]`` uint8 (two e2m1 codes a byte, the even element in the low nibble) and ``scales``
    ``[experts, out, in/32]`` uint8 (a power-of-two exponent + 127), the layout transformers'
    ``convert_moe_packed_tensors`` unpacks."""
    t = w.float().transpose(1, 2)  # [E, out, in]
    e, o, i = t.shape
    groups = t.reshape(e, o, i // 32, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    codes = (groups / torch.exp2(exp)[..., None]).unsqueeze(-1)
    idx = (codes - FP4_VALUES).abs().argmin(-1).to(torch.uint8)  # nearest e2m1 value
    blocks = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return blocks.contiguous(), (exp + 127).to(torch.uint8)


def _check(hub: Path, cfg, reference) -> tuple:
    """Load ``hub`` with layerwise; its loss and every gradient equal HF's over ``reference``."""
    adapter, store = load_store(hub)
    batch = make_batch(cfg.vocab_size)
    ref_loss, ref_grads = hf_reference(reference.eval(), cfg, [batch])
    loss = engine_loss(adapter, store, Plan.every_k(adapter.num_layers, 1), [batch])
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(engine_grads(store), ref_grads)
    return adapter, store, batch


def _no_quant_names(hub: Path) -> None:
    names = HFModelDirSource(hub).hf_names()
    assert not [n for n in names if n.endswith(("_blocks", "_scales", "scale_inv", "absmax"))]


def _qwen3_fp8(tmp_path: Path) -> tuple[Path, Any, Any]:
    """(dir, config, reference): Qwen3 in the Qwen3-FP8 layout, the reference transformers' own
    ``from_pretrained(..., quantization_config=FineGrainedFP8Config(dequantize=True))``."""
    hub = tmp_path / "qwen3-fp8"
    cfg, _ = _saved("qwen3-debug-untied", hub)
    _fp8_release(hub, tmp_path / "ref", (16, 16), torch.bfloat16)
    with safe_open(hub / "model.safetensors", "pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight_scale_inv").get_shape() == [2, 2]
    ref = AutoModelForCausalLM.from_pretrained(
        hub, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager")
    return hub, cfg, ref


def _deepseek_v3_fp8(tmp_path: Path) -> tuple[Path, Any, Any]:
    """DeepSeek-V3's release layout (per-expert FP8 experts with their scales, MLA, a 20-row
    ``kv_a_proj_with_mqa`` over 16-row blocks); the reference HF over the same keys dequantized
    independently."""
    hub = tmp_path / "dsv3-fp8"
    cfg, _ = _saved("deepseek-v3-debug", hub)
    packed = _fp8_release(hub, tmp_path / "ref", (16, 16), torch.float32)
    assert packed["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(packed["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape) == (2, 2)
    return hub, cfg, AutoModelForCausalLM.from_pretrained(tmp_path / "ref", config=cfg, dtype=torch.float32)


def _gpt_oss_mxfp4(tmp_path: Path) -> tuple[Path, Any, Any]:
    """gpt-oss's release: experts as ``gate_up_proj_blocks``/``_scales`` and ``down_proj_…``,
    attention, router, embedding and head bf16, the release's ``quantization_config``; the
    reference ``from_pretrained(..., quantization_config=Mxfp4Config(dequantize=True))``."""
    hub = tmp_path / "gpt-oss-mxfp4"
    cfg, _ = _saved("gpt-oss-debug", hub)
    tensors = load_file(hub / "model.safetensors")
    for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[k + "_blocks"], tensors[k + "_scales"] = _mxfp4_pack(tensors.pop(k))
    assert tuple(tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape) == (4, 64, 1, 16)
    _write(hub, tensors, {"modules_to_not_convert": ["model.layers.*.self_attn",
                                                      "model.layers.*.mlp.router",
                                                      "model.embed_tokens", "lm_head"],
                          "quant_method": "mxfp4"})
    ref = AutoModelForCausalLM.from_pretrained(
        hub, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager")
    return hub, cfg, ref


def _bnb_nf4(tmp_path: Path) -> tuple[Path, Any, Any]:
    """An unsloth ``-bnb-4bit`` directory (NF4, double quant, bf16 compute) as transformers'
    ``save_pretrained`` of the 4-bit model writes it; the reference that model's own
    ``dequantize()``."""
    pytest.importorskip("bitsandbytes")
    from transformers import BitsAndBytesConfig

    plain = tmp_path / "plain"
    cfg, _ = _saved("llama-debug", plain, dtype=torch.float32)
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16,
                             bnb_4bit_blocksize=64)
    hub = tmp_path / "llama-bnb-4bit"
    AutoModelForCausalLM.from_pretrained(plain, quantization_config=bnb).save_pretrained(hub)
    assert json.loads((hub / "config.json").read_text())["quantization_config"]["load_in_4bit"]
    ref = AutoModelForCausalLM.from_pretrained(hub, dtype=torch.float32, attn_implementation="eager")
    return hub, cfg, ref.dequantize(dtype=torch.float32).float()


RELEASES = {"qwen3-fp8": _qwen3_fp8, "deepseek-v3-fp8": _deepseek_v3_fp8,
            "gpt-oss-mxfp4": _gpt_oss_mxfp4, "llama-bnb-nf4": _bnb_nf4}


def test_block_fp8_dense_trains_as_transformers_dequantized(tmp_path):
    """Qwen3-FP8. Mutation seen failing: the quantizer not passed to ``HubLayout`` (the scales
    dropped, the e4m3 codes read as weights): refused by the unread-scales check; with both
    refusal checks off too, the loss is 0.5% off and a gradient's relative error 38."""
    hub, cfg, ref = _qwen3_fp8(tmp_path)
    _no_quant_names(hub)
    _check(hub, cfg, ref)


def test_block_fp8_deepseek_v3_trains_as_hf_over_its_dequantized_weights(tmp_path):
    """DeepSeek-V3: the per-expert scales are merged into the fused experts after dequantizing;
    ``kv_a_proj_with_mqa`` has a ceiling grid (as its 576 rows over 128 are). Mutations seen
    failing: the block size derived from the scale grid (transformers' ``Fp8Dequantize`` alone:
    rows 0-9 and 10-19 per scale row instead of 0-15 and 16-19): the loss 1.7e-4 off, the
    router's gradient 0.63; the scales dropped (no quantizer, refusal checks off): the loss 1.5%
    off, a gradient's relative error 80."""
    hub, cfg, ref = _deepseek_v3_fp8(tmp_path)
    _no_quant_names(hub)
    _check(hub, cfg, ref)


def test_mxfp4_gpt_oss_trains_as_transformers_dequantized(tmp_path):
    """gpt-oss. Mutation seen failing: no quantizer (the state before): refused, the
    ``_blocks``/``_scales`` unread (without the unread-scales check: "weights missing for 4
    tensors")."""
    hub, cfg, ref = _gpt_oss_mxfp4(tmp_path)
    _no_quant_names(hub)
    _check(hub, cfg, ref)


def test_bitsandbytes_nf4_trains_as_bitsandbytes_dequantized(tmp_path):
    """bitsandbytes NF4. Mutations seen failing: the QuantState's nested absmax left out (the
    double-quantized ``absmax`` read as its uint8 codes): the loss 1e-3 off, a gradient's
    relative error 80; no quantizer: refused, ``weight.absmax`` &c. unread."""
    hub, cfg, ref = _bnb_nf4(tmp_path)
    _no_quant_names(hub)
    _check(hub, cfg, ref)


@pytest.mark.parametrize("release, fmt, max_bytes", [
    # a scale per 16x16 tile; DeepSeek's 20-row projection has a ceiling grid, as its scales do
    ("qwen3-fp8", "fp8-16", 1 + 4 / 16**2), ("deepseek-v3-fp8", "fp8-16", 1.02),
    ("gpt-oss-mxfp4", "mxfp4", 0.5 + 1 / 32), ("llama-bnb-nf4", "nf4", 0.5 + 4 / 64)])
def test_lora_holds_a_release_in_its_own_low_bit_format(release, fmt, max_bytes, tmp_path, capsys):
    """LoRA over a quantized release (``lora.base_dtype`` left ``auto``): the tensors the release
    packs are held packed in its format (bytes per such parameter measured from the store's
    regions), the ones it keeps plain stay plain, the held values are the release's (the loss
    with the adapters at zero equals HF's over transformers' dequantized model, rel 1e-5), and
    ``layerwise train`` trains it, printing the bytes per frozen parameter. Mutations seen
    failing: every matmul weight packed (``packed_names`` ignored): gpt-oss's bf16 attention is
    refused ("do not pack back"); with the round-trip check off too, the packed set is not the
    release's."""
    hub, cfg, ref = RELEASES[release](tmp_path)
    source = HFModelDirSource(hub)
    assert release_weight_format(source.config) == fmt
    lora = LoraConfig(r=4, alpha=8, base_dtype=fmt)
    adapter = LoraAdapter(DecoderAdapter(cfg), lora, packed_names=source.packed_names())
    store = LoraStore(adapter)
    store.release_format = True
    fill_store(source, store)
    store.init_adapters(0)
    entries = [e for b in store.layers for e in b.layout.frozen]
    packed = [e for e in entries if e.fmt == fmt]
    assert packed and {e.hf_name for e in packed} == source.packed_names() & {e.hf_name for e in entries}
    held = sum(tensor_nbytes(e.view(store.by_name[b.name].source.view(torch.uint8)))
               for b in store.layers for e in b.layout.frozen if e.fmt == fmt)
    assert held / sum(e.numel for e in packed) <= max_bytes + 1e-9
    batch = make_batch(cfg.vocab_size)
    ref_loss, _ = hf_reference(ref.eval(), cfg, [batch])
    loss = engine_loss(adapter, store, Plan.every_k(adapter.num_layers, 1), [batch])
    assert loss == pytest.approx(ref_loss, rel=1e-5)

    capsys.readouterr()
    assert main(["train", f"model={hub}", f"out_dir={tmp_path / 'run'}", "lora.r=4", "steps=2",
                 "seq_len=16", "micro_batch_size=1", "grad_accum=1"]) == 0
    said = "".join(capsys.readouterr())
    assert f"lora.base_dtype=auto: {fmt}" in said and "bytes per frozen layer parameter" in said, said[-3000:]
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_export_of_a_quantized_release_is_plain_and_loads(tmp_path):
    """A full export from an FP8 release: no ``quantization_config`` in its config.json, plain
    float weights, ``from_pretrained`` loads it to the reference's logits. Mutation seen failing:
    ``export_config`` keeping the source's ``quantization_config`` (the config assertion; on a
    CPU transformers then falls back to dequantizing, a pass-through for fp32 weights, so the
    load alone would not show it: with a GPU it would build FP8 layers for weights with no
    scales)."""
    hub = tmp_path / "qwen3-fp8"
    _saved("qwen3-debug-untied", hub)
    _fp8_release(hub, tmp_path / "ref", (16, 16), torch.bfloat16)
    adapter, store = load_store(hub)
    out = export_store(store, tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "ref", dtype=torch.float32)
    ids = make_batch(adapter.config.vocab_size).input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["gptq", "awq", "compressed-tensors"])
def test_an_unread_quant_method_is_refused_in_one_line(method, tmp_path):
    hub = tmp_path / method
    _saved("llama-debug", hub)
    tensors = load_file(hub / "model.safetensors")
    _write(hub, tensors, {"quant_method": method, "bits": 4, "group_size": 128})
    with pytest.raises(ValueError) as e:
        load_store(hub)
    msg = str(e.value)
    assert "\n" not in msg and repr(method) in msg and "dequantize=True" in msg


def test_scales_no_config_describes_are_refused(tmp_path):
    """FP8 weights and their scales under a config.json without ``quantization_config`` (one
    copied from the base model): refused, never read as e4m3 codes without their scales.
    Mutations seen failing: ``_refuse_unread_scales`` off (the packed-dtype check refuses, not
    naming the scales); ``_refuse_packed`` off (the codes alone load: "DID NOT RAISE")."""
    hub = tmp_path / "fp8-no-config"
    _saved("qwen3-debug-untied", hub)
    packed = _fp8_release(hub, tmp_path / "ref", (16, 16), torch.bfloat16)
    _write(hub, packed, None)
    with pytest.raises(ValueError, match="scales") as e:
        load_store(hub)
    assert "\n" not in str(e.value)
    # the scales dropped too: the e4m3 codes alone are still refused
    _write(hub, {k: v for k, v in packed.items() if not k.endswith("scale_inv")}, None)
    with pytest.raises(ValueError, match="float8_e4m3fn") as e:
        load_store(hub)
    assert "\n" not in str(e.value)


def test_gguf_config_over_plain_weights_loads_as_plain(tmp_path):
    """A directory transformers converted from GGUF keeps ``quant_method: gguf`` over plain
    float weights: nothing to dequantize, read as is, exported without it."""
    hub = tmp_path / "from-gguf"
    _saved("llama-debug", hub)
    _write(hub, load_file(hub / "model.safetensors"), {"quant_method": "gguf"})
    adapter, store = load_store(hub)
    out = export_store(store, tmp_path / "out")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())


def test_cli_refuses_an_unread_quant_method_with_exit_2(tmp_path, capsys):
    """In process (``cli.main``, what the ``layerwise`` script calls): a fresh process only
    paid the imports again."""
    from layerwise.cli import main

    hub = tmp_path / "gptq"
    _saved("llama-debug", hub)
    _write(hub, load_file(hub / "model.safetensors"), {"quant_method": "gptq", "bits": 4})
    capsys.readouterr()
    assert main(["train", f"model={hub}", f"out_dir={tmp_path / 'run'}", "steps=1"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the lines that say what was resolved
    assert "'gptq'" in last and last.startswith("layerwise train: error:"), err[-2000:]
    assert "Traceback" not in err
