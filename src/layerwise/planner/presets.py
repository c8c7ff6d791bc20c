"""The hardware presets: common training boxes from datasheets plus stated assumptions (each
tagged once below, cited where used), and ``get_hardware`` (a preset name or a profile file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .hardware import GB, GIB, HardwareProfile
from .host_rates import PRESET_HOSTS, preset_optimizer_fields

# Shared assumptions (stated once, used below):
# [EFF-H] 0.40 of dense peak on Hopper: the best published whole-step BF16 training rates on
#        H100 are ~390-400 model TFLOPS/GPU (GPT-3 175B, 47% MFU counted with attention;
#        Llama 3 405B on 16k H100, 38-43% MFU: Megatron-Core benchmark notes), and 328-334 on
#        DGX-H100 for NeMo AutoModel's Nemotron 3 BF16 runs (fused kernels: their non-GEMM work is
#        small), so it is each GEMM's compute roof; an eager layer's elementwise work is priced
#        apart ([MEM]). Sources: docs/planner.md, "Hardware presets".
# [EFF-A] 0.52 on the A100: Megatron-LM (Narayanan et al. 2021) sustains 163 TFLOPS/GPU (52% of
#        312) on 3072 A100s for a 1T-parameter GPT, data loading and optimizer included.
# [EFF-C] 0.52 on GeForce cards: no published training rate found; assumption, the A100's
#        fraction.
# [PCIE5] PCIe 5.0 x16 is 64 GB/s per direction raw; pinned cudaMemcpy measures ~50-55 GB/s
#        (CUDA bandwidthTest on H100/H200 hosts); 50 GB/s used.
# [PCIE4] PCIe 4.0 x16 is 32 GB/s raw; pinned copies measure ~24-26 GB/s; 25 GB/s used.
# [DCNVME] one datacenter PCIe 4.0 NVMe drive per GPU (Samsung PM9A3 datasheet: 6.9 GB/s read,
#        4.1 GB/s write sequential, per drive); 3.84 TB drive, 3 TB given to spill and optimizer
#        state. Per GPU, as [HOSTMEM]: DGX H100 / H200 datasheets, 8 x 3.84 TB U.2 NVMe data
#        drives for 8 GPUs, one drive each (assumption: each GPU's process uses its own drive;
#        ZeRO-Infinity, Rajbhandari et al. 2021, sizes ~3 GB/s of NVMe per GPU for its offload).
# [CNVME] one consumer PCIe 4.0 NVMe drive (Samsung 980 PRO datasheet: 7.0 GB/s read,
#        5.0 GB/s write sequential, per drive); 2 TB drive, 1.5 TB given to spill and optimizer
#        state; the one GPU of a workstation has it to itself.
# Host side (the engine's own kernels; ``layerwise calibrate`` measures each on the machine,
# these are what a preset assumes without it). Per-thread rates measured here
# (``layerwise calibrate --quick --device cpu``; 2 shared cores, load 7-14): the fused bf16 -> fp32
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
#        1-5 GB/s estimated for loopback TCP (measured here between 2 in-process ranks on 2 shared
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
#        activations the planner counts (``preset_host_reserve_bytes``; docs/results.md):
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
#        - the pinned gradient ring (scales with the model, added per model by
#          ``HardwareProfile.for_model``): ``HOST_GRAD_RING`` buffers of the largest decoder
#          layer's gradient in the compute dtype, each page-locked in place at its own size by
#          ``CudaBackend.host_alloc`` (torch's pinned allocator would round each up to a power
#          of two: 4 x 1 GiB for qwen2.5-14b's 0.55 GB layers). A synchronous profile has no ring.
#        Not in the reserve (the run adds them; measured by ``benchmarks/host_reserve.py``): the tokenized
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
# [HOSTMEM] host RAM, per GPU: a plan is what one GPU runs, so each preset holds the RAM one GPU
#        of such a machine has; ``layerwise plan --gpus G`` on a preset plans on G of these shares
#        (``preset_host_mem_bytes``); ``--host-mem`` gives a machine's own figure, and
#        ``layerwise plan`` without ``--hardware`` reads this machine's RAM.
#        - H100 / H800 / H200: a node's per-GPU share: DGX H100 and DGX H200 datasheets, 2 TB of
#          system memory for 8 GPUs -> 250 GB per GPU (cloud 1-GPU H100 instances are that size:
#          Google Cloud a3-highgpu-1g, 234 GB).
#        - A100 80GB: a node's per-GPU share: DGX A100 datasheet, 1 TB for 8 GPUs -> 125 GB.
#        - RTX 3090 / 4090: a typical workstation with one such card ships with 64-128 GB (two or
#          four 32 GB DIMMs on a desktop board); the lower figure, 64 GB, is taken (assumption).
NODE_SHARE_H = 2000 * GB // 8
"""[HOSTMEM] an H100 / H800 / H200 node's RAM per GPU: 250 GB."""
NODE_SHARE_A100 = 1000 * GB // 8
"""[HOSTMEM] an A100 node's RAM per GPU: 125 GB."""
WORKSTATION_RAM = 64 * GB
"""[HOSTMEM] a one-card RTX 3090 / 4090 workstation's RAM (typical: 64-128 GB)."""
RUNTIME_HOST_BYTES = 1 * GB
"""[HOSTRES] measured: a training run's RSS beside its store, device-side memory and ring."""
CUDA_HOST_BYTES = 2 * GB
"""[HOSTRES] cited: the CUDA context and driver's host memory."""
OS_HOST_BYTES = 1 * GB
"""[HOSTRES] assumption: the OS beside the training process."""
HOST_RESERVE_MARGIN = 0.20
"""[HOSTRES] assumption: the margin, a fraction of the parts above."""


