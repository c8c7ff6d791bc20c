"""Issue 4: the hybrid 8-bit AdamW — state size, CPU step time side by side, eval loss.

    python benchmarks/optim.py [--quick]

Prints one JSON object:

- ``state_bytes_per_param``: 8-bit moments (codes + block scales) per parameter of a large
  tensor (fp32 AdamW: 8).
- ``step_ratio_vs_*``: our 8-bit step time / another optimizer's step time on the same
  ~50M parameters, timed interleaved (round-robin) in this run; median of the rounds. At
  torch's default thread count and at one thread (``*_1thread``). ``*_with_clip`` compares
  ``AdamW8bit(max_grad_norm=1)`` with ``clip_grad_norm_`` + fused AdamW. An optimizer that
  cannot run gives a reason string instead of a number.
- ``eval_loss_fp32`` / ``eval_loss_8bit`` / ``eval_loss_delta_pct``: a small Llama trained on the
  built-in corpus with ``torch.optim.AdamW`` vs ``AdamW8bit`` (same seed, data and clip),
  evaluated on held-out text. Trained at one thread: the machine's cores are shared and
  intra-op threads then mostly wait on each other.
- ``quant_error``: the update-direction error (``m / sqrt(v)``) each quantisation map makes
  on the trained model's real moments, and ``block_size_sweep``: that error and the step time
  per block size (how the defaults were chosen).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time
import warnings

import torch

from layerwise.models.registry import FAMILIES, get_flavor
from layerwise.optim import _kernel, quant
from layerwise.optim.adamw8bit import AdamW8bit
from layerwise.engine.batch import IGNORE_INDEX
from layerwise.train.data import batches, corpus_tokens

ADAM = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_avg_1m": os.getloadavg()[0],
        "kernel": _kernel.kernel_name(torch.device("cpu")),
    }


# ----- step time ----------------------------------------------------------------------------

def _params(total: int, seed: int = 0) -> list[torch.nn.Parameter]:
    """~``total`` parameters as 2048-wide matrices (a model's weight shapes), grads filled."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2048
    out = []
    while sum(p.numel() for p in out) < total:
        p = torch.nn.Parameter(torch.randn(rows, 2048, generator=gen) * 0.02)
        p.grad = torch.randn(rows, 2048, generator=gen) * 1e-3
        out.append(p)
    return out


def _others(params) -> dict[str, object]:
    """Every other optimizer, or why it cannot run here."""
    opts: dict[str, object] = {
        "torch_fused": torch.optim.AdamW(params, **ADAM, fused=True),
        "torch_foreach": torch.optim.AdamW(params, **ADAM, foreach=True),
    }
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes as bnb
        opts["bitsandbytes"] = bnb.optim.AdamW8bit(params, **ADAM)
    except Exception as e:  # report, don't skip
        opts["bitsandbytes"] = f"cannot run: {type(e).__name__}: {e}"[:200]
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.optim import AdamW8bit as AoAdamW8bit
        opts["torchao"] = AoAdamW8bit(params, **ADAM)
    except Exception as e:
        opts["torchao"] = f"cannot run: {type(e).__name__}: {e}"[:200]
    return opts


def _time_round_robin(fns: dict[str, callable], rounds: dict[str, int], restore) -> dict:
    """Median seconds per call of each fn, calls interleaved so load hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(max(rounds.values())):
        for name, fn in fns.items():
            if r >= rounds[name]:
                continue
            restore()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def step_times(total_params: int, rounds: int, slow_rounds: int, threads: int,
               with_others: bool = True) -> dict:
    torch.set_num_threads(threads)
    params = _params(total_params)
    grads = [p.grad.clone() for p in params]

    def restore():  # clip_grad_norm_ scales grads in place; keep every step on the same grads
        for p, g in zip(params, grads):
            p.grad.copy_(g)

    ours = AdamW8bit(params, **ADAM, num_threads=threads)
    ours_clip = AdamW8bit(params, **ADAM, max_grad_norm=1.0, num_threads=threads)
    fns = {"ours": ours.step, "ours_clip": ours_clip.step}
    skipped: dict[str, str] = {}
    others = _others(params) if with_others else {
        "torch_fused": torch.optim.AdamW(params, **ADAM, fused=True)}
    cold: dict[str, float] = {}
    for name, opt in others.items():
        if isinstance(opt, str):
            skipped[name] = opt
            continue
        fns[name] = opt.step
    fused = others["torch_fused"]

    def fused_clip():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        fused.step()

    fns["torch_fused_clip"] = fused_clip
    for name, fn in fns.items():  # first step: state allocation, compilation
        restore()
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:
            skipped[name] = f"cannot run: {type(e).__name__}: {e}"[:200]
        cold[name] = time.perf_counter() - t0
    for name in skipped:
        fns.pop(name, None)
    slow = {"bitsandbytes", "torchao"}
    t = _time_round_robin(fns, {k: slow_rounds if k in slow else rounds for k in fns}, restore)
    numel = sum(p.numel() for p in params)
    out = {"params": numel, "threads": threads,
           "step_s": {k: round(v, 4) for k, v in t.items()},
           "first_step_s": {k: round(v, 3) for k, v in cold.items()}}
    ratios = {}
    for name in ("torch_fused", "torch_foreach", "bitsandbytes", "torchao"):
        if name in t:
            ratios[name] = round(t["ours"] / t[name], 3)
        elif name in skipped:
            ratios[name] = skipped[name]
    ratios["with_clip"] = round(t["ours_clip"] / t["torch_fused_clip"], 3)
    out["ratios"] = ratios
    return out


def _state_bytes(state: dict) -> int:
    """Bytes of an optimizer state's moment tensors (``step`` excluded)."""
    return sum(v.numel() * v.element_size() for k, v in state.items() if k != "step")


def state_bytes_per_param(numel: int = 4096 * 4096) -> float:
    p = torch.nn.Parameter(torch.zeros(numel))
    p.grad = torch.zeros(numel)
    opt = AdamW8bit([p])
    opt.step()
    return round(_state_bytes(opt.state[p]) / numel, 4)


# ----- eval loss ----------------------------------------------------------------------------

def _loss(model, b) -> torch.Tensor:
    logits = model(input_ids=b.input_ids).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b.labels.flatten(),
                                             ignore_index=IGNORE_INDEX)


