"""The ``layerwise`` command. Each area registers its own subcommands from its ``cli`` module.

Only the modules of the command being run are imported (named here as strings), so each
``--help`` answers in a fraction of a second instead of torch's seconds; ``prepare`` is a
torch-free step run before the handler's import (``train``'s checks and lock).

Errors: a user's mistake is one line on stderr and exit 2 (traceback with ``--debug`` or
``LAYERWISE_DEBUG=1``); an interrupted run says how to resume, exit 130/143."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable

from .util.errors import Interrupted, one_line
from .util.logs import command_output

COMMANDS: dict[str, tuple[tuple[str, ...], str]] = {
    "demo": (("layerwise.train.cli",),
             "train a small Llama on the Python standard library's source, end to end"),
    "train": (("layerwise.train.cli",), "train a model with the streaming engine"),
    "report": (("layerwise.train.cli",),
               "draw a training run: curves, per-layer change, checkpoint history"),
    "plan": (("layerwise.planner.cli",),
             "plan where activations live (MILP) and compare with fixed rules"),
    "calibrate": (("layerwise.planner.calibrate_cli",), "measure this machine and write a hardware profile"),
    "ckpt": (("layerwise.ckpt.cli", "layerwise.interop.cli"),
             "inspect, verify, clean and merge layer-wise checkpoints"),
}
"""Command -> (the modules with a ``register(subparsers)`` that adds it, its one-line help);
a test keeps each help equal to the one its module registers."""

USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
               PermissionError)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with ``command``'s modules registered (None: every command, as a name and a
    line of help, no module imported)."""
    parser = argparse.ArgumentParser(
        prog="layerwise",
        description="Train LLMs bigger than the GPU by streaming layers; checkpoint only what changed.",
        epilog="`layerwise COMMAND --help` for a command's options.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (anywhere on the command line)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    if command in COMMANDS:
        for name in dict.fromkeys(COMMANDS[command][0]):
            importlib.import_module(name).register(sub)
    else:
        for name, (_, summary) in COMMANDS.items():
            sub.add_parser(name, help=summary)
    return parser


OWN_OPTIONS = frozenset({"--config", "--print-config", "--help-all", "--help", "-h", "--debug"})
"""``train``'s own options; any other ``--key`` is a setting."""


def dashed_overrides(argv: list[str]) -> list[str]:
    """``--key value`` and ``--key=value`` (HF scripts' ``--learning_rate 1e-4``) as the
    ``key=value`` settings they mean (a bare ``--flag``: ``flag=true``); the command's own
    options stay as they are."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        key, eq, value = a[2:].partition("=")
        if a.startswith("--") and key and a.split("=")[0] not in OWN_OPTIONS:
            if not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            elif not eq:
                value = "true"
            a = f"{key}={value}"
        out.append(a)
        i += 1
    return out


def resolve(func: Callable | str) -> Callable:
    """A handler, or ``"module:function"`` imported now."""
    if callable(func):
        return func
    module, _, name = func.partition(":")
    return getattr(importlib.import_module(module), name)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("LAYERWISE_DEBUG") == "1"
    argv = [a for a in argv if a != "--debug"]
    command = next((a for a in argv if not a.startswith("-")), None)
    if command == "train":
        argv = dashed_overrides(argv)
    parser = build_parser(command)
    args, extra = parser.parse_known_args(argv)
    if extra:  # KEY=VALUE after an option (``train --print-config steps=3``) is an override too
        if isinstance(getattr(args, "overrides", None), list) and all(
                "=" in e and not e.startswith("-") for e in extra):
            args.overrides += extra
        else:
            parser.parse_args(argv)  # argparse's own error for what it does not know
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        with command_output():  # the library's log lines, printed as plain lines
            prepare = getattr(args, "prepare", None)
            if prepare is not None:
                code = prepare(args)
                if code is not None:
                    return int(code)
            return int(resolve(args.func)(args) or 0)
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"layerwise {args.command}: interrupted, stopped at once (nothing saved now; a "
              "checkpoint committed before is intact)", file=sys.stderr)
        return 130
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"layerwise {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
