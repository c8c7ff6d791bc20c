"""The lines the package logs (what ``layerwise`` prints on the terminal), for tests whose
fixtures outlive pytest's function-scoped ``caplog``, or that act on a line as it comes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from layerwise.util.logs import PACKAGE_LOGGER


class _CallbackHandler(logging.Handler):
    def __init__(self, on_line: Callable[[str], None]):
        super().__init__(logging.INFO)
        self.on_line = on_line

    def emit(self, record: logging.LogRecord) -> None:
        self.on_line(record.getMessage())  # what it raises reaches the code that logged


@contextmanager
def on_each_line(on_line: Callable[[str], None]) -> Iterator[None]:
    """Call ``on_line`` with every message the package logs at INFO and above while inside."""
    logger = logging.getLogger(PACKAGE_LOGGER)
    handler, saved = _CallbackHandler(on_line), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


@contextmanager
def logged_lines() -> Iterator[list[str]]:
    """The messages the package logs at INFO and above while inside, in order."""
    lines: list[str] = []
    with on_each_line(lines.append):
        yield lines
