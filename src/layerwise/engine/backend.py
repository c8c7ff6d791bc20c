"""Device backends: three lanes (compute, H2D, D2H) and the events that order them.

The engine is written once against :class:`DeviceBackend`, the way CUDA works: the host queues
work and returns; an :class:`Event` orders lanes or the host. Device buffers are allocated once
(``alloc``), so the device peak is what the memory model says whatever the host's pace. Every
backend counts each copy lane's bytes (``copied_bytes``), for tests to compare with the plan.

- :class:`CudaBackend`: compute on the current stream, each copy lane a stream of its own.
- :class:`CpuBackend`: synchronous on the calling thread; its compute reads host weights in place.
- :class:`AsyncCpuBackend` (``backend_async.py``): lanes as threads with seeded random delays, so
  a missing wait shows up as wrong numbers in tests.

Data parallel adds a reduction lane (``collective``) behind the compute that wrote its tensor;
on CUDA its own stream, which ``work.wait()`` orders after NCCL without blocking the host."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from ..util.host_memory import alloc_pinned


class Event(Protocol):
    def synchronize(self) -> None:
        """Block the calling host thread until the work before the event has run."""

    def query(self) -> bool:
        """True when the work before the event has run."""


class Ref:
    """A tensor a compute closure fills in; a copy lane takes it after an event, letting go of it,
    so an offloaded boundary's memory is freed once its copy is done."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor | None = None):
        self.value = value

    def get(self) -> torch.Tensor:
        assert self.value is not None, "read a Ref before the compute that fills it ran"
        return self.value

    def take(self) -> torch.Tensor:
        t, self.value = self.get(), None
        return t


class HeldRef(Ref):
    """A copy source kept until the compute lane waits for the copy, then released.

    Not ``record_stream``: that returns the block only once the host sees the copy done, so a host
    running ahead would get fresh blocks for every offload; released here, the block is reused at
    once in the compute stream's order."""

    __slots__ = ("inner", "held", "released")

    def __init__(self, inner: torch.Tensor | Ref):
        super().__init__(None)
        self.inner = inner
        self.held: torch.Tensor | None = None
        self.released = False

    def get(self) -> torch.Tensor:
        return self.inner.get() if isinstance(self.inner, Ref) else self.inner

    def take(self) -> torch.Tensor:
        t, self.inner = resolve(self.inner), None
        if not self.released:  # taken before its release (CUDA: always): keep it until then
            self.held = t
        return t

    def release(self) -> None:
        """The compute lane has been made to wait for the copy: the tensor may go."""
        self.released, self.held = True, None


Source = torch.Tensor | Ref


def resolve(src: Source) -> torch.Tensor:
    return src.take() if isinstance(src, Ref) else src


def peek(src: Source) -> torch.Tensor:
    """The tensor of ``src``, leaving a Ref its tensor (a later copy takes it)."""
    return src.get() if isinstance(src, Ref) else src


class Work(Protocol):
    def wait(self) -> object:
        """CUDA: make the current stream wait for the collective (the host does not block);
        gloo: block until it is done."""


IssueCollective = Callable[[torch.Tensor], "Work | None"]
"""Issues a collective on the tensor it is given (async) and returns its work."""


def run_collective(src: Source, issue: IssueCollective, release: bool) -> None:
    """A collective on the host's timeline (the CPU backends): issue, wait, and let go of a
    Ref's tensor when ``release``."""
    work = issue(peek(src))
    if work is not None:
        work.wait()
    if release and isinstance(src, Ref):
        src.take()


