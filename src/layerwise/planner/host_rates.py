"""The presets' host optimizer rates: a per-core rate per engine configuration
(``benchmarks/host_optimizer.py``) times a stated assumption of the host's cores and bus, which
``layerwise plan`` prints; ``layerwise calibrate`` measures the real one."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

MOMENTS = ("fp32", "8bit")
GRADS = ("fp32", "bf16")
MASTERS = ("plain", "split")
CONFIGS = tuple(itertools.product(MOMENTS, GRADS, MASTERS))
"""(moments, gradient dtype, master form) of every host optimizer configuration."""


def config_name(moments: str, grad: str, master: str, clip: bool = False) -> str:
    """The name ``benchmarks/host_optimizer.py`` reports a configuration under."""
    return f"{moments}-{grad}grad-{master}" + ("-clip" if clip else "")


def bytes_per_param(moments: str, grad: str) -> int:
    """Bytes one AdamW step must touch per parameter: master read + written (8, plain or split),
    the gradient read (4 or 2), the moments read + written (16 fp32, 4 block-wise 8-bit)."""
    return 8 + (4 if grad == "fp32" else 2) + (16 if moments == "fp32" else 4)


MEASURED_ON = "a 2-core shared Intel Xeon VM with AVX-512, 38.31 GB/s one-thread stream, 2026-12-03"
"""Where ``PER_CORE_GPARAM_S`` was measured: docs/results.md, "Host optimizer by configuration",
``python benchmarks/host_optimizer.py`` (median of 3, load 1.29 -> 1.30)."""

PER_CORE_GPARAM_S: dict[str, float] = {  # measured on MEASURED_ON: the 1-thread column, clip off
    "fp32-fp32grad-plain": 0.788, "fp32-fp32grad-split": 0.801,
    "fp32-bf16grad-plain": 0.943, "fp32-bf16grad-split": 0.892,
    "8bit-fp32grad-plain": 0.865, "8bit-fp32grad-split": 0.842,
    "8bit-bf16grad-plain": 0.998, "8bit-bf16grad-split": 0.994,
}
"""Gparam/s of one thread of ``step_unit`` per configuration (the clip's cost is within 1-9%
either way there, so one figure stands for both)."""


@dataclass(frozen=True)
class HostAssumption:
    """What a preset assumes of its host's optimizer: ``optimizer_cores`` threads at the
    measured per-core rate (linear scaling, assumed: measured only from 1 to 2 threads, 1.64-1.71x
    for the compute-bound 8-bit forms), capped by ``stream_gbps`` / the configuration's bytes
    per parameter (the memory-bandwidth roofline)."""

    name: str
    optimizer_cores: int
    """CPUs the engine gives the optimizer: all but the launcher's (``engine.host_threads``)."""
    stream_gbps: float
    """The host's streaming rate for the optimizer's read-modify-write mix, GB/s (assumed)."""
    source: str
    """Where the two figures come from."""

    def cores_gparam_s(self, config: str) -> float:
        return self.optimizer_cores * PER_CORE_GPARAM_S[config]

    def roofline_gparam_s(self, moments: str, grad: str) -> float:
        return self.stream_gbps / bytes_per_param(moments, grad)

    def rate_gparam_s(self, moments: str, grad: str, master: str) -> float:
        """The assumed rate of one configuration: cores x per-core rate, capped by the bus."""
        return min(self.cores_gparam_s(config_name(moments, grad, master)),
                   self.roofline_gparam_s(moments, grad))

    def describe(self, moments: str, grad: str, master: str) -> str:
        """The assumption behind ``rate_gparam_s``, in the words ``layerwise plan`` prints."""
        name = config_name(moments, grad, master)
        cores, roof = self.cores_gparam_s(name), self.roofline_gparam_s(moments, grad)
        bound = (f"capped by memory bandwidth: {self.stream_gbps:g} GB/s / {bytes_per_param(moments, grad)} B "
                 f"per param" if roof < cores else "below the memory-bandwidth cap")
        return (f"assumed: {self.optimizer_cores} cores x {PER_CORE_GPARAM_S[name]:g} Gparam/s per core "
                f"(measured on {MEASURED_ON}), {bound}")


GPU_RUN = ("bf16", "split")
"""(gradient, master) of a GPU run whose gradients land once per step (``train/loop.py``: bf16
compute, one landing per step -> bf16 host gradients; a bf16 store keeps its master split):
the configuration a preset's two rates are priced in. A run that sums micro-batches on the
host lands fp32 gradients; ``layerwise plan`` says so and what that form's rate would be."""

SERVER_H = HostAssumption(
    "2-socket Xeon 8480C, DDR5", 111, 150.0,
    "DGX H100/H200 datasheets: 2 x 56 cores, one left to the launcher; 150 GB/s: assumption, a "
    "third of the ~450 GB/s STREAM of 16 x DDR5-4800 (remote-NUMA pages, the read-modify-write mix)")
SERVER_A100 = HostAssumption(
    "2-socket EPYC 7742, DDR4", 127, 150.0,
    "DGX A100 datasheet: 2 x 64 cores, one left to the launcher; 150 GB/s as the H servers' "
    "(assumption, as [ACC])")
WORKSTATION = HostAssumption(
    "workstation, 16 cores", 15, 60.0,
    "assumption: a 16-core Threadripper/EPYC-class box, one core left to the launcher; ~60 GB/s bus")

PRESET_HOSTS: dict[str, HostAssumption] = {
    "h200": SERVER_H, "h800": SERVER_H, "h100": SERVER_H, "a100-80g": SERVER_A100,
    "rtx3090": WORKSTATION, "rtx4090": WORKSTATION,
}
"""The host each GPU preset assumes (the ``cpu`` preset's rates stay a placeholder for
``layerwise calibrate``: its optimizer shares the cores with the compute)."""


def preset_optimizer_fields(host: HostAssumption) -> dict[str, float]:
    """A preset's ``optimizer_params_per_s`` (fp32 moments) and ``optimizer_8bit_params_per_s``:
    the assumed rates of the configuration a GPU run keeps (``GPU_RUN``), params/s."""
    grad, master = GPU_RUN
    return {"optimizer_params_per_s": host.rate_gparam_s("fp32", grad, master) * 1e9,
            "optimizer_8bit_params_per_s": host.rate_gparam_s("8bit", grad, master) * 1e9}
