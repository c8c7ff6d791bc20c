"""Streaming executor: device backends, weight/grad/activation streams, the step executor.

The step program and the device-memory model it obeys live in ``layerwise.plan`` (no tensors).
"""

from .backend import CpuBackend, CudaBackend, DeviceBackend, make_backend
from .executor import EngineConfig, StepStats, StreamingEngine

__all__ = ["CpuBackend", "CudaBackend", "DeviceBackend", "make_backend", "EngineConfig",
           "StepStats", "StreamingEngine"]
