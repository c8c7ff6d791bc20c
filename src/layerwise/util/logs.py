"""What a run tells the person running it: library code logs to module loggers with no handler;
the ``layerwise`` command installs one (:func:`command_output`) printing INFO+ bare on stdout."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

PACKAGE_LOGGER = "layerwise"


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is when a record comes (a redirect or a test's capture
    made after the handler was installed is followed)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, _value) -> None:
        pass


@contextmanager
def command_output() -> Iterator[None]:
    """While a ``layerwise`` command runs: the package's records at INFO and above print on
    stdout as their message alone (no level or logger name), and only there (not also through a
    handler the root logger may have)."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    handler = _StdoutHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextmanager
def quiet_unless(speaks: bool) -> Iterator[None]:
    """Unless ``speaks``, the package logs nothing below ERROR in this process while inside: the
    ranks of a data-parallel run other than 0 (rank 0 speaks for the run, and the others would
    repeat its lines)."""
    if speaks:
        yield
        return
    logger = logging.getLogger(PACKAGE_LOGGER)
    saved = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(saved)
