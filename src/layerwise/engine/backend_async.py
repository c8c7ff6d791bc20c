"""AsyncCpuBackend: the GPU's protocol played on the CPU, to test the engine's ordering.

Each lane is a thread that sleeps a seeded random delay before each item, so lanes drift the way
streams do and a forgotten wait turns into wrong numbers in a test instead of passing by luck.
``start_trace`` records each item run (:class:`LaneItem`) for overlap checks."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .backend import (DONE, DoneEvent, Event, IssueCollective, Source, nbytes_of,
                      new_byte_counter, resolve, run_collective)

LANE_TIMEOUT_S = 120.0
"""A wait longer than this is a deadlock in the engine's ordering; fail instead of hanging."""


class LaneItem(NamedTuple):
    """One item a lane ran, with ``time.perf_counter()`` times."""

    lane: str
    kind: str
    """``compute`` (a launched closure), ``wait`` (the compute lane waiting on events),
    ``record`` (an event marker) or ``copy``."""
    queued_s: float
    start_s: float
    end_s: float
    tag: str = ""
    """The backend's ``trace_tag`` when the item was queued (e.g. the op a caller is running)."""


class ThreadEvent:
    def __init__(self) -> None:
        self._ev = threading.Event()

    def set(self) -> None:
        self._ev.set()

    def synchronize(self) -> None:
        if not self._ev.wait(LANE_TIMEOUT_S):
            raise RuntimeError("event never completed: the engine's lanes wait on each other")

    def query(self) -> bool:
        return self._ev.is_set()


def _wait_all(events: Sequence[Event | None]) -> None:
    for ev in events:
        if ev is not None and not isinstance(ev, DoneEvent):
            ev.synchronize()


class _Lane:
    def __init__(self, name: str, rng: random.Random, max_delay_s: float, errors: list[BaseException],
                 delay_probability: float = 0.5):
        self.name = name
        self._rng = rng
        self._max_delay_s = max_delay_s
        self._delay_probability = delay_probability
        self._errors = errors
        self._queue: queue.Queue = queue.Queue()
        self.trace: list[LaneItem] | None = None
        """Where the lane appends the items it runs (None: not tracing)."""
        self.thread = threading.Thread(target=self._loop, name=f"lane-{name}", daemon=True)
        self.thread.start()

    def put(self, fn: Callable[[], None], done: ThreadEvent | None = None, kind: str = "compute",
            tag: str = "") -> None:
        self._queue.put((fn, done, kind, tag, time.perf_counter()))

    def _loop(self) -> None:
        while True:
            fn, done, kind, tag, queued_s = self._queue.get()
            try:
                if fn is None:
                    return
                if self._max_delay_s and self._rng.random() < self._delay_probability:
                    time.sleep(self._rng.uniform(0, self._max_delay_s))
                if not self._errors:  # after an error, only release waiters
                    start_s = time.perf_counter()
                    fn()
                    trace = self.trace
                    if trace is not None:
                        trace.append(LaneItem(self.name, kind, queued_s, start_s, time.perf_counter(), tag))
            except BaseException as e:  # noqa: BLE001  (re-raised on the host at synchronize)
                self._errors.append(e)
            finally:
                if done is not None:
                    done.set()
                self._queue.task_done()

    def drain(self) -> None:
        self._queue.join()

    def close(self) -> None:
        self._queue.put((None, None, "", "", 0.0))
        self.thread.join()