def preset_host_reserve_bytes(gpu: bool) -> int:
    """[HOSTRES] A preset's host reserve: runtime + the CUDA context (a GPU's) + OS, plus the
    margin; the model's gradient ring is added by ``HardwareProfile.for_model``."""
    parts = RUNTIME_HOST_BYTES + (CUDA_HOST_BYTES if gpu else 0) + OS_HOST_BYTES
    return int(round(parts * (1 + HOST_RESERVE_MARGIN)))


GPU_HOST_RESERVE_BYTES = preset_host_reserve_bytes(gpu=True)
"""4.8 GB: every GPU preset's host reserve before the model's ring."""


def _gpu(name: str, **fields: Any) -> HardwareProfile:
    """A GPU preset: what every GPU preset shares, then its own ``fields``."""
    return HardwareProfile(
        name=name,
        kernel_launch_s=5e-6, gemm_tile_rows=128,  # [LAUNCH] [TILE]
        device_reserved_bytes=int(1.5 * GB),  # [RES]
        host_reserved_bytes=GPU_HOST_RESERVE_BYTES,  # [HOSTRES]
        **preset_optimizer_fields(PRESET_HOSTS[name]),  # [OPT]
        gloo_reduce_gbps=3.0,  # [GLOO]
        **fields)


_SERVER: dict[str, Any] = dict(
    nvme_read_gbps=6.9, nvme_write_gbps=4.1, nvme_capacity_bytes=3000 * GB,  # [DCNVME]
    host_accum_gbps=150.0, host_accum_bf16_gbps=80.0, pinned_copy_gbps=150.0,  # [ACC] [ACC16] [PIN] server
    gpus_per_node=8)  # [NODE8]
