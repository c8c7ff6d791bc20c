"""A profiled step's copies against its kernels, from ``torch.profiler``'s chrome trace: interval
arithmetic and the copy/compute overlap. Standard library only (tested on the CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GB = 10**9


# ----- interval arithmetic ---------------------------------------------------------------------

def merge_intervals(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``[start, end)`` intervals, as sorted disjoint intervals."""
    out: list[tuple[float, float]] = []
    for s, e in sorted((s, e) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def measure(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``intervals``."""
    return sum(e - s for s, e in merge_intervals(intervals))


def intersect_measure(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union of ``a``) ∩ (union of ``b``): |A| + |B| − |A ∪ B|."""
    return max(0.0, measure(a) + measure(b) - measure(a + b))


# ----- profiler trace analysis -----------------------------------------------------------------

def load_trace_events(path: str | Path) -> list[dict[str, Any]]:
    """Complete events (``"ph": "X"``) of a trace written by ``torch.profiler``'s
    ``export_chrome_trace``."""
    with open(path) as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]


def _stream_of(event: dict[str, Any]) -> Any:
    args = event.get("args") or {}
    if "stream" in args:
        return args["stream"]
    tid = event.get("tid")
    if isinstance(tid, str) and tid.startswith("stream "):
        tid = tid[len("stream "):]
    try:
        return int(tid)
    except (TypeError, ValueError):
        return tid


def gpu_activity(events: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kernels, copies) of a chrome trace; each ``{start_s, end_s, stream, name, bytes}``.

    Kineto writes GPU kernels with ``cat`` ``kernel`` and copies with ``gpu_memcpy`` (``Memcpy``
    in older versions); ``ts``/``dur`` are microseconds; ``args.stream`` is the CUDA stream and
    ``args.bytes`` a copy's size. Memsets are neither compute nor copies and are left out.
    """
    kernels, copies = [], []
    for e in events:
        cat = str(e.get("cat", "")).lower()
        if cat not in ("kernel", "gpu_memcpy", "memcpy"):
            continue
        start = float(e["ts"]) * 1e-6
        end = start + float(e.get("dur", 0.0)) * 1e-6
        args = e.get("args") or {}
        rec = {"start_s": start, "end_s": end, "stream": _stream_of(e), "name": str(e.get("name", "")),
               "bytes": args.get("bytes")}
        (kernels if cat == "kernel" else copies).append(rec)
    return kernels, copies


def copy_direction(name: str) -> str:
    """``h2d``, ``d2h``, ``d2d`` or ``other`` from a kineto memcpy name
    (e.g. ``Memcpy HtoD (Pinned -> Device)``)."""
    return next((d for k, d in (("HtoD", "h2d"), ("DtoH", "d2h"), ("DtoD", "d2d")) if k in name), "other")


def copy_overlap(events: list[dict[str, Any]]) -> dict[str, Any]:
    """How the copies of a profiled window sit against its compute kernels.

    The compute stream is the stream with the most kernel time (the engine computes on the
    current stream). Copies on any other stream are the engine's asynchronous copies: per
    direction, their count, bytes, busy seconds (sum of durations), union seconds, bandwidth
    while copying (bytes / busy seconds), and the part of their union that overlaps the union of
    all kernels (``overlap_fraction``: 1.0 means every copy was hidden behind compute). Copies
    on the compute stream serialise with compute and are reported apart.
    """
    kernels, copies = gpu_activity(events)
    kernel_time: dict[Any, float] = {}
    for k in kernels:
        kernel_time[k["stream"]] = kernel_time.get(k["stream"], 0.0) + k["end_s"] - k["start_s"]
    compute_stream = max(kernel_time, key=kernel_time.get) if kernel_time else None
    compute_iv = [(k["start_s"], k["end_s"]) for k in kernels]
    everything = compute_iv + [(c["start_s"], c["end_s"]) for c in copies]
    window = (max(e for _, e in everything) - min(s for s, _ in everything)) if everything else 0.0
    compute_union = measure(compute_iv)
    out: dict[str, Any] = {
        "compute_stream": compute_stream,
        "kernel_streams": sorted(kernel_time, key=str),
        "kernels": len(kernels),
        "compute_busy_s": compute_union,
        "window_s": window,
        "compute_idle_fraction": (1.0 - compute_union / window) if window > 0 else None,
    }

    def summarise(group: list[dict[str, Any]]) -> dict[str, Any]:
        iv = [(c["start_s"], c["end_s"]) for c in group]
        busy = sum(e - s for s, e in iv)
        union = measure(iv)
        overlap = intersect_measure(iv, compute_iv)
        nbytes = sum(int(c["bytes"]) for c in group if isinstance(c["bytes"], (int, float)))
        return {
            "count": len(group),
            "bytes": nbytes,
            "busy_s": busy,
            "union_s": union,
            "gbps_active": (nbytes / busy / GB) if busy > 0 else None,
            "overlap_s": overlap,
            "overlap_fraction": (overlap / union) if union > 0 else None,
            "streams": sorted({c["stream"] for c in group}, key=str),
        }

    side = [c for c in copies if c["stream"] != compute_stream]
    for direction in ("h2d", "d2h"):
        out[direction] = summarise([c for c in side if copy_direction(c["name"]) == direction])
    out["all_async_copies"] = summarise(side)
    out["copies_on_compute_stream"] = summarise([c for c in copies if c["stream"] == compute_stream])
    out["pageable_copies"] = sum(1 for c in copies if "Pageable" in c["name"])
    return out
