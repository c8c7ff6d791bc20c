"""The last save of a ``Checkpointer`` that was never closed, written when the interpreter exits.

A save runs on worker threads (``concurrent.futures``), and at exit those stop taking new work:
the pending save (a deferred snapshot still to hand its write over) would be dropped without a
word, and the run would have no committed step. So every checkpointer is tracked (weakly), and
at exit each one not closed is closed (its save written, its error logged), with a warning
that says how to close it: ``with Checkpointer(...) as ckpt:`` or ``ckpt.close()``.

The hook is registered with ``threading._register_atexit``, whose callbacks run in reverse
order of registration before the executors' own exit hook (registered when
``concurrent.futures.thread`` was imported, before any checkpointer existed), so the workers
still take the write; plain ``atexit`` (which runs after them) where that is missing.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Any

_log = logging.getLogger(__name__)

_open: weakref.WeakSet = weakref.WeakSet()
_registered = False


def track(ck: Any) -> None:
    """Close ``ck`` (a ``Checkpointer``: ``run_dir``, ``unclosed_save()``, ``close()``) at exit
    if it is still open with a save pending."""
    global _registered
    _open.add(ck)
    if not _registered:
        register = getattr(threading, "_register_atexit", None) or atexit.register
        register(flush_unclosed)
        _registered = True


def flush_unclosed() -> None:
    """Write the pending save of every checkpointer not closed (the exit hook)."""
    for ck in list(_open):
        step = ck.unclosed_save()
        if step is None:
            continue
        _log.warning(f"layerwise: the Checkpointer of {ck.run_dir} was not closed; writing its "
                     f"last save (step {step}) at exit. Use `with Checkpointer(...) as ckpt:` "
                     "or call ckpt.close() when training ends")
        try:
            ck.close()
        except Exception as e:  # at exit nobody can catch it: say it
            _log.error(f"layerwise: the save of step {step} in {ck.run_dir} failed at exit: {e}")
