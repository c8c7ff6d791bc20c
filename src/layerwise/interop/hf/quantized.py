"""Quantized Hub releases, read dequantized through transformers' own load ops.

:func:`dequantizer` builds the quantizer transformers would use with ``dequantize=True`` (FP8,
MXFP4, bitsandbytes NF4/FP4 and LLM.int8), so each group reads back as ``from_pretrained``
would build it. Any other format is refused: weights read without their scales must never be
trained."""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers.core_model_loading import ConversionOps

from ...adapters.quant import fp8_format

# FP8 (DeepSeek-V3, Qwen3-FP8), MXFP8 (same op, ue8m0 scales) and gpt-oss MXFP4
DEQUANTIZED_BY_TRANSFORMERS = ("fp8", "mxfp8", "mxfp4")
BITSANDBYTES = "bitsandbytes"
DEQUANTIZE_MIN = "5.25"
"""The oldest transformers whose load ops the quantized tests pass on (5.21 reads block FP8 and
MXFP4 off by more than their rounding)."""
# formats whose weights are plain floats already (a GGUF file converted by transformers and saved)
PLAIN_WEIGHTS = ("gguf",)

# Companion tensors of a packed weight (scales, packed blocks, bnb state, GPTQ/AWQ codes): a file
# key like this that no model parameter takes means weights would load without their scales.
QUANT_KEY = re.compile(
    r"(_scale_inv|_scales?|\.scales?|_blocks|\.absmax|\.quant_map|\.nested_\w+|\.quant_state\.\w+"
    r"|\.SCB|\.weight_format|\.qweight|\.qzeros|\.g_idx|\.weight_packed|\.weight_shape"
    r"|\.weight_zero_point|_zero_point|\.W_q|\.meta)$"
)

_HOW = ("dequantize it first with transformers (`AutoModelForCausalLM.from_pretrained(dir, "
        "quantization_config=<its config class>(dequantize=True))`, then `save_pretrained`) or "
        "start from the unquantized release")


def quant_method(config: dict | None) -> str | None:
    """The ``quant_method`` of ``config``'s ``quantization_config`` (bitsandbytes: ``bitsandbytes``),
    None when the config has none."""
    qc = (config or {}).get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json's quantization_config is {type(qc).__name__}, not a mapping")
    if qc.get("load_in_4bit") or qc.get("load_in_8bit"):
        return BITSANDBYTES
    return str(qc.get("quant_method", "unknown"))


def release_weight_format(config: dict | None) -> str | None:
    """The ``adapters.quant`` format that holds ``config``'s quantized weights as the release has
    them (NF4 in 64-blocks, LLM.int8, square-block FP8, MXFP4), None for a plain checkpoint or a
    format none of them is."""
    method = quant_method(config)
    qc = (config or {}).get("quantization_config") or {}
    if method == BITSANDBYTES:
        if qc.get("load_in_8bit"):
            return "int8"
        nf4 = qc.get("bnb_4bit_quant_type", "fp4") == "nf4"
        return "nf4" if nf4 and qc.get("bnb_4bit_blocksize", 64) == 64 else None
    if method == "fp8":
        block = qc.get("weight_block_size")
        return fp8_format(block[0]) if block and len(block) == 2 and block[0] == block[1] else None
    return "mxfp4" if method == "mxfp4" else None


def refusal(path: Any, method: str, why: str = "layerwise does not read it") -> ValueError:
    return ValueError(f"{path}: weights quantized with quant_method {method!r}: {why}; {_HOW}")


def dequantizer(config: dict | None, path: Any = "the model dir") -> Any | None:
    """The transformers quantizer that reads ``config``'s checkpoint dequantized (``None``: the
    checkpoint is plain); ValueError for a format that is not read."""
    method = quant_method(config)
    if method is None or method in PLAIN_WEIGHTS:
        return None
    from transformers.quantizers import AutoHfQuantizer
    from transformers.quantizers.auto import AutoQuantizationConfig
    from transformers.quantizers.base import HfQuantizer
    from packaging.version import Version
    from transformers import __version__

    if not hasattr(HfQuantizer, "get_load_operations") or Version(__version__) < Version(DEQUANTIZE_MIN):
        # older 5.x releases dequantize these differently from their own from_pretrained
        raise refusal(path, method, f"reading it needs transformers >= {DEQUANTIZE_MIN} (this is "
                      f"{__version__}): pip install -U transformers")
    qc = dict(config["quantization_config"])
    if method == BITSANDBYTES:
        return _bnb_dequantizer(qc, path)
    if method not in DEQUANTIZED_BY_TRANSFORMERS:
        raise refusal(path, method)
    qcfg = AutoQuantizationConfig.from_dict(qc)
    qcfg.dequantize = True
    quantizer = AutoHfQuantizer.from_config(qcfg, pre_quantized=True)
    if method in ("fp8", "mxfp8"):
        quantizer.get_load_operations = lambda: {"dequantize": _block_fp8_dequantize()}
    if "dequantize" not in quantizer.get_load_operations():
        raise refusal(path, method, "the installed transformers has no dequantize op for it")
    return quantizer


