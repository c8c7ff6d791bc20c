"""The host side of a step, measured side by side in one run: gradient accumulation against a
plain copy, the optimizer's overlap with the next step's compute, and the H2D bytes a step moves.

- ``accumulation``: ``accum_bf16_into_fp32_gelems_s`` (``optim.grad_accum.accumulate``: bf16
  gradient into the fp32 host gradient, no temporary) next to ``copy_fp32_gelems_s``
  (``dst.copy_(src)``, fp32, the memory-speed yardstick) and the torch ``add_`` it replaces, at
  each thread count (target: accumulation >= 0.7 x the copy rate).
- ``optimizer_overlap``: on the asynchronous CPU backend (lanes as threads, no injected delays),
  the share of the host update time during which the next step's compute is queued or running
  on the compute lane (the lane's own timestamps; ``..._running`` counts running items only),
  with the update time and the next forward's compute time beside it (target >= 0.9 when the
  forward's compute >= the update time: the model and batch are chosen so). Beside them, the
  time the thread queuing device work waited for a gradient ring buffer, in all and while the
  compute lane had nothing queued (the ring starving the device).
- ``h2d_bytes``: bytes the H2D lane copied in one step (the backend's own counter) over the
  model's weight bytes, with ``embed_bwd`` reading no weights (after) and with it streaming the
  embedding again as it used to (before, the old behaviour switched back on for this run).
- ``nvme_page_cache``: host RAM the NVMe tier's boundaries hold in the page cache once written
  (the kernel's count, ``mmap`` + ``mincore``), as the tier writes them (``O_DIRECT``) and as a
  buffered write leaves them (``benchmarks/nvme_page_cache.py`` has the full comparison).

The headline figures (``accum_bf16_into_fp32_gelems_s`` and ``copy_fp32_gelems_s`` at the first
thread count, ``optimizer_overlap_fraction``, ``h2d_bytes_per_step_over_model_bytes``,
``nvme_tier_page_cache_bytes``) are also copied to the top level of the JSON.

Every figure is the median of 3 rounds. One function per measurement (``MEASUREMENTS``); each
returns the keys it adds to the one JSON object printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.models.names import EMBED
from layerwise.optim import grad_accum
from layerwise.plan import Plan
from layerwise.plan.program import FORWARD_OPS, Op, OpKind
from layerwise.store import HostStore
from layerwise.util import direct_io

ROUNDS = 3


def _median_rate(fn, numel: int, reps: int) -> float:
    """G elements/s of ``fn``: the median over ``ROUNDS`` of the best of ``reps`` calls."""
    rounds = []
    for _ in range(ROUNDS):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        rounds.append(numel / best / 1e9)
    return statistics.median(rounds)


def measure_accumulation(args) -> dict:
    numel = (1 << 23) if args.quick else (1 << 25)
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(numel, generator=g)
    src32 = torch.randn(numel, generator=g)
    src16 = src32.bfloat16()
    out = {"accum_numel": numel, "accum_kernel": grad_accum.kernel_name(dst, src16), "by_threads": {}}
    saved = torch.get_num_threads()
    for threads in args.threads:
        torch.set_num_threads(threads)  # the torch rows run at the same thread count
        row = {
            "copy_fp32_gelems_s": _median_rate(lambda: dst.copy_(src32), numel, 3),
            "accum_bf16_into_fp32_gelems_s": _median_rate(
                lambda: grad_accum.accumulate(dst, src16, threads=threads), numel, 3),
            "first_bf16_into_fp32_gelems_s": _median_rate(
                lambda: grad_accum.accumulate(dst, src16, first=True, threads=threads), numel, 3),
            "torch_add_bf16_gelems_s": _median_rate(lambda: dst.add_(src16), numel, 2),
            "accum_fp32_into_fp32_gelems_s": _median_rate(
                lambda: grad_accum.accumulate(dst, src32, threads=threads), numel, 3),
        }
        row["accum_over_copy"] = row["accum_bf16_into_fp32_gelems_s"] / row["copy_fp32_gelems_s"]
        row["accum_over_torch_add"] = (row["accum_bf16_into_fp32_gelems_s"]
                                       / row["torch_add_bf16_gelems_s"])
        out["by_threads"][str(threads)] = {k: round(v, 3) if isinstance(v, float) else v
                                           for k, v in row.items()}
    torch.set_num_threads(saved)
    out["target_accum_over_copy"] = 0.7
    return out


def _build(flavor: str, device: str, plan_of, **overrides):
    cfg = get_flavor(flavor).build_config(**overrides)
    model = build_hf_model(cfg, seed=0)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    engine = StreamingEngine(adapter, store, plan_of(adapter.num_layers),
                             EngineConfig(device=device, async_seed=None))
    return adapter, store, engine


def _batch(vocab: int, rows: int, seq: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def _tag_ops(engine: StreamingEngine) -> None:
    """Stamp every lane item with the op whose handler queued it (the dispatch table wrapped)."""
    backend = engine.backend
    for kind, handler in list(engine.handlers.ops.items()):
        def tagged(mb, i, handler=handler, kind=kind):
            backend.trace_tag = str(kind) if i < 0 else f"{kind} {i}"
            try:
                handler(mb, i)
            finally:
                backend.trace_tag = ""
        engine.handlers.ops[kind] = tagged


def _union_overlap(spans: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Seconds of ``spans`` covered by the union of ``busy``."""
    merged: list[list[float]] = []
    for a, b in sorted(busy):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for a, b in spans:
        for c, d in merged:
            total += max(0.0, min(b, d) - max(a, c))
    return total


