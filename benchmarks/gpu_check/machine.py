"""Where the GPU check runs, and what it reads about the machine.

``Dev`` is CUDA, or for a dry run the asynchronous CPU backend (the engine's ``cpu-async``:
lanes as threads, the host running ahead as it does of a GPU) with tensors on the CPU; every
CUDA-only call goes through it, so a dry run executes the rest of the check's Python.

Host RAM: the GPU machine's ``MemTotal``/``MemAvailable`` start far below its RAM and grow as
memory is used, so the check never sizes anything from them: it is given the RAM
(``--host-budget-gb``) and reports both readings beside it.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parents[2]

PACKAGES = ("transformers", "numba", "highspy", "blake3", "deepspeed", "pytest", "pytest-timeout")
"""Reported by version without importing them (``importlib.metadata``)."""


class Dev:
    def __init__(self, dry_run: bool):
        import torch

        self.torch = torch
        self.dry_run = dry_run
        self.is_cuda = not dry_run
        self.name = "cpu" if dry_run else "cuda"
        """Where tensors go."""
        self.engine_device = "cpu-async" if dry_run else "cuda"
        """``EngineConfig.device``."""

    def sync(self) -> None:
        if self.is_cuda:
            self.torch.cuda.synchronize()

    def clean(self) -> None:
        """Give device memory back between stages (a collection first: tensors held by cycles
        would keep their blocks). On the CPU there is nothing to give back, and a collection in
        a process holding torch and transformers takes most of a second."""
        if self.is_cuda:
            gc.collect()
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()

    def reset_peak(self) -> None:
        if self.is_cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def mem(self, counter: str) -> int | None:
        """``torch.cuda.<counter>()`` (``memory_reserved``, ``max_memory_allocated``, ...); None
        without CUDA."""
        return int(getattr(self.torch.cuda, counter)()) if self.is_cuda else None

    def timed(self, fn) -> float:
        """Seconds ``fn()`` takes, the device synchronised before and after."""
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t

    def best_s(self, fn, repeats: int) -> float:
        """The fastest of ``repeats`` timed calls of ``fn`` after one warm-up call."""
        fn()
        return min(self.timed(fn) for _ in range(repeats))

    def generator(self, seed: int):
        g = self.torch.Generator(device=self.name)
        g.manual_seed(seed)
        return g

    @contextmanager
    def true_fp32(self) -> Iterator[None]:
        """fp32 matmuls in fp32, not TF32, while comparing against autograd (restored after)."""
        b = self.torch.backends
        old = b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32
        b.cuda.matmul.allow_tf32 = b.cudnn.allow_tf32 = False
        try:
            yield
        finally:
            b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32 = old


def meminfo_bytes() -> dict[str, int | None]:
    """``MemTotal`` and ``MemAvailable`` of ``/proc/meminfo`` (None where unreadable)."""
    out: dict[str, int | None] = {"memtotal_bytes": None, "memavailable_bytes": None}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[f"{key.lower()}_bytes"] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def process_rss_bytes() -> int | None:
    """Resident bytes of this process (``/proc/self/statm``), None where unreadable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def host_ram(budget_bytes: int) -> dict[str, Any]:
    """The RAM figure every check uses, beside what the kernel reports now."""
    return {"figure_used": "--host-budget-gb", "host_budget_bytes": budget_bytes, **meminfo_bytes(),
            "note": "store and planner RAM checks use host_budget_bytes (minus this process's RSS "
                    "for the store); MemTotal/MemAvailable are only reported"}


EXPANDABLE = "expandable_segments:True"
ALLOC_CONF: dict[str, Any] = {"source": "not set by the check", "before_cuda_init": None}
"""What ``set_alloc_conf`` did, for ``device_facts``."""


def set_alloc_conf() -> None:
    """``PYTORCH_CUDA_ALLOC_CONF`` with ``expandable_segments:True``: the caching allocator grows
    segments in place rather than leaving the gaps between fixed blocks unusable (the plans of a
    large model run within a few GB of the device's memory). Called before the check imports
    torch; the allocator reads it when CUDA starts, so whether CUDA had started is recorded."""
    torch = sys.modules.get("torch")
    ALLOC_CONF["before_cuda_init"] = torch is None or not torch.cuda.is_initialized()
    given = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if not given:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
        ALLOC_CONF["source"] = "set by the check"
    elif "expandable_segments" in given:
        ALLOC_CONF["source"] = "given"
    else:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = f"{given},{EXPANDABLE}"
        ALLOC_CONF["source"] = "given; expandable_segments added by the check"


WHEEL_PACKAGES = ("highspy", "blake3", "numba")
"""What the check imports that the GPU image may lack (``make gpu-wheels`` brings them): where
each was imported from says whether the ``.whl`` install took."""


def host_kernels() -> dict[str, Any]:
    """Which host kernels run: numba's (compiled) or the torch fallback, per kernel family."""
    from layerwise import split_master
    from layerwise.optim import _kernel, grad_accum

    forced = os.environ.get("LAYERWISE_OPTIM_KERNEL", "") == "torch"
    avx512 = None
    if _kernel.numba_available():  # the 512-bit vectors ``util/simd`` asks for exist here?
        import llvmlite.binding as llvm

        avx512 = "+avx512f" in llvm.get_host_cpu_features().flatten()
    return {"numba": package_versions().get("numba"),
            "optimizer_8bit": "numba" if _kernel.numba_available() and not forced else "torch",
            "grad_accumulation": "numba" if grad_accum.numba_available() else "torch",
            "split_master": "numba" if split_master.numba_available() else "torch",
            "host_avx512": avx512}


def imported_from(names: tuple[str, ...]) -> dict[str, str | None]:
    """Each module's file once imported (None: it does not import)."""
    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = getattr(importlib.import_module(name), "__file__", None)
        except Exception:  # noqa: BLE001 - a missing or broken wheel is what is reported
            out[name] = None
    return out


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def _run(cmd: list[str], **kw) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20, **kw)
        return (proc.stdout.strip() or proc.stderr.strip()) or None
    except Exception:  # noqa: BLE001 - a missing tool is reported as null
        return None


def device_facts(dev: Dev, data: dict[str, Any]) -> None:
    """The machine: Python, torch, packages, cores; on CUDA the GPU, its driver, and how long
    creating the CUDA context took."""
    torch = dev.torch
    data.update({
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "packages": package_versions(),
        "device": dev.engine_device,
        "layerwise_commit": _run(["git", "rev-parse", "HEAD"], cwd=REPO),
        "kernels": host_kernels(),
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "expandable_segments": EXPANDABLE in (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "").replace(" ", ""),
        "cuda_alloc_conf_source": ALLOC_CONF["source"],
        "cuda_alloc_conf_before_cuda_init": ALLOC_CONF["before_cuda_init"],
        "imported_from": imported_from(WHEEL_PACKAGES),
    })
    gpu: dict[str, Any] = dict.fromkeys(("device_name", "device_capability", "device_total_mem_bytes",
                                         "device_multiprocessors", "nvidia_smi", "cuda_init_s"))
    gpu["device_count"] = 0
    if dev.is_cuda:
        t = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        gpu["cuda_init_s"] = round(time.perf_counter() - t, 3)
        p = torch.cuda.get_device_properties(0)
        gpu.update(device_name=p.name, device_capability=f"{p.major}.{p.minor}",
                   device_total_mem_bytes=int(p.total_memory), device_multiprocessors=p.multi_processor_count,
                   device_count=torch.cuda.device_count(),
                   nvidia_smi=_run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm",
                                    "--format=csv,noheader"]))
    data.update(gpu)


def find_spec_ok(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
