"""Host bytes per parameter of a training store, measured from the process's memory.

For each case (8-bit or fp32 moments; one micro-batch per step, where the bf16 device gradient
lands in bf16, or micro-batch-major accumulation into fp32 gradients), a child process builds a
HostStore of a >= 100M-parameter llama-style model with bf16 compute (split fp32 master), writes
every weight, creates the optimizer state, writes every gradient and runs one optimizer update
over every unit, so every page of the store has been touched. The figure is the child's RSS
growth over all that (``/proc/self/statm``, read before the store exists and after the update)
divided by the parameter count; beside it the store's own allocations (the live buffers' bytes)
and the footprint formula (``store_footprint``, nothing allocated), and the formula's error
against the RSS measurement.

Not measured here (issue 21 items 3-4, not built): layer-major accumulation and resident
weights, so ``weight_bytes_per_step_over_model_bytes_layer_major`` is absent.

    python benchmarks/host_memory.py [--quick]

prints one JSON object. ``--quick``: the 8-bit and fp32 one-micro-batch cases only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASES = {"8bit": ("8bit", 1), "fp32": ("fp32", 1), "8bit_accum": ("8bit", 8), "fp32_accum": ("fp32", 8)}
"""Case -> (moments, micro-batches per step)."""


def _config():
    from transformers import LlamaConfig

    # ~134M parameters: 12 layers of 768 (MLP 2048), a 32000-token vocabulary, untied head
    return LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, vocab_size=32000,
                       max_position_embeddings=512, tie_word_embeddings=False)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_CHUNK = 1 << 16
"""Elements of random values drawn at a time: no temporary of a whole tensor in the RSS."""


def _fill(adapter, opt, grad_dtype, gen, scratch):
    """A store with every weight, gradient and moment written (one update of every unit)."""
    import torch

    from layerwise.store import HostStore

    store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False, grad_dtype=grad_dtype)
    for b in store:
        n = b.layout.numel
        for a in range(0, n, _CHUNK):
            e = min(a + _CHUNK, n)
            b.write_master(torch.randn(e - a, generator=gen, out=scratch[:e - a]).mul_(0.02), a)
            b.grad[a:e].copy_(torch.randn(e - a, generator=gen, out=scratch[:e - a]).mul_(1e-3))
        opt.init_state(b)
        opt.step_unit(b, 1e-4, 1.0)  # writes the moments (every page of the state)
    return store


def measure(case: str) -> dict:
    """One case, in this process (run it in a fresh one: ``--case``)."""
    import torch

    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.optim.adamw import AdamWConfig, HostAdamW
    from layerwise.optim.adamw8bit import HostAdamW8bit
    from layerwise.store import store_footprint

    moments, micro_batches = CASES[case]
    torch.set_num_threads(1)
    adapter = DecoderAdapter(_config())
    grad_dtype = torch.bfloat16 if micro_batches == 1 else torch.float32
    opt = (HostAdamW8bit if moments == "8bit" else HostAdamW)(AdamWConfig(lr=1e-4))
    gen = torch.Generator().manual_seed(0)
    numel = sum(len_ for len_ in (p.numel for u in adapter.units for p in u.params))
    state = sum(opt.state_nbytes(n) for n in (sum(p.numel for p in u.params) for u in adapter.units))
    formula = store_footprint(adapter, torch.bfloat16, pin=False, state_nbytes=state,
                              grad_dtype=grad_dtype)
    scratch = torch.empty(_CHUNK)
    _fill(DecoderAdapter(get_flavor("llama-debug").build_config()), opt, grad_dtype, gen,
          scratch)  # warm-up: the kernels loaded, the scratch allocated, before the baseline
    rss0 = _rss_bytes()
    store = _fill(adapter, opt, grad_dtype, gen, scratch)
    rss1 = _rss_bytes()
    live = store.footprint()
    assert live.numel == numel
    return {"case": case, "moments": moments, "micro_batches": micro_batches,
            "num_params": numel, "rss_delta_bytes": rss1 - rss0,
            "store_alloc_bytes": live.total, "formula_bytes": formula.total,
            "host_bytes_per_param": round((rss1 - rss0) / numel, 3),
            "store_alloc_bytes_per_param": round(live.total / numel, 3),
            "formula_bytes_per_param": round(formula.total / numel, 3),
            "footprint_error_pct": round(100 * (formula.total - (rss1 - rss0)) / (rss1 - rss0), 3)}


def _child(case: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"))
    out = subprocess.run([sys.executable, __file__, "--case", case], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one-micro-batch cases only")
    ap.add_argument("--case", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.case:
        print(json.dumps(measure(args.case)))
        return
    cases = ["8bit", "fp32"] if args.quick else list(CASES)
    got = {c: _child(c) for c in cases}
    out = {
        "num_params": got["8bit"]["num_params"],
        "compute_dtype": "bfloat16", "master": "split fp32 (bf16 copy + int16 remainder)",
        "host_bytes_per_param_8bit": got["8bit"]["host_bytes_per_param"],
        "host_bytes_per_param_fp32": got["fp32"]["host_bytes_per_param"],
        "footprint_error_pct": max(abs(r["footprint_error_pct"]) for r in got.values()),
        "not_measured": "weight_bytes_per_step_over_model_bytes_layer_major (layer-major "
                        "accumulation is issue 21 item 3, not built)",
        "load_average": open("/proc/loadavg").read().split()[:3],
        "cases": got,
    }
    for c in ("8bit_accum", "fp32_accum"):
        if c in got:
            out[f"host_bytes_per_param_{c}"] = got[c]["host_bytes_per_param"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
