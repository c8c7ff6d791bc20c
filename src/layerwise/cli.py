"""The ``layerwise`` command. Each area registers its own subcommands from its ``cli`` module."""

from __future__ import annotations

import argparse
import importlib
import sys

from .util.logs import command_output

# Modules with a ``register(subparsers)`` function; each adds its subcommands.
COMMAND_MODULES = (
    "layerwise.train.cli",  # demo, train
    "layerwise.plan.cli",  # plan
    "layerwise.engine.cli",  # calibrate
    "layerwise.ckpt.cli",  # ckpt ls/show/verify/gc
    "layerwise.interop.cli",  # ckpt merge
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layerwise",
        description="Train LLMs bigger than the GPU by streaming layers; checkpoint only what changed.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with command_output():  # the library's log lines, printed as plain lines
            return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        # User mistakes: one clear line, no traceback.
        print(f"layerwise {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
