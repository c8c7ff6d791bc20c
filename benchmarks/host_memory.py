"""Host bytes per parameter of a training store, measured from the process's memory.

For each case (8-bit or fp32 moments; one micro-batch per step, or 8 in layer-major order (one
group sharing each weight load), where the bf16 device gradient lands once a step in bf16; or 8
in micro-batch-major order, accumulated into fp32 gradients), a child process builds a
HostStore of a >= 100M-parameter llama-style model with bf16 compute (split fp32 master), writes
every weight, creates the optimizer state, writes every gradient and runs one optimizer update
over every unit, so every page of the store has been touched. The figure is the child's RSS
growth over all that (``/proc/self/statm``, read before the store exists and after the update)
divided by the parameter count; beside it the store's own allocations (the live buffers' bytes)
and the footprint formula (``store_footprint``, nothing allocated), and the formula's error
against the RSS measurement.

The store's gradient dtype comes from the case's plan as the trainer takes it
(``Plan.lands_once``): bf16 when every gradient lands once a step.

``weight_bytes_per_step_over_model_bytes_layer_major``: the asynchronous CPU backend's own H2D
byte counter over one training step of 8 micro-batches (every boundary on the device, so the
lane carries weights only) divided by the model's copy-source bytes, in layer-major order;
beside it the same in micro-batch-major order, and the bytes a step copies with half the layers
resident minus those without them (each resident layer's one refresh less its streamed copies).
A small model in fp32 on the CPU (the ratio does not depend on the size).

    python benchmarks/host_memory.py [--quick]

prints one JSON object. ``--quick``: without the micro-batch-major accumulation cases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASES = {"8bit": ("8bit", 1, 1), "fp32": ("fp32", 1, 1),
         "8bit_layer_major": ("8bit", 8, 8), "fp32_layer_major": ("fp32", 8, 8),
         "8bit_accum": ("8bit", 8, 1), "fp32_accum": ("fp32", 8, 1)}
"""Case -> (moments, micro-batches per step, micro-batches per weight load)."""


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
    from layerwise.plan.plan import Plan
    from layerwise.store import store_footprint

    moments, micro_batches, per_load = CASES[case]
    torch.set_num_threads(1)
    adapter = DecoderAdapter(_config())
    plan = Plan(["device"] * adapter.num_layers, num_micro_batches=micro_batches,
                micro_batches_per_load=per_load)
    grad_dtype = torch.bfloat16 if plan.lands_once() else torch.float32
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
            "micro_batches_per_load": per_load, "grad_dtype": str(grad_dtype).split(".")[-1],
            "num_params": numel, "rss_delta_bytes": rss1 - rss0,
            "store_alloc_bytes": live.total, "formula_bytes": formula.total,
            "host_bytes_per_param": round((rss1 - rss0) / numel, 3),
            "store_alloc_bytes_per_param": round(live.total / numel, 3),
            "formula_bytes_per_param": round(formula.total / numel, 3),
            "footprint_error_pct": round(100 * (formula.total - (rss1 - rss0)) / (rss1 - rss0), 3)}


def weight_copy_ratios(micro_batches: int = 8) -> dict:
    """H2D bytes of one step (the copy lane's counter) / model copy-source bytes, per order."""
    import torch

    from layerwise.engine import EngineConfig, StreamingEngine
    from layerwise.engine.batch import Batch
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.models.init import build_hf_model
    from layerwise.plan.plan import Plan
    from layerwise.store import HostStore

    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=4, hidden_size=128,
                                                 intermediate_size=256, vocab_size=2048)
    model = build_hf_model(cfg, seed=0)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2 * micro_batches, 2, 33), generator=gen)
    steps = [[Batch(ids[s * micro_batches + k, :, :-1].contiguous(),
                    ids[s * micro_batches + k, :, 1:].contiguous()) for k in range(micro_batches)]
             for s in range(2)]
    n = cfg.num_hidden_layers

    def step_bytes(per_load: int, resident: list[int]) -> tuple[int, int]:
        adapter = DecoderAdapter(cfg)
        store = HostStore(adapter)
        store.copy_from_model(model)
        plan = Plan(["device"] * n, num_micro_batches=micro_batches,
                    micro_batches_per_load=per_load, resident_layers=resident)
        engine = StreamingEngine(adapter, store, plan, EngineConfig(device="cpu-async"))
        try:
            engine.train_step(steps[0])  # the second step: refreshes after a real update
            engine.synchronize()
            engine.backend.synchronize()
            before = engine.backend.copied_bytes["h2d"]
            engine.train_step(steps[1])
            engine.backend.synchronize()
            return engine.backend.copied_bytes["h2d"] - before, store.copy_source_nbytes()
        finally:
            engine.close()

    lm, model_bytes = step_bytes(micro_batches, [])
    mb, _ = step_bytes(1, [])
    half = list(range(0, n, 2))
    lm_res, _ = step_bytes(micro_batches, half)
    adapter = DecoderAdapter(cfg)
    resident_bytes = sum(HostStore(adapter).copy_source(f"layers.{i}").nbytes for i in half)
    return {"weight_bytes_per_step_over_model_bytes_layer_major": round(lm / model_bytes, 4),
            "weight_bytes_per_step_over_model_bytes_micro_batch_major": round(mb / model_bytes, 4),
            "copy_ratio_micro_batches": micro_batches,
            "copy_ratio_model_copy_bytes": model_bytes,
            "resident_layers": half,
            "resident_layers_copy_bytes": resident_bytes,
            "step_h2d_bytes_layer_major": lm,
            "step_h2d_bytes_layer_major_resident": lm_res}


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
    cases = [c for c in CASES if not (args.quick and c.endswith("_accum"))]
    got = {c: _child(c) for c in cases}
    out = {
        "num_params": got["8bit"]["num_params"],
        "compute_dtype": "bfloat16", "master": "split fp32 (bf16 copy + int16 remainder)",
        "host_bytes_per_param_8bit": got["8bit"]["host_bytes_per_param"],
        "host_bytes_per_param_fp32": got["fp32"]["host_bytes_per_param"],
        "footprint_error_pct": max(abs(r["footprint_error_pct"]) for r in got.values()),
        "host_bytes_per_param_8bit_layer_major": got["8bit_layer_major"]["host_bytes_per_param"],
        "host_bytes_per_param_fp32_layer_major": got["fp32_layer_major"]["host_bytes_per_param"],
        **weight_copy_ratios(),
        "load_average": open("/proc/loadavg").read().split()[:3],
        "cases": got,
    }
    for c in ("8bit_accum", "fp32_accum"):
        if c in got:
            out[f"host_bytes_per_param_{c}"] = got[c]["host_bytes_per_param"]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
