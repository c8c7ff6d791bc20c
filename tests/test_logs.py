"""The package's log lines: bare lines on stdout under the ``layerwise`` command, nothing
installed otherwise, and silence on the ranks that do not speak for a run."""

from __future__ import annotations

import logging

from layerwise.util.logs import PACKAGE_LOGGER, command_output, quiet_unless

_log = logging.getLogger("layerwise.train.somewhere")


def _state(logger: logging.Logger):
    return list(logger.handlers), logger.level, logger.propagate


def test_the_command_prints_bare_lines_on_stdout_and_leaves_logging_as_it_was(capsys, caplog):
    """Mutations that fail it: a ``%(levelname)s:`` prefix in the command's formatter; the
    handler bound to the ``sys.stdout`` of when it was made (pytest's capture replaced it since);
    records also propagating to the root logger (each line twice where the root has a handler:
    pytest's capture handler here); the handler left installed after the command."""
    package = logging.getLogger(PACKAGE_LOGGER)
    before = _state(package)
    caplog.set_level(logging.DEBUG)
    with command_output():
        _log.debug("not shown")
        _log.info("step 1/2: loss 2.0000")
        _log.warning("warning: the data position now indexes the new data")
    out, err = capsys.readouterr()
    assert out == "step 1/2: loss 2.0000\nwarning: the data position now indexes the new data\n"
    assert err == ""
    assert not caplog.records  # only the command's handler saw them
    assert _state(package) == before
    _log.warning("after the command")
    assert capsys.readouterr().out == ""


def test_ranks_other_than_0_say_nothing(caplog):
    """Mutation that fails it: ``quiet_unless`` letting warnings through (every rank would repeat
    rank 0's warnings), or not restoring the level after."""
    caplog.set_level(logging.INFO, logger=PACKAGE_LOGGER)
    with quiet_unless(False):
        _log.info("rank 1 line")
        _log.warning("warning: rank 1")
    assert caplog.messages == []
    with quiet_unless(True):
        _log.info("rank 0 line")
    _log.warning("after")
    assert caplog.messages == ["rank 0 line", "after"]
