"""Layer-wise checkpoints measured in fine-tuning (``ckpt_savings.py --finetune``).

LLMTailor measured fine-tuning of pre-trained 7-10B models; this is the same experiment at CPU
scale. A 12-layer Llama (hidden 128, 2.4M parameters) is pre-trained on the standard library's
source (once; cached under ``benchmarks/.cache/``), then fully fine-tuned (fresh AdamW, LR
``--lr``, warmup + cosine) on instruction records built from another part of the standard
library (``ckpt_finetune_setup``), checkpointing every ``--every`` steps under every policy side
by side (one run directory each, on the same state).

At step ``--fail-at`` a failure is simulated: each policy's composite of that step is loaded
into a fresh, randomly initialised model and trained on to ``--steps`` (the schedule's end);
its eval loss on the held-out records is compared with that of the resume from ``full``
(``eval_loss_delta_pct``). ``full`` must restore the live model's eval loss exactly.

Timing (all on the CPU, one policy at a time, nothing else of ours running):

- ``write_s``: the checkpointer's writer thread, from taking the write job to the committed
  manifest: every new blob written and fsynced, renamed, its directories fsynced, the step's
  state files and the manifest written atomically (fsync + rename + directory fsync). The
  durable write, and nothing else. ``write_speedup_wall``: ``full``'s total ``write_s`` over the
  policy's, over every save of the run (the first save writes everything for every policy).
- ``save_s``: the wall time from calling ``save`` to ``wait`` returning: ``write_s`` plus
  measuring the weight changes, choosing and copying the groups (``save_speedup_wall``).
- ``torch_save_s``: ``torch.save`` of model and optimizer state dicts into two files, each
  fsynced, and the directory fsynced (the HF Trainer's files, made durable), at every third
  checkpoint step; the reference a full save outside this library costs.

The skew statistic is computed from the live weights: per decoder layer, the L2 norm of its
change over each optimizer step (and each checkpoint interval); a step is skewed when fewer than
30% of the layers (3 of 12) carry more than 70% of the summed change (``skew_share_of_steps``).

``--model smollm2``: the same experiment on SmolLM2-135M-Instruct (``real_model.py`` makes its
directory; nothing is pre-trained here), its own tokenizer, 2 x 64 tokens a step, LR 3e-5, a save
every 10 steps, the failure at step 40 and 5 steps after it; ``full`` and the default policy
only. ``--encodings`` (default ``plain,delta``): each is measured for ``full`` and the default
policy side by side (``ckpt.blob_codec``; labels ``<policy>+delta``), reported under
``finetune.encoded``. Its saves write from the live tensors (no snapshot buffers, each waited for).

Prints one JSON object: per seed, and medians over seeds (``--seeds``, default 3) per policy;
``finetune.*`` are the medians of the default policy (what ``layerwise train`` uses:
``ckpt.policy`` and its options in ``train.config.CheckpointConfig``). ``--quick``: one seed, a shorter
pre-training and fine-tune (a few minutes on 2 busy cores, plus the first pre-training).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling ckpt_finetune_setup

from ckpt_finetune_setup import (LayerDeltas, build_model, eval_batches, eval_loss,  # noqa: E402
                                 instruction_corpus, lr_lambda, pretrained_base, real_base, skew_stats,
                                 train_step)
from real_model import smollm2_dir  # noqa: E402
from layerwise.ckpt import Checkpointer  # noqa: E402
from layerwise.ckpt.policies import make_policy  # noqa: E402
from layerwise.train.config import CheckpointConfig  # noqa: E402
from layerwise.util.atomic import fsync_dir  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one seed, short runs (a few minutes)")
    p.add_argument("--seeds", type=int, default=None, help="fine-tune seeds (data order; default 3, quick 1)")
    p.add_argument("--steps", type=int, default=None, help="fine-tune steps (the schedule's length)")
    p.add_argument("--fail-at", type=int, default=None, help="the simulated failure's step (a checkpoint step)")
    p.add_argument("--every", type=int, default=None, help="checkpoint every K steps")
    p.add_argument("--lr", type=float, default=None,
                   help="fine-tune peak LR (default 1e-4; smollm2 3e-5; pre-training: 2e-3)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="fine-tune AdamW weight decay")
    p.add_argument("--pretrain-steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="default 8 (smollm2: 2)")
    p.add_argument("--seq-len", type=int, default=None, help="default 128 (smollm2: 64)")
    p.add_argument("--eval-batches", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on 2 shared cores)")
    p.add_argument("--extra", action="append", default=[], metavar="POLICY:K=V,...",
                   help="another policy, e.g. filter:threshold=0.03,max_staleness=4")
    p.add_argument("--dir", default=None, help="where to write the runs (default: a temp dir, removed)")
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny",
                   help="tiny: the 12-layer Llama pre-trained here; smollm2: SmolLM2-135M-Instruct "
                        "(benchmarks/real_model.py makes its directory), its tokenizer, no pre-training")
    p.add_argument("--encodings", default="plain,delta",
                   help="blob encodings measured for full and the default policy (ckpt.blob_codec)")
    a = p.parse_args(argv)
    real = a.model == "smollm2"
    defaults = dict(seeds=(1, 3), steps=(60, 45 if real else 180), fail_at=(45, 40 if real else 150),
                    every=(5, 10), pretrain_steps=(300, 800), eval_batches=(4, 8 if real else 12))
    for k, (q, f) in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, q if a.quick else f)
    small = (2, 64, 3e-5) if real else (8, 128, 1e-4)  # the real model: 135M parameters on 2 cores
    a.batch_size, a.seq_len, a.lr = (x if x is not None else d for x, d in
                                     zip((a.batch_size, a.seq_len, a.lr), small))
    a.encodings = [e.strip() for e in a.encodings.split(",") if e.strip()]
    if a.fail_at % a.every or not 0 < a.fail_at < a.steps:
        p.error("--fail-at must be a checkpoint step (a multiple of --every) before --steps")
    return a


def default_spec() -> tuple[str, dict]:
    """The policy ``layerwise train`` checkpoints with, with its options."""
    c = CheckpointConfig()
    return c.policy, c.policy_options()


def policy_specs(args) -> dict[str, tuple[str, dict]]:
    """Run-directory name (the policy as ``make_policy`` reads it) -> (policy, options)."""
    stale = {"max_staleness": CheckpointConfig().max_staleness}
    policy, options = default_spec()
    candidates = [("full", {}), (policy, options)] if args.model != "tiny" else [  # 135M: two
        ("full", {}),
        ("parity", {}),
        (policy, options),
        ("filter", {"threshold": 0.01, "max_staleness": 2}),
        ("filter", {"threshold": 0.02, **stale}),
        ("filter", {"threshold": 0.05, **stale}),
        ("filter", {"threshold": 0.01, "max_fraction": 0.25, **stale}),
        ("topk", {"k": 3, **stale}),
        ("budget", {"budget_fraction": 0.25, **stale}),
    ]
    for spec in args.extra:
        pol = make_policy(spec)
        candidates.append((pol.name, {k: v for k, v in pol.config().items() if k != "name"}))
    for enc in (e for e in args.encodings if e != "plain"):  # the same saves, coded
        candidates += [("full", {"encoding": enc}), (policy, {**options, "encoding": enc})]
    out: dict[str, tuple[str, dict]] = {}
    for name, opts in candidates:
        out.setdefault(policy_label(*_full_options(name, opts)), (name, opts))
    return out


def _full_options(name: str, options: dict) -> tuple[str, dict]:
    """The policy with every option it has that is set (its defaults included), and the
    encoding when it is not plain."""
    pol = {k: v for k, v in options.items() if k != "encoding"}
    full = {k: v for k, v in make_policy(name, **pol).config().items() if k != "name" and v is not None}
    return name, {**full, **({"encoding": options["encoding"]} if "encoding" in options else {})}


def policy_label(name: str, options: dict) -> str:
    enc = options.get("encoding")
    options = {k: v for k, v in options.items() if k != "encoding"}
    return name + (":" + ",".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                                  for k, v in sorted(options.items())) if options else "") + \
        (f"+{enc}" if enc else "")


def durable_torch_save(model, opt, d: Path) -> float:
    """Seconds to ``torch.save`` model and optimizer state dicts (HF Trainer's two files), each
    fsynced, and their directory fsynced."""
    d.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    for name, obj in (("pytorch_model.bin", model.state_dict()), ("optimizer.pt", opt.state_dict())):
        with open(d / name, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    fsync_dir(d)
    dt = time.perf_counter() - t
    shutil.rmtree(d)
    return dt


def make_optimizer(model, args, total_steps: int):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    warmup = max(1, total_steps // 10)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(warmup, total_steps))


def run_seed(args, seed: int, base_state: dict, data, root: Path) -> dict:
    """One fine-tune with every policy checkpointing, the failure, and every policy's resume."""
    train_tok, eval_set = data
    specs = policy_specs(args)
    for name in specs:
        shutil.rmtree(root / name, ignore_errors=True)
    torch.manual_seed(seed)
    model = build_model(0, args.model_config)
    model.load_state_dict(base_state)
    opt, sched = make_optimizer(model, args, args.steps)
    eval_base = eval_loss(model, eval_set)
    # A real model's snapshots would be GBs per checkpointer: its saves write from the live
    # tensors (each save is waited for anyway, one policy at a time).
    live = {"async_save": False, "sync_copy": False} if args.model != "tiny" else {}
    cks = {name: Checkpointer(root / name, model, opt, sched, policy=policy, tracker_log=False,
                              **live, **options) for name, (policy, options) in specs.items()}
    deltas = LayerDeltas(model)
    batches_it = _batches(train_tok, args, seed, 0)
    save_s = {n: [] for n in cks}
    torch_s, losses = [], []
    t0 = time.perf_counter()
    for step in range(1, args.fail_at + 1):
        losses.append(train_step(model, opt, sched, next(batches_it)))
        deltas.step()
        if step % args.every:
            continue
        deltas.interval()
        if (step // args.every) % 3 == 1:
            torch_s.append(durable_torch_save(model, opt, root / "torch_save"))
        for name, ck in cks.items():
            t = time.perf_counter()
            ck.save(step, data_position=step)
            ck.wait()  # one policy at a time: writes never contend
            save_s[name].append(time.perf_counter() - t)
            ck.store.gc(keep=1)  # bytes are counted per save; keep the disk small
    train_s = time.perf_counter() - t0
    eval_at_fail = eval_loss(model, eval_set)
    del model, opt, sched

    results = {}
    for name, ck in cks.items():
        ck.close()
        policy, _ = specs[name]
        m2 = build_model(10_000 + seed, args.model_config)  # random weights: a load that restores nothing shows
        o2, s2 = make_optimizer(m2, args, args.steps)
        loader = Checkpointer(root / name, m2, o2, s2, policy=policy, tracker_log=False)
        res = loader.load()
        loader.close()
        assert res.step == args.fail_at
        at_load = eval_loss(m2, eval_set)
        d2 = _batches(train_tok, args, seed, res.data_position)
        for _ in range(args.steps - args.fail_at):
            train_step(m2, o2, s2, next(d2))
        reps = ck.reports
        ages = [args.fail_at - s for s in res.stale_groups.values()]
        results[name] = {
            "bytes_written": sum(r.bytes_written for r in reps),
            "write_s": sum(r.write_s for r in reps),
            "save_s": sum(save_s[name]),
            "write_s_per_save_median": statistics.median(r.write_s for r in reps),
            "groups_written_mean": statistics.fmean(len(r.written) for r in reps),
            "criterion_share": _criterion_share(reps),
            "eval_loss_at_load": at_load,
            "eval_loss": eval_loss(m2, eval_set),
            "stale_groups_at_failure": len(ages),
            "max_group_age_steps_at_failure": max(ages, default=0),
        }
        del m2, o2, s2
    ref, n_saves = results["full"], len(save_s["full"])
    for r in results.values():
        r["size_ratio"] = ref["bytes_written"] / r["bytes_written"]
        r["eval_loss_delta_pct"] = 100.0 * (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        r["write_speedup_wall"] = ref["write_s"] / r["write_s"]
        r["save_speedup_wall"] = ref["save_s"] / r["save_s"]
        r["write_speedup_per_save_median"] = (ref["write_s_per_save_median"]
                                              / r["write_s_per_save_median"])
        r["write_speedup_vs_torch_save"] = statistics.fmean(torch_s) * n_saves / r["write_s"]
    return {
        "seed": seed, "policies": results,
        "skew_per_step": skew_stats(deltas.per_step),
        "skew_per_checkpoint_interval": skew_stats(deltas.per_interval),
        "eval_loss_base": eval_base, "eval_loss_at_failure": eval_at_fail,
        "full_restores_exactly": ref["eval_loss_at_load"] == eval_at_fail,
        "train_loss_first_5": statistics.fmean(losses[:5]), "train_loss_last_5": statistics.fmean(losses[-5:]),
        "torch_save_s_mean": statistics.fmean(torch_s), "train_s": train_s,
        "checkpoints": n_saves,
    }


def _batches(tokens, args, seed: int, start: int):
    from layerwise.train.data import batches
    return batches(tokens, args.seq_len, args.batch_size, seed=seed, start=start)


def _criterion_share(reports) -> float:
    reasons = [r for rep in reports for r in rep.reasons.values()]
    return sum(r == "criterion" for r in reasons) / max(1, len(reasons))


MEDIAN_KEYS = ("size_ratio", "eval_loss_delta_pct", "write_speedup_wall", "save_speedup_wall",
               "write_speedup_per_save_median",
               "write_speedup_vs_torch_save", "bytes_written", "write_s", "groups_written_mean",
               "criterion_share", "max_group_age_steps_at_failure")


def medians(runs: list[dict]) -> dict:
    names = list(runs[0]["policies"])
    return {n: {k: statistics.median(r["policies"][n][k] for r in runs) for k in MEDIAN_KEYS}
            for n in names}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    pre_spec = {"steps": args.pretrain_steps, "lr": 2e-3, "warmup": max(1, args.pretrain_steps // 20),
                "batch_size": args.batch_size, "seq_len": args.seq_len, "weight_decay": 0.1}
    tok, args.model_config = None, None
    if args.model == "smollm2":
        model_dir = smollm2_dir(fetch=False)
        if model_dir is None:
            sys.exit("no SmolLM2 directory: run `python benchmarks/real_model.py` first (pip install gguf)")
        base_state, args.model_config, tok = real_base(model_dir)
        pre_meta = {"model": str(model_dir), "pretrained": "SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)"}
    else:
        base_state, pre_meta = pretrained_base(pre_spec)
    n_train = (args.steps + 2) * args.batch_size * args.seq_len + 1
    train_tok, held_tok, n_records = instruction_corpus(
        n_train, args.eval_batches * args.batch_size * args.seq_len + 1, tok=tok)
    eval_set = eval_batches(held_tok, args.seq_len, args.batch_size, args.eval_batches)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt_finetune_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        runs = [run_seed(args, seed, base_state, (train_tok, eval_set), root)
                for seed in range(args.seeds)]
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    table = medians(runs)
    default = policy_label(*_full_options(*default_spec()))
    skew_step = statistics.median(r["skew_per_step"]["skew_share"] for r in runs)
    d = table[default]
    out = {
        "benchmark": "ckpt_savings --finetune",
        "finetune": {
            "policy": default,
            "size_ratio": d["size_ratio"], "eval_loss_delta_pct": d["eval_loss_delta_pct"],
            "write_speedup_wall": d["write_speedup_wall"], "skew_share_of_steps": skew_step,
            "skew_share_of_checkpoint_intervals": statistics.median(
                r["skew_per_checkpoint_interval"]["skew_share"] for r in runs),
            "top_layers_share_of_change_median": statistics.median(
                r["skew_per_step"]["top_layers_share_median"] for r in runs),
            "policies": table,
            "encoded": {label: {k: table[label][k] for k in ("size_ratio", "eval_loss_delta_pct",
                                                           "write_speedup_wall")}
                        for label in table if "+" in label},
        },
        "targets": {
            "size_ratio>=4": d["size_ratio"] >= 4,
            "eval_loss_delta_pct<=0.1": d["eval_loss_delta_pct"] <= 0.1,
            "write_speedup_wall>=2.5": d["write_speedup_wall"] >= 2.5,
            "skew_share_of_steps>0.8 (the paper's)": skew_step > 0.8,
            "full_restores_exactly": all(r["full_restores_exactly"] for r in runs),
        },
        "inputs": {**{k: getattr(args, k) for k in (
            "model", "encodings", "quick", "seeds", "steps", "fail_at", "every", "lr", "weight_decay", "batch_size",
            "seq_len", "eval_batches", "threads")}, "finetune_records": n_records,
            "finetune_train_tokens": int(train_tok.numel())},
        "pretrain": pre_meta,
        "num_params": sum({t.data_ptr(): t.numel() for t in base_state.values()}.values()),
        "runs": runs,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "load_average_start": load_start, "load_average_end": os.getloadavg()},
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
