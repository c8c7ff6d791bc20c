"""Cost model: FLOPs, bytes and seconds of every op the engine runs, from the model config.

One source of numbers for the simulator and the MILP, so that what the solver optimises is what
the simulator (and, through calibration, the machine) measures. Everything is per micro-batch of
``micro_batch_size x seq_len`` tokens.

FLOP conventions (multiply-add = 2 FLOPs):

- a linear layer with ``n`` weights costs ``2 n`` FLOPs per token forward, ``4 n`` backward;
- causal attention costs ``4 * heads * head_dim`` FLOPs per (query, key) pair forward (QK^T and
  AV), over ``sum_q min(q + 1, window)`` pairs per sequence, and twice that backward;
- the engine's ``layer_bwd`` re-runs the layer's forward with a graph, then the backward:
  ``3x`` the forward FLOPs. Model FLOPs (for TFLOPS) count ``1x`` forward + ``2x`` backward only.

Device memory follows ``layerwise.plan.memory`` (which the engine uses too) op by op: the
weight buffers of the op and ``prefetch_depth`` uses ahead, the stored boundaries, and the op's
transient inputs, outputs, gradients and autograd workspace.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

from . import memory
from .hardware import HardwareProfile

# Host store bytes per parameter (layerwise.store.HostStore + optimizer state).
MASTER_BYTES = 4  # fp32 master weights
GRAD_BYTES = 4  # fp32 gradient accumulator
MOMENT_BYTES = {"fp32": 8, "8bit": 2 + 2 * 4 / 256}  # m and v; 8-bit: 1 B each + fp32 absmax per 256 block


@dataclass(frozen=True)
class ModelShape:
    """The shape facts the planner needs, read from a Hugging Face config."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    """Qwen2 has biases on q/k/v."""
    qk_norm: bool
    """Qwen3 has RMSNorm on q and k (head_dim weights each)."""
    layer_windows: tuple[int | None, ...]
    """Attention window per layer (None = full causal)."""

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        mt = getattr(config, "model_type", None)
        if mt not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"unsupported architecture model_type={mt!r}; the planner supports "
                             "llama, mistral, qwen2, qwen3")
        h = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        n = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types:
            windows = tuple(window if t == "sliding_attention" else None for t in types)
        elif mt == "mistral" and window:
            windows = (window,) * n
        else:
            windows = (None,) * n
        return cls(
            name=name or getattr(config, "_name_or_path", "") or mt,
            num_layers=n,
            hidden_size=h,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=mt == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=mt == "qwen3",
            layer_windows=windows,
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def layer_matmul_params(self) -> int:
        """Weights of a decoder layer that sit in matmuls (q, k, v, o, gate, up, down)."""
        h, f = self.hidden_size, self.intermediate_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * f

    @cached_property
    def layer_params(self) -> int:
        extra = 2 * self.hidden_size  # input and post-attention RMSNorm
        if self.qkv_bias:
            extra += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            extra += 2 * self.head_dim
        return self.layer_matmul_params + extra

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Final norm, plus lm_head when untied."""
        return self.hidden_size + (0 if self.tied else self.vocab_size * self.hidden_size)

    @property
    def num_params(self) -> int:
        return self.embed_params + self.num_layers * self.layer_params + self.head_params

    def unit_names(self) -> list[str]:
        return ["embed"] + [f"layers.{i}" for i in range(self.num_layers)] + ["head"]

    def unit_params(self, unit: str) -> int:
        if unit == "embed":
            return self.embed_params
        if unit == "head":
            return self.head_params
        return self.layer_params

    def attention_pairs(self, seq_len: int, window: int | None) -> int:
        """(query, key) pairs a causal (windowed) attention scores per sequence."""
        if window is None or window >= seq_len:
            return seq_len * (seq_len + 1) // 2
        return window * (window + 1) // 2 + (seq_len - window) * window


def load_shape(model: str) -> ModelShape:
    """A registry flavor name or a local Hugging Face model directory."""
    from pathlib import Path

    from ..models.registry import FLAVORS

    if model in FLAVORS:
        return ModelShape.from_config(FLAVORS[model].build_config(), name=model)
    p = Path(model)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"{model} has no config.json; pass a Hugging Face model directory or a flavor name")
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(str(p)), name=p.name)
    raise ValueError(f"unknown model {model!r}: use a flavor ({', '.join(sorted(FLAVORS))}) "
                     "or a local Hugging Face model directory")