def _overlap_round(engine: StreamingEngine, batch: Batch) -> dict:
    """One step's updates against the next step's compute (a ``compute_grads``, so no new
    updates overwrite the times)."""
    engine.train_step([batch])  # its updates start as it returns
    trace = engine.backend.start_trace()
    engine.sink.ring_wait_s = 0.0
    engine.sink.ring_waits.clear()
    engine.compute_grads([batch])
    engine.synchronize()
    engine.backend.stop_trace()
    spans = list(engine.updates.times.values())
    t0 = min(a for a, _ in spans)
    nxt = [it for it in trace if it.lane == "compute" and it.kind == "compute" and it.queued_s >= t0]
    forward = (str(OpKind.EMBED_FWD), *(str(k) for k in FORWARD_OPS))
    update_s = sum(b - a for a, b in spans)
    # when the host queued each unit's forward closure (the op's last compute item), after its
    # update ended: the host's wake-up and queuing latency, which no compute covers
    queued = {}
    for it in nxt:
        unit = EMBED if it.tag == str(OpKind.EMBED_FWD) else (
            f"layers.{it.tag.split()[-1]}" if it.tag.startswith(forward[1:]) else None)
        if unit is not None:
            queued[unit] = it.queued_s
    lag = [queued[u] - engine.updates.times[u][1] for u in queued]
    waits = list(engine.sink.ring_waits)
    lane_has_work = [(it.queued_s, it.end_s) for it in trace if it.lane == "compute"]
    return {
        "overlap_fraction": _union_overlap(spans, [(it.queued_s, it.end_s) for it in nxt]) / update_s,
        "overlap_running_fraction": _union_overlap(spans, [(it.start_s, it.end_s) for it in nxt]) / update_s,
        "update_s": update_s,
        "update_wall_s": max(b for _, b in spans) - t0,
        "next_forward_compute_s": sum(it.end_s - it.start_s for it in nxt if it.tag.startswith(forward)),
        "forward_queued_after_update_median_s": statistics.median(lag),
        "forward_queued_after_update_max_s": max(lag),
        "next_step_compute_s": sum(it.end_s - it.start_s for it in nxt),
        "ring_wait_s": engine.sink.ring_wait_s,
        "ring_wait_device_starved_s": sum(b - a for a, b in waits) - _union_overlap(waits, lane_has_work),
    }


def measure_optimizer_overlap(args) -> dict:
    # Only the next forward can overlap the updates (unit u's forward needs u's update), and the
    # first layer's update overlaps nothing but the embedding's gather: the bound is about
    # 1 - 1/(layers + 1) when each layer's forward outlasts the next layer's update. Hence many
    # layers, and enough tokens that a forward outlasts an update several times.
    seq, rows, layers = (128, 2, 10) if args.quick else (256, 2, 16)
    shape = dict(num_hidden_layers=layers)
    out = {"overlap_model": f"llama-30m with {layers} layers", "overlap_tokens": seq * rows,
           "by_threads": {}}
    saved = torch.get_num_threads()
    for threads in args.threads:
        torch.set_num_threads(threads)  # compute and the optimizer share these cores
        adapter, store, engine = _build("llama-30m", "cpu-async", Plan.keep_all, **shape)
        _tag_ops(engine)
        batch = _batch(adapter.vocab_size, rows, seq, seed=0)
        engine.train_step([batch])  # warm-up
        engine.synchronize()
        rounds = [_overlap_round(engine, batch) for _ in range(ROUNDS)]
        engine.close()
        row = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
        row["forward_over_update"] = row["next_forward_compute_s"] / row["update_s"]
        out["by_threads"][str(threads)] = {k: round(v, 4) for k, v in row.items()}
    torch.set_num_threads(saved)
    out["optimizer_overlap_fraction"] = out["by_threads"][str(args.threads[0])]["overlap_fraction"]
    out["target_overlap_fraction"] = 0.9
    return out


