"""Device seconds of a compute op from its shape: a roofline per kernel plus a launch per kernel.

An op runs as the HF module runs it (eager, SDPA), so it is priced kernel by kernel: GEMMs
(``M`` rounded up to ``gemm_tile_rows``: a tile is computed whole), flash attention (backward
2.5x the forward), routed experts as grouped GEMMs (bandwidth-bound with few tokens per expert),
and elementwise kernels by bytes only (estimates from transformers' modules, below). A kernel
costs ``max(roofline, kernel_launch_s)`` on an asynchronous device and ``kernel_launch_s +
roofline`` on a synchronous one, the roofline being ``max(FLOPs / (peak_tflops x efficiency),
bytes / device_mem_gbps)``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cached_property

from ..models.names import layer_unit
from .hardware import HardwareProfile
from ..plan.memory import grad_slot_itemsize
from ..plan.shape import ModelShape

NORM_KERNELS, NORM_BYTES_PER_ELEM = 6, 36
"""An RMSNorm as transformers runs it: upcast, square, mean, scale, downcast, weight: ~9 fp32 passes."""
ROPE_KERNELS, ROPE_PASSES = 5, 10
"""Rotary embedding of one tensor: ``x * cos + rotate_half(x) * sin`` (mul, neg, cat, mul, add)."""
ACT_KERNELS, ACT_PASSES = 2, 5
"""SwiGLU's ``act(gate) * up``: read, write; read two, write one."""
ROUTER_KERNELS = 8
"""An MoE layer's routing bookkeeping (softmax, top-k, renormalise, sort, offsets), over fp32 logits."""
BACKWARD_ELEMWISE = 2
"""A backward's elementwise bytes and kernels per forward one."""
ATTENTION_BWD_FLOPS = 2.5
"""Flash attention's backward: 5 pair-sized products (the scores recomputed) against the forward's 2."""


@dataclass(frozen=True)
class Kernel:
    """One launch (``count`` alike): what each computes and moves. ``kind``: ``gemm`` (a weight's
    product: input and weight gradients backward), ``attention`` (a pair or recurrent mixer),
    ``adapter`` (LoRA's products, FLOPs only), ``gather`` (rows copied by an index) or
    ``elementwise``."""

    flops: float
    nbytes: float
    count: int = 1
    kind: str = "elementwise"


def gemm(m: int | float, k: int, n: int, e: int, tile: int = 1, groups: int = 1) -> Kernel:
    """``groups`` GEMMs of ``m`` rows each (a grouped expert GEMM: every expert's weights read)."""
    rows = math.ceil(m / tile) * tile if m > 0 else 0
    return Kernel(2.0 * groups * rows * k * n, e * groups * (m * (k + n) + k * n), kind="gemm")


def elementwise(nbytes: float, count: int) -> Kernel:
    return Kernel(0.0, nbytes / count, count)


def gather(nbytes: float) -> Kernel:
    """Rows copied by an index (``x[idx]``: an MoE's dispatch, an embedding): ``nbytes`` read and
    written."""
    return Kernel(0.0, nbytes, kind="gather")


def backward_of(k: Kernel, weight_grads: bool = True) -> list[Kernel]:
    """A kernel's backward: a GEMM's input gradient and (``weight_grads``) weight gradient, each
    its forward's FLOPs and bytes; attention's at 2.5x FLOPs and twice the bytes; a gather's a
    scatter of the same rows (``index_put_`` accumulating: its bytes); elementwise at twice the
    bytes and kernels."""
    if k.kind == "gemm":
        return [k, k] if weight_grads else [k]
    if k.kind == "adapter":  # a frozen base's adapters: input and weight gradients
        return [k, k]
    if k.kind == "attention":
        return [replace(k, flops=ATTENTION_BWD_FLOPS * k.flops, nbytes=2 * k.nbytes)]
    if k.kind == "gather":
        return [k]
    return [replace(k, count=BACKWARD_ELEMWISE * k.count)]


def kernels_s(kernels: list[Kernel], hw: HardwareProfile) -> float:
    """Seconds of a kernel sequence on ``hw`` (see the module docstring)."""
    launch = hw.kernel_launch_s or 0.0
    t = 0.0
    for k in kernels:
        roof = max(k.flops / hw.flops_per_s, k.nbytes / (hw.device_mem_gbps * 1e9))
        t += k.count * (launch + roof if hw.synchronous else max(launch, roof))
    return t


