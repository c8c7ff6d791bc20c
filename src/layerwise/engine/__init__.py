"""The streaming executor: runs a Plan's step program on a device with all state on the host.

Owns the device backends (CUDA streams; CPU synchronous; CPU asynchronous, which plays the
GPU's protocol with threads), device slots and pinned rings (``slots``), weights in
(``weight_stream``), gradients out (``grad_sink``), activation tiers (``boundary_tiers``), the
executor (``executor``: a step's sequence; ``op_handlers``: the ops; ``updates``:
the host optimizer updates; ``reduce``: how ranks combine a step, ``LocalReducer`` alone;
``host_threads``: which CPUs the landing and optimizer threads use), the
micro-batch contract (``batch``), the layer backward (``layer_ops``) and ``layerwise
calibrate``. The step program and the memory
model it obeys live in ``layerwise.plan``.
"""

from .backend import CpuBackend, CudaBackend, DeviceBackend
from .backend_async import AsyncCpuBackend
from .devices import make_backend
from .executor import EngineConfig, StepStats, StreamingEngine

__all__ = ["AsyncCpuBackend", "CpuBackend", "CudaBackend", "DeviceBackend", "make_backend", "EngineConfig",
           "StepStats", "StreamingEngine"]
