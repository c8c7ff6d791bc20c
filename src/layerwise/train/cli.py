"""``layerwise demo``, ``layerwise train`` and ``layerwise report``."""

from __future__ import annotations

import argparse

from .. import config
from .demo import DemoConfig, run_demo
from .loop import TrainConfig, train
from .report import report


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo", help="train a small Llama on the Python standard library's source, end to end",
        description="The path of a user's run, small: learn a BPE tokenizer from the Python "
                    "standard library's source, train the built-in `llama-demo` model on that "
                    "source with the streaming engine (8-bit AdamW moments on the layers, "
                    "layer-wise checkpoints with the filter policy), export it as a Hugging Face "
                    "model with its tokenizer, reload both with transformers, sample Python from "
                    "it and draw the run. Needs no download and no GPU; about 2 minutes on 2 CPU "
                    "cores. Starts fresh: an earlier demo run in --out is replaced.")
    defaults = DemoConfig()
    demo.add_argument("--steps", type=int, default=defaults.steps,
                      help=f"optimizer steps (default {defaults.steps})")
    demo.add_argument("--out", default=defaults.out_dir,
                      help=f"output directory (default {defaults.out_dir}; an earlier demo run "
                           "there is replaced, any other non-empty directory refused)")
    demo.add_argument("--device", default=defaults.device, help="cpu or cuda (default cpu)")
    demo.set_defaults(func=run_demo_command)

    train = sub.add_parser(
        "train", help="train a model with the streaming engine",
        description="Train with the streaming engine. Settings come from TrainConfig defaults, an "
                    "optional YAML file, then key=value overrides (e.g. steps=200 optimizer.lr=1e-3).")
    train.add_argument("--config", help="YAML file with TrainConfig fields")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    train.set_defaults(func=run_train)

    rep = sub.add_parser(
        "report", help="draw a training run: curves, per-layer change, checkpoint history",
        description="One PNG of a `layerwise train` run (loss and eval, LR, gradient norm, "
                    "tokens/s against the planner's prediction, a per-layer x step heat map of "
                    "relative weight change, and which groups each checkpoint wrote with its "
                    "bytes against a full save), and a short text summary.")
    rep.add_argument("run", help="the run's out_dir (or a layer-wise checkpoint run directory)")
    rep.add_argument("--out", default=None, help="PNG to write (default RUN/report.png)")
    rep.set_defaults(func=run_report)


def run_train(args: argparse.Namespace) -> int:
    cfg = config.load(TrainConfig, args.config, args.overrides)
    result = train(cfg)
    if result.rank:
        return 0  # rank 0 reports for the run
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
