"""LoRA settings (``lora.*`` of ``layerwise train``), torch-free so ``--help`` reads them cheaply.

The names follow PEFT's ``LoraConfig`` (``r``, ``lora_alpha`` as ``alpha``, ``lora_dropout`` as
``dropout``, ``target_modules``), so an adapter trained here is a PEFT adapter."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

BASE_DTYPES = ("auto", "compute", "bf16", "int8", "nf4", "fp8", "mxfp4")
"""How the frozen base's decoder-layer matmul weights are held on the host and streamed."""
ALL_LINEAR = "all-linear"


@dataclass
class LoraConfig:
    r: int = 0
    """LoRA rank; 0 trains every parameter (no adapters)."""
    alpha: float = 16.0
    """PEFT's ``lora_alpha``: the adapter's output is scaled by ``alpha / r``."""
    dropout: float = 0.0
    """PEFT's ``lora_dropout``: dropout on the adapter's input while training (the same mask in a
    micro-batch's forward, recompute and backward)."""
    target_modules: list[str] = field(default_factory=lambda: [ALL_LINEAR])
    """Decoder-layer linears that get adapters, by PEFT's names (``q_proj``, ``v_proj``, ...: a
    module whose name is one of these or ends with ``.`` + one), or ``all-linear`` (every linear of
    the decoder layers; the lm_head never)."""
    base_dtype: str = field(default="auto", metadata={"choices": BASE_DTYPES})
    """The frozen base's decoder-layer matmul weights (linears, expert tensors) on the host and
    on the wire: ``compute`` (the compute dtype), ``bf16``, ``int8`` (per-row absmax, ~1
    B/param), ``nf4`` (QLoRA's 4-bit, block-wise absmax, 0.56 B/param), ``fp8`` (e4m3 in
    128x128 blocks, ~1 B/param) or ``mxfp4`` (gpt-oss's, 0.53 B/param); dequantised on the
    device. ``auto``: a quantized release's own format (its values kept exactly), else
    ``compute``. Norms, embedding and head stay in the compute dtype."""
    init: str | None = None
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) to start
    from; its r, alpha and target modules must match these."""
    merge: bool = False
    """On export also write the base with the adapters merged in (``out_dir/model``) as a full
    Hugging Face model directory."""

    @property
    def enabled(self) -> bool:
        return self.r > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def check(self, prefix: str = "lora.") -> None:
        """Refuse settings no run can use (``ValueError`` naming the key)."""
        if self.r < 0:
            raise ValueError(f"{prefix}r must be >= 0 (0: no adapters), got {self.r}")
        if not self.enabled:
            return
        if not self.alpha > 0:
            raise ValueError(f"{prefix}alpha must be > 0, got {self.alpha:g}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{prefix}dropout must be in [0, 1), got {self.dropout:g}")
        if not self.target_modules:
            raise ValueError(f"{prefix}target_modules is empty: name linears (q_proj, v_proj, ...) "
                             f"or {ALL_LINEAR}")
        if self.base_dtype not in BASE_DTYPES and not re.fullmatch(r"fp8-[1-9]\d*", self.base_dtype):
            raise ValueError(f"{prefix}base_dtype must be one of {', '.join(BASE_DTYPES)}, got "
                             f"{self.base_dtype!r}")
