"""The streaming executor: runs a Plan's step program on a device with all state on the host.

The modules are mapped in ``docs/design-notes.md`` ("Engine"); the step program and its memory
model live in ``layerwise.plan``."""

from .backend import CpuBackend, CudaBackend, DeviceBackend
from .backend_async import AsyncCpuBackend
from .devices import make_backend
from .executor import EngineConfig, StepStats, StreamingEngine

__all__ = ["AsyncCpuBackend", "CpuBackend", "CudaBackend", "DeviceBackend", "make_backend", "EngineConfig",
           "StepStats", "StreamingEngine"]