"""A GPU server node's host side (H100 / H800 / H200 / A100)."""
_WORKSTATION: dict[str, Any] = dict(
    nvme_read_gbps=7.0, nvme_write_gbps=5.0, nvme_capacity_bytes=1500 * GB,  # [CNVME]
    host_mem_bytes=WORKSTATION_RAM,  # [HOSTMEM] a typical RTX 3090 / 4090 workstation: 64 GB
    host_accum_gbps=50.0, host_accum_bf16_gbps=50.0, pinned_copy_gbps=60.0,  # [ACC] [ACC16] [PIN] workstation
    gpus_per_node=4, intra_node_gbps=10.0, inter_node_gbps=2.8, node_host_link_gbps=50.0)  # [WS4] [HOSTLINK]
"""A GeForce workstation's host side (RTX 3090 / 4090)."""

PRESETS: dict[str, HardwareProfile] = {
    "h200": _gpu(
        "h200", **_SERVER,
        device_mem_gbps=0.85 * 4800.0,  # H200: 4.8 TB/s [MEM]
        device_mem_bytes=141 * GB,  # NVIDIA H200 datasheet: 141 GB HBM3e
        peak_tflops=989.0,  # H200 SXM datasheet: 1,979 TFLOPS bf16 with sparsity -> 989 dense
        efficiency=0.40,  # [EFF-H]
        h2d_gbps=50.0, d2h_gbps=50.0,  # [PCIE5]
        host_mem_bytes=NODE_SHARE_H,  # [HOSTMEM] per-GPU share: DGX H200 datasheet, 2 TB for 8 GPUs
        intra_node_gbps=360.0, inter_node_gbps=45.0, node_host_link_gbps=200.0,  # [NVL] [IB] [HOSTLINK]
    ),
    "h800": _gpu(
        "h800", **_SERVER,
        device_mem_gbps=0.85 * 3350.0,  # as H100 SXM: 3.35 TB/s [MEM]
        device_mem_bytes=80 * GB,  # NVIDIA H800 SXM: 80 GB HBM3 (same die as H100 SXM)
        peak_tflops=989.0,  # H800 SXM: H100 SXM compute (989 dense bf16); only NVLink is cut
        efficiency=0.40,  # [EFF-H]
        h2d_gbps=50.0, d2h_gbps=50.0,  # [PCIE5]
        host_mem_bytes=NODE_SHARE_H,  # [HOSTMEM] per-GPU share: HGX H800 as DGX H100, 2 TB for 8 GPUs
        intra_node_gbps=160.0, inter_node_gbps=45.0, node_host_link_gbps=200.0,  # [NVL] H800 [IB] [HOSTLINK]
    ),
    "h100": _gpu(
        "h100", **_SERVER,
        device_mem_gbps=0.85 * 3350.0,  # H100 SXM: 3.35 TB/s [MEM]
        device_mem_bytes=80 * GB,  # NVIDIA H100 SXM datasheet: 80 GB HBM3
        peak_tflops=989.0,  # H100 SXM datasheet: 1,979 bf16 with sparsity -> 989 dense
        efficiency=0.40,  # [EFF-H]
        h2d_gbps=50.0, d2h_gbps=50.0,  # [PCIE5]
        host_mem_bytes=NODE_SHARE_H,  # [HOSTMEM] per-GPU share: DGX H100 datasheet, 2 TB for 8 GPUs
        intra_node_gbps=360.0, inter_node_gbps=45.0, node_host_link_gbps=200.0,  # [NVL] [IB] [HOSTLINK]
    ),
    "a100-80g": _gpu(
        "a100-80g", **_SERVER,
        device_mem_gbps=0.85 * 2039.0,  # A100 80GB: 2,039 GB/s [MEM]
        device_mem_bytes=80 * GB,  # NVIDIA A100 80GB datasheet
        peak_tflops=312.0,  # A100 datasheet: 312 TFLOPS bf16 dense (624 with sparsity)
        efficiency=0.52,  # [EFF-A]
        h2d_gbps=25.0, d2h_gbps=25.0,  # [PCIE4]
        host_mem_bytes=NODE_SHARE_A100,  # [HOSTMEM] per-GPU share: DGX A100 datasheet, 1 TB for 8 GPUs
        intra_node_gbps=240.0, inter_node_gbps=22.5, node_host_link_gbps=120.0,  # [NVL] A100 [IB] [HOSTLINK]
    ),
    "rtx3090": _gpu(
        "rtx3090", **_WORKSTATION,
        device_mem_gbps=0.85 * 936.0,  # GA102 whitepaper: 936 GB/s [MEM]
        device_mem_bytes=24 * GIB,  # GeForce RTX 3090: 24 GB GDDR6X (24 GiB)
        peak_tflops=71.0,  # GA102 whitepaper: 71 TFLOPS fp16/bf16 tensor with fp32 accumulate
        efficiency=0.52,  # [EFF-C]
        h2d_gbps=25.0, d2h_gbps=25.0,  # [PCIE4]
    ),
    "rtx4090": _gpu(
        "rtx4090", **_WORKSTATION,
        device_mem_gbps=0.85 * 1008.0,  # Ada whitepaper: 1,008 GB/s [MEM]
        device_mem_bytes=24 * GIB,  # GeForce RTX 4090: 24 GB GDDR6X (24 GiB)
        peak_tflops=165.2,  # Ada whitepaper: 165.2 TFLOPS fp16/bf16 tensor with fp32 accumulate
        efficiency=0.52,  # [EFF-C]
        h2d_gbps=25.0, d2h_gbps=25.0,  # [PCIE4]
    ),
    "cpu": HardwareProfile(
        name="cpu",
        # The CPU backend: "device" memory is host memory; everything runs on the same cores.
        device_mem_bytes=16 * GB,  # assumption: a small box; calibrate reads the real size
        device_reserved_bytes=1 * GB,
        peak_tflops=0.05,  # assumption: 2 cores x AVX2 fp32 matmul in PyTorch; calibrate measures
        efficiency=1.0,  # peak_tflops is already a measured-style sustained number
        device_mem_gbps=10.0, kernel_launch_s=1e-5,  # assumption: a few cores, eager dispatch; calibrate measures
        h2d_gbps=5.0, d2h_gbps=5.0,  # assumption: memcpy of large buffers; calibrate measures
        nvme_read_gbps=1.0, nvme_write_gbps=0.5, nvme_capacity_bytes=50 * GB,  # assumption (VM disk)
        host_mem_bytes=16 * GB,
        host_reserved_bytes=preset_host_reserve_bytes(gpu=False),  # [HOSTRES]: no CUDA, no ring
        optimizer_params_per_s=1e8, optimizer_8bit_params_per_s=5e7,  # assumption; calibrate measures
        host_accum_gbps=5.0, host_accum_bf16_gbps=5.0,  # assumption; calibrate measures
        pinned_copy_gbps=2.0,  # assumption (the per-thread refresh rate measured here); calibrate measures
        compute_dtype_bytes=4,  # CPU runs fp32
        synchronous=True,  # CPU backend copies and computes in one thread
    ),
}


def preset_host_mem_bytes(name: str, gpus: int) -> int | None:
    """[HOSTMEM] The host RAM of ``gpus`` GPUs of the preset ``name`` on one node: that many
    per-GPU shares (the node's GPUs share one host store); None: not a GPU preset."""
    hw = PRESETS.get(name)
    if hw is None or hw.synchronous:
        return None
    return hw.host_mem_bytes * max(1, min(gpus, hw.gpus_per_node))


def get_hardware(spec: str) -> HardwareProfile:
    """A preset name or the path of a profile JSON file."""
    if spec in PRESETS:
        return PRESETS[spec]
    p = Path(spec)
    if p.suffix == ".json" or p.exists():
        return HardwareProfile.load(p)
    raise ValueError(f"unknown hardware {spec!r}: use a preset ({', '.join(PRESETS)}) "
                     "or a profile file written by `layerwise calibrate --out profile.json`")
