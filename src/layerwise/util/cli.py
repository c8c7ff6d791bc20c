"""Command groups that several packages add subcommands to (``layerwise ckpt ...``)."""

from __future__ import annotations

import argparse


def command_group(subparsers: argparse._SubParsersAction, name: str, **kwargs) -> argparse._SubParsersAction:
    """The subcommand action of group ``name``, created on first use, so ``ckpt`` and ``interop``
    register into one group without importing each other."""
    parser = subparsers.choices.get(name)
    if parser is None:
        parser = subparsers.add_parser(name, **kwargs)
        parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
        parser._layerwise_group = parser.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND")
    return parser._layerwise_group