@dataclass(frozen=True)
class CostModel:
    """Seconds and bytes of each engine op for one micro-batch shape on one machine."""

    shape: ModelShape
    hw: HardwareProfile
    micro_batch_size: int
    seq_len: int
    head_chunk_tokens: int = 1024

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"micro_batch_size and seq_len must be >= 1, got "
                             f"{self.micro_batch_size} and {self.seq_len}")

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    @property
    def elem_bytes(self) -> int:
        return self.hw.compute_dtype_bytes

    # ----- FLOPs --------------------------------------------------------------------------

    def layer_fwd_flops(self, i: int) -> float:
        s = self.shape
        pairs = s.attention_pairs(self.seq_len, s.layer_windows[i])
        attn = 4.0 * s.q_dim * pairs * self.micro_batch_size
        return 2.0 * s.layer_matmul_params * self.tokens + attn

    @property
    def head_fwd_flops(self) -> float:
        return 2.0 * self.shape.hidden_size * self.shape.vocab_size * self.tokens

    def model_flops(self) -> float:
        """Forward + backward FLOPs of one micro-batch, no recompute (the MFU numerator)."""
        return 3.0 * (sum(self.layer_fwd_flops(i) for i in range(self.shape.num_layers)) + self.head_fwd_flops)

    # ----- seconds ------------------------------------------------------------------------

    def _secs(self, flops: float) -> float:
        return flops / self.hw.flops_per_s + self.hw.op_overhead_s

    def layer_fwd_s(self, i: int) -> float:
        return self._secs(self.layer_fwd_flops(i))

    def layer_bwd_s(self, i: int) -> float:
        """Forward with a graph + backward (2x): 3x forward FLOPs."""
        return self._secs(3.0 * self.layer_fwd_flops(i))

    @property
    def head_s(self) -> float:
        """Norm + lm_head + loss forward and backward, all chunks."""
        chunks = -(-self.tokens // self.head_chunk_tokens)
        return 3.0 * self.head_fwd_flops / self.hw.flops_per_s + chunks * self.hw.op_overhead_s

    @property
    def embed_s(self) -> float:
        """Embedding gather or scatter-add: memory-bound and tiny; only the op overhead counts."""
        return self.hw.op_overhead_s

    def op_s(self, kind: str, i: int = -1) -> float:
        if kind in ("layer_fwd", "recompute_layer"):
            return self.layer_fwd_s(i)
        if kind == "layer_bwd":
            return self.layer_bwd_s(i)
        if kind == "head":
            return self.head_s
        if kind in ("embed_fwd", "recompute_embed", "embed_bwd"):
            return self.embed_s
        return 0.0  # fetch: a copy, not compute

    def h2d_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.h2d_gbps * 1e9)

    def d2h_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.d2h_gbps * 1e9)

    def nvme_read_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.nvme_read_gbps * 1e9)

    def nvme_write_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.nvme_write_gbps * 1e9)

    def grad_accumulate_s(self, unit: str) -> float:
        """Host fp32 ``grad += device grad``: reads elem + 4 bytes, writes 4 bytes per parameter."""
        return self.shape.unit_params(unit) * (self.elem_bytes + 8) / (self.hw.host_accum_gbps * 1e9)

    def optimizer_s(self, unit: str, moments: str = "fp32") -> float:
        rate = self.hw.optimizer_params_per_s if moments == "fp32" else self.hw.optimizer_8bit_params_per_s
        return self.shape.unit_params(unit) / rate

    # ----- bytes --------------------------------------------------------------------------

    def unit_weight_bytes(self, unit: str) -> int:
        """Bytes streamed H2D for a unit (compute dtype); its gradient D2H has the same size."""
        return self.shape.unit_params(unit) * self.elem_bytes

    def grad_bytes(self, unit: str) -> int:
        return self.unit_weight_bytes(unit)

    @property
    def boundary_bytes(self) -> int:
        """One layer-boundary activation ``[mbs, seq, hidden]`` in the compute dtype."""
        return self.tokens * self.shape.hidden_size * self.elem_bytes

    @property
    def layer_workspace_bytes(self) -> int:
        """What autograd keeps for one layer's backward (the engine's formula)."""
        return memory.layer_workspace_bytes(self.shape, self.tokens, self.elem_bytes)

    def op_transient_bytes(self, kind: str, i: int = -1) -> int:
        """Device bytes an op holds only while it runs (inputs, outputs, grads, workspace)."""
        return memory.op_transient_bytes(self.shape, kind, i, self.tokens, self.elem_bytes,
                                         self.head_chunk_tokens)

    def host_store_bytes(self, moments: list[str] | None = None) -> int:
        """Host bytes of the store: fp32 master + fp32 grad (+ compute copy) + moments, per unit."""
        units = self.shape.unit_names()
        moments = moments or ["fp32"] * len(units)
        compute_copy = self.elem_bytes if self.elem_bytes != 4 else 0
        total = 0.0
        for u, m in zip(units, moments):
            total += self.shape.unit_params(u) * (MASTER_BYTES + GRAD_BYTES + compute_copy + MOMENT_BYTES[m])
        return int(total)
