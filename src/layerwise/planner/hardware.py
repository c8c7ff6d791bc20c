"""Hardware profiles: what one machine can hold and move per second, the only thing the planner
knows about a machine. Per-GPU figures are one GPU alone; scale-out fields feed ``scaling``.

Units: bytes, seconds, GB/s = 1e9 bytes/s, TFLOPS = 1e12 FLOP/s."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..util.atomic import atomic_write_text

GB = 10**9
GIB = 2**30
PROFILE_FORMAT_VERSION = 8
"""The one hardware profile format this layerwise writes and reads; a file of another version is
refused (``refuse_version``)."""
HOST_RATE_FIELDS = ("host_accum_bf16_gbps", "pinned_copy_gbps", "gloo_reduce_gbps")
"""Measured host rates a profile may leave null (``host_accum_gbps`` stands in)."""


def refuse_version(version: object, where: str | None = None) -> None:
    """Refuse, in one line, a hardware profile of a format version other than this layerwise's
    (``where``: its file)."""
    if version != PROFILE_FORMAT_VERSION:
        raise ValueError(f"{where + ': ' if where else ''}hardware profile format_version {version}; this layerwise reads "
                         f"{PROFILE_FORMAT_VERSION}: measure it again with `layerwise calibrate --out FILE`")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    """Preset name or a free-form label for a calibrated machine."""
    device_mem_bytes: int
    """Accelerator memory (the whole card)."""
    device_reserved_bytes: int
    """Device memory the planner must not use: CUDA context, allocator slack, kernels' scratch."""
    peak_tflops: float
    """Dense throughput in the compute dtype (bf16 on GPUs, fp32 on CPU), TFLOPS."""
    efficiency: float
    """Fraction of ``peak_tflops`` that training GEMMs actually reach (0 < e <= 1)."""
    h2d_gbps: float
    """Host-to-device copy bandwidth from pinned memory, GB/s."""
    d2h_gbps: float
    """Device-to-host copy bandwidth into pinned memory, GB/s."""
    nvme_read_gbps: float
    """Sequential NVMe read bandwidth (activation spill), GB/s."""
    nvme_write_gbps: float
    """Sequential NVMe write bandwidth, GB/s."""
    nvme_capacity_bytes: int
    """Spill space on NVMe available to activations."""
    host_mem_bytes: int
    """Host RAM."""
    host_reserved_bytes: int
    """Host RAM the planner must leave alone, beside the store and the host-tier activations it
    counts: the OS, the run's runtime (Python, torch, data, threads), the CUDA context. A preset
    derives it from measured, cited and assumed parts ([HOSTRES], ``presets.preset_host_reserve_bytes``);
    the part that scales with the model (the pinned gradient ring) is added by ``for_model``."""
    optimizer_params_per_s: float
    """Host AdamW step with fp32 moments (``HostAdamW.step_unit``, the compute copy's refresh
    not included), parameters/s at the optimizer threads the engine runs (``host_threads``)."""
    optimizer_8bit_params_per_s: float
    """The same for block-wise 8-bit moments (``HostAdamW8bit``: dequantise + requantise)."""
    device_mem_gbps: float
    """Sustained device memory bandwidth, GB/s, the roof of memory-bound kernels
    (``planner/device_cost.py``; on the CPU backend the host's)."""
    host_accum_gbps: float = 150.0
    """Host gradient accumulation of an fp32 gradient (``grad_accum.accumulate``, fp32 into
    fp32: the CPU backend's), GB/s counted as 12 bytes per element (read 4 + 4, write 4)."""
    host_accum_bf16_gbps: float | None = None
    """The same for a bf16 gradient landing from the pinned ring (the GPU path), at the landing
    threads the engine runs, GB/s counted as 10 bytes per element (read 2 + 4, write 4); None
    (not measured): ``host_accum_gbps``."""
    pinned_copy_gbps: float | None = None
    """Host copy into page-locked memory: the compute copy's refresh after an update
    (``UnitBuffers.refresh_compute``, fp32 master -> bf16 arena), GB/s counted as bytes read +
    written; None (not measured): ``host_accum_gbps``."""
    gloo_reduce_gbps: float | None = None
    """Bus bandwidth of gloo's reduce of host fp32 gradients between the processes of a node
    (``grad_reduce="host"``), GB/s: ``(G-1)/G`` of the bytes per second, as
    ``intra_node_gbps``; None: not measured, the host reduction is timed at ``intra_node_gbps``."""
    compute_dtype_bytes: int = 2
    """Bytes per element of streamed weights, gradients and activations (2 = bf16, 4 = fp32)."""
    synchronous: bool = False
    """True when copies and compute cannot overlap (the CPU backend): one lane for everything."""
    gpus_per_node: int = 1
    """GPUs in one node of this machine type: a data-parallel run uses at most this many per node."""
    intra_node_gbps: float | None = None
    """Per-GPU bandwidth of the gradient reduction inside a node (NVLink, or PCIe peer), GB/s;
    None: unknown (a single-GPU profile), and a multi-GPU prediction refuses it."""
    inter_node_gbps: float | None = None
    """Per-GPU bandwidth between nodes when every GPU sends at once (its share of the node's
    InfiniBand / Ethernet NICs), GB/s; None: unknown, a multi-node prediction refuses it."""
    node_host_link_gbps: float | None = None
    """Host<->device copy bandwidth the host side of a node sustains for all its GPUs together,
    per direction (host memory, PCIe root complexes), GB/s; None: not shared (each GPU keeps
    ``h2d_gbps``/``d2h_gbps`` however many copy at once)."""
    kernel_launch_s: float | None = None
    """One kernel's launch and dispatch, s (hidden behind the last kernel unless ``synchronous``)."""
    gemm_tile_rows: int = 1
    """Rows of a GEMM's output tile: a GEMM's rows (an expert's tokens) round up to it."""
    format_version: int = PROFILE_FORMAT_VERSION

    def __post_init__(self) -> None:
        for f in ("peak_tflops", "h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps",
                  "optimizer_params_per_s", "optimizer_8bit_params_per_s", "host_accum_gbps", "device_mem_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        if not 0 < self.efficiency <= 1:
            raise ValueError(f"hardware profile {self.name!r}: efficiency must be in (0, 1], got {self.efficiency}")
        if self.device_mem_bytes <= self.device_reserved_bytes:
            raise ValueError(f"hardware profile {self.name!r}: device_mem_bytes must exceed device_reserved_bytes")
        if self.host_mem_bytes <= self.host_reserved_bytes:
            raise ValueError(f"hardware profile {self.name!r}: host RAM ({self.host_mem_bytes / GB:.2f} GB) must "
                             f"exceed the host reserve ({self.host_reserved_bytes / GB:.2f} GB); give more "
                             "with --host-mem")
        for f in ("intra_node_gbps", "inter_node_gbps", "node_host_link_gbps") + HOST_RATE_FIELDS:
            if getattr(self, f) is not None and not getattr(self, f) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {f} must be > 0 or null, got {getattr(self, f)}")
        if self.gpus_per_node < 1:
            raise ValueError(f"hardware profile {self.name!r}: gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.compute_dtype_bytes not in (2, 4):
            raise ValueError(f"compute_dtype_bytes must be 2 (bf16) or 4 (fp32), got {self.compute_dtype_bytes}")

    # ----- derived ------------------------------------------------------------------------

    @property
    def flops_per_s(self) -> float:
        """Sustained FLOP/s the cost model uses."""
        return self.peak_tflops * 1e12 * self.efficiency

    @property
    def accum_bf16_gbps(self) -> float:
        """Accumulation bandwidth of a bf16 gradient (``host_accum_gbps`` when not measured)."""
        return self.host_accum_gbps if self.host_accum_bf16_gbps is None else self.host_accum_bf16_gbps

    @property
    def pinned_gbps(self) -> float:
        """Host copy bandwidth into pinned memory (``host_accum_gbps`` when not measured)."""
        return self.host_accum_gbps if self.pinned_copy_gbps is None else self.pinned_copy_gbps

    @property
    def device_cap_bytes(self) -> int:
        """Device bytes a plan may use."""
        return self.device_mem_bytes - self.device_reserved_bytes

    @property
    def host_cap_bytes(self) -> int:
        """Host bytes the store plus offloaded activations may use."""
        return self.host_mem_bytes - self.host_reserved_bytes

    def for_model(self, layer_grad_bytes: int) -> HardwareProfile:
        """A copy whose host reserve also holds the engine's pinned gradient ring ([HOSTRES]; none
        on a synchronous profile), so ``host_cap_bytes`` is what the store and activations really
        have."""
        ring = 0 if self.synchronous else HOST_GRAD_RING * layer_grad_bytes
        return replace(self, host_reserved_bytes=self.host_reserved_bytes + ring)

    def with_memory(self, gpu_mem_gb: float | None = None, host_mem_gb: float | None = None) -> HardwareProfile:
        """A copy with device and/or host memory overridden (GB = 1e9 bytes)."""
        kw: dict[str, Any] = {}
        if gpu_mem_gb is not None:
            kw["device_mem_bytes"] = int(gpu_mem_gb * GB)
        if host_mem_gb is not None:
            kw["host_mem_bytes"] = int(host_mem_gb * GB)
        return replace(self, **kw) if kw else self

    # ----- JSON ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str | None = None) -> HardwareProfile:
        """The profile ``d`` describes; one of another format version is refused (``where``: its
        file, for that refusal)."""
        refuse_version(d.get("format_version"), where)
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"hardware profile has unknown keys {sorted(unknown)} (an older format?); "
                             "regenerate it with `layerwise calibrate --out FILE`")
        missing = {f.name for f in fields(cls) if f.default is MISSING} - set(d)
        if missing:
            raise ValueError(f"hardware profile is missing {sorted(missing)}; regenerate it with "
                             "`layerwise calibrate --out FILE`")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        atomic_write_text(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> HardwareProfile:
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"hardware profile {path} does not exist; run `layerwise calibrate --out {path}`"
                             " or use a preset") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"hardware profile {path} is not valid JSON: {e}") from None
        return cls.from_dict(d, str(path))


HOST_GRAD_RING = 4
"""Pinned host buffers the engine's gradients land in (``engine.grad_sink.HOST_GRAD_RING``; a
test keeps the two equal: the planner does not import the engine)."""