class AsyncCpuBackend:
    """Lanes as threads with seeded delays; device memory is host memory allocated once."""

    asynchronous = True
    reads_host = False

    def __init__(self, seed: int | None = 0, max_delay_s: float = 0.004,
                 lane_delays_s: dict[str, float] | None = None):
        """``seed``: each lane's pace per seed (idle, quick or slow, up to ``max_delay_s``), so
        every lane sometimes lags far behind; None: no delays. ``lane_delays_s``: per-lane delays
        instead."""
        self.device = torch.device("cpu")
        rng = random.Random(seed)
        self._errors: list[BaseException] = []
        self._lanes = {}
        for name in ("compute", "h2d", "d2h"):
            lane_rng = random.Random(rng.random())
            if lane_delays_s is not None:
                delay, probability = lane_delays_s.get(name, 0.0), 1.0
            else:
                delay, probability = (rng.choice((0.0, 0.2, 1.0)) * max_delay_s if seed is not None else 0.0), 0.5
            self._lanes[name] = _Lane(name, lane_rng, delay, self._errors, probability)
        for name in ("h2d", "d2h"):  # after the three above: their per-seed paces stay the same
            parent = self._lanes[name]
            self._lanes[f"{name}<-compute"] = _Lane(
                f"{name}<-compute", random.Random(rng.random()), parent._max_delay_s, self._errors,
                parent._delay_probability)
        self._rng = rng
        self._lane_delays_s = lane_delays_s
        self._max_delay_s = max_delay_s if seed is not None else 0.0
        self.allocated_bytes = 0
        """Bytes of device slots allocated so far (the device memory the engine asked for)."""
        self._lane_bytes = {name: 0 for name in self._lanes}
        """Bytes each lane has copied, counted by that lane's thread as it runs the copy."""
        self.trace_tag = ""
        """Stamped on each item queued from now on (read back in :class:`LaneItem`)."""

    @property
    def copied_bytes(self) -> dict[str, int]:
        """Bytes copied per direction (``h2d``, ``d2h``), over the host's and compute's lanes."""
        out = new_byte_counter()
        for lane, n in self._lane_bytes.items():
            direction = lane.split("<-")[0]
            if direction in out:
                out[direction] += n
        return out

    def start_trace(self) -> list[LaneItem]:
        """From now on every lane appends each item it runs to the returned list."""
        trace: list[LaneItem] = []
        for lane in self._lanes.values():
            lane.trace = trace
        return trace

    def stop_trace(self) -> None:
        for lane in self._lanes.values():
            lane.trace = None

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Device memory in the compute lane's order: the host waits until compute has run what it
        queued, as on CUDA, or it would hold new memory beside what compute has not freed yet."""
        if not self._on_compute_lane():
            self._lanes["compute"].drain()
        t = torch.empty(numel, dtype=dtype)
        self.allocated_bytes += t.untyped_storage().nbytes()
        return t

    def host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def _queue(self, lane: str, fn: Callable[[], None], kind: str) -> ThreadEvent:
        ev = ThreadEvent()
        self._lanes[lane].put(fn, ev, kind, self.trace_tag)
        return ev

    def launch(self, fn: Callable[[], None]) -> None:
        self._lanes["compute"].put(fn, tag=self.trace_tag)

    def _on_compute_lane(self) -> bool:
        return threading.current_thread() is self._lanes["compute"].thread

    def record(self) -> Event:
        if self._on_compute_lane():  # inside a compute item: the lane's work so far has run
            return DONE
        return self._queue("compute", lambda: None, "record")

    def wait(self, events: Sequence[Event | None]) -> None:
        events = list(events)
        if self._on_compute_lane():  # inside a compute item: the lane waits right here
            _wait_all(events)
            return
        self._lanes["compute"].put(lambda: _wait_all(events), kind="wait", tag=self.trace_tag)

    def call_on_lanes(self, fn: Callable[[], object]) -> dict[str, object]:
        """Run ``fn`` on every lane's thread (behind the work queued so far) and return what it
        returned, by lane: per-thread state such as a profiler (``engine/memory_probe.py``)."""
        out: dict[str, object] = {}
        events = [self._queue(name, lambda name=name: out.__setitem__(name, fn()), "call")
                  for name in self._lanes]
        _wait_all(events)
        return out

    def _copy(self, lane: str, dst: torch.Tensor, src: Source, after: Sequence[Event | None]) -> Event:
        after = list(after)
        if self._on_compute_lane():
            # queued from a running compute item: on CUDA it would sit among the copies the host
            # queued up to that item's launch; at the end of this lane's queue it would sit behind
            # copies waiting for later compute, which may wait for it (the offload window). A lane
            # of its own keeps every declared ordering and no false one.
            lane = f"{lane}<-compute"

        def run() -> None:
            _wait_all(after)
            dst.copy_(resolve(src).reshape(dst.shape))
            self._lane_bytes[lane] += nbytes_of(dst)  # only this lane's thread writes its entry

        return self._queue(lane, run, "copy")

    def copy_h2d(self, dst: torch.Tensor, src: Source, after: Sequence[Event | None] = ()) -> Event:
        return self._copy("h2d", dst, src, after)

    def copy_d2h(self, dst: torch.Tensor, src: Source, after: Sequence[Event | None] = ()) -> Event:
        return self._copy("d2h", dst, src, after)

    def collective(self, src: Source, issue: IssueCollective, after: Sequence[Event | None] = (),
                   release: bool = False) -> Event:
        after = list(after)
        if "reduce" not in self._lanes:  # made on first use: the other lanes' paces stay the seed's
            self._lanes["reduce"] = self._reduce_lane()
            self._lanes["reduce"].trace = self._lanes["compute"].trace

        def run() -> None:
            _wait_all(after)
            run_collective(src, issue, release)

        return self._queue("reduce", run, "collective")

    def _reduce_lane(self) -> _Lane:
        rng = random.Random(self._rng.random())
        if self._lane_delays_s is not None:
            return _Lane("reduce", rng, self._lane_delays_s.get("reduce", 0.0), self._errors, 1.0)
        return _Lane("reduce", rng, rng.choice((0.0, 0.2, 1.0)) * self._max_delay_s, self._errors)

    def bind_thread(self) -> None:
        pass

    def synchronize(self) -> None:
        for lane in self._lanes.values():  # compute first: its items may queue copies
            lane.drain()
        self.raise_errors()

    def raise_errors(self) -> None:
        if self._errors:
            err = self._errors[0]
            self._errors.clear()
            raise err

    def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