def _groups(model, lr, wd):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=wd), dict(params=rest, weight_decay=0.0)]


def train_eval(steps: int, seq_len: int, batch_size: int, hidden: int, layers: int,
               seed: int = 0, noise_floor: bool = False) -> dict:
    """fp32 AdamW vs AdamW8bit from the same init on the same batches.

    ``noise_floor`` adds a third run, fp32 again on a different batch order, to show how much
    eval loss moves between two equally good runs (the scale ``eval_loss_delta_pct`` is read on).
    """
    torch.set_num_threads(1)
    tokens = corpus_tokens(1_500_000)
    split = int(tokens.numel() * 0.9)
    train, held = tokens[:split], tokens[split:]
    cfg = get_flavor("llama-30m").build_config(
        hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    init = FAMILIES["llama"].model_class(cfg).state_dict()
    eval_batches = []
    it = batches(held, seq_len, batch_size, seed=1234)
    for _ in range(16):
        eval_batches.append(next(it))
    lr, wd, warmup = 3e-3, 0.1, 30
    results, moments = {}, {}
    for name in ("fp32", "8bit") + (("fp32_other_order",) if noise_floor else ()):
        torch.manual_seed(seed)
        model = FAMILIES["llama"].model_class(cfg)
        model.load_state_dict(init)
        groups = _groups(model, lr, wd)
        fp32 = name.startswith("fp32")
        if fp32:
            opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
        else:
            opt = AdamW8bit(groups, lr=lr, betas=(0.9, 0.95), max_grad_norm=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / steps))
        data = batches(train, seq_len, batch_size, seed=seed + (name == "fp32_other_order"))
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = _loss(model, next(data))
            loss.backward()
            if fp32:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
        train_s = time.perf_counter() - t0
        model.eval()
        with torch.no_grad():
            ev = statistics.fmean(float(_loss(model, b)) for b in eval_batches)
        results[name] = {"eval_loss": round(ev, 4),
                         "final_train_loss": round(float(loss.detach()), 4),
                         "train_s": round(train_s, 1)}
        if name == "fp32":
            moments = {n: opt.state[p] for n, p in model.named_parameters()
                       if p.dim() >= 2}
        elif name == "8bit":
            results[name]["skipped_steps"] = opt.skipped_steps
    params = sum(p.numel() for p in model.parameters())
    delta = 100.0 * (results["8bit"]["eval_loss"] - results["fp32"]["eval_loss"]) \
        / results["fp32"]["eval_loss"]
    out_noise = {}
    if noise_floor:
        out_noise["noise_floor_pct"] = round(
            100.0 * (results["fp32_other_order"]["eval_loss"] - results["fp32"]["eval_loss"])
            / results["fp32"]["eval_loss"], 3)
    model_info = {"family": "llama", "hidden": hidden, "layers": layers, "params": params,
                  "steps": steps, "seq_len": seq_len, "batch_size": batch_size, "lr": lr}
    return {**out_noise, "model": model_info,
            "runs": results, "delta_pct": round(delta, 3), "moments": moments}


