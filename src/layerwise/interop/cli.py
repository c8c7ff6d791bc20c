"""``layerwise ckpt merge``: write an ordinary checkpoint from any source or a recipe;
``layerwise ckpt import``: compact ordinary checkpoints into a layer-wise run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..ckpt.errors import CheckpointError
from ..ckpt.resolve import composite_text
from ..util.cli import command_group
from ..util.units import human_bytes
from .recipes.import_checkpoints import ImportedStep, import_checkpoints
from .layout import CheckpointSource
from .peft.lora_step import PEFT, export_step, lora_step_of
from .recipes.merge import FORMATS, merge
from .recipes.recipe import load_recipe
from .sources import open_source


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``merge`` to the ``layerwise ckpt`` subcommands."""
    ckpt_subparsers = command_group(subparsers, "ckpt")
    p = ckpt_subparsers.add_parser(
        "merge",
        help="export a step (or a recipe of layers) to an HF model dir, HF Trainer or DCP checkpoint",
        description=(
            "Write an ordinary checkpoint from a layer-wise run step, an HF Trainer checkpoint-N dir "
            "or an HF model dir; or, with --recipe, from layer ranges of several of them. The output "
            "appears only when complete."
        ),
    )
    p.add_argument("run", nargs="?", help="a `layerwise train` out_dir or its ckpt/ (any layer-wise run dir), HF Trainer checkpoint-N dir, HF model dir, ZeRO "
                   "save or DCP dir (torchtitan step-N: see --config)")
    p.add_argument("--step", type=int, default=None, help="step of a layer-wise run (default: latest)")
    p.add_argument("--recipe", default=None, help="YAML recipe (mergekit/LLMTailor slices) instead of RUN")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--format", choices=(*FORMATS, PEFT), default="hf", help="hf: model dir; trainer: checkpoint-N dir; dcp: torch.distributed.checkpoint dir; "
                   "deepspeed: ZeRO save (see --template); peft: a LoRA run's adapters as a PEFT adapter dir "
                   "(with hf, a LoRA run's step is the base with its adapters merged)")
    p.add_argument("--template", default=None,
                   help="--format deepspeed: a ZeRO save (global_stepN) of the run that will resume, made "
                        "after its first step; default: the source's own when it is a ZeRO save")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    p.add_argument("--dtype", default=None, help="cast weights (float32, bfloat16, float16); default: as stored")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--config", default=None,
                   help="HF config (config.json or an HF model dir) of a DCP checkpoint that holds none, "
                        "e.g. a torchtitan step-N dir")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="copy the tokenizer files and generation_config.json of DIR (an HF model dir "
                        "or a saved tokenizer) beside the weights; default: the source's own (a "
                        "`layerwise train` run keeps them in OUT/tokenizer)")
    p.add_argument("--base", default=None, metavar="DIR",
                   help="a LoRA run's base model directory, when it is no longer where the run's "
                        "run.json says (model_path)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_merge)
    imp = ckpt_subparsers.add_parser(
        "import",
        help="compact HF Trainer checkpoints / HF model dirs into a layer-wise run, one step each",
        description=(
            "Store each checkpoint as a step of a layer-wise run, oldest first (the Trainer's "
            "global_step, else the order given). Group versions already stored are not stored "
            "again; with a policy other than full, only the groups it picks (from their change "
            "since the stored version) are stored."
        ),
    )
    imp.add_argument("sources", nargs="+", metavar="SRC",
                     help="checkpoint-N dirs, HF model dirs, ZeRO saves or DCP dirs (torchtitan's step-N)")
    imp.add_argument("--run", required=True, help="layer-wise run dir (created if needed), or a "
                     "`layerwise train` out_dir (its ckpt/)")
    imp.add_argument("--policy", default="full",
                     help="full, filter, topk or budget, with options: filter:threshold=0.01,max_staleness=4")
    imp.add_argument("--config", default=None,
                     help="HF config (config.json or an HF model dir) of a DCP checkpoint that holds none, "
                          "e.g. a torchtitan step-N dir")
    imp.add_argument("--expert-groups", action="store_true",
                     help="MoE models: version each routed expert as its own group, so a step "
                          "stores only the experts that moved")
    imp.add_argument("--json", action="store_true", help="print one JSON object")
    imp.set_defaults(func=_cmd_import)


def _cmd_import(args: argparse.Namespace) -> int:
    def line(s: ImportedStep) -> None:
        if not args.json:
            print(f"step {s.step:>8}  {s.source}: {len(s.selected)} group(s) chosen, "
                  f"{len(s.written)} new, {human_bytes(s.bytes_written)} written "
                  f"of {human_bytes(s.input_bytes)}")
    rep = import_checkpoints(args.sources, args.run, args.policy, on_step=line, config=args.config,
                             expert_groups=args.expert_groups)
    if args.json:
        print(json.dumps({"ok": True, **rep.to_json()}, sort_keys=True))
    else:
        ratio = rep.stored_bytes / rep.input_bytes if rep.input_bytes else 0.0
        print(f"imported {len(rep.steps)} checkpoint(s) into {rep.run} ({rep.policy}): "
              f"{human_bytes(rep.input_bytes)} in, {human_bytes(rep.stored_bytes)} stored ({ratio:.1%})")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    """Exit codes: 0 written; 2 a user mistake (bad arguments, recipe, source); 1 the write failed."""
    try:
        summary = _run_merge(args)
    except (ValueError, FileNotFoundError) as e:
        if not args.json:
            raise  # the ``layerwise`` entry point prints user mistakes as one line, exit 2
        print(json.dumps({"ok": False, "error": str(e)}))
        return 2
    except (CheckpointError, OSError) as e:
        msg = f"merge failed, nothing was written to {args.out}: {e}"
        print(json.dumps({"ok": False, "error": msg}) if args.json else f"layerwise ckpt merge: error: {msg}",
              file=sys.stdout if args.json else sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"ok": True, **summary}, sort_keys=True))
    else:
        print(
            f"wrote {summary['format']} checkpoint of step {summary['step']} to {summary['out']}: "
            f"{len(summary['weight_files'])} weight file(s), {summary['bytes'] / 1e6:.1f} MB "
            f"in {summary['seconds']:.1f} s"
        )
        note = composite_text(summary["step"], summary.get("older_groups") or {},
                              summary.get("num_groups", 0))
        if note:
            print(f"  note: {note}")
        if summary.get("base_model"):
            print(f"  base model: {summary['base_model']}")
        if summary.get("tokenizer_from"):
            print(f"  tokenizer and generation config <- {summary['tokenizer_from']}")
        elif summary["format"] in ("hf", "trainer"):
            print("  no tokenizer copied: the source has none (--tokenizer DIR adds one)")
        if "sources" in summary:
            for group, model in summary["sources"]["groups"].items():
                print(f"  {group:<12} <- {model}")
            print(f"  state (step, scheduler, RNG, trainer state) <- {summary['sources']['state_from']}")
    return 0


def _run_merge(args: argparse.Namespace) -> dict[str, Any]:
    if (args.run is None) == (args.recipe is None):
        raise ValueError("give either RUN or --recipe recipe.yaml (exactly one)")
    if args.recipe is not None:
        if args.step is not None:
            raise ValueError("--step does not apply to --recipe; write path@step for a source in the recipe")
        if args.config is not None:
            raise ValueError("--config does not apply to --recipe; write `config: PATH` in the recipe")
        source: CheckpointSource = load_recipe(args.recipe).open()
    else:  # a LoRA run's step exports its adapters (peft) or the base with them merged (hf)
        source = open_source(args.run, args.step, args.config)
    if args.format == PEFT or lora_step_of(source, args.base) is not None:
        return export_step(source, args.out, args.format, base=args.base, dtype=args.dtype,
                           max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                           tokenizer=args.tokenizer)
    return merge(
        source, args.out, args.format, max_shard_size=args.max_shard_size, dtype=args.dtype,
        template=args.template, overwrite=args.overwrite, config=args.config,
        tokenizer=args.tokenizer,
    )
