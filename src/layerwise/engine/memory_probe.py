"""The device memory a step really takes, measured from allocations (never from the engine's own
bookkeeping), to hold the memory model to account: on CUDA ``max_memory_reserved``; on the CPU
backends the profiler's allocations over the step (every lane's thread on the async one, by the
legacy per-thread profiler: kineto records only its own thread) plus the slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from torch.autograd import _disable_profiler_legacy, _enable_profiler_legacy
from torch.autograd.profiler_legacy import profile as legacy_profile

from .batch import Batch
from .executor import StreamingEngine


@dataclass
class MeasuredPeak:
    peak_bytes: int
    peak_op: str
    """The op running when the peak was reached ("" when not known)."""
    slot_bytes: int
    """Of which the engine's slots (weights, gradients, fetched boundaries)."""
    how: str


def slot_storage_bytes(engine: StreamingEngine) -> int:
    """Bytes of the device storages behind the engine's slots and resident weight buffers, read
    off the tensors themselves."""
    slots = list(engine.streamer.slots) + list(getattr(engine.sink, "slots", [])) + list(engine.acts.slots)
    resident = engine.streamer.resident.buffers.values()
    return (sum(s.buffer.untyped_storage().nbytes() for s in slots)
            + sum(b.untyped_storage().nbytes() for b in resident))


def measure_step_peak(engine: StreamingEngine, batches: list[Batch]) -> MeasuredPeak:
    """Run ``engine.compute_grads(batches)`` once and measure its device peak. Run a warm-up step
    first: slots for fetched boundaries are allocated by the first step."""
    engine.synchronize()  # no optimizer update allocating on the side
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
        engine.compute_grads(batches)
        torch.cuda.synchronize(engine.device)
        return MeasuredPeak(int(torch.cuda.max_memory_reserved(engine.device)), "",
                            slot_storage_bytes(engine), "cuda max_memory_reserved")
    if engine.backend.asynchronous:
        call_on_lanes = getattr(engine.backend, "call_on_lanes", None)
        if call_on_lanes is None:
            raise ValueError(f"no allocation probe for the {type(engine.backend).__name__} backend")
        return _measure_on_lanes(engine, batches, call_on_lanes)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        engine.compute_grads(batches)
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    ops = sorted((e.start_ns(), e.end_ns(), e.name()) for e in events
                 if e.name() in {str(op) for op in engine.program})
    live = peak = 0
    peak_t = None
    for t, nbytes in mem:
        live += nbytes
        if live > peak:
            peak, peak_t = live, t
    peak_op = next((name for s, e, name in ops if peak_t is not None and s <= peak_t <= e), "")
    slots = slot_storage_bytes(engine)
    return MeasuredPeak(peak + slots, peak_op, slots, "torch profiler allocation events + slot storages")


def _measure_on_lanes(engine: StreamingEngine, batches: list[Batch], call_on_lanes) -> MeasuredPeak:
    config = legacy_profile(profile_memory=True).config()
    call_on_lanes(lambda: _enable_profiler_legacy(config))
    _enable_profiler_legacy(config)
    try:
        engine.compute_grads(batches)
    finally:
        threads = [_disable_profiler_legacy()]
        threads += call_on_lanes(_disable_profiler_legacy).values()
    start = threads[0][0][0]  # the calling thread's start mark: the common clock's origin
    mem = sorted((start.cpu_elapsed_us(e), e.cpu_memory_usage()) for records in threads
                 for events in records for e in events if e.kind() == "memory_alloc")
    live = peak = 0
    for _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    slots = slot_storage_bytes(engine)
    return MeasuredPeak(peak + slots, "", slots,
                        "per-thread profiler allocation events (host + lanes) + slot storages")
