"""What every store raises, whichever holds the state (memory, SQLite or Redis)."""

from __future__ import annotations


class StoreUnavailable(Exception):
    """The store did not answer (down, unreachable, or too slow); the request can be retried."""

    def __init__(self, store: str, reason: str = "unavailable") -> None:
        super().__init__(f"{store} store unavailable: {reason}")
        self.store = store
