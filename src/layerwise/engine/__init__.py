"""The streaming executor: runs a Plan's step program on a device with all state on the host.

Backends (CUDA streams; CPU synchronous; CPU asynchronous, the GPU's protocol on threads),
``slots`` (device slots, pinned rings), ``weight_stream`` (weights in), ``grad_sink`` (gradients
out), ``boundary_tiers`` (activations), ``executor`` (a step's sequence), ``op_handlers`` (the
ops), ``updates`` (host optimizer), ``reduce`` (how ranks combine a step), ``host_threads``
(CPU placement), ``batch`` (the micro-batch contract), ``layer_ops`` (the layer backward). The
step program and its memory model live in ``layerwise.plan``.
"""

from .backend import CpuBackend, CudaBackend, DeviceBackend
from .backend_async import AsyncCpuBackend
from .devices import make_backend
from .executor import EngineConfig, StepStats, StreamingEngine

__all__ = ["AsyncCpuBackend", "CpuBackend", "CudaBackend", "DeviceBackend", "make_backend", "EngineConfig",
           "StepStats", "StreamingEngine"]