def _block_fp8_dequantize():
    """transformers' ``Fp8Dequantize`` with the block size taken from ``weight_block_size`` when
    the scale grid is the ceiling one of a shape the block does not divide (DeepSeek-V3's
    ``kv_a_proj_with_mqa``: 576 rows, 128-row blocks, 5 scale rows), where deriving the block
    from the grid would take the wrong rows for each scale."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    class BlockFp8Dequantize(Fp8Dequantize):
        def _dequantize_one(self, quantized, scales, output_dtype=None):
            block = getattr(self.hf_quantizer.quantization_config, "weight_block_size", None)
            if block and quantized.dtype.is_floating_point and scales.dim() >= 2 \
                    and quantized.dim() >= 2:
                bm, bn = block
                rows, cols = quantized.shape[-2:]
                grid = (-(-rows // bm), -(-cols // bn))
                if tuple(scales.shape[-2:]) == grid and (rows % bm or cols % bn):
                    s = scales.to(torch.float32)
                    if scales.dtype == torch.uint8:  # ue8m0 exponents
                        s = (s - 127.0).exp2()
                    s = s.repeat_interleave(bm, -2)[..., :rows, :]
                    s = s.repeat_interleave(bn, -1)[..., :cols]
                    dtype = output_dtype or torch.bfloat16
                    return (quantized.to(torch.float32) * s).to(dtype)
            return super()._dequantize_one(quantized, scales, output_dtype=output_dtype)

    return BlockFp8Dequantize


def _bnb_dequantizer(qc: dict, path: Any) -> Any:
    """bitsandbytes' quantizer with a dequantize load op (transformers only deserializes bnb into
    its own low-bit modules): NF4/FP4 by ``bitsandbytes.functional.dequantize_4bit`` with the
    QuantState the saved ``quant_state.*`` tensors describe, LLM.int8 by ``SCB``."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise refusal(path, BITSANDBYTES, "reading it needs the bitsandbytes package, which is "
                      "not installed (`pip install bitsandbytes`)") from None
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer
    from transformers.quantizers.quantizer_bnb_8bit import Bnb8BitHfQuantizer

    qcfg = BitsAndBytesConfig.from_dict(qc)
    qcfg.dequantize = True
    if qcfg.load_in_8bit:
        class Bnb8bitDequantizer(Bnb8BitHfQuantizer):
            def get_load_operations(self):
                return {"dequantize": Bnb8bitDequantize}
        return Bnb8bitDequantizer(qcfg, pre_quantized=True)

    class Bnb4bitDequantizer(Bnb4BitHfQuantizer):
        def get_load_operations(self):
            return {"dequantize": Bnb4bitDequantize}
    return Bnb4bitDequantizer(qcfg, pre_quantized=True)


def _target_dtype(model: torch.nn.Module | None, name: str | None) -> torch.dtype:
    if model is not None and name is not None:
        try:
            return model.get_parameter(name).dtype
        except AttributeError:
            pass
    return torch.float32


def _as_list(v: Any) -> list:
    return v if isinstance(v, list) else [v]


class _BnbDequantize(ConversionOps):
    """A load op turning each ``…weight`` entry and its companions (``…weight<suffix>`` for the
    quantizer's serialized names) into the plain weight; entries without companions pass through
    (a weight bnb did not quantize). Subclasses give ``_base(key)`` (the weight key whose
    companion ``key`` is; None: ``key`` is a weight) and ``_dequantize``."""

    companions: tuple[str, ...] = ()

    def __init__(self, hf_quantizer):
        self.hf_quantizer = hf_quantizer

    def convert(self, input_dict: dict[str, Any], model=None, full_layer_name=None, **kwargs):
        dtype = _target_dtype(model, full_layer_name)
        parts: dict[str, dict[str, Any]] = {}
        for key, value in input_dict.items():
            base = self._base(key)
            if base is None:
                parts.setdefault(key, {})["weight"] = value
            else:
                parts.setdefault(base, {})[key[len(base):]] = value
        out: dict[str, Any] = {}
        for key, p in parts.items():
            weights = _as_list(p.pop("weight"))
            if not p:
                out[key] = [w if not w.is_floating_point() else w.to(dtype) for w in weights]
                continue
            per = [{k: _as_list(v)[i] for k, v in p.items()} for i in range(len(weights))]
            out[key] = [self._dequantize(w, stats).to(dtype) for w, stats in zip(weights, per)]
        # a per-expert pattern keeps its list for the converter's merge; a plain key, one tensor
        return {k: v if "*" in k or len(v) != 1 else v[0] for k, v in out.items()}

    @property
    def reverse_op(self):
        from transformers.core_model_loading import _IdentityOp

        return _IdentityOp()


class Bnb4bitDequantize(_BnbDequantize):
    companions = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map",
                  ".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")

    def _base(self, key: str) -> str | None:
        for c in self.companions:
            if key.endswith("weight" + c):
                return key[: -len(c)]
        return None

    def _dequantize(self, weight, stats):
        from bitsandbytes.functional import QuantState, dequantize_4bit

        state = QuantState.from_dict(qs_dict={k.lstrip("."): v for k, v in stats.items()},
                                     device=weight.device)
        return dequantize_4bit(weight, state)


class Bnb8bitDequantize(_BnbDequantize):
    companions = ("SCB", "weight_format")

    def _base(self, key: str) -> str | None:
        for c in self.companions:
            if key.endswith(c) and not key.endswith("weight"):
                return key[: -len(c)] + "weight"
        return None

    def _dequantize(self, weight, stats):
        scb = stats["SCB"] if "SCB" in stats else next(v for k, v in stats.items() if k.endswith("SCB"))
        return weight.to(torch.float32) * (scb.to(torch.float32).unsqueeze(1) / 127.0)
