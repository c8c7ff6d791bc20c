"""Layer-wise checkpoint savings on a real training run (CPU, ~30M-parameter Llama).

One training run on the built-in corpus (the Python standard library's source) with AdamW and a
warmup + cosine schedule; every K steps the same state is checkpointed side by side under the
policies ``full``, ``parity``, ``filter`` and ``budget`` (one run directory each, async saves;
``--pareto`` adds filter thresholds, top-k and budget variants). For each policy: total bytes
written, mean blocked and background write seconds per checkpoint, and ``criterion_share``: the
share of its group-writes chosen by its own rule (threshold, k, budget) rather than by the
guards every policy has (a group never saved, ``max_staleness``, ``full_every``).

Blocked time is all the time the training loop waits for checkpointing: ``save`` itself, the
statistics pass (``observe``, taken at every checkpoint step for the policies that read weight
changes), and, with deferred snapshots (the default on the CPU), the time the next optimizer
step waited for the snapshot (``stall_s``). So that the stall is measured as training would
see it, the ``filter`` checkpointer's save runs last at each checkpoint step and is not waited
for: its snapshot and write overlap the next training steps, as in real use. The other
policies are waited for right after their save (so their writes never contend), and the
synchronous reference save is timed before any of them.
Then, from the last checkpoint step, each policy's composite is loaded into a fresh model and
trained on for the same number of steps as a resume from the ``full`` checkpoint; the eval loss
of each is compared with that of ``full`` (``eval_loss_delta_pct``). Each composite's eval loss
right after loading (``eval_loss_at_load``) is reported too, with the live model's at the last
checkpoint (``eval_loss_at_save``; ``full`` must reproduce it) and an untrained model's
(``eval_loss_untrained``): the deltas only mean something if loading restored the run, since a
load that restored nothing would make every policy agree with ``full``. A synchronous full save
(``torch.save`` of model + optimizer state dicts, as the HF Trainer writes them) is timed in the
same run at several checkpoint steps.

Prints one JSON object. ``--quick`` runs in under 3 minutes on a 2-core machine. ``--moe``
measures expert-level vs layer-level groups on a tiny MoE instead (``ckpt_savings_moe.py``).

``--finetune`` runs the fine-tuning measurement instead (``ckpt_finetune.py``: a pre-trained
12-layer model fine-tuned on another corpus, the skew statistic, durable write wall time); the
other arguments are then that mode's (``--finetune --help``).
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

from ckpt_finetune_setup import next_token_loss
from layerwise.ckpt import Checkpointer
from layerwise.ckpt.policies import parse_policy_value
from layerwise.models.registry import FAMILIES, get_flavor
from layerwise.train.data import batches, corpus_tokens

POLICIES = ("full", "parity", "budget", "filter")
"""``filter`` last: its save is the one measured as training sees it (not waited for)."""
THRESHOLD, MAX_FRACTION = 0.06, 0.2
"""The headline filter: a group is written when its weights moved by more than 6% (relative L2)
since the version last saved, at most 20% of a full checkpoint's bytes per checkpoint (most
changed first). Earlier the threshold was 0.3 (0.25 with --quick), which no decoder
layer reached between two staleness refreshes: the guards (staleness, never saved) chose 95%
of the writes."""
PARETO_THRESHOLDS = (0.02, 0.04, 0.06, 0.1, 0.15, 0.2, 0.3)
PARETO_CAPPED = ((0.04, 0.1), (0.1, 0.25))
"""(threshold, max_fraction) of capped filters besides the headline one."""
PARETO_K = (1, 2, 4)
PARETO_BUDGETS = (0.1, 0.2, 0.4)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small run (< 3 minutes)")
    p.add_argument("--finetune", action="store_true",
                   help="the fine-tuning measurement (ckpt_finetune.py; its own options)")
    p.add_argument("--flavor", default="llama-30m", help="model flavor (>= 20M parameters)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="decoder layers (default: the flavor's; llama-30m has 10)")
    p.add_argument("--pareto", action="store_true",
                   help="also run filter thresholds, top-k and budget variants (bytes vs quality)")
    p.add_argument("--extra", action="append", default=[], metavar="POLICY:K=V,...",
                   help="another policy to run side by side, e.g. filter:threshold=0.05,max_fraction=0.2")
    p.add_argument("--steps", type=int, default=None, help="training steps before the last checkpoint")
    p.add_argument("--every", type=int, default=None, help="checkpoint every K steps")
    p.add_argument("--resume-steps", type=int, default=None, help="steps trained on after resuming")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--threshold", type=float, default=THRESHOLD, help="filter: relative change threshold")
    p.add_argument("--max-fraction", type=float, default=MAX_FRACTION,
                   help="filter: bytes per checkpoint as a fraction of a full one (0: no cap)")
    p.add_argument("--budget-fraction", type=float, default=None, help="budget: fraction of a full save")
    p.add_argument("--max-staleness", type=int, default=None, help="filter/budget staleness bound (checkpoints)")
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: as set)")
    p.add_argument("--dir", default=None, help="where to write the runs (default: a temp dir, removed)")
    p.add_argument("--moe", action="store_true",
                   help="instead: expert-level vs layer-level groups on a tiny MoE (ckpt_savings_moe.py)")
    a = p.parse_args(argv)
    defaults = dict(
        # quick: 12 checkpoints; full: 20 checkpoints over 240 steps (2 shared CPU cores).
        steps=(48, 240), every=(4, 12), resume_steps=(8, 24), batch_size=(4, 4), seq_len=(32, 32),
        warmup_steps=(8, 24), budget_fraction=(0.2, 0.2),
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
    if args.num_layers is not None:
        cfg.num_hidden_layers = args.num_layers
    model = FAMILIES[cfg.model_type].model_class(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup_steps, total_steps))
    return model, opt, sched


def train_step(model, opt, sched, batch) -> float:
    loss = next_token_loss(model, batch)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.detach())


@torch.no_grad()
def eval_loss(model, eval_batches) -> float:
    model.eval()
    losses = [float(next_token_loss(model, b)) for b in eval_batches]
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


def policy_specs(args) -> dict[str, tuple[str, dict]]:
    """Run-directory name -> (policy, options): the four headline policies, and with
    ``--pareto`` the variants of the bytes-vs-quality table."""
    stale = {"max_staleness": args.max_staleness}
    specs = {
        "full": ("full", {}),
        "parity": ("parity", {}),
        "budget": ("budget", {"budget_fraction": args.budget_fraction, **stale}),
        "filter": ("filter", {"threshold": args.threshold, "max_fraction": args.max_fraction or None,
                              **stale}),
    }
    if args.pareto:
        for t in PARETO_THRESHOLDS:
            specs[f"filter-{t:g}"] = ("filter", {"threshold": t, **stale})
        for t, f in PARETO_CAPPED:
            specs[f"filter-{t:g}-cap{f:g}"] = ("filter", {"threshold": t, "max_fraction": f, **stale})
        for k in PARETO_K:
            specs[f"topk-{k}"] = ("topk", {"k": k, **stale})
        for f in PARETO_BUDGETS:
            if f != args.budget_fraction:
                specs[f"budget-{f:g}"] = ("budget", {"budget_fraction": f, **stale})
    for spec in args.extra:
        name, _, opts = spec.partition(":")
        specs[spec] = (name, {k: parse_policy_value(v) for k, _, v in (o.partition("=") for o in opts.split(",") if o)})
    order = [n for n in specs if n != "filter"] + ["filter"]  # filter last, not waited for
    return {n: specs[n] for n in order}


def criterion_share(reports) -> float:
    """Share of a policy's group-writes chosen by its own rule, not by a guard."""
    reasons = [r for rep in reports for r in rep.reasons.values()]
    return sum(r == "criterion" for r in reasons) / max(1, len(reasons))


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--finetune" in argv:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import ckpt_finetune
        return ckpt_finetune.main([a for a in argv if a != "--finetune"])
    args = parse_args(argv)
    if args.moe:
        from ckpt_savings_moe import run_moe  # beside this script
        out = {"moe": run_moe(args.quick, args.threshold, args.max_staleness,
                              Path(args.dir) if args.dir else None)}
        print(json.dumps(out, indent=1))
        return out
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt_savings_"))
    root.mkdir(parents=True, exist_ok=True)
    specs = policy_specs(args)
    for name in specs:  # fresh runs: an old run would deduplicate everything against itself
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
    num_layers = model.config.num_hidden_layers
    cks = {
        name: Checkpointer(root / name, model, opt, sched, policy=policy, track_every_steps=args.every,
                           **options)
        for name, (policy, options) in specs.items()
    }

    data = batches(train_tokens, args.seq_len, args.batch_size, seed=0)
    step_s, tracker_s = [], {name: [] for name in cks}
    after_save_s = []  # steps right after a checkpoint step: the filter's snapshot overlaps them
    sync_s = []
    n_ckpt = args.steps // args.every
    sync_every = max(1, n_ckpt // 5)
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        train_step(model, opt, sched, next(data))
        (after_save_s if step > 1 and (step - 1) % args.every == 0 else step_s).append(
            time.perf_counter() - t)
        if step % args.every == 0:
            for ck in cks.values():  # keep one step per run on disk (bytes are counted per save)
                ck.wait()
                ck.store.gc(keep=1)
            if (step // args.every) % sync_every == 0 or step == args.steps:
                # Before any policy's save: nothing of ours runs in the background meanwhile.
                cks["filter"].wait()
                sync_s.append(sync_full_save(model, opt, root / "sync_full"))
            for name, ck in cks.items():
                if getattr(ck.policy, "uses_change", True):
                    t = time.perf_counter()
                    ck.observe(step)  # update statistics (the tracker's every-K-steps pass)
                    tracker_s[name].append(time.perf_counter() - t)
                ck.save(step, data_position=step)
                if name != "filter":
                    ck.wait()  # measured one at a time so that their writes never contend
        opt.zero_grad(set_to_none=True)
    cks["filter"].wait()
    train_s = time.perf_counter() - t_start
    # The scale the resume comparison is read on: a load that restored nothing would resume
    # from an untrained model, and every policy, `full` included, would agree with `full`.
    eval_at_save = eval_loss(model, eval_set)
    eval_untrained = eval_loss(build(args, total_steps, seed=1)[0], eval_set)

    # Resume every policy's last composite and train on; compare eval loss with `full`.
    results = {}
    for name, ck in cks.items():
        ck.close()
        policy, _ = specs[name]
        m2, o2, s2 = build(args, total_steps, seed=1)
        res = Checkpointer(root / name, m2, o2, s2, policy=policy, tracker_log=False).load()
        assert res.step == args.steps
        eval_at_load = eval_loss(m2, eval_set)
        d2 = batches(train_tokens, args.seq_len, args.batch_size, seed=0, start=res.data_position)
        for _ in range(args.resume_steps):
            train_step(m2, o2, s2, next(d2))
            o2.zero_grad(set_to_none=True)
        reps = ck.reports
        results[name] = {
            "policy": ck.policy.config(),
            "bytes_written": sum(r.bytes_written for r in reps),
            "blocked_s_mean": statistics.fmean(r.blocked_s for r in reps),
            "stall_s_mean": statistics.fmean(r.stall_s for r in reps),
            "observe_stall_s_mean": ck.observe_stall_s / len(reps),
            "snapshot_s_mean": statistics.fmean(r.snapshot_s for r in reps),
            "deferred": all(r.deferred for r in reps),
            "write_s_mean": statistics.fmean(r.write_s for r in reps),
            "eval_loss": eval_loss(m2, eval_set),
            "eval_loss_at_load": eval_at_load,
            "checkpoints": len(reps),
            "group_writes": sum(len(r.selected) for r in reps),
            "criterion_share": criterion_share(reps),
            "writes_by_reason": {k: sum(v == k for r in reps for v in r.reasons.values())
                                 for k in ("new", "full_every", "stale", "criterion")},
            "groups_written_mean": statistics.fmean(len(r.written) for r in reps),
            "stale_groups_at_resume": len(res.stale_groups),
            "tracker_s_mean": statistics.fmean(tracker_s[name]) if tracker_s[name] else 0.0,
        }
        del m2, o2, s2
    base = results["full"]["eval_loss"]
    full_bytes = results["full"]["bytes_written"]
    for r in results.values():
        r["eval_loss_delta_pct"] = 100.0 * (r["eval_loss"] - base) / base
        r["size_ratio"] = full_bytes / r["bytes_written"]
    step_mean = statistics.fmean(step_s[len(step_s) // 10:])
    sync_mean = statistics.fmean(sync_s)
    filt = results["filter"]
    tracker_pct = 100.0 * filt["tracker_s_mean"] / (args.every * step_mean)
    # Everything the training loop waited for, per checkpoint of the filter policy.
    filter_held = (filt["blocked_s_mean"] + filt["stall_s_mean"] + filt["tracker_s_mean"]
                   + filt["observe_stall_s_mean"])
    out = {
        "benchmark": "ckpt_savings",
        "inputs": {**{k: getattr(args, k) for k in (
            "quick", "flavor", "steps", "every", "resume_steps", "batch_size", "seq_len", "lr",
            "warmup_steps", "threshold", "max_fraction", "budget_fraction", "max_staleness",
            "eval_batches", "pareto")}, "num_layers": num_layers},
        "num_params": num_params,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average_start": load_start,
                    "load_average_end": os.getloadavg()},
        "policies": results,
        "pareto": [{"name": n, "size_ratio": r["size_ratio"], "eval_loss_delta_pct": r["eval_loss_delta_pct"],
                    "criterion_share": r["criterion_share"]}
                   for n, r in sorted(results.items(), key=lambda kv: kv[1]["size_ratio"])],
        "eval_loss_at_save": eval_at_save,
        "eval_loss_untrained": eval_untrained,
        "full_load_eval_loss_rel_diff": abs(results["full"]["eval_loss_at_load"] - eval_at_save) / eval_at_save,
        "sync_full_save_s": sync_mean,
        "size_ratio_filter": filt["size_ratio"],
        "blocked_ratio_filter": filter_held / sync_mean,
        "blocked_ratio_filter_save_only": filt["blocked_s_mean"] / sync_mean,
        "step_s_mean": step_mean,
        "step_after_save_s_mean": statistics.fmean(after_save_s) if after_save_s else None,
        "tracker_overhead_pct": tracker_pct,
        "tracker_overhead_pct_if_every_step": 100.0 * filt["tracker_s_mean"] / step_mean,
        "targets": {
            "full_load_restores_the_saved_model": abs(results["full"]["eval_loss_at_load"] - eval_at_save)
            <= 1e-6 * eval_at_save,
            "size_ratio_filter>=4": filt["size_ratio"] >= 4,
            "filter_eval_loss_delta_pct<=0.5": filt["eval_loss_delta_pct"] <= 0.5,
            "filter_criterion_share>=0.5": filt["criterion_share"] >= 0.5,
            "blocked_ratio_filter<=0.05": filter_held / sync_mean <= 0.05,
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
