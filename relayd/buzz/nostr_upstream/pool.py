"""The broker's connections to its upstream Nostr relay: one per identity, opened on demand.

Reconnection. Twisted's L{twisted.application.internet.ClientService} keeps one connection up for
as long as the service runs, retrying forever; these connections do not fit that shape:

 - a connection is opened by the first request that needs it (docs/decisions.md B-7) and, once
   dropped, reopened only when a later request waits for it; an attempt nobody waits for any more
   is given up;
 - each request bounds the wait with its own timeout, and the backoff never delays an attempt past
   half of it (L{UpstreamConnection.ensure_ready});
 - a connection that keeps failing requests is dropped and reopened on the next demand, which is
   not a connection failure to back off from.

What does fit is ClientService's backoff policy: L{UpstreamSettings.retry_delay} is
L{twisted.application.internet.backoffPolicy} (doubling from C{backoff_base} up to C{backoff_cap},
without jitter). The broker's one long-lived upstream connection, the health probe of
L{relayd.buzz.upstream}, has ClientService's shape.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet import defer
from twisted.logger import Logger

from relayd.base.clock import Timekeeper
from relayd.base.reactor import IReactor
from relayd.buzz import nostr
from relayd.buzz.nostr_upstream.connection import UpstreamConnection
from relayd.buzz.nostr_upstream.settings import UpstreamSettings
from relayd.buzz.upstream import REPEAT_EVERY, Throttle


class NostrRelayPool:
    """Connections to the upstream Nostr relay, one per identity, opened on demand."""

    _log = Logger()

    def __init__(
        self,
        url: str,
        reactor: IReactor,
        clock: Timekeeper,
        *,
        auth_url: str | None = None,
        connect_timeout: float = 10.0,
        challenge_wait: float = 1.0,
        backoff_base: float = 0.25,
        backoff_cap: float = 5.0,
        max_message: int = 16 * 1024 * 1024,
        wall_clock: Callable[[], float] | None = None,
        recycle_after: int = 3,
    ) -> None:
        self.settings = UpstreamSettings(
            url,
            reactor,
            clock,
            auth_url or url,
            wall_clock or clock.seconds,
            connect_timeout=connect_timeout,
            challenge_wait=challenge_wait,
            backoff_base=backoff_base,
            backoff_cap=backoff_cap,
            max_message=max_message,
            recycle_after=recycle_after,
        )
        self.url = url
        self.clock = clock
        self.failure_lines = Throttle(clock, REPEAT_EVERY)  # connection failures logged at most once a minute
        self._conns: dict[str, UpstreamConnection] = {}
        # Owner attestations (NIP-OA tags) of managed identities, sent in their AUTH events.
        self.attestations: dict[str, list[str]] = {}
        self._closing: list[defer.Deferred[None]] = []

    def connection(self, signer: nostr.Signer) -> UpstreamConnection:
        """The connection that speaks as C{signer}."""
        conn = self._conns.get(signer.pubkey)
        if conn is None:
            conn = self._conns[signer.pubkey] = UpstreamConnection(self.settings, signer, self.attestations, self.failure_lines)
        return conn

    def states(self) -> dict[str, int]:
        """Connections by state (C{ready}, C{connecting}, C{down}), for the metrics listener."""
        counts = {"ready": 0, "connecting": 0, "down": 0}
        for conn in self._conns.values():
            counts["ready" if conn.ready else "connecting" if conn._connecting else "down"] += 1
        return counts

    def forget(self, pubkey: str) -> None:
        """Close and drop the connection of an identity that no longer exists."""
        self.attestations.pop(pubkey, None)
        conn = self._conns.pop(pubkey, None)
        if conn is not None:
            self._closing.append(conn.close())

    def close(self) -> defer.Deferred[Any]:
        """Close every connection; fires when all are gone."""
        closing = [conn.close() for conn in self._conns.values()] + self._closing
        self._conns.clear()
        self._closing = []
        return defer.gatherResults(closing)

    def abort(self) -> None:
        """Drop every connection at once (tests simulating a dead relay)."""
        for conn in list(self._conns.values()):
            conn.abort()
