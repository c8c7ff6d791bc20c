"""Data-parallel topology: how many GPUs train one model together, and what each one gets.

The semantics are ``train/``'s: a node's GPUs share one host store; each unit's gradient goes to
its owner (balanced by bytes), then is all-reduced among that unit's owners across nodes; each
owner updates its units with its share of the cores. So a GPU's share of the host side shrinks
with GPUs per node (:func:`rank_hardware`), and reductions cost ring-style times."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import HardwareProfile

REDUCE_BYTES_PER_PARAM = 4
"""The step's gradient sum on the host is fp32."""
GRAD_REDUCE = ("host", "device")


@dataclass(frozen=True)
class Topology:
    """A data-parallel run: ``gpus_per_node`` processes (one GPU each) on each of ``nodes``."""

    gpus_per_node: int = 1
    """GPUs (processes) per node; they share the node's host store, memory bandwidth and cores."""
    nodes: int = 1
    """Nodes; each holds its own host copy and updates it identically."""
    grad_reduce: str = "host"
    """Where a node's gradients are summed (``train/``'s ``dist.grad_reduce``, which defaults to
    ``device``). ``host``: every process copies and accumulates its own gradient on the host, and
    the step's fp32 sum is reduced to the owner after the last micro-batch. ``device``: every
    micro-batch's gradient is reduced on the GPUs (NCCL, compute dtype) right after its backward,
    and only the owner copies and accumulates it: 1/G of the host traffic."""

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"need at least 1 GPU per node and 1 node, got {self.gpus_per_node} GPUs "
                             f"per node on {self.nodes} nodes")
        if self.grad_reduce not in GRAD_REDUCE:
            raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE}, got {self.grad_reduce!r}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def check(self, hw: HardwareProfile) -> None:
        """Refuse a topology the profile cannot price, saying which field to set."""
        if self.gpus_per_node > hw.gpus_per_node:
            raise ValueError(f"{self.gpus_per_node} GPUs per node, but a {hw.name} node has {hw.gpus_per_node}; "
                             f"use --gpus <= {hw.gpus_per_node} and more --nodes, or a profile with a larger "
                             "gpus_per_node")
        if self.gpus_per_node > 1 and hw.intra_node_gbps is None:
            raise ValueError(f"hardware profile {hw.name!r} has no intra_node_gbps (the GPUs' reduction bandwidth "
                             "inside a node); add it to the profile file to predict more than one GPU per node")
        if self.nodes > 1 and hw.inter_node_gbps is None:
            raise ValueError(f"hardware profile {hw.name!r} has no inter_node_gbps (per-GPU network bandwidth "
                             "between nodes); add it to the profile file to predict more than one node")


def rank_hardware(hw: HardwareProfile, topo: Topology) -> HardwareProfile:
    """The machine as one GPU's process sees it while all ``gpus_per_node`` of its node run: host
    link, memory bandwidth, optimizer cores and spill drive divided by G; device figures its own."""
    g = topo.gpus_per_node
    link = hw.node_host_link_gbps if g > 1 else None  # one GPU alone gets h2d_gbps by definition
    return replace(
        hw,
        h2d_gbps=min(hw.h2d_gbps, link / g) if link else hw.h2d_gbps,
        d2h_gbps=min(hw.d2h_gbps, link / g) if link else hw.d2h_gbps,
        host_accum_gbps=hw.host_accum_gbps / g,
        host_accum_bf16_gbps=hw.host_accum_bf16_gbps and hw.host_accum_bf16_gbps / g,
        pinned_copy_gbps=hw.pinned_copy_gbps and hw.pinned_copy_gbps / g,
        optimizer_params_per_s=hw.optimizer_params_per_s / g,
        optimizer_8bit_params_per_s=hw.optimizer_8bit_params_per_s / g,
        nvme_read_gbps=hw.nvme_read_gbps / g,
        nvme_write_gbps=hw.nvme_write_gbps / g,
    )


def _ring_s(nbytes: float, g: int, gbps: float | None) -> float:
    """Ring-style reduce among ``g`` peers: (g-1)/g of the bytes cross each one's link."""
    if g == 1:
        return 0.0
    assert gbps is not None  # Topology.check refuses it first
    return (g - 1) / g * nbytes / (gbps * 1e9)


def intra_reduce_s(nbytes: float, hw: HardwareProfile, topo: Topology) -> float:
    """Reduce ``nbytes`` from the node's G GPUs to the owner, ring-style."""
    return _ring_s(nbytes, topo.gpus_per_node, hw.intra_node_gbps)


def host_reduce_s(nbytes: float, hw: HardwareProfile, topo: Topology) -> float:
    """Reduce ``nbytes`` of host fp32 gradient to the owner with gloo (``grad_reduce="host"``),
    at ``gloo_reduce_gbps`` when the profile has it (gloo moves host tensors over its TCP
    transport, not the GPUs' links), else as :func:`intra_reduce_s`."""
    return _ring_s(nbytes, topo.gpus_per_node, hw.gloo_reduce_gbps or hw.intra_node_gbps)


def inter_allreduce_s(nbytes: float, hw: HardwareProfile, topo: Topology) -> float:
    """All-reduce ``nbytes`` among the unit's owners on the N nodes, ring: 2(N-1)/N of the bytes
    cross each owner's NIC."""
    return 2 * _ring_s(nbytes, topo.nodes, hw.inter_node_gbps)
