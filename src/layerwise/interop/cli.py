"""``layerwise ckpt merge``: write an ordinary checkpoint from any source or a recipe."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..ckpt.errors import CheckpointError
from ..util.cli import command_group
from .layout import CheckpointSource
from .merge import FORMATS, merge
from .recipe import load_recipe


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
    p.add_argument("run", nargs="?", help="layer-wise run dir, HF Trainer checkpoint-N dir or HF model dir")
    p.add_argument("--step", type=int, default=None, help="step of a layer-wise run (default: latest)")
    p.add_argument("--recipe", default=None, help="YAML recipe (mergekit/LLMTailor slices) instead of RUN")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.add_argument("--format", choices=FORMATS, default="hf", help="hf: model dir; trainer: checkpoint-N dir; dcp: torch.distributed.checkpoint dir")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard, e.g. 5GB, 500MB")
    p.add_argument("--dtype", default=None, help="cast weights (float32, bfloat16, float16); default: as stored")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_merge)


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
        source: CheckpointSource | str = load_recipe(args.recipe).open()
        step = None
    else:
        source, step = args.run, args.step
    return merge(
        source, args.out, args.format, step=step, max_shard_size=args.max_shard_size, dtype=args.dtype,
        overwrite=args.overwrite,
    )
