"""The last save of a ``Checkpointer`` that was never closed, written when the interpreter exits.

At exit the worker threads stop taking work and a pending save would be silently dropped, so
each unclosed checkpointer is closed with a warning. ``threading._register_atexit`` runs before
the executors' own exit hook, so the workers still take the write (plain ``atexit`` otherwise)."""

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
