"""``layerwise demo``, ``layerwise train`` and ``layerwise report``: their arguments, and what
``train`` checks before the heavy imports (torch-free; ``train/commands.py`` runs them).

Settings, lowest first: ``TrainConfig``'s defaults, the continued run's ``run.json``, the
``--config`` YAML, ``key=value`` overrides; so ``layerwise train out_dir=OUT`` resumes a run as it
was started, and any key given now wins."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .. import config as config_lib
from ..util import dirlock
from . import outdir
from .config import (FINETUNE_DEFAULTS, FINETUNE_DEFERS_TO, LORA_FINETUNE_LR, DemoConfig,
                     TrainConfig, help_keys)
from .options import check_settings

TRAIN_DESCRIPTION = (
    "Train with the streaming engine. Settings: the defaults, then (when out_dir holds a run "
    "this one continues) the settings saved in its run.json, then --config YAML, then "
    "KEY=VALUE overrides. Values are parsed as you mean them: 2e-5, 1_000, true, [a, b]. "
    "Nested keys with dots (optimizer.lr=1e-4, ckpt.policy=filter ckpt.threshold=0.01).")


def register(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser(
        "demo", help="train a small Llama on the Python standard library's source, end to end",
        description="The path of a user's run, small: learn a BPE tokenizer from the Python "
                    "standard library's source, train the built-in `llama-demo` model on that "
                    "source with the streaming engine (8-bit AdamW moments on the layers, "
                    "layer-wise checkpoints with the filter policy), export it as a Hugging Face "
                    "model with its tokenizer, reload both with transformers, sample Python from "
                    "it and draw the run. Needs no download and no GPU; under 3 minutes on 2 idle CPU "
                    "cores, several times that on a busy machine. Starts fresh: an earlier demo run in --out is replaced.")
    defaults = DemoConfig()
    demo.add_argument("--steps", type=int, default=None,
                      help=f"optimizer steps (default {defaults.steps})")
    demo.add_argument("--out", default=None,
                      help=f"output directory (default {defaults.out_dir}; an earlier demo run "
                           "there is replaced, any other non-empty directory refused)")
    demo.add_argument("--device", default=defaults.device, help="cpu or cuda (default cpu)")
    demo.add_argument("--pretrained", metavar="DIR", default=None,
                      help="instead: LoRA-tune the chat model in DIR (a local Hugging Face "
                           "directory; `make demo-pretrained` makes SmolLM2-135M-Instruct's) to "
                           "answer capital-city questions in a pirate's voice, and print its "
                           "answers to held-out questions before and after (--out default "
                           "runs/demo-pretrained, --steps default 12)")
    demo.set_defaults(func="layerwise.train.commands:run_demo_command")

    train = sub.add_parser(
        "train", help="train a model with the streaming engine", description=TRAIN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="common settings (KEY=DEFAULT; --help-all lists every key with its full text):\n"
               + config_lib.help_text(TrainConfig, only=help_keys()))
    train.add_argument("--config", metavar="YAML", help="a YAML file of settings (nested or "
                       "dotted keys, as --print-config writes them)")
    train.add_argument("--print-config", action="store_true",
                       help="print the resolved settings as YAML and exit (nothing is trained)")
    train.add_argument("--help-all", action="store_true",
                       help="list every setting with its default and documentation, and exit")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="settings")
    train.set_defaults(prepare=prepare_train, func="layerwise.train.commands:run_train")

    rep = sub.add_parser(
        "report", help="draw a training run: curves, per-layer change, checkpoint history",
        description="One PNG of a `layerwise train` run (loss and eval, LR, gradient norm, "
                    "tokens/s against the planner's prediction, a per-layer x step heat map of "
                    "relative weight change, and which groups each checkpoint wrote with its "
                    "bytes against a full save), and a short text summary.")
    rep.add_argument("run", help="the run's out_dir (or a layer-wise checkpoint run directory)")
    rep.add_argument("--out", default=None, help="PNG to write (default RUN/report.png)")
    rep.set_defaults(func="layerwise.train.commands:run_report")


def finetune_defaults(cfg: TrainConfig, given: dict) -> dict:
    """The fine-tuning defaults (``config.FINETUNE_DEFAULTS``) a run of a pretrained model
    takes: none for a built-in flavor (trained from scratch), and none the user's ``given``
    settings (a nested dict) set or override."""
    name = cfg.model.name
    if not (Path(name).is_dir() or "/" in name):
        return {}
    chosen = dict(FINETUNE_DEFAULTS)
    if cfg.lora.enabled:
        chosen["optimizer.lr"] = LORA_FINETUNE_LR
    said = {k for k, _ in config_lib._flatten(given)}
    return {k: v for k, v in chosen.items()
            if k not in said and not said.intersection(FINETUNE_DEFERS_TO.get(k, ()))}


def resolve_config(path: str | None, overrides: list[str]) -> tuple[TrainConfig, list[str]]:
    """The run's settings (module docstring: which win) and the lines to say about them."""
    layers = [config_lib.read_yaml(path)] if path else []
    given_overrides = config_lib.parse_overrides(TrainConfig, overrides)
    given = config_lib.build(TrainConfig, *layers, given_overrides)
    lines: list[str] = []
    continues = (given.resume != "false" and not given.overwrite
                 and given.resume_from_checkpoint is None)
    saved = outdir.saved_config(Path(given.out_dir)) if continues else None
    if not saved:
        said: dict = {}
        for layer in (*layers, given_overrides):
            said = config_lib.merge(said, config_lib.normalize(TrainConfig, layer))
        tuned = finetune_defaults(given, said)
        if tuned:
            given = config_lib.build(TrainConfig, tuned, *layers, given_overrides)
            lines.append(f"fine-tuning defaults ({given.model.name} is a pretrained model): "
                         + " ".join(f"{k}={config_lib.show_value(v)}" for k, v in tuned.items())
                         + "; set a key to change it")
        return given, lines
    try:
        cfg = config_lib.build(TrainConfig, saved, *layers, given_overrides)
    except ValueError as e:
        raise ValueError(f"the settings saved in {Path(given.out_dir) / outdir.RUN_JSON} no longer "
                         f"load ({e}); continue it with an older layerwise, or start afresh with "
                         "overwrite=true") from None
    lines.append(f"settings: those saved by the run in {given.out_dir} (run.json), then this "
                 "command's")
    return cfg, lines


def _lead_process() -> bool:
    """Rank 0 of a torchrun launch, or a process alone: the one that locks the out_dir."""
    return os.environ.get("RANK", "0") == "0"


def prepare_train(args: argparse.Namespace) -> int | None:
    """``--help-all`` and ``--print-config``, the settings and their checks, the out_dir lock;
    an exit code when the command is done, None to go on and train (``args.cfg``)."""
    if args.help_all:
        print("every setting of `layerwise train` (KEY=DEFAULT):\n"
              + config_lib.help_text(TrainConfig, full=True))
        return 0
    cfg, lines = resolve_config(args.config, args.overrides)
    # what was resolved: on stdout with the run's other lines (a refusal is one line on
    # stderr), on stderr where stdout is the YAML of --print-config
    for line in lines:
        print(line, file=sys.stderr if args.print_config else sys.stdout)
    check_settings(cfg)
    if args.print_config:
        print(config_lib.to_yaml(cfg), end="")
        return 0
    args.lock = dirlock.acquire(cfg.out_dir) if _lead_process() else None
    args.cfg = cfg
    return None