# ----- quantisation error on real moments ---------------------------------------------------

def _bnb_dynamic_map(signed: bool) -> torch.Tensor | None:
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import bitsandbytes.functional as F
        return F.create_dynamic_map(signed=signed).float().sort().values
    except Exception:
        return None


def _quant_lut(x: torch.Tensor, block: int, table: torch.Tensor) -> torch.Tensor:
    """Block absmax + nearest entry of ``table`` (a value map on [-1, 1] or [0, 1])."""
    n = x.numel()
    xb = quant._padded_blocks(x, block)
    a = xb.abs().amax(1, keepdim=True).clamp(min=1e-30)
    y = xb / a
    mid = (table[1:] + table[:-1]) / 2
    idx = torch.bucketize(y, mid)
    return (table[idx] * a).view(-1)[:n]


def _schemes(block: int) -> dict:
    lin_s = torch.linspace(-1, 1, 255)
    lin_u = torch.linspace(0, 1, 256)
    out = {
        "square_law (ours)": (
            lambda m: quant.dequantize_signed(*quant.quantize_signed(m, block), block),
            lambda v: quant.dequantize_sq(*quant.quantize_sq(v, block), block)),
        "linear": (lambda m: _quant_lut(m, block, lin_s), lambda v: _quant_lut(v, block, lin_u)),
    }
    ds, du = _bnb_dynamic_map(True), _bnb_dynamic_map(False)
    if ds is not None:
        out["bnb_dynamic"] = (lambda m: _quant_lut(m, block, ds),
                              lambda v: _quant_lut(v, block, du))
    return out


def quant_errors(moments: dict, block: int, betas=(0.9, 0.95), eps: float = 1e-8) -> dict:
    """Error of the *next* Adam update when the stored moments are quantised with each map.

    The next gradient is drawn elementwise with the stored second moment (g ~ N(0, v)), so the
    error is what training would see one step later. Reported: relative L2 error of the update
    ``m' / (sqrt(v') + eps)``, the 99th percentile of the per-element relative error, and the
    fraction of positive ``v`` stored as zero.
    """
    m = torch.cat([s["exp_avg"].reshape(-1) for s in moments.values()]).float()
    v = torch.cat([s["exp_avg_sq"].reshape(-1) for s in moments.values()]).float()
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(m.shape, generator=gen) * v.sqrt()

    def update(mm, vv):
        m2 = betas[0] * mm + (1 - betas[0]) * g
        v2 = betas[1] * vv + (1 - betas[1]) * g * g
        return m2 / (v2.sqrt() + eps)

    exact = update(m, v)
    out = {}
    for name, (qm, qv) in _schemes(block).items():
        mq, vq = qm(m), qv(v)
        upd = update(mq, vq)
        rel = (upd - exact).abs() / exact.abs().clamp(min=1e-3 * float(exact.abs().mean()))
        out[name] = {"update_rel_l2": round(float((upd - exact).norm() / exact.norm()), 5),
                     "update_rel_p99": round(float(rel.quantile(0.99)
                                                   if rel.numel() <= 16_000_000
                                                   else rel[::4].quantile(0.99)), 5),
                     "v_zeroed_frac": round(float(((vq == 0) & (v > 0)).float().mean()), 6)}
    return out


