"""The streaming executor: runs a Plan's step program on a device with all state on the host.

Owns the device backends (CUDA streams; CPU synchronous), the weight / gradient / activation
streams, the executor itself, the micro-batch contract (``batch``), the layer backward shared
with calibration (``layer_ops``) and ``layerwise calibrate``. The step program and the memory
model it obeys live in ``layerwise.plan``.
"""

from .backend import CpuBackend, CudaBackend, DeviceBackend, make_backend
from .executor import EngineConfig, StepStats, StreamingEngine

__all__ = ["CpuBackend", "CudaBackend", "DeviceBackend", "make_backend", "EngineConfig",
           "StepStats", "StreamingEngine"]
