"""The verbs every layer-wise checkpointer answers to, by shape, not inheritance
(``tests/ckpt/test_protocol.py`` holds them to it)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .reports import LoadResult, SaveReport


@runtime_checkable
class CheckpointerProtocol(Protocol):
    def save(self, step: int, extra: dict | None = None, *, data_position: Any = None,
             trainer_state: dict | None = None, every_group: bool = False) -> SaveReport:
        """Checkpoint ``step`` (on every rank, where the checkpointer spans several);
        ``every_group``: every group, whatever the policy."""
        ...

    def load(self, step: int | None = None) -> LoadResult | None:
        """Load ``step`` (default: the newest committed); None when the run has none yet."""
        ...

    def latest(self) -> int | None:
        """The newest committed step; None when there is none."""
        ...

    def close(self) -> None:
        """Finish what is in flight (raising its error) and release the checkpointer's
        threads and buffers."""
        ...