def block_sweep(moments: dict, numel: int, rounds: int) -> dict:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = {}
    p = torch.nn.Parameter(torch.randn(numel) * 0.02)
    p.grad = torch.randn(numel) * 1e-3
    for block in (64, 128, 256, 512, 1024, 2048):
        err = quant_errors(moments, block)["square_law (ours)"]
        opt = AdamW8bit([p], **ADAM, block_size=block)
        opt.step()
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t0)
        out[str(block)] = {"update_rel_l2": err["update_rel_l2"],
                           "update_rel_p99": err["update_rel_p99"],
                           "step_s": round(statistics.median(ts), 4),
                           # measured from the optimizer's state tensors, not from the format's formula
                           "bytes_per_param": round(_state_bytes(opt.state[p]) / numel, 4)}
        del opt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds/steps (< 3 min)")
    args = ap.parse_args()
    t_start = time.perf_counter()
    threads = torch.get_num_threads()
    info = machine()
    cold_import = time.perf_counter()
    # cold start of the compiled kernel in this process (cache hit unless first run ever)
    p = torch.nn.Parameter(torch.zeros(4096))
    p.grad = torch.ones(4096)
    AdamW8bit([p], min_8bit_numel=0).step()
    kernel_first_call_s = time.perf_counter() - cold_import

    quick = args.quick
    ev = train_eval(steps=300 if quick else 600, seq_len=64 if quick else 128, batch_size=8,
                    hidden=128, layers=4, noise_floor=not quick)
    total = 50_000_000
    st = step_times(total, rounds=5 if quick else 11, slow_rounds=2 if quick else 3,
                    threads=threads)
    st1 = step_times(total, rounds=3 if quick else 7, slow_rounds=1, threads=1,
                     with_others=False)
    torch.set_num_threads(threads)
    result = {
        "benchmark": "optim",
        "quick": quick,
        "machine": info,
        "state_bytes_per_param": state_bytes_per_param(),
        "step_ratio_vs_torch_fused": st["ratios"]["torch_fused"],
        "step_ratio_vs_torch_foreach": st["ratios"]["torch_foreach"],
        "step_ratio_vs_bitsandbytes": st["ratios"]["bitsandbytes"],
        "step_ratio_vs_torchao": st["ratios"]["torchao"],
        "step_ratio_with_clip_vs_torch_fused_clip": st["ratios"]["with_clip"],
        "step_ratio_vs_torch_fused_1thread": st1["ratios"]["torch_fused"],
        "step_ratio_with_clip_vs_torch_fused_clip_1thread": st1["ratios"]["with_clip"],
        "eval_loss_fp32": ev["runs"]["fp32"]["eval_loss"],
        "eval_loss_8bit": ev["runs"]["8bit"]["eval_loss"],
        "eval_loss_delta_pct": ev["delta_pct"],
        "eval_loss_noise_floor_pct": ev.get("noise_floor_pct", "full run only"),
        "step_time": st,
        "step_time_1thread": st1,
        "train": {k: v for k, v in ev.items() if k != "moments"},
        "kernel_first_call_s": round(kernel_first_call_s, 3),
        "quant_error": quant_errors(ev["moments"], quant.DEFAULT_BLOCK_SIZE),
    }
    result["block_size_sweep"] = block_sweep(ev["moments"], 4_000_000 if quick else 50_000_000,
                                             rounds=3 if quick else 5)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    json.dump(result, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
