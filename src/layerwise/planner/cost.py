"""Cost model: FLOPs, bytes and seconds of every op the engine runs, from the model config.

One source of numbers for the simulator and the MILP, so both price a step alike; per
micro-batch of ``micro_batch_size x seq_len`` tokens. FLOP conventions and memory accounting:
``docs/planner.md`` ("Cost model"). Model FLOPs (for TFLOPS) count 1x forward + 2x backward."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..optim import adamw, adamw8bit
from ..store import StoreFootprint, grad_itemsizes_of
from ..util.host_memory import locked_nbytes
from ..plan import memory
from .device_cost import DeviceCost
from ..plan.plan import NVME_GRAD_SLOTS, NVME_SOURCE_SLOTS, NVME_STATE_SLOTS
from ..plan.program import EMBED_OPS, OpKind

# The host store's bytes are counted with the store's own arithmetic (``StoreFootprint``) and
# the optimizers' (per unit: fp32 moments 8 B/param; 8-bit 2 B/param + 8 B per 256-block).
STATE_NBYTES = {"fp32": adamw.state_nbytes, "8bit": adamw8bit.state_nbytes}
"""Exact optimizer-state bytes of a unit of ``n`` parameters, per moment format."""


@dataclass(frozen=True)
class CostModel(DeviceCost):
    """Seconds and bytes of each engine op for one micro-batch shape on one machine (the ops'
    compute seconds: ``DeviceCost``)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1 or self.seq_len < 1:
            raise ValueError(f"micro_batch_size and seq_len must be >= 1, got "
                             f"{self.micro_batch_size} and {self.seq_len}")

    elem_bytes = DeviceCost.e

    # ----- FLOPs --------------------------------------------------------------------------

    def layer_fwd_flops(self, i: int) -> float:
        s = self.shape
        pairs = s.attention_pairs(self.seq_len, s.layer_windows[i]) * self.micro_batch_size
        adapters = 0.0 if s.frozen_base is None else s.frozen_base.adapter_flops_per_token * self.tokens
        c = s.layer(i)
        if c is not None:  # per-layer facts: routed experts at top-k, latent/linear attention
            pairs = pairs if c.pair_flops else 0
            return (2.0 * c.matmul_params * self.tokens + c.pair_flops * pairs
                    + c.mixer_flops_per_token * self.tokens + adapters)
        return 2.0 * s.layer_matmul_params * self.tokens + 4.0 * s.q_dim * pairs + adapters

    def model_flops(self) -> float:
        """Forward + backward FLOPs of one micro-batch, no recompute (the MFU numerator); with a
        frozen base the backward is the input gradients' (1x) plus the adapters' weight gradients
        (their forward's again)."""
        s = self.shape
        fwd = (sum(self.layer_fwd_flops(i) for i in range(s.num_layers))
               + 2.0 * s.hidden_size * s.vocab_size * self.tokens)  # + the head
        if s.frozen_base is None:
            return 3.0 * fwd
        return 2.0 * fwd + s.num_layers * (s.frozen_base.adapter_flops_per_token * self.tokens)

    @property
    def _frozen(self) -> bool:
        return self.shape.frozen_base is not None

    @property
    def split_master(self) -> bool:
        """A 2-byte compute dtype is bf16 to the planner, and a bf16 store keeps its master split
        (``StoreFootprint.of_numels``); a LoRA store keeps its adapters' masters plain."""
        return self.elem_bytes == 2 and not self._frozen

    # ----- seconds (compute: ``DeviceCost``) ---------------------------------------------

    def op_s(self, kind: OpKind, i: int = -1) -> float:
        if kind in (OpKind.LAYER_FWD, OpKind.RECOMPUTE_LAYER):
            return self.layer_fwd_s(i)
        if kind == OpKind.LAYER_BWD:
            return self.layer_bwd_s(i)
        if kind == OpKind.LAYER_FWD_KEEP:
            return self.layer_fwd_keep_s(i)
        if kind == OpKind.LAYER_BWD_KEPT:
            return self.layer_bwd_kept_s(i)
        if kind == OpKind.HEAD:
            return self.head_s
        if kind in EMBED_OPS:
            return self.embed_s
        return 0.0  # fetch, fetch_internals: a copy, not compute

    def h2d_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.h2d_gbps * 1e9)

    def d2h_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.d2h_gbps * 1e9)

    @cached_property
    def internals_d2h_s(self) -> float:
        """One layer's host-tier internals copied out: the largest layer's saved bytes (as the
        capacity rows count them)."""
        return self.d2h_s(self.layer_workspace_bytes)

    @cached_property
    def internals_h2d_s(self) -> float:
        """The same fetched back before the backward."""
        return self.h2d_s(self.layer_workspace_bytes)

    def nvme_read_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.nvme_read_gbps * 1e9)

    def nvme_write_s(self, nbytes: float) -> float:
        return nbytes / (self.hw.nvme_write_gbps * 1e9)

    def grad_accumulate_s(self, unit: str, first: bool = False, landed_itemsize: int | None = None) -> float:
        """Host ``grad (fp32) += landed grad``: reads the landed gradient (``landed_itemsize``) + 4
        and writes 4 bytes per parameter (``first``: reads it and writes 4), at the bf16 or fp32
        rate."""
        itemsize = self.elem_bytes if landed_itemsize is None else landed_itemsize
        gbps = self.hw.accum_bf16_gbps if itemsize == 2 else self.hw.host_accum_gbps
        per_param = itemsize + (4 if first else 8)
        return self.shape.trainable_params(unit) * per_param / (gbps * 1e9)

    def optimizer_step_s(self, unit: str, moments: str = "fp32") -> float:
        """The AdamW step of a unit at the measured per-parameter rate."""
        rate = self.hw.optimizer_params_per_s if moments == "fp32" else self.hw.optimizer_8bit_params_per_s
        return self.shape.trainable_params(unit) / rate

    def compute_refresh_s(self, unit: str) -> float:
        """After the step, the compute copy's refresh into the pinned arena (fp32 master read, ``e``
        bytes written per parameter) at ``pinned_copy_gbps``; none when computing in fp32 (the
        master is the copy source) or with a split master (the step writes the copy's bf16
        halves itself: ``layerwise.split_master``)."""
        if self.elem_bytes != 4 and not self.split_master:
            return self.shape.trainable_params(unit) * (4 + self.elem_bytes) / (self.hw.pinned_gbps * 1e9)
        return 0.0

    def optimizer_s(self, unit: str, moments: str = "fp32") -> float:
        """A unit's host update as the optimizer worker runs it: the step, then the refresh."""
        return self.optimizer_step_s(unit, moments) + self.compute_refresh_s(unit)

    # ----- bytes --------------------------------------------------------------------------

    def unit_weight_bytes(self, unit: str) -> int:
        """Bytes streamed H2D for a unit (compute dtype; a frozen base in its own format)."""
        return self.shape.unit_weight_bytes(unit, self.elem_bytes)

    def grad_bytes(self, unit: str) -> int:
        """Bytes of its gradient D2H (the compute dtype; 0 for a frozen unit)."""
        return self.shape.trainable_params(unit) * self.elem_bytes

    @property
    def boundary_bytes(self) -> int:
        """One layer-boundary activation ``[mbs, seq, hidden]`` in the compute dtype."""
        return self.tokens * self.shape.hidden_size * self.elem_bytes

    @property
    def layer_workspace_bytes(self) -> int:
        """What autograd keeps for one layer's backward (the engine's formula); layers that
        differ: the largest layer's (an upper bound where one number stands for all)."""
        return max(memory.layer_workspace_bytes(self.shape, self.tokens, self.elem_bytes, i, self.seq_len)
                   for i in range(self.shape.num_layers))

    def op_transient_bytes(self, kind: OpKind, i: int = -1) -> int:
        """Device bytes an op holds only while it runs (inputs, outputs, grads, workspace)."""
        return memory.op_transient_bytes(self.shape, kind, i, self.tokens, self.elem_bytes,
                                         self.head_chunk_tokens, self.seq_len)

    def store_footprint(self, moments: list[str] | None = None,
                        bf16_grads: bool = False) -> StoreFootprint:
        """The HostStore's bytes by buffer (``layerwise.store.StoreFootprint``), with the optimizer
        state of ``moments`` (per unit, default fp32). Pinned bytes (the copy-source arena, with
        its alignment padding) are part of these, not extra. ``bf16_grads``: the store of a
        run of one micro-batch per step with bf16 compute (``HostStore(grad_dtype=bf16)``)."""
        units = self.shape.unit_names()
        moments = moments or ["fp32"] * len(units)
        numels = [self.shape.trainable_params(u) for u in units]
        state = sum(STATE_NBYTES[m](n) for n, m in zip(numels, moments))
        if self._frozen:
            # a frozen base: one copy source per unit (adapters + base), fp32 state for the
            # adapters alone (``adapters.lora_store.lora_footprint``, less the per-tensor alignment)
            trained, source = sum(numels), sum(self.unit_weight_bytes(u) for u in units)
            in_arena = 4 * trained if self.elem_bytes == 4 else 0
            return StoreFootprint(trained, self.elem_bytes, 4 * trained, 4 * trained,
                                  source - in_arena, state, source, source, locked_nbytes(source))
        grads = None
        if bf16_grads and self.elem_bytes == 2:
            grads = grad_itemsizes_of(units, self.shape.tied, torch.bfloat16, torch.bfloat16)
        return StoreFootprint.of_numels(numels, self.elem_bytes, state_nbytes=state,
                                        grad_itemsizes=grads)

    def host_store_bytes(self, moments: list[str] | None = None, bf16_grads: bool = False,
                         state_tiers: list[str] | None = None) -> int:
        """Host bytes of the store, exactly ``HostStore.nbytes()`` with all state in RAM.
        ``state_tiers``: units off the RAM leave their bytes out and the staging slots come in."""
        fp = self.store_footprint(moments, bf16_grads)
        if not state_tiers or set(state_tiers) == {"ram"}:
            return fp.total
        padding = fp.padding
        if "nvme-all" in state_tiers and not self._frozen:  # the arena holds the others' sources
            numels = [0 if t == "nvme-all" else self.shape.trainable_params(u)
                      for u, t in zip(self.shape.unit_names(), state_tiers)]
            padding = StoreFootprint.of_numels(numels, self.elem_bytes).padding
        return (fp.total - fp.padding + padding - self.nvme_bytes(moments, state_tiers, bf16_grads)
                + self.staging_bytes(moments, state_tiers, bf16_grads))

    # ----- state on NVMe (``Plan.state_tiers``) ---------------------------------------------

    def master_state_bytes(self, unit: str) -> int:
        """Bytes of a unit's master that are not its copy source: the 16-bit remainder of a split
        master (2 B/param), a plain fp32 master beside a separate copy (4), none where the fp32
        master is the copy source (fp32 compute)."""
        n = self.shape.trainable_params(unit)
        if self.split_master:
            return 2 * n
        return 0 if self.elem_bytes == 4 else 4 * n

    def unit_state_bytes(self, unit: str, moments: str = "8bit") -> int:
        """What an ``nvme`` unit keeps on NVMe and moves once in and once out per step: its master
        remainder and its optimizer moments."""
        return self.master_state_bytes(unit) + STATE_NBYTES[moments](self.shape.trainable_params(unit))

    def unit_source_bytes(self, unit: str) -> int:
        """An ``nvme-all`` unit's copy source on NVMe: the compute-dtype weights the device
        receives (the fp32 master itself with fp32 compute)."""
        return self.shape.trainable_params(unit) * self.elem_bytes

    def unit_grad_store_bytes(self, unit: str, bf16_grads: bool = False) -> int:
        """A unit's gradient as the store keeps it (an ``nvme-all`` unit's, on NVMe): bf16 where
        every gradient lands once per step with bf16 compute (a head's, or a tied embedding's,
        summed in fp32, stays fp32: ``grad_itemsizes_of``), else fp32."""
        n = self.shape.trainable_params(unit)
        if not (bf16_grads and self.elem_bytes == 2):
            return 4 * n
        units = self.shape.unit_names()
        items = grad_itemsizes_of(units, self.shape.tied, torch.bfloat16, torch.bfloat16)
        return items[units.index(unit)] * n

    def tier_sizes(self, moments: list[str] | None, state_tiers: list[str] | None,
                   bf16_grads: bool = False) -> list[tuple[str, int, int, int]]:
        """Per unit off the RAM, in unit order: (tier, state, copy source, gradient) bytes on
        NVMe (the last two 0 on ``nvme``)."""
        units = self.shape.unit_names()
        moments = moments or ["fp32"] * len(units)
        out = []
        for u, m, t in zip(units, moments, state_tiers or ()):
            if t == "ram":
                continue
            full = t == "nvme-all"
            out.append((t, self.unit_state_bytes(u, m), self.unit_source_bytes(u) if full else 0,
                        self.unit_grad_store_bytes(u, bf16_grads) if full else 0))
        return out

    def nvme_state_bytes(self, moments: list[str] | None, state_tiers: list[str] | None) -> int:
        """State bytes (master remainders and moments) the ``nvme`` and ``nvme-all`` units keep
        on NVMe (and out of RAM)."""
        return sum(s for _, s, _, _ in self.tier_sizes(moments, state_tiers))

    def nvme_bytes(self, moments: list[str] | None, state_tiers: list[str] | None,
                   bf16_grads: bool = False) -> int:
        """Everything the store keeps on NVMe: the state, and the ``nvme-all`` units' copy
        sources and gradients."""
        return sum(s + w + g for _, s, w, g in self.tier_sizes(moments, state_tiers, bf16_grads))

    def staging_bytes(self, moments: list[str] | None, state_tiers: list[str] | None,
                      bf16_grads: bool = False) -> int:
        """RAM the engine stages NVMe units in: ``NVME_STATE_SLOTS`` x the largest off-RAM unit's
        state, ``NVME_SOURCE_SLOTS`` x the largest ``nvme-all`` copy source, ``NVME_GRAD_SLOTS`` x
        the largest ``nvme-all`` gradient."""
        sizes = self.tier_sizes(moments, state_tiers, bf16_grads)
        return (NVME_STATE_SLOTS * max((s for _, s, _, _ in sizes), default=0)
                + NVME_SOURCE_SLOTS * max((w for _, _, w, _ in sizes), default=0)
                + NVME_GRAD_SLOTS * max((g for _, _, _, g in sizes), default=0))

    def state_read_s(self, unit: str, moments: str = "8bit") -> float:
        return self.nvme_read_s(self.unit_state_bytes(unit, moments))

    def state_write_s(self, unit: str, moments: str = "8bit") -> float:
        return self.nvme_write_s(self.unit_state_bytes(unit, moments))

    def nvme_traffic(self, moments: list[str] | None, state_tiers: list[str] | None, bf16_grads: bool,
                     copies: dict[str, int], landings: dict[str, int]) -> dict[str, int]:
        """Bytes a step moves over the NVMe by kind: state read and written once per unit; an
        ``nvme-all`` unit's source read per copy and by its update, written once, its gradient
        written per landing and read by each later landing and the update."""
        units = self.shape.unit_names()
        out = dict.fromkeys(TRAFFIC_KINDS, 0)
        off = [u for u, t in zip(units, state_tiers or ()) if t != "ram"]
        for u, (t, s, w, g) in zip(off, self.tier_sizes(moments, state_tiers, bf16_grads)):
            out["state_read"] += s
            out["state_write"] += s
            out["source_read"] += w * (copies.get(u, 0) + 1) if t == "nvme-all" else 0
            out["source_write"] += w
            out["grad_write"] += g * landings.get(u, 0)
            out["grad_read"] += g * max(1, landings.get(u, 0))
        return out

    def traffic_s(self, traffic: dict[str, int]) -> float:
        """NVMe seconds for ``traffic`` (``nvme_traffic``), reads and writes on one lane."""
        reads = sum(v for k, v in traffic.items() if k.endswith("_read"))
        return self.nvme_read_s(reads) + self.nvme_write_s(sum(traffic.values()) - reads)

    def state_traffic_s(self, moments: list[str] | None, state_tiers: list[str] | None) -> float:
        """NVMe seconds a step spends moving the off-RAM units' state (read in, written back);
        ``nvme_traffic`` adds the ``nvme-all`` units' copy sources and gradients."""
        n = self.nvme_state_bytes(moments, state_tiers)
        return self.nvme_read_s(n) + self.nvme_write_s(n)


TRAFFIC_KINDS = ("state_read", "state_write", "source_read", "source_write", "grad_write", "grad_read")
"""What crosses the NVMe per step for the store's units off the RAM (``CostModel.nvme_traffic``)."""
