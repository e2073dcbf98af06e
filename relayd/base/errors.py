"""What every store raises, whichever holds the state (memory, SQLite or Redis)."""

from __future__ import annotations

from twisted.internet.defer import FirstError
from twisted.python.failure import Failure


class StoreUnavailable(Exception):
    """The store did not answer (down, unreachable, or too slow); the request can be retried."""

    def __init__(self, store: str, reason: str = "unavailable") -> None:
        super().__init__(f"{store} store unavailable: {reason}")
        self.store = store


class OutcomeUnknown(StoreUnavailable):
    """The store was sent a write and did not answer in time: it may have done it, or may still do it.

    A retry is safe only where the write is idempotent (AEP's event-id dedupe); a caller that says
    "nothing happened, retry" for this would be wrong.
    """


class StoreRefused(StoreUnavailable):
    """The store refused the request without doing it (full, read-only, busy: C{code} says which); its
    client logs that once per outage, so a wing answering it need not log each request."""

    def __init__(self, store: str, code: str, reason: str) -> None:
        super().__init__(store, reason)
        self.code = code


def first_error(f: Failure) -> Failure:
    """The failure of calls gathered with C{gatherResults(..., consumeErrors=True)} as the first of
    them failed (L{StoreUnavailable}, L{OutcomeUnknown}...), not wrapped in C{FirstError}."""
    if isinstance(f.value, FirstError):
        return f.value.subFailure
    return f
