"""Whether a save's host snapshot fits in the RAM available now, or the save writes live.

The copy (blob bytes of the chosen groups) comes on top of a host store that may fill the
machine; if it does not fit (less a margin) the save writes from live tensors, same bytes, and
training waits. Ranks of one host share its RAM, so their bytes are summed before comparing."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable

from ..util.host_memory import available_host_memory
from ..util.units import human_bytes
from .collective import RankExchange

_log = logging.getLogger(__name__)

MARGIN_BYTES = 1 << 30
"""Left free beside a snapshot at the least: the runtime's own allocations go on meanwhile."""
MARGIN_FRACTION = 0.05
"""... or this share of the available memory, whichever is larger."""


def margin_bytes(available_bytes: int) -> int:
    return max(MARGIN_BYTES, int(MARGIN_FRACTION * available_bytes))


def host_need_bytes(exchange: RankExchange, need_bytes: int) -> int:
    """The bytes every rank on this host would allocate for its share of the snapshot (a
    collective with several writers: every rank calls it)."""
    if exchange.world_size == 1:
        return need_bytes
    host = socket.gethostname()
    everyone = exchange.gather((host, need_bytes))
    per_host: dict[str, int] = {}
    for h, n in everyone or []:
        per_host[h] = per_host.get(h, 0) + n
    return exchange.broadcast(per_host)[host]


class SnapshotFit:
    """Decides per save whether its snapshot is copied; warns once per checkpointer when not."""

    def __init__(self, available: Callable[[], int | None] | None = None):
        self.available = available or available_host_memory
        self._warned = False

    def decide(self, step: int, need_bytes: int) -> bool:
        """Whether to copy the snapshot (else write from the live tensors); ``need_bytes``: what
        the copy would allocate (``host_need_bytes``). Unknown available memory: copy."""
        avail = self.available() if need_bytes > 0 else None
        if avail is None or need_bytes + margin_bytes(avail) <= avail:
            return True
        if not self._warned:
            self._warned = True
            _log.warning(
                f"checkpoint of step {step}: its host snapshot would take "
                f"{human_bytes(need_bytes)} but {human_bytes(avail)} of RAM is available (keeping "
                f"{human_bytes(margin_bytes(avail))} free), so this save writes straight from the "
                "live tensors and training waits for the write (the same bytes on disk; so will "
                "any later save that does not fit). To save in the background, write fewer groups "
                "per save (ckpt.policy=parity or filter; the first save writes every group) or "
                "use a machine with more RAM.")
        return False
