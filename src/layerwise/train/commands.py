"""What ``layerwise demo``, ``train`` and ``report`` do once their arguments are checked (the
command imports this module, and with it torch, only then: ``train/cli.py``)."""

from __future__ import annotations

import argparse

from .demo import DemoConfig, run_demo
from .demo_pretrained import PretrainedDemoConfig, check_model_dir, run_pretrained_demo
from .loop import throughput_text, train
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
    print(f"done: eval loss {result.eval_loss_start:.4f} -> {result.eval_loss_end:.4f}; "
          f"{throughput_text(result)}; outputs in {result.out_dir}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    path, lines = report(args.run, args.out)
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


def run_demo_command(args: argparse.Namespace) -> int:
    if args.pretrained is not None:
        return _run_pretrained_demo(args)
    print("layerwise demo: the path of a user's run, small: BPE tokenizer, streaming-engine "
          "training of a small Llama on the Python stdlib source, layer-wise checkpoints, export, "
          "sample, report")
    defaults = DemoConfig()
    result = run_demo(DemoConfig(steps=defaults.steps if args.steps is None else args.steps,
                                 out_dir=args.out or defaults.out_dir, device=args.device))
    if not result.train.eval_loss_end < result.train.eval_loss_start:
        print("warning: eval loss did not improve")
        return 1
    return 0


def _run_pretrained_demo(args: argparse.Namespace) -> int:
    check_model_dir(args.pretrained)
    defaults = PretrainedDemoConfig(model=args.pretrained)
    cfg = PretrainedDemoConfig(model=args.pretrained, device=args.device,
                               steps=defaults.steps if args.steps is None else args.steps,
                               out_dir=args.out or defaults.out_dir)
    print(f"layerwise demo --pretrained: LoRA on {args.pretrained}, chat data as JSONL, layer-wise "
          "checkpoints, a PEFT adapter; held-out answers before and after")
    result = run_pretrained_demo(cfg)
    if not result.train.eval_loss_end < result.train.eval_loss_start:
        print("warning: held-out eval loss did not improve")
        return 1
    return 0
