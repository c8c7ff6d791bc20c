"""What ``layerwise demo``, ``train`` and ``report`` do once their arguments are checked (the
command imports this module, and with it torch, only then: ``train/cli.py``)."""

from __future__ import annotations

import argparse

from .demo import DemoConfig, run_demo
from .loop import train
from .report import report


def run_train(args: argparse.Namespace) -> int:
    try:
        result = train(args.cfg)
    finally:
        if args.lock is not None:
            args.lock.release()
    if result.rank:
        return 0  # rank 0 reports for the run
    if result.note:
        print(result.note)
        return 0
    print(f"done: eval loss {result.eval_loss_start:.4f} -> {result.eval_loss_end:.4f}, "
          f"{result.tokens_per_s:.0f} tok/s; outputs in {result.out_dir}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    path, lines = report(args.run, args.out)
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


def run_demo_command(args: argparse.Namespace) -> int:
    print("layerwise demo: the path of a user's run, small: BPE tokenizer, streaming-engine "
          "training of a small Llama on the Python stdlib source, layer-wise checkpoints, export, "
          "sample, report")
    result = run_demo(DemoConfig(steps=args.steps, out_dir=args.out, device=args.device))
    if not result.train.eval_loss_end < result.train.eval_loss_start:
        print("warning: eval loss did not improve")
        return 1
    return 0