def new_byte_counter() -> dict[str, int]:
    return {"h2d": 0, "d2h": 0}


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class DeviceBackend(Protocol):
    device: torch.device
    asynchronous: bool
    """True when the host may run ahead of the lanes (CUDA, AsyncCpuBackend)."""
    reads_host: bool
    """True when compute reads host memory in place (the device is the host and runs
    synchronously): the engine binds the host weights instead of copying them into slots."""
    copied_bytes: dict[str, int]
    """Bytes each copy lane (``h2d``, ``d2h``) has copied since the backend was made (or the
    caller reset the entries)."""

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory for a slot, allocated once by the engine."""

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory a copy lane reads or writes (pinned on CUDA)."""

    def launch(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` (tensor work) on the compute lane."""

    def record(self) -> Event:
        """An event at the compute lane's current position."""

    def wait(self, events: Sequence[Event | None]) -> None:
        """Make the compute lane wait for ``events`` before its next work."""

    def copy_h2d(self, dst: torch.Tensor, src: Source, after: Sequence[Event | None] = ()) -> Event:
        """On the H2D lane, after ``after``: ``dst.copy_(src)``; the event marks its end."""

    def copy_d2h(self, dst: torch.Tensor, src: Source, after: Sequence[Event | None] = ()) -> Event:
        """On the D2H lane, after ``after`` (typically a ``record()`` behind the compute that
        produces ``src``): ``dst.copy_(src)``; the event marks its end. ``src`` stays valid until
        then."""

    def collective(self, src: Source, issue: IssueCollective, after: Sequence[Event | None] = (),
                   release: bool = False) -> Event:
        """On the reduction lane after ``after``: ``issue(tensor)`` and wait for its work; the event
        marks the collective's end. ``release``: let go of a Ref's tensor once issued."""

    def bind_thread(self) -> None:
        """Make the calling thread's CUDA calls go to this backend's device (run first by
        every host worker thread: a CUDA call from a thread that never set its device goes to
        GPU 0 and creates a context there)."""

    def synchronize(self) -> None:
        """Block until every lane is idle; re-raises an error a lane hit."""

    def raise_errors(self) -> None:
        """Re-raise an error a lane has hit so far, without waiting (CUDA: errors surface at
        the next call that synchronises, as they do in torch)."""


class DoneEvent:
    """An event whose work has run (synchronous backends)."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = DoneEvent()


class CpuBackend:
    """Synchronous: the "device" is host memory; every call has finished when it returns."""

    asynchronous = False

    def __init__(self, reads_host: bool = True) -> None:
        """``reads_host=False``: copy weights into slots as a GPU run does (what tests of the
        streaming schedule count)."""
        self.device = torch.device("cpu")
        self.reads_host = reads_host
        self.copied_bytes = new_byte_counter()

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def launch(self, fn: Callable[[], None]) -> None:
        fn()

    def record(self) -> Event:
        return DONE

    def wait(self, events: Sequence[Event | None]) -> None:
        pass

    def copy_h2d(self, dst: torch.Tensor, src: Source, after: Sequence[Event | None] = ()) -> Event:
        dst.copy_(resolve(src).reshape(dst.shape))
        self.copied_bytes["h2d"] += nbytes_of(dst)
        return DONE

    def copy_d2h(self, dst: torch.Tensor, src: Source, after: Sequence[Event | None] = ()) -> Event:
        dst.copy_(resolve(src).reshape(dst.shape))
        self.copied_bytes["d2h"] += nbytes_of(dst)
        return DONE

    def collective(self, src: Source, issue: IssueCollective, after: Sequence[Event | None] = (),
                   release: bool = False) -> Event:
        run_collective(src, issue, release)
        return DONE

    def bind_thread(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def raise_errors(self) -> None:
        pass


class CudaBackend:
    """Compute on the current stream; H2D and D2H copies on streams of their own."""

    asynchronous = True
    reads_host = False

    def __init__(self, device: str | torch.device = "cuda"):
        if not torch.cuda.is_available():
            raise ValueError("CUDA backend requested but torch.cuda.is_available() is False; use device='cpu'")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self.reduce_stream: torch.cuda.Stream | None = None
        """The reduction lane (made at the first collective: data parallel only)."""
        self.copied_bytes = new_byte_counter()
        self._count_lock = threading.Lock()

    def _event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        ev = torch.cuda.Event(blocking=True)  # host waits sleep instead of spinning a core
        ev.record(stream)
        return ev

    @property
    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.device)

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # locked in place at its own size: torch's pinned allocator rounds every block up to a
        # power of two (the gradient ring of a 14B model would lock 4.3 GB for 2.2 GB of buffers)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        region, _ = alloc_pinned(nbytes)
        return region.view(dtype)

    def launch(self, fn: Callable[[], None]) -> None:
        fn()  # kernels are queued on the current stream

    def record(self) -> Event:
        return self._event(self._compute)

    def wait(self, events: Sequence[Event | None]) -> None:
        for ev in events:
            if ev is not None and not isinstance(ev, DoneEvent):
                self._compute.wait_event(ev)

    def _copy(self, lane: str, stream, dst, src, after) -> Event:
        with self._count_lock:  # counted as issued (every issued copy runs), from any thread
            self.copied_bytes[lane] += nbytes_of(dst)
        with torch.cuda.stream(stream):
            for ev in after:
                if ev is not None and not isinstance(ev, DoneEvent):
                    stream.wait_event(ev)
            t = resolve(src)
            dst.copy_(t.reshape(dst.shape), non_blocking=True)
            if t.is_cuda and not isinstance(src, HeldRef):
                t.record_stream(stream)  # allocator memory lives until copied (HeldRef: its owner's)
            return self._event(stream)

    def copy_h2d(self, dst: torch.Tensor, src: Source, after: Sequence[Event | None] = ()) -> Event:
        return self._copy("h2d", self.h2d_stream, dst, src, after)

    def copy_d2h(self, dst: torch.Tensor, src: Source, after: Sequence[Event | None] = ()) -> Event:
        return self._copy("d2h", self.d2h_stream, dst, src, after)

    def collective(self, src: Source, issue: IssueCollective, after: Sequence[Event | None] = (),
                   release: bool = False) -> Event:
        if self.reduce_stream is None:
            self.reduce_stream = torch.cuda.Stream(self.device)
        stream = self.reduce_stream
        with torch.cuda.stream(stream):
            for ev in after:
                if ev is not None and not isinstance(ev, DoneEvent):
                    stream.wait_event(ev)
            t = peek(src)
            work = issue(t)  # NCCL's stream waits for this one's position: behind `after`
            if work is not None:
                work.wait()  # this stream waits for NCCL's end; the host does not
            if t.is_cuda:
                # allocator memory (the head's fp32 gradient) is reused only after this stream's
                # work so far, the wait for NCCL's end included
                t.record_stream(stream)
            if release and isinstance(src, Ref):
                src.take()
            return self._event(stream)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def raise_errors(self) -> None:
        pass
