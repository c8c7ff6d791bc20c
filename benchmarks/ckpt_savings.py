"""Layer-wise checkpoint savings on a real training run (CPU, ~30M-parameter Llama).

One training run on the built-in corpus (the Python standard library's source) with AdamW and a
warmup + cosine schedule; every K steps the same state is checkpointed side by side under the
policies ``full``, ``parity``, ``filter`` and ``budget`` (one run directory each, async saves).
For each policy: total bytes written, mean blocked and background write seconds per checkpoint.
Then, from the last checkpoint step, each policy's composite is loaded into a fresh model and
trained on for the same number of steps as a resume from the ``full`` checkpoint; the eval loss
of each is compared with that of ``full`` (``eval_loss_delta_pct``). Each composite's eval loss
right after loading (``eval_loss_at_load``) is reported too, with the live model's at the last
checkpoint (``eval_loss_at_save``; ``full`` must reproduce it) and an untrained model's
(``eval_loss_untrained``): the deltas only mean something if loading restored the run, since a
load that restored nothing would make every policy agree with ``full``. A synchronous full save
(``torch.save`` of model + optimizer state dicts, as the HF Trainer writes them) is timed in the
same run at several checkpoint steps.

Prints one JSON object. ``--quick`` runs in under 3 minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from layerwise.ckpt import Checkpointer
from layerwise.models.registry import FAMILIES, get_flavor
from layerwise.train.data import batches, corpus_tokens

POLICIES = ("full", "parity", "filter", "budget")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (< 3 minutes)")
    p.add_argument("--flavor", default="llama-30m", help="model flavor (>= 20M parameters)")
    p.add_argument("--steps", type=int, default=None, help="training steps before the last checkpoint")
    p.add_argument("--every", type=int, default=None, help="checkpoint every K steps")
    p.add_argument("--resume-steps", type=int, default=None, help="steps trained on after resuming")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--threshold", type=float, default=None, help="filter: relative change threshold")
    p.add_argument("--budget-fraction", type=float, default=None, help="budget: fraction of a full save")
    p.add_argument("--max-staleness", type=int, default=None, help="filter/budget staleness bound (checkpoints)")
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as set)")
    p.add_argument("--dir", default=None, help="where to write the runs (default: a temp dir, removed)")
    a = p.parse_args(argv)
    defaults = dict(
        # quick: 12 checkpoints; full: 20 checkpoints over 240 steps (2 shared CPU cores).
        steps=(48, 240), every=(4, 12), resume_steps=(8, 24), batch_size=(4, 4), seq_len=(32, 32),
        warmup_steps=(8, 24), threshold=(0.25, 0.3), budget_fraction=(0.2, 0.2),
        max_staleness=(8, 8), eval_batches=(4, 8),
    )
    for k, (q, f) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, q if a.quick else f)
    if a.steps % a.every:
        p.error("--steps must be a multiple of --every (the last checkpoint is at the last step)")
    return a


def lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
    return f


def build(args, total_steps: int, seed: int = 0):
    torch.manual_seed(seed)
    cfg = get_flavor(args.flavor).build_config()
    model = FAMILIES[cfg.model_type].model_class(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup_steps, total_steps))
    return model, opt, sched


def train_step(model, opt, sched, batch) -> float:
    out = model(input_ids=batch.input_ids, labels=batch.labels)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(out.loss.detach())


@torch.no_grad()
def eval_loss(model, eval_batches) -> float:
    model.eval()
    losses = [float(model(input_ids=b.input_ids, labels=b.labels).loss) for b in eval_batches]
    model.train()
    return sum(losses) / len(losses)


def sync_full_save(model, opt, d: Path) -> float:
    """``torch.save`` of model and optimizer state dicts into a fresh dir (HF Trainer style)."""
    d.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    torch.save(model.state_dict(), d / "pytorch_model.bin")
    torch.save(opt.state_dict(), d / "optimizer.pt")
    dt = time.perf_counter() - t
    shutil.rmtree(d)
    return dt


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt_savings_"))
    root.mkdir(parents=True, exist_ok=True)
    for name in POLICIES:  # fresh runs: an old run would deduplicate everything against itself
        shutil.rmtree(root / name, ignore_errors=True)
    total_steps = args.steps + args.resume_steps
    t_start = time.perf_counter()

    # Data: train stream and a held-out eval slice from the end of the corpus.
    n_train = (total_steps + 8) * args.batch_size * args.seq_len + 1
    n_eval = args.eval_batches * args.batch_size * args.seq_len + 1
    tokens = corpus_tokens(n_train + n_eval)
    train_tokens, eval_tokens = tokens[:n_train], tokens[n_train:]
    eval_it = batches(eval_tokens, args.seq_len, args.batch_size, seed=99)
    eval_set = [next(eval_it) for _ in range(args.eval_batches)]

    model, opt, sched = build(args, total_steps)
    num_params = sum(p.numel() for p in model.parameters())
    options = {
        "full": {},
        "parity": {},
        "filter": {"threshold": args.threshold, "max_staleness": args.max_staleness},
        "budget": {"budget_fraction": args.budget_fraction, "max_staleness": args.max_staleness},
    }
    cks = {
        name: Checkpointer(root / name, model, opt, sched, policy=name, track_every_steps=args.every,
                           **options[name])
        for name in POLICIES
    }

    data = batches(train_tokens, args.seq_len, args.batch_size, seed=0)
    step_s, tracker_s = [], {name: [] for name in POLICIES}
    sync_s = []
    n_ckpt = args.steps // args.every
    sync_every = max(1, n_ckpt // 5)
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        train_step(model, opt, sched, next(data))
        step_s.append(time.perf_counter() - t)
        if step % args.every == 0:
            for name, ck in cks.items():
                if getattr(ck.policy, "uses_change", True):
                    t = time.perf_counter()
                    ck.observe(step)  # update statistics (the tracker's every-K-steps pass)
                    tracker_s[name].append(time.perf_counter() - t)
            for name, ck in cks.items():
                ck.save(step, data_position=step)
                ck.wait()  # policies are measured one at a time so their writes never contend
            if (step // args.every) % sync_every == 0 or step == args.steps:
                sync_s.append(sync_full_save(model, opt, root / "sync_full"))
        opt.zero_grad(set_to_none=True)
    train_s = time.perf_counter() - t_start
    # The scale the resume comparison is read on: a load that restored nothing would resume
    # from an untrained model, and every policy, `full` included, would agree with `full`.
    eval_at_save = eval_loss(model, eval_set)
    eval_untrained = eval_loss(build(args, total_steps, seed=1)[0], eval_set)

    # Resume every policy's last composite and train on; compare eval loss with `full`.
    results = {}
    for name, ck in cks.items():
        ck.close()
        m2, o2, s2 = build(args, total_steps, seed=1)
        res = Checkpointer(root / name, m2, o2, s2, policy=name, tracker_log=False).load()
        assert res.step == args.steps
        eval_at_load = eval_loss(m2, eval_set)
        d2 = batches(train_tokens, args.seq_len, args.batch_size, seed=0, start=res.data_position)
        for _ in range(args.resume_steps):
            train_step(m2, o2, s2, next(d2))
            o2.zero_grad(set_to_none=True)
        reps = ck.reports
        results[name] = {
            "bytes_written": sum(r.bytes_written for r in reps),
            "blocked_s_mean": statistics.fmean(r.blocked_s for r in reps),
            "write_s_mean": statistics.fmean(r.write_s for r in reps),
            "eval_loss": eval_loss(m2, eval_set),
            "eval_loss_at_load": eval_at_load,
            "checkpoints": len(reps),
            "groups_written_mean": statistics.fmean(len(r.written) for r in reps),
            "stale_groups_at_resume": len(res.stale_groups),
            "tracker_s_mean": statistics.fmean(tracker_s[name]) if tracker_s[name] else 0.0,
        }
        del m2, o2, s2
    base = results["full"]["eval_loss"]
    for r in results.values():
        r["eval_loss_delta_pct"] = 100.0 * (r["eval_loss"] - base) / base
    step_mean = statistics.fmean(step_s[len(step_s) // 10:])
    sync_mean = statistics.fmean(sync_s)
    filt = results["filter"]
    tracker_pct = 100.0 * filt["tracker_s_mean"] / (args.every * step_mean)
    out = {
        "benchmark": "ckpt_savings",
        "inputs": {k: getattr(args, k) for k in (
            "quick", "flavor", "steps", "every", "resume_steps", "batch_size", "seq_len", "lr",
            "warmup_steps", "threshold", "budget_fraction", "max_staleness", "eval_batches")},
        "num_params": num_params,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__},
        "policies": results,
        "eval_loss_at_save": eval_at_save,
        "eval_loss_untrained": eval_untrained,
        "full_load_eval_loss_rel_diff": abs(results["full"]["eval_loss_at_load"] - eval_at_save) / eval_at_save,
        "sync_full_save_s": sync_mean,
        "size_ratio_filter": results["full"]["bytes_written"] / filt["bytes_written"],
        "blocked_ratio_filter": filt["blocked_s_mean"] / sync_mean,
        "blocked_ratio_filter_incl_tracker": (filt["blocked_s_mean"] + filt["tracker_s_mean"]) / sync_mean,
        "step_s_mean": step_mean,
        "tracker_overhead_pct": tracker_pct,
        "tracker_overhead_pct_if_every_step": 100.0 * filt["tracker_s_mean"] / step_mean,
        "targets": {
            "full_load_restores_the_saved_model": abs(results["full"]["eval_loss_at_load"] - eval_at_save)
            <= 1e-6 * eval_at_save,
            "size_ratio_filter>=4": results["full"]["bytes_written"] / filt["bytes_written"] >= 4,
            "filter_eval_loss_delta_pct<=0.5": filt["eval_loss_delta_pct"] <= 0.5,
            "blocked_ratio_filter<=0.1": filt["blocked_s_mean"] / sync_mean <= 0.1,
            "tracker_overhead_pct<=2": tracker_pct <= 2.0,
        },
        "wall_s": time.perf_counter() - t_start,
        "train_s": train_s,
    }
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
