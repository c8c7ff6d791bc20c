"""Streaming executor: device backends, step program, weight/grad/activation streams."""

from .backend import CpuBackend, CudaBackend, DeviceBackend, make_backend
from .executor import EngineConfig, StepStats, StreamingEngine
from .memory import MemoryEstimate, predict_peak_device_bytes
from .program import Op, micro_batch_program

__all__ = ["CpuBackend", "CudaBackend", "DeviceBackend", "make_backend", "EngineConfig",
           "StepStats", "StreamingEngine", "MemoryEstimate", "predict_peak_device_bytes",
           "Op", "micro_batch_program"]
