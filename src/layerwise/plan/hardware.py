"""Hardware profiles: what one machine can hold and move per second.

A profile is the only thing the planner knows about a machine. Presets describe common
training boxes from their datasheets plus a few stated assumptions (realistic efficiency,
pinned-copy bandwidth, the host a card usually sits in); ``layerwise calibrate`` measures the
machine it runs on and writes a profile file that replaces them. Per-GPU figures are what one GPU
gets alone; the scale-out fields (GPUs per node, the interconnects, the host side all GPUs of a
node share) serve the data-parallel prediction (``plan.scaling``).

Units: bytes, seconds, GB/s = 1e9 bytes/s, TFLOPS = 1e12 FLOP/s.
"""

from __future__ import annotations

import json
import logging
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from ..util.atomic import atomic_write_text
from .host_rates import PRESET_HOSTS, preset_optimizer_fields

GB = 10**9
GIB = 2**30
PROFILE_FORMAT_VERSION = 6
"""What each version added: docs/formats.md, "Hardware profile". An older file loads with those
fields unset, each read as its stated fallback, and a note saying to re-run ``layerwise calibrate``."""
HOST_FIELDS_V4 = ("host_accum_bf16_gbps", "pinned_copy_gbps", "gloo_reduce_gbps")

log = logging.getLogger(__name__)


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
    derives it from measured, cited and assumed parts ([HOSTRES], ``preset_host_reserve_bytes``);
    the part that scales with the model (the pinned gradient ring) is added by ``for_model``."""
    optimizer_params_per_s: float
    """Host AdamW step with fp32 moments (``HostAdamW.step_unit``, the compute copy's refresh
    not included), parameters/s at the optimizer threads the engine runs (``host_threads``)."""
    optimizer_8bit_params_per_s: float
    """The same for block-wise 8-bit moments (``HostAdamW8bit``: dequantise + requantise)."""
    host_accum_gbps: float = 150.0
    """Host gradient accumulation of an fp32 gradient (``grad_accum.accumulate``, fp32 into
    fp32: the CPU backend's), GB/s counted as 12 bytes per element (read 4 + 4, write 4)."""
    host_accum_bf16_gbps: float | None = None
    """The same for a bf16 gradient landing from the pinned ring (the GPU path), at the landing
    threads the engine runs, GB/s counted as 10 bytes per element (read 2 + 4, write 4); None
    (a profile before version 4): ``host_accum_gbps``."""
    pinned_copy_gbps: float | None = None
    """Host copy into page-locked memory: the compute copy's refresh after an update
    (``UnitBuffers.refresh_compute``, fp32 master -> bf16 arena), GB/s counted as bytes read +
    written; None (a profile before version 4): ``host_accum_gbps``."""
    gloo_reduce_gbps: float | None = None
    """Bus bandwidth of gloo's reduce of host fp32 gradients between the processes of a node
    (``grad_reduce="host"``), GB/s: ``(G-1)/G`` of the bytes per second, as
    ``intra_node_gbps``; None: not measured, the host reduction is timed at ``intra_node_gbps``."""
    compute_dtype_bytes: int = 2
    """Bytes per element of streamed weights, gradients and activations (2 = bf16, 4 = fp32)."""
    synchronous: bool = False
    """True when copies and compute cannot overlap (the CPU backend): one lane for everything."""
    op_overhead_s: float = 0.0
    """Fixed cost of one compute op (launches, Python), seconds."""
    fwd_efficiency: float | None = None
    """Fraction of ``peak_tflops`` a layer's forward without a graph reaches (the engine's
    ``layer_fwd`` and recompute); None = ``efficiency``. Calibration measures both: a forward
    without autograd bookkeeping runs at a different rate than forward + backward."""
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
    device_mem_gbps: float | None = None
    """Sustained device memory bandwidth, GB/s, the roof of memory-bound kernels
    (``plan/device_cost.py``); None (before version 5): ops priced by FLOPs alone."""
    kernel_launch_s: float | None = None
    """One kernel's launch and dispatch, s (hidden behind the last kernel unless ``synchronous``)."""
    backward_launch_s: float | None = None
    """The same for a backward's kernels (autograd's, no Python modules); None: ``kernel_launch_s``."""
    gemm_tile_rows: int = 1
    """Rows of a GEMM's output tile: a GEMM's rows (an expert's tokens) round up to it."""
    gemm_tflops_points: tuple[tuple[float, ...], ...] | None = None
    """Measured GEMMs ((weight bytes, TFLOPS, GB/s the weight is read at), ...), interpolated by a
    GEMM's weight size (``layerwise calibrate``); None: ``peak_tflops x efficiency``."""
    saved_tensor_s: float | None = None
    """A kept layer's cost per tensor its forward saves, s, in the forward and in the backward each
    (the engine's pack and unpack hooks: ``engine/internals.py``); None (before version 6): 0."""
    storage_copy_s: float | None = None
    """The host tier's cost per saved storage, s, out and back each, beside its bytes; None: 0."""
    format_version: int = PROFILE_FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.gemm_tflops_points is not None:  # JSON gives lists
            object.__setattr__(self, "gemm_tflops_points", tuple(map(tuple, self.gemm_tflops_points)))
        for f in ("peak_tflops", "h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps",
                  "optimizer_params_per_s", "optimizer_8bit_params_per_s", "host_accum_gbps"):
            if not getattr(self, f) > 0:
                raise ValueError(f"hardware profile {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        for f in ("efficiency", "fwd_efficiency"):
            v = getattr(self, f)
            if v is not None and not 0 < v <= 1:
                raise ValueError(f"hardware profile {self.name!r}: {f} must be in (0, 1], got {v}")
        if self.device_mem_bytes <= self.device_reserved_bytes:
            raise ValueError(f"hardware profile {self.name!r}: device_mem_bytes must exceed device_reserved_bytes")
        if self.host_mem_bytes <= self.host_reserved_bytes:
            raise ValueError(f"hardware profile {self.name!r}: host RAM ({self.host_mem_bytes / GB:.2f} GB) must "
                             f"exceed the host reserve ({self.host_reserved_bytes / GB:.2f} GB); give more "
                             "with --host-mem")
        if any(v is not None and not v >= 0 for v in (self.saved_tensor_s, self.storage_copy_s)):
            raise ValueError(f"hardware profile {self.name!r}: saved_tensor_s and storage_copy_s must be >= 0 or null")
        for f in ("intra_node_gbps", "inter_node_gbps", "node_host_link_gbps") + HOST_FIELDS_V4:
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
    def fwd_flops_per_s(self) -> float:
        """Sustained FLOP/s of a forward without a graph."""
        eff = self.efficiency if self.fwd_efficiency is None else self.fwd_efficiency
        return self.peak_tflops * 1e12 * eff

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

    def grad_ring_bytes(self, layer_grad_bytes: int) -> int:
        """Host bytes of the engine's pinned gradient ring for a model whose largest decoder
        layer's gradient is ``layer_grad_bytes`` in the compute dtype ([HOSTRES]): none on a
        synchronous profile (the CPU backend adds gradients inline)."""
        return 0 if self.synchronous else grad_ring_bytes(layer_grad_bytes)

    def for_model(self, layer_grad_bytes: int) -> HardwareProfile:
        """A copy whose host reserve also holds what scales with the model: the pinned gradient
        ring of ``grad_ring_bytes``. The planner plans on this copy (``layerwise plan``), so its
        usable host RAM (``host_cap_bytes``) is what the store and activations really have."""
        return replace(self, host_reserved_bytes=self.host_reserved_bytes + self.grad_ring_bytes(layer_grad_bytes))

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
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"hardware profile has unknown keys {sorted(unknown)}; known: {sorted(known)}")
        version = d.get("format_version", PROFILE_FORMAT_VERSION)
        if version not in (1, 2, 3, 4, 5, PROFILE_FORMAT_VERSION):
            raise ValueError(f"hardware profile format_version {d['format_version']} is not supported "
                             f"(expected {PROFILE_FORMAT_VERSION}); re-run `layerwise calibrate`")
        if version < 4:
            log.warning("hardware profile %r is format version %s: it has no %s; the bf16 accumulation "
                        "and pinned copies are timed at host_accum_gbps and a host reduction at "
                        "intra_node_gbps. Re-run `layerwise calibrate` to measure them",
                        d.get("name"), version, ", ".join(HOST_FIELDS_V4))
        d = {**d, "format_version": PROFILE_FORMAT_VERSION}  # older versions lack only optional fields
        missing = {f.name for f in fields(cls) if f.default is MISSING} - set(d)
        if missing:
            raise ValueError(f"hardware profile is missing {sorted(missing)}")
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
        return cls.from_dict(d)


# ----- presets ---------------------------------------------------------------------------
# Shared assumptions (stated once, used below):
# [EFF-H] 0.40 of dense peak on Hopper: the best published whole-step BF16 training rates on
#        H100 are ~390-400 model TFLOPS/GPU (GPT-3 175B, 47% MFU counted with attention;
#        Llama 3 405B on 16k H100, 38-43% MFU: Megatron-Core benchmark notes), and 328-334 on
#        DGX-H100 for NeMo AutoModel's Nemotron 3 BF16 runs (fused kernels: their non-GEMM work is
#        small), so it is each GEMM's compute roof; an eager layer's elementwise work is priced
#        apart ([MEM]). Sources: docs/benchmarks.md, "Preset efficiencies".
# [EFF-A] 0.52 on the A100: Megatron-LM (Narayanan et al. 2021) sustains 163 TFLOPS/GPU (52% of
#        312) on 3072 A100s for a 1T-parameter GPT, data loading and optimizer included.
# [EFF-C] 0.52 on GeForce cards: no published training rate found; assumption, the A100's
#        fraction.
# [PCIE5] PCIe 5.0 x16 is 64 GB/s per direction raw; pinned cudaMemcpy measures ~50-55 GB/s
#        (CUDA bandwidthTest on H100/H200 hosts); 50 GB/s used.
# [PCIE4] PCIe 4.0 x16 is 32 GB/s raw; pinned copies measure ~24-26 GB/s; 25 GB/s used.
# [DCNVME] one datacenter PCIe 4.0 NVMe drive (Samsung PM9A3 datasheet: 6.9 GB/s read,
#        4.1 GB/s write sequential); 3.84 TB drive, 3 TB given to spill.
# [CNVME] one consumer PCIe 4.0 NVMe drive (Samsung 980 PRO datasheet: 7.0 GB/s read,
#        5.0 GB/s write sequential); 2 TB drive, 1.5 TB given to spill.
# Host side (the engine's own kernels; ``layerwise calibrate`` measures each on the machine,
# these are what a preset assumes without it). Per-thread rates measured here
# (docs/benchmarks.md, "Host cost model"; 2 shared cores, load 7-14): the fused bf16 -> fp32
# accumulation ~1.2 G elements/s (12 GB/s), the compute copy's refresh (torch fp32 -> bf16
# ``copy_``) ~2.2 GB/s; the optimizer's per-core rates: [OPT].
# [OPT]  host optimizer (``plan.host_rates``): per configuration, the per-core rate measured by
#        ``benchmarks/host_optimizer.py`` x the cores the preset's host gives the optimizer, capped
#        by its bus (the configuration's bytes per parameter / the host's stream rate); scaling and
#        bus are assumptions, tagged there and in ``layerwise plan``. In the form a GPU run keeps
#        when a step lands once (split master, bf16 gradient): server fp32 moments 5.8e9, 8-bit
#        10.7e9 params/s (both bus-bound: 26 / 14 B a parameter); workstation 2.3e9 / 4.3e9.
# [ACC]  fp32 -> fp32 accumulation (the CPU backend's; a GPU preset never lands fp32 gradients
#        unless computing in fp32): a third of STREAM (assumption, as [OPT]): ~150 GB/s on a
#        2-socket DDR5 server, ~50 GB/s on an 8-channel DDR4 workstation.
# [ACC16] a bf16 gradient's landing is split over at most 8 threads (``host_threads``
#        MAX_LANDING_THREADS): 8 x the ~12 GB/s one thread reaches here = ~100 GB/s, derated to
#        80 for a 2-socket server's remote-NUMA pages (assumption); a workstation's bus caps it
#        at 50 (as [ACC]).
# [PIN]  the compute copy's refresh after each update (fp32 master -> bf16 pinned arena,
#        ``torch.copy_`` over the optimizer's intra-op threads): ~2.2 GB/s a thread measured
#        here x the server's 111 worker CPUs, capped by [OPT]'s 150 GB/s; workstation 60
#        (assumption: 16-32 cores, its bus).
# [GLOO] gloo's reduce of host fp32 gradients (``grad_reduce="host"``) goes through the
#        loopback TCP transport, not NVLink: assumption 3 GB/s bus bandwidth, the middle of the
#        1-5 GB/s estimated in issue 19 (measured here between 2 in-process ranks on 2 shared
#        cores: 0.4-0.5 GB/s); ``layerwise calibrate --gloo`` measures it.
# [LAUNCH] estimate: ~5 us for eager PyTorch to dispatch and launch one CUDA kernel (the launch is
#        a few us, the dispatcher and Python the rest); not measured here: calibrate on the GPU.
# [TILE] estimate: cuBLAS / CUTLASS bf16 GEMMs on Ampere / Hopper compute 128-row output tiles.
# [MEM]  device memory bandwidth (``device_mem_gbps``), the roof of memory-bound kernels: 0.85 of
#        the datasheet's HBM / GDDR figure (H100 / H800 / H200 / A100 datasheets; estimate, a sustained fraction as [EFF-*] is for
#        compute: ECC and DRAM row effects keep streaming kernels below the peak; one published
#        Nsight Compute measurement on H100 SXM: coalesced loads 2.8 of 3.35 TB/s, 84%).
# [RES]  1.5 GB device reserve: CUDA context (~500 MB) + cuBLAS workspace + allocator slack.
# [HOSTRES] host reserve: what a run holds in host RAM beside its store and the host-tier
#        activations the planner counts (``preset_host_reserve_bytes``; docs/benchmarks.md,
#        "Host reserve"):
#        - runtime (measured, ``RUNTIME_HOST_BYTES``): ``benchmarks/host_reserve.py``, a
#          ``layerwise train`` run of a 134M-parameter llama, bf16 compute, 8-bit moments, on
#          the cpu-async backend: its step peak RSS minus the store's storages, minus the
#          device-side allocations the CPU backend keeps in RAM (slots and the step's measured
#          device peak) and minus the gradient ring: median 0.77 GB (0.68-0.99 GB over 7
#          rounds; Python, torch, transformers, the data, the lanes' and landing threads, the
#          optimizer's scratch), taken as 1 GB. It does not grow with the model: the optimizer
#          and the landing work in fixed chunks.
#        - CUDA (cited, ``CUDA_HOST_BYTES``): the CUDA context and driver's host memory, absent on
#          a CPU: pytorch/pytorch#113326 (torch 2.2, CUDA 11.8, lazy module loading) measures
#          322 MB max RSS for ``import torch`` and 2,057 MB once a CUDA tensor exists after a
#          device query, +1.73 GB; taken as 2 GB.
#        - OS (assumption, ``OS_HOST_BYTES``): kernel, page tables of a store-sized process (8 B
#          per 4 KiB page: 0.25 GB per 128 GB), system daemons: 1 GB.
#        - margin (assumption, ``HOST_RESERVE_MARGIN``): 20% of the three above, 0.8 GB (the
#          runtime's spread over rounds is 0.3 GB).
#        - the pinned gradient ring (scales with the model, ``grad_ring_bytes``, added per model
#          by ``HardwareProfile.for_model``): ``HOST_GRAD_RING`` buffers of the largest decoder
#          layer's gradient in the compute dtype, each page-locked in place at its own size by
#          ``CudaBackend.host_alloc`` (torch's pinned allocator would round each up to a power
#          of two: 4 x 1 GiB for qwen2.5-14b's 0.55 GB layers). A synchronous profile has no ring.
#        Not in the reserve (the run adds them; docs/benchmarks.md says how much): the tokenized
#        data set beyond the built-in corpus (held whole: 8 B per token measured for a token
#        stream, up to 20 with labels and segment ids) and a checkpoint save's snapshot (a copy
#        of the groups it writes: 6.0 B per saved parameter with 8-bit moments, its peak 1.17x).
# Scale-out (data parallel, ``plan.scaling``):
# [NODE8] HGX/DGX boards carry 8 GPUs (DGX H200, DGX H100, DGX A100 datasheets).
# [NVL]  NVLink per GPU, bidirectional: 900 GB/s on H100/H200 SXM (NVLink 4, datasheets), 400 GB/s
#        on H800 SXM, 600 GB/s on A100 SXM (NVLink 3): 450 / 200 / 300 GB/s per direction; NCCL
#        reaches ~80% of that as bus bandwidth (assumption) -> 360 / 160 / 240 GB/s.
# [IB]   one NIC per GPU: DGX H100/H200 have 8 single-port ConnectX-7 400 Gb/s (50 GB/s), DGX A100
#        8 ConnectX-6 200 Gb/s (25 GB/s) (datasheets); ~90% reached (assumption) -> 45 / 22.5 GB/s.
# [HOSTLINK] assumption: all GPUs' pinned copies draw on the host's memory bandwidth (STREAM ~450
#        GB/s on a 2-socket DDR5 server, ~300 GB/s on 2-socket EPYC DDR4, ~150 GB/s on a workstation,
#        as [ACC]), which the optimizer and accumulation use too: ~200 / ~120 / ~50 GB/s per
#        direction for the copies of all GPUs together. Measure concurrent copies to replace it.
# [WS4]  assumption: a workstation with 4 cards and no NVLink or peer access (the RTX 4090 has no
#        P2P; RTX 3090 bridges pair two cards only): reduction through PCIe and host memory, ~10
#        GB/s per GPU; one 100 GbE NIC per node shared by 4 GPUs (12.5 GB/s x 0.9 / 4 = 2.8 GB/s).
RUNTIME_HOST_BYTES = 1 * GB
"""[HOSTRES] measured: a training run's RSS beside its store, device-side memory and ring."""
CUDA_HOST_BYTES = 2 * GB
"""[HOSTRES] cited: the CUDA context and driver's host memory."""
OS_HOST_BYTES = 1 * GB
"""[HOSTRES] assumption: the OS beside the training process."""
HOST_RESERVE_MARGIN = 0.20
"""[HOSTRES] assumption: the margin, a fraction of the parts above."""
HOST_GRAD_RING = 4
"""Pinned host buffers the engine's gradients land in (``engine.grad_sink.HOST_GRAD_RING``; a
test keeps the two equal: the planner does not import the engine)."""


def grad_ring_bytes(layer_grad_bytes: int) -> int:
    """[HOSTRES] The pinned gradient ring of a model whose largest decoder layer's gradient is
    ``layer_grad_bytes`` in the compute dtype (``engine.grad_sink.ring_piece_bytes``)."""
    return HOST_GRAD_RING * layer_grad_bytes


def preset_host_reserve_bytes(gpu: bool) -> int:
    """[HOSTRES] A preset's host reserve: runtime + the CUDA context (a GPU's) + OS, plus the
    margin; the model's gradient ring is added by ``HardwareProfile.for_model``."""
    parts = RUNTIME_HOST_BYTES + (CUDA_HOST_BYTES if gpu else 0) + OS_HOST_BYTES
    return int(round(parts * (1 + HOST_RESERVE_MARGIN)))


GPU_HOST_RESERVE_BYTES = preset_host_reserve_bytes(gpu=True)
"""4.8 GB: every GPU preset's host reserve before the model's ring."""

PRESETS: dict[str, HardwareProfile] = {
    "h200": HardwareProfile(
        name="h200",
        device_mem_gbps=0.85 * 4800.0, kernel_launch_s=5e-6, gemm_tile_rows=128,  # H200: 4.8 TB/s [MEM] [LAUNCH] [TILE]
        device_mem_bytes=141 * GB,  # NVIDIA H200 datasheet: 141 GB HBM3e
        device_reserved_bytes=int(1.5 * GB),  # [RES]
        peak_tflops=989.0,  # H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity -> 989 dense
        efficiency=0.40,  # [EFF-H]
        h2d_gbps=50.0, d2h_gbps=50.0,  # [PCIE5]
        nvme_read_gbps=6.9, nvme_write_gbps=4.1, nvme_capacity_bytes=3000 * GB,  # [DCNVME]
        host_mem_bytes=2000 * GB,  # HGX H200 servers ship with 2 TB DDR5 (e.g. DGX H200 datasheet)
        host_reserved_bytes=GPU_HOST_RESERVE_BYTES,  # [HOSTRES]
        **preset_optimizer_fields(PRESET_HOSTS["h200"]),  # [OPT] server
        host_accum_gbps=150.0, host_accum_bf16_gbps=80.0,  # [ACC] [ACC16] server
        pinned_copy_gbps=150.0, gloo_reduce_gbps=3.0,  # [PIN] [GLOO]
        gpus_per_node=8,  # [NODE8]
        intra_node_gbps=360.0, inter_node_gbps=45.0, node_host_link_gbps=200.0,  # [NVL] [IB] [HOSTLINK]
    ),
    "h800": HardwareProfile(
        name="h800",
        device_mem_gbps=0.85 * 3350.0, kernel_launch_s=5e-6, gemm_tile_rows=128,  # as H100 SXM: 3.35 TB/s [MEM] [LAUNCH] [TILE]
        device_mem_bytes=80 * GB,  # NVIDIA H800 SXM: 80 GB HBM3 (same die as H100 SXM)
        device_reserved_bytes=int(1.5 * GB),  # [RES]
        peak_tflops=989.0,  # H800 SXM: H100 SXM compute (989 dense bf16); only NVLink is cut
        efficiency=0.40,  # [EFF-H]
        h2d_gbps=50.0, d2h_gbps=50.0,  # [PCIE5]
        nvme_read_gbps=6.9, nvme_write_gbps=4.1, nvme_capacity_bytes=3000 * GB,  # [DCNVME]
        host_mem_bytes=2000 * GB,  # HGX H800 servers as DGX H100: 2 TB (DGX H100 datasheet)
        host_reserved_bytes=GPU_HOST_RESERVE_BYTES,  # [HOSTRES]
        **preset_optimizer_fields(PRESET_HOSTS["h800"]),  # [OPT] server
        host_accum_gbps=150.0, host_accum_bf16_gbps=80.0,  # [ACC] [ACC16] server
        pinned_copy_gbps=150.0, gloo_reduce_gbps=3.0,  # [PIN] [GLOO]
        gpus_per_node=8,  # [NODE8]
        intra_node_gbps=160.0, inter_node_gbps=45.0, node_host_link_gbps=200.0,  # [NVL] H800 [IB] [HOSTLINK]
    ),
    "h100": HardwareProfile(
        name="h100",
        device_mem_gbps=0.85 * 3350.0, kernel_launch_s=5e-6, gemm_tile_rows=128,  # H100 SXM: 3.35 TB/s [MEM] [LAUNCH] [TILE]
        device_mem_bytes=80 * GB,  # NVIDIA H100 SXM datasheet: 80 GB HBM3
        device_reserved_bytes=int(1.5 * GB),  # [RES]
        peak_tflops=989.0,  # H100 SXM datasheet: 1,979 bf16 with sparsity -> 989 dense
        efficiency=0.40,  # [EFF-H]
        h2d_gbps=50.0, d2h_gbps=50.0,  # [PCIE5]
        nvme_read_gbps=6.9, nvme_write_gbps=4.1, nvme_capacity_bytes=3000 * GB,  # [DCNVME]
        host_mem_bytes=2000 * GB,  # DGX H100 datasheet: 2 TB system memory
        host_reserved_bytes=GPU_HOST_RESERVE_BYTES,  # [HOSTRES]
        **preset_optimizer_fields(PRESET_HOSTS["h100"]),  # [OPT] server
        host_accum_gbps=150.0, host_accum_bf16_gbps=80.0,  # [ACC] [ACC16] server
        pinned_copy_gbps=150.0, gloo_reduce_gbps=3.0,  # [PIN] [GLOO]
        gpus_per_node=8,  # [NODE8]
        intra_node_gbps=360.0, inter_node_gbps=45.0, node_host_link_gbps=200.0,  # [NVL] [IB] [HOSTLINK]
    ),
    "a100-80g": HardwareProfile(
        name="a100-80g",
        device_mem_gbps=0.85 * 2039.0, kernel_launch_s=5e-6, gemm_tile_rows=128,  # A100 80GB: 2,039 GB/s [MEM] [LAUNCH] [TILE]
        device_mem_bytes=80 * GB,  # NVIDIA A100 80GB datasheet
        device_reserved_bytes=int(1.5 * GB),  # [RES]
        peak_tflops=312.0,  # A100 datasheet: 312 TFLOPS bf16 dense (624 with sparsity)
        efficiency=0.52,  # [EFF-A]
        h2d_gbps=25.0, d2h_gbps=25.0,  # [PCIE4]
        nvme_read_gbps=6.9, nvme_write_gbps=4.1, nvme_capacity_bytes=3000 * GB,  # [DCNVME]
        host_mem_bytes=1000 * GB,  # DGX A100 datasheet: 1 TB system memory (2 TB option)
        host_reserved_bytes=GPU_HOST_RESERVE_BYTES,  # [HOSTRES]
        **preset_optimizer_fields(PRESET_HOSTS["a100-80g"]),  # [OPT] server
        host_accum_gbps=150.0, host_accum_bf16_gbps=80.0,  # [ACC] [ACC16] server
        pinned_copy_gbps=150.0, gloo_reduce_gbps=3.0,  # [PIN] [GLOO]
        gpus_per_node=8,  # [NODE8]
        intra_node_gbps=240.0, inter_node_gbps=22.5, node_host_link_gbps=120.0,  # [NVL] A100 [IB] [HOSTLINK]
    ),
    "rtx3090": HardwareProfile(
        name="rtx3090",
        device_mem_gbps=0.85 * 936.0, kernel_launch_s=5e-6, gemm_tile_rows=128,  # GA102 whitepaper: 936 GB/s [MEM] [LAUNCH] [TILE]
        device_mem_bytes=24 * GIB,  # GeForce RTX 3090: 24 GB GDDR6X (24 GiB)
        device_reserved_bytes=int(1.5 * GB),  # [RES]
        peak_tflops=71.0,  # GA102 whitepaper: 71 TFLOPS fp16/bf16 tensor with fp32 accumulate
        efficiency=0.52,  # [EFF-C]
        h2d_gbps=25.0, d2h_gbps=25.0,  # [PCIE4]
        nvme_read_gbps=7.0, nvme_write_gbps=5.0, nvme_capacity_bytes=1500 * GB,  # [CNVME]
        host_mem_bytes=512 * GB,  # assumption: 8 x 64 GB workstation (Threadripper/EPYC class)
        host_reserved_bytes=GPU_HOST_RESERVE_BYTES,  # [HOSTRES]
        **preset_optimizer_fields(PRESET_HOSTS["rtx3090"]),  # [OPT] workstation
        host_accum_gbps=50.0, host_accum_bf16_gbps=50.0,  # [ACC] [ACC16] workstation
        pinned_copy_gbps=60.0, gloo_reduce_gbps=3.0,  # [PIN] [GLOO]
        gpus_per_node=4, intra_node_gbps=10.0, inter_node_gbps=2.8, node_host_link_gbps=50.0,  # [WS4] [HOSTLINK]
    ),
    "rtx4090": HardwareProfile(
        name="rtx4090",
        device_mem_gbps=0.85 * 1008.0, kernel_launch_s=5e-6, gemm_tile_rows=128,  # Ada whitepaper: 1,008 GB/s [MEM] [LAUNCH] [TILE]
        device_mem_bytes=24 * GIB,  # GeForce RTX 4090: 24 GB GDDR6X (24 GiB)
        device_reserved_bytes=int(1.5 * GB),  # [RES]
        peak_tflops=165.2,  # Ada whitepaper: 165.2 TFLOPS fp16/bf16 tensor with fp32 accumulate
        efficiency=0.52,  # [EFF-C]
        h2d_gbps=25.0, d2h_gbps=25.0,  # [PCIE4]
        nvme_read_gbps=7.0, nvme_write_gbps=5.0, nvme_capacity_bytes=1500 * GB,  # [CNVME]
        host_mem_bytes=512 * GB,  # assumption: 8 x 64 GB workstation
        host_reserved_bytes=GPU_HOST_RESERVE_BYTES,  # [HOSTRES]
        **preset_optimizer_fields(PRESET_HOSTS["rtx4090"]),  # [OPT] workstation
        host_accum_gbps=50.0, host_accum_bf16_gbps=50.0,  # [ACC] [ACC16] workstation
        pinned_copy_gbps=60.0, gloo_reduce_gbps=3.0,  # [PIN] [GLOO]
        gpus_per_node=4, intra_node_gbps=10.0, inter_node_gbps=2.8, node_host_link_gbps=50.0,  # [WS4] [HOSTLINK]
    ),
    "cpu": HardwareProfile(
        name="cpu",
        # The CPU backend: "device" memory is host memory; everything runs on the same cores.
        device_mem_bytes=16 * GB,  # assumption: a small box; calibrate reads the real size
        device_reserved_bytes=1 * GB,
        peak_tflops=0.05,  # assumption: 2 cores x AVX2 fp32 matmul in PyTorch; calibrate measures
        efficiency=1.0,  # peak_tflops is already a measured-style sustained number
        h2d_gbps=5.0, d2h_gbps=5.0,  # assumption: memcpy of large buffers; calibrate measures
        nvme_read_gbps=1.0, nvme_write_gbps=0.5, nvme_capacity_bytes=50 * GB,  # assumption (VM disk)
        host_mem_bytes=16 * GB,
        host_reserved_bytes=preset_host_reserve_bytes(gpu=False),  # [HOSTRES]: no CUDA, no ring
        optimizer_params_per_s=1e8, optimizer_8bit_params_per_s=5e7,  # assumption; calibrate measures
        host_accum_gbps=5.0, host_accum_bf16_gbps=5.0,  # assumption; calibrate measures
        pinned_copy_gbps=2.0,  # assumption (the per-thread refresh rate measured here); calibrate measures
        compute_dtype_bytes=4,  # CPU runs fp32
        synchronous=True,  # CPU backend copies and computes in one thread
        op_overhead_s=2e-4,  # Python + dispatch per op (assumption)
    ),
}


def get_hardware(spec: str) -> HardwareProfile:
    """A preset name or the path of a profile JSON file."""
    if spec in PRESETS:
        return PRESETS[spec]
    p = Path(spec)
    if p.suffix == ".json" or p.exists():
        return HardwareProfile.load(p)
    raise ValueError(f"unknown hardware {spec!r}: use a preset ({', '.join(PRESETS)}) "
                     "or a profile file written by `layerwise calibrate --out profile.json`")