@contextlib.contextmanager
def _embed_bwd_streams_weights(engine: StreamingEngine):
    """The old ``embed_bwd``: the embedding's weights streamed in for it (the schedule names the
    unit, the handler acquires and releases it), for a before/after in one run."""
    old_units = Op.units

    def units(self, tied):
        return (EMBED,) if self.kind == OpKind.EMBED_BWD else old_units(self, tied)

    handler = engine.handlers.ops[OpKind.EMBED_BWD]

    def embed_bwd(mb, i):
        engine.streamer.acquire(EMBED)
        handler(mb, i)
        engine.streamer.release(EMBED)

    Op.units = units
    engine.handlers.ops[OpKind.EMBED_BWD] = embed_bwd
    try:
        yield
    finally:
        Op.units = old_units
        engine.handlers.ops[OpKind.EMBED_BWD] = handler


def measure_h2d_bytes(args) -> dict:
    vocab, micro = 8192, 2
    adapter, store, engine = _build("llama-30m", "cpu-async", lambda n: Plan.every_k(n, 1),
                                    num_hidden_layers=4, vocab_size=vocab)
    model_bytes = sum(b.copy_source.numel() * b.copy_source.element_size() for b in store)
    embed_bytes = store[EMBED].copy_source.numel() * store[EMBED].copy_source.element_size()
    batches = [_batch(vocab, 2, 32, seed=s) for s in range(micro)]

    def step_bytes() -> int:
        before = engine.backend.copied_bytes["h2d"]
        engine.train_step(batches)
        engine.synchronize()
        return engine.backend.copied_bytes["h2d"] - before

    after, before = [], []
    for _ in range(ROUNDS):  # interleaved
        after.append(step_bytes())
        with _embed_bwd_streams_weights(engine):
            before.append(step_bytes())
    engine.close()
    a, b = statistics.median(after), statistics.median(before)
    return {"h2d_model": f"llama-30m (4 layers, vocab {vocab}), every-1, {micro} micro-batches",
            "model_weight_bytes": model_bytes, "embed_weight_bytes": embed_bytes,
            "h2d_bytes_per_step_over_model_bytes": round(a / model_bytes, 4),
            "h2d_bytes_per_step_over_model_bytes_before": round(b / model_bytes, 4),
            "h2d_drop_over_embed_bytes": round((b - a) / embed_bytes, 4)}


def measure_nvme_page_cache(args) -> dict:
    import nvme_page_cache  # beside this file; reads and writes through the tier itself

    numel, count = ((2 << 20), 2) if args.quick else ((8 << 20), 4)
    runs = {mode: [] for mode in ("o_direct", "buffered_before")}
    with tempfile.TemporaryDirectory(prefix="host-path-nvme-") as spill:
        for _ in range(ROUNDS):
            for mode in runs:
                runs[mode].append(nvme_page_cache.after_writes(mode, spill, count, numel))
        fs = direct_io.filesystem_type(spill)
    med = {m: int(statistics.median(r["resident_bytes"] for r in rs)) for m, rs in runs.items()}
    return {"nvme_written_bytes": runs["o_direct"][0]["on_disk_bytes"], "nvme_filesystem": fs,
            "nvme_tier_page_cache_bytes": med["o_direct"],
            "nvme_page_cache_bytes_buffered_before": med["buffered_before"]}


MEASUREMENTS = {
    "accumulation": measure_accumulation,
    "optimizer_overlap": measure_optimizer_overlap,
    "h2d_bytes": measure_h2d_bytes,
    "nvme_page_cache": measure_nvme_page_cache,
}
"""Name -> function(args) returning the keys it adds; run in this order."""


def headline(out: dict, threads: int) -> None:
    """Copy the figures the issue names to the top level (those of the measurements that ran)."""
    row = out.get("accumulation", {}).get("by_threads", {}).get(str(threads), {})
    for key in ("accum_bf16_into_fp32_gelems_s", "copy_fp32_gelems_s"):
        if key in row:
            out[key] = row[key]
    for name, key in (("optimizer_overlap", "optimizer_overlap_fraction"),
                      ("h2d_bytes", "h2d_bytes_per_step_over_model_bytes"),
                      ("nvme_page_cache", "nvme_tier_page_cache_bytes")):
        if key in out.get(name, {}):
            out[key] = out[name][key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller buffers and batches (~1 minute)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--only", nargs="+", choices=sorted(MEASUREMENTS), default=None)
    args = ap.parse_args()
    out = {"benchmark": "host_path", "quick": args.quick, "rounds": ROUNDS,
           "load_avg_before": list(os.getloadavg())}
    for name, fn in MEASUREMENTS.items():
        if args.only is None or name in args.only:
            out[name] = fn(args)
    headline(out, args.threads[0])
    out["load_avg_after"] = list(os.getloadavg())
    out["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                      "torch": torch.__version__, "python": sys.version.split()[0],
                      "numba": grad_accum.numba_available()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
