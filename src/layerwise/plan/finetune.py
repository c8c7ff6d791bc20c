"""A frozen base with trained adapters (LoRA / QLoRA), as the planner's models see it: no tensors.

With ``ModelShape.frozen_base``, weights stream in the base format, only adapters get gradients
and state, embedding and head are frozen units, and a layer's backward is 1x its forward (input
gradients only), not 2x."""

from __future__ import annotations

from dataclasses import dataclass

BASE_DTYPES = ("auto", "compute", "bf16", "int8", "nf4", "fp8", "mxfp4")
"""The frozen base's formats (``lora.base_dtype``): ``compute`` is the run's compute dtype;
``auto`` a quantized release's own format, else ``compute`` (planned as ``compute``)."""

BASE_BYTES_PER_PARAM = {"bf16": 2.0, "nf4": 0.5 + 4 / 64, "fp8": 1.0 + 4 / 128**2, "mxfp4": 0.5 + 1 / 32}
"""Host and wire bytes per base matmul weight by format (int8 depends on the row length)."""


@dataclass(frozen=True)
class FrozenBase:
    adapter_params_per_layer: int
    """Adapter parameters (``lora_A`` + ``lora_B`` of every targeted linear) of one layer."""
    base_bytes_per_param: float | None = None
    """Bytes per decoder-layer matmul weight on the host and on the wire; None: the compute
    dtype's (norms, embedding and head are always in the compute dtype)."""
    adapter_flops_per_token: float = 0.0
    """Forward FLOPs per token of one layer's adapters (``2 (in + out) r`` per targeted linear)."""
    rank: int = 0
    """The adapters' rank (``lora.r``; 0: not said)."""
    base_dtype: str = ""
    """The base's format by name (``lora.base_dtype``; empty: not said)."""

    def label(self) -> str:
        """``LoRA r=16, nf4 base``: the run in words (``layerwise plan``'s verdict)."""
        base = f", {self.base_dtype} base" if self.base_dtype not in ("", "compute", "auto") else ""
        return f"LoRA r={self.rank}{base}" if self.rank else "LoRA"


def lora_frozen_base(hidden: int, intermediate: int, q_dim: int, kv_dim: int, r: int,
                     targets: list[str] | tuple[str, ...], base_dtype: str) -> FrozenBase:
    """The planner's view of ``lora.r=r lora.target_modules=targets lora.base_dtype=base_dtype``."""
    dims = {"q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),  # (in, out)
            "o_proj": (q_dim, hidden), "gate_proj": (hidden, intermediate),
            "up_proj": (hidden, intermediate), "down_proj": (intermediate, hidden)}
    chosen = [n for n in dims if "all-linear" in targets or n in targets
              or any(t.endswith("." + n) for t in targets)]
    adapter = sum(r * (dims[n][0] + dims[n][1]) for n in chosen)
    if base_dtype == "int8":
        matmul = sum(i * o for i, o in dims.values())
        per = 1.0 + sum(4 * o for _, o in dims.values()) / matmul  # codes + fp32 row scales
    else:
        per = BASE_BYTES_PER_PARAM.get(base_dtype)
    return FrozenBase(adapter, per, 2.0 * adapter, r, base_dtype)
