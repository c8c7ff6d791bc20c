"""The host optimizer in every configuration the engine runs, against this machine's
memory roofline, at 1 and 2 threads.

    python benchmarks/host_optimizer.py [--quick]

Configurations: moments (fp32 ``HostAdamW`` / 8-bit ``HostAdamW8bit``) × gradient (fp32 / bf16)
× master (plain fp32 / split into its bf16 copy and a 16-bit remainder) × clip (coefficient 1 /
0.5), over the decoder layers of ``llama-30m`` (the units the engine steps), through
``step_unit`` — the call the engine makes. The default of one landing per step is
``8bit-bf16grad-split``.

Prints one JSON object: per configuration and thread count, Gparam/s (median of 3 interleaved
rounds) and the fraction of the roofline: the bytes the step must touch per parameter (master
read + written: 8; gradient read: 4 or 2; moments read + written: 16 or 4) × the parameters /
this machine's streaming rate at that thread count (``stream_gbps``: an in-place fp32
``a += b * c`` over one unit's elements, timed in each round beside the runs, their median). Summary keys: ``min_roofline_fraction_1thread``,
``min_speedup_2threads`` (over configurations), ``default_over_fp32_path`` (the default's rate
over ``8bit-fp32grad-plain``'s, 1 thread), and the load average before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time

import torch

from layerwise.models import DecoderAdapter, get_flavor
from layerwise.optim import _kernel
from layerwise.optim.adamw import HostAdamW
from layerwise.optim.adamw8bit import HostAdamW8bit
from layerwise.optim.config import AdamWConfig
from layerwise.planner.host_rates import CONFIGS, bytes_per_param, config_name
from layerwise.store import HostStore

CONFIG = AdamWConfig(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def configs() -> list[tuple[str, str, str, float]]:
    """(moments, gradient, master, clip coefficient) of every run: the planner's configurations
    (``plan.host_rates.CONFIGS``, whose per-core rates come from this benchmark) x clip off / on."""
    return [(m, g, master, clip) for m, g, master in CONFIGS for clip in (1.0, 0.5)]


def stream_gbps(threads: int, numel: int) -> float:
    """GB/s of an in-place fp32 ``a += b * c`` over ``numel`` elements at ``threads`` intra-op
    threads (3 streams read, 1 written: 16 bytes an element; best of 5): the streaming rate of
    read-modify-write passes like the optimizer's (a plain copy, one stream each way, streams
    slower per core on this machine)."""
    torch.set_num_threads(threads)
    a, b, c = (torch.randn(numel) * 1e-3 for _ in range(3))
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a.addcmul_(b, c)
        best = min(best, time.perf_counter() - t0)
    return 16 * numel / best / 1e9


def make_store(adapter: DecoderAdapter, grad: str, master: str) -> HostStore:
    # bf16 compute, as on a GPU: a plain master has its fp32 copy beside the bf16 copy source
    store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False,
                      split_master=master == "split",
                      grad_dtype=torch.bfloat16 if grad == "bf16" else torch.float32)
    gen = torch.Generator().manual_seed(0)
    for buf in store.layers:
        buf.write_master(torch.randn(buf.layout.numel, generator=gen) * 0.02)
        buf.grad.copy_(torch.randn(buf.layout.numel, generator=gen) * 1e-3)
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one round instead of three")
    ap.add_argument("--flavor", default="llama-30m")
    args = ap.parse_args()
    load_before = os.getloadavg()
    adapter = DecoderAdapter(get_flavor(args.flavor).build_config())
    rounds = 1 if args.quick else 3
    threads = (1, 2)
    runs = {}
    for moments, grad, master, clip in configs():
        store = make_store(adapter, grad, master)
        for t in threads:
            opt = HostAdamW(CONFIG) if moments == "fp32" else HostAdamW8bit(CONFIG, num_threads=t)
            for buf in store.layers:
                opt.init_state(buf)
            runs[(moments, grad, master, clip, t)] = (store, opt)
    params = sum(b.layout.numel for b in next(iter(runs.values()))[0].layers)
    times = {k: [] for k in runs}
    # over one unit's elements: the rate the data of one ``step_unit`` call streams at
    unit_numel = max(b.layout.numel for b in next(iter(runs.values()))[0].layers)
    streams = {t: [] for t in threads}
    for _ in range(rounds):
        for t in threads:  # the roofline timed in each round beside the runs: this VM's rate drifts ~1.5x
            streams[t].append(stream_gbps(t, unit_numel))
        for key, (store, opt) in runs.items():  # interleaved: each round times every run once
            torch.set_num_threads(key[-1])
            opt.step_unit(store.layers[0], 1e-4, key[3])  # warm (compile, caches)
            t0 = time.perf_counter()
            for buf in store.layers:
                opt.step_unit(buf, 1e-4, key[3])
            times[key].append(time.perf_counter() - t0)
    rates = {t: statistics.median(r) for t, r in streams.items()}
    out = {}
    for (moments, grad, master, clip, t), ts in times.items():
        name = config_name(moments, grad, master, clip != 1.0)
        s = statistics.median(ts)
        gps = params / s / 1e9
        roof = rates[t] / bytes_per_param(moments, grad)
        out.setdefault(name, {})[f"{t}thread"] = {
            "gparam_per_s": round(gps, 3), "roofline_gparam_per_s": round(roof, 3),
            "roofline_fraction": round(gps / roof, 3)}
    one = {n: r["1thread"]["roofline_fraction"] for n, r in out.items()}
    speedup = {n: r["2thread"]["gparam_per_s"] / r["1thread"]["gparam_per_s"] for n, r in out.items()}
    print(json.dumps({
        "benchmark": "host_optimizer", "flavor": args.flavor, "params": params, "rounds": rounds,
        "kernel": _kernel.kernel_name(torch.device("cpu")),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "stream_gbps": {f"{t}thread": round(r, 2) for t, r in rates.items()},
        "bytes_per_param": {f"{m}-{g}grad": bytes_per_param(m, g)
                            for m, g in itertools.product(("fp32", "8bit"), ("fp32", "bf16"))},
        "configs": out,
        "min_roofline_fraction_1thread": round(min(one.values()), 3),
        "min_speedup_2threads": round(min(speedup.values()), 3),
        "speedup_2threads": {n: round(v, 3) for n, v in speedup.items()},
        "default_over_fp32_path": round(out["8bit-bf16grad-split"]["1thread"]["gparam_per_s"]
                                        / out["8bit-fp32grad-plain"]["1thread"]["gparam_per_s"], 3),
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
    }, indent=1))


if __name__ == "__main__":
    main()
