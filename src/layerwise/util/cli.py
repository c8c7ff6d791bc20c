"""Command groups that several packages add subcommands to (``layerwise ckpt ...``)."""

from __future__ import annotations

import argparse


def command_group(subparsers: argparse._SubParsersAction, name: str, **kwargs) -> argparse._SubParsersAction:
    """The subcommand action of group ``name``, created on first use with ``kwargs``.

    ``layerwise ckpt`` gets ``ls/show/verify/gc`` from the checkpoint core and ``merge`` from
    interop; each registers into the same group without importing the other.
    """
    parser = subparsers.choices.get(name)
    if parser is None:
        parser = subparsers.add_parser(name, **kwargs)
        parser.set_defaults(func=lambda args: (parser.print_help(), 2)[1])
        parser._layerwise_group = parser.add_subparsers(dest=f"{name}_command", metavar="SUBCOMMAND")
    return parser._layerwise_group