@dataclass(frozen=True)
class LayerDims:
    """A decoder layer's GEMM shapes and widths, as its kernels need them."""

    hidden: int
    q_dim: int
    kv_dim: int
    head_dim: int
    heads: int
    projections: tuple[tuple[int, int], ...]
    """(K, N) of the token mixer's projections."""
    mlp_width: int
    """The dense (or shared-expert) MLP's intermediate width; 0: none."""
    experts: int = 0
    top_k: int = 0
    expert_width: int = 0
    pair_flops: float = 0.0
    mixer_flops_per_token: float = 0.0
    qk_norm: bool = False
    window: int | None = None

    @classmethod
    def of(cls, s: ModelShape, i: int) -> LayerDims:
        h, q, kv = s.hidden_size, s.q_dim, s.kv_dim
        standard = ((h, q), (h, kv), (h, kv), (q, h))
        c = s.layer(i)
        base = dict(hidden=h, q_dim=q, kv_dim=kv, head_dim=s.head_dim, heads=s.num_heads,
                    qk_norm=s.qk_norm, window=s.layer_windows[i])
        if c is None:
            return cls(projections=standard, mlp_width=s.intermediate_size, pair_flops=4.0 * q, **base)
        mlp = c.mlp_matmul_params or max(0, c.matmul_params - sum(k * n for k, n in standard))
        mixer = c.matmul_params - mlp
        std = sum(k * n for k, n in standard)
        proj = standard if abs(mixer - std) <= 0.02 * std else ((h, max(1, mixer // (4 * h))),) * 4
        e, k = c.num_experts, c.experts_per_token
        ew = c.routed_params // (3 * h * e) if e else 0
        dense = mlp - (c.routed_params * k // e if e else 0) - e * h  # less the routed and the router
        return cls(projections=proj, mlp_width=max(0, dense // (3 * h)), experts=e, top_k=k,
                   expert_width=ew, pair_flops=c.pair_flops,
                   mixer_flops_per_token=c.mixer_flops_per_token, **base)


@dataclass(frozen=True)
class DeviceCost:
    """Kernel sequences of one micro-batch's ops, and their seconds on ``hw``."""

    shape: ModelShape
    hw: HardwareProfile
    micro_batch_size: int
    seq_len: int
    head_chunk_tokens: int = 1024
    per_load: int = 1
    """Micro-batches that share a weight load (layer-major order when > 1): their weight
    gradients are summed on the device in an fp32 slot, a deposit each backward pays."""

    @property
    def e(self) -> int:
        """Bytes per element of the compute dtype."""
        return self.hw.compute_dtype_bytes

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_len

    def layer_forward(self, i: int) -> list[Kernel]:
        d, s, e, T = LayerDims.of(self.shape, i), self.shape, self.e, self.tokens
        tile = self.hw.gemm_tile_rows
        h, q, kv = d.hidden, d.q_dim, d.kv_dim
        norm = elementwise(NORM_BYTES_PER_ELEM * h * T, NORM_KERNELS)
        residual = elementwise(3 * e * h * T, 1)
        ks = [norm] + [gemm(T, k, n, e, tile) for k, n in d.projections]
        if d.qk_norm:
            ks.append(elementwise(NORM_BYTES_PER_ELEM * (q + kv) * T, 2 * NORM_KERNELS))
        if d.pair_flops:
            pairs = s.attention_pairs(self.seq_len, d.window) * self.micro_batch_size
            probs = 4 * 4 * 2 * pairs * d.heads if s.eager_attention else 0  # fp32, the full square
            ks += [elementwise(ROPE_PASSES * e * (q + kv) * T, 2 * ROPE_KERNELS),
                   Kernel(d.pair_flops * pairs, e * T * 2 * (q + kv) + probs, kind="attention")]
        if d.mixer_flops_per_token:
            ks.append(Kernel(d.mixer_flops_per_token * T, e * T * 2 * (q + kv), kind="attention"))
        ks += [elementwise(2 * e * q * T, 1), residual, norm]  # heads back to rows; add; norm
        if d.mlp_width:
            w = d.mlp_width
            ks += [gemm(T, h, w, e, tile), gemm(T, h, w, e, tile),
                   elementwise(ACT_PASSES * e * w * T, ACT_KERNELS), gemm(T, w, h, e, tile)]
        if d.experts:
            E, k, w = d.experts, d.top_k, d.expert_width
            m = T * k / E  # rows per expert, even routing
            ks += [gemm(T, h, E, e, tile), elementwise(3 * 4 * E * T, ROUTER_KERNELS),
                   gather(2 * e * k * h * T),  # each token's copies, sorted by expert
                   gemm(m, h, 2 * w, e, tile, groups=E),
                   elementwise(ACT_PASSES * e * k * w * T, ACT_KERNELS),
                   gemm(m, w, h, e, tile, groups=E),
                   elementwise(3 * e * k * h * T, 1),  # weighted by the router
                   gather(2 * e * k * h * T),  # back to token order
                   elementwise((k + 1) * e * h * T, 1)]  # summed over the top-k
        ks.append(residual)
        fb = s.frozen_base
        if fb is not None and fb.adapter_flops_per_token:
            ks.append(Kernel(fb.adapter_flops_per_token * T, 0.0, kind="adapter"))
        return ks

    def layer_backward(self, i: int) -> list[Kernel]:
        """The backward through a layer's graph (no forward): every kernel's backward; a frozen
        base has no weight gradients but its adapters' (their forward's FLOPs once more)."""
        frozen = self.shape.frozen_base is not None
        out = [b for k in self.layer_forward(i) for b in backward_of(k, weight_grads=not frozen)]
        return out + self.grad_deposit(i)

    def grad_deposit(self, i: int) -> list[Kernel]:
        """On an asynchronous device each backward deposits its weight gradients into the unit's
        grad slot (``grad_sink.deposit``): a copy (``e`` read, the slot's itemsize written), in
        layer-major order an add into an fp32 slot for all but the group's first micro-batch.
        (A synchronous backend adds them on the host: the host lane's accumulation.)"""
        if self.hw.synchronous:
            return []
        n = self.shape.trainable_params(layer_unit(i))
        slot = grad_slot_itemsize(self.e, self.per_load)
        per_param = self.e + slot + slot * (1 - 1 / self.per_load)  # the adds read the slot too
        return [elementwise(n * per_param, 1)] if n else []

    @cached_property
    def _layer_s(self) -> dict[tuple[LayerDims, str], float]:
        return {}

    def _priced(self, i: int, what: str) -> float:
        key = (LayerDims.of(self.shape, i), what)
        if key not in self._layer_s:
            fwd = self.layer_forward(i)
            bwd = self.layer_backward(i) if what != "fwd" else []
            ks = {"fwd": fwd, "bwd": fwd + bwd, "kept": bwd}[what]
            self._layer_s[key] = kernels_s(ks, self.hw)
        return self._layer_s[key]

    def layer_fwd_s(self, i: int) -> float:
        return self._priced(i, "fwd")

    def layer_bwd_s(self, i: int) -> float:
        return self._priced(i, "bwd")

    def layer_bwd_kept_s(self, i: int) -> float:
        return self._priced(i, "kept")

    layer_fwd_keep_s = layer_fwd_s
    """A forward with a graph whose saved tensors are kept: the same kernels."""

    def head_chunk(self, rows: int) -> list[Kernel]:
        """Norm, lm_head and the fp32 loss over ``rows`` tokens, forward and backward (a frozen
        head: no weight gradient): the logits upcast, log-softmax, gather (~4 passes of 4
        bytes and one of ``e`` per logit), their backward twice that."""
        s, e = self.shape, self.e
        h, V = s.hidden_size, s.vocab_size
        fwd = [elementwise(NORM_BYTES_PER_ELEM * h * rows, NORM_KERNELS),
               gemm(rows, h, V, e, self.hw.gemm_tile_rows),
               elementwise((e + 16) * V * rows, 4)]
        bwd = [b for k in fwd for b in backward_of(k, weight_grads=s.frozen_base is None)]
        return fwd + bwd

    @property
    def head_s(self) -> float:
        """Every chunk of the micro-batch's tokens (``head_chunk_tokens`` each, the last the rest)."""
        full, rest = divmod(self.tokens, self.head_chunk_tokens)
        t = full * kernels_s(self.head_chunk(self.head_chunk_tokens), self.hw) if full else 0.0
        return t + (kernels_s(self.head_chunk(rest), self.hw) if rest else 0.0)

    @property
    def embed_s(self) -> float:
        """The embedding's gather (or its gradient's scatter): one kernel over the rows."""
        return kernels_s([gather(2 * self.e * self.shape.hidden_size * self.tokens)], self.hw)
