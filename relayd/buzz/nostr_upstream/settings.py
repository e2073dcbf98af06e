"""What every upstream connection of a pool is configured with, fixed when the pool is made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from twisted.application.internet import backoffPolicy

from relayd.base.clock import Timekeeper
from relayd.base.reactor import IReactor
from relayd.buzz.upstream import public_url


def _no_jitter() -> float:
    # Delays stay exact, as the retry log line states them and the tests advance a fake clock by them.
    return 0.0


@dataclass(frozen=True)
class UpstreamSettings:
    """The upstream Nostr relay, and how connections to it are made, authenticated and retried."""

    url: str
    reactor: IReactor
    clock: Timekeeper
    auth_url: str  # the relay URL signed into NIP-42 AUTH events
    wall_clock: Callable[[], float]  # created_at of AUTH events
    connect_timeout: float = 10.0
    challenge_wait: float = 1.0  # how long a new connection waits for the relay's AUTH challenge
    backoff_base: float = 0.25
    backoff_cap: float = 5.0
    max_message: int = 16 * 1024 * 1024
    recycle_after: int = 3  # consecutive failures (timeout, refusal) that drop a connection
    shown_url: str = field(init=False)  # for logs: no credentials a URL might carry

    def __post_init__(self) -> None:
        object.__setattr__(self, "shown_url", public_url(self.url))

    def retry_delay(self, failures: int) -> float:
        """Seconds to wait before the next attempt after C{failures} consecutive failed ones (>= 1).

        L{twisted.application.internet.backoffPolicy}: doubling from C{backoff_base} up to
        C{backoff_cap}, without jitter.
        """
        return backoffPolicy(self.backoff_base, self.backoff_cap, factor=2.0, jitter=_no_jitter)(failures - 1)
