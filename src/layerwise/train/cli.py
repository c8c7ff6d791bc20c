"""``layerwise demo``, ``layerwise train`` and ``layerwise report``."""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from .. import config
from .data import ByteTokenizer
from .loop import TrainConfig, train
from .report import report


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo", help="train a small Llama on the Python standard library's source, end to end",
        description="Train the built-in `llama-demo` model with the streaming engine on the Python "
                    "standard library's own source files, export it as a Hugging Face model, reload "
                    "it with transformers and sample from it. Needs no download and no GPU.")
    demo.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150)")
    demo.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    demo.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    demo.set_defaults(func=run_demo)

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
    print(f"done: eval loss {result.eval_loss_start:.4f} -> {result.eval_loss_end:.4f}, "
          f"{result.tokens_per_s:.0f} tok/s; outputs in {result.out_dir}")
    return 0


def run_report(args: argparse.Namespace) -> int:
    path, lines = report(args.run, args.out)
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0


def run_demo(args: argparse.Namespace) -> int:
    cfg = TrainConfig(steps=args.steps, out_dir=args.out, device=args.device)
    print("layerwise demo: streaming-engine training of a small Llama on the Python stdlib source")
    result = train(cfg)
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    tok = ByteTokenizer()
    prompt = "import os\n\n\ndef "
    ids = torch.tensor([tok.encode(prompt, eos=False)])
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=120, do_sample=True, temperature=0.7, top_k=20,
                             pad_token_id=tok.eos_id)
    sample = tok.decode(out[0, 1:].tolist())
    print(f"reloaded {result.model_dir} with transformers; a sample:\n---\n{sample}\n---")
    print(f"eval loss {result.eval_loss_start:.4f} -> {result.eval_loss_end:.4f} "
          f"({result.tokens_per_s:.0f} tok/s, predicted device peak "
          f"{result.peak_device_bytes_predicted / 2**20:.1f} MiB)")
    path, _ = report(result.out_dir)
    print(f"report of the run (loss, throughput, per-layer change): {path}")
    if not result.eval_loss_end < result.eval_loss_start:
        print("warning: eval loss did not improve")
        return 1
    return 0
