"""One identity's connection to the upstream Nostr relay: NIP-42 AUTH, publishing, querying.

Each L{UpstreamConnection} speaks for one signer: on connect it waits briefly for the relay's AUTH
challenge, answers it with a kind-22242 event signed by that identity, and from then on sends
EVENTs (tracked until their C{OK} or a timeout) and REQs (collected until C{EOSE}, then CLOSEd).
A relay that never answers the AUTH with C{OK} is normal (PyPI nostr-relay does not); messages on
one connection are processed in order, so what follows the AUTH is judged authenticated.

An C{OK} whose message starts with C{duplicate:} means the relay already holds the event, which is
success whatever its boolean. A dropped connection fails what is pending on it (callers turn a
publish in flight into C{outcome_unknown}); the next demand reconnects, after the pool's backoff
(L{relayd.buzz.nostr_upstream.settings.UpstreamSettings.retry_delay}) when connecting keeps failing.
Every timer goes through the L{relayd.base.clock.Timekeeper}.
"""

from __future__ import annotations

import itertools
from typing import Any, Mapping, cast

import orjson
from autobahn.exception import Disconnected
from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall, ITCPTransport
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.buzz import nostr
from relayd.buzz.nostr_upstream import websocket
from relayd.buzz.nostr_upstream.errors import ConnectionLost, NotConnected, QueryClosed, UpstreamTimeout
from relayd.buzz.nostr_upstream.settings import UpstreamSettings
from relayd.buzz.nostr_upstream.websocket import UpstreamWebSocket
from relayd.buzz.upstream import Throttle

Event = dict[str, Any]


class _Publish:
    """An EVENT awaiting its OK; every caller publishing the same event shares the answer."""

    __slots__ = ("waiters", "timer")

    def __init__(self, timer: IDelayedCall) -> None:
        self.waiters: list[defer.Deferred[tuple[bool, str]]] = []
        self.timer = timer

    def wait(self) -> defer.Deferred[tuple[bool, str]]:
        d: defer.Deferred[tuple[bool, str]] = defer.Deferred()
        self.waiters.append(d)
        return d

    def resolve(self, result: tuple[bool, str] | Exception) -> None:
        waiters, self.waiters = self.waiters, []
        for d in waiters:
            if isinstance(result, Exception):
                d.errback(result)
            else:
                d.callback(result)


class _Query:
    __slots__ = ("deferred", "timer", "events")

    def __init__(self, deferred: defer.Deferred[list[Event]], timer: IDelayedCall) -> None:
        self.deferred = deferred
        self.timer = timer
        self.events: list[Event] = []


class UpstreamConnection:
    """The connection to the upstream Nostr relay the host uses to act as one identity."""

    _log = Logger()
    _sub_ids = itertools.count(1)

    def __init__(
        self,
        settings: UpstreamSettings,
        signer: nostr.Signer,
        attestations: Mapping[str, list[str]],
        failure_lines: Throttle,
    ) -> None:
        """C{attestations}: the owner attestations (NIP-OA tags) of managed identities, kept by the
        pool as agents are created, sent in AUTH; C{failure_lines}: the pool's one throttle on
        connection-failure log lines, however many identities retry."""
        self.settings = settings
        self.signer = signer
        self._attestations = attestations
        self._failure_lines = failure_lines
        self._proto: UpstreamWebSocket | None = None
        self._ready = False
        self._connecting = False
        self._waiters: list[defer.Deferred[None]] = []
        self._challenge_timer: IDelayedCall | None = None
        self._retry_timer: IDelayedCall | None = None
        self._failures = 0
        self._next_attempt = 0.0
        self._publishes: dict[str, _Publish] = {}
        self._queries: dict[str, _Query] = {}
        self.authenticated_as: str | None = None
        self._live: set[UpstreamWebSocket] = set()  # transports not yet lost (open or handshaking)
        self._gone: list[defer.Deferred[None]] = []
        self._handshake_timer: IDelayedCall | None = None
        self._connect_d: defer.Deferred[Any] | None = None
        self._strikes = 0  # consecutive publishes/reads on this connection that failed
        self.recycled = 0  # connections dropped for failing (tests, logs)

    # --- connection lifecycle

    @property
    def ready(self) -> bool:
        return self._ready

    def ensure_ready(self, timeout: float) -> defer.Deferred[None]:
        """Fires once the connection is open and (if the relay asked) AUTH has been sent."""
        if self._ready:
            return defer.succeed(None)
        clock = self.settings.clock
        d: defer.Deferred[None] = defer.Deferred()
        clock.cancel_when(d, clock.call_later(timeout, self._waiter_timeout, d))
        self._waiters.append(d)
        if not self._connecting and self._retry_timer is None:
            # Back off, but never so long that this demand gets no attempt within its timeout.
            delay = min(self._next_attempt - clock.seconds(), timeout / 2)
            if delay > 0:
                self._retry_timer = clock.call_later(delay, self._retry)
            else:
                self._connect()
        return d

    def _waiter_timeout(self, d: defer.Deferred[None]) -> None:
        if d in self._waiters:
            self._waiters.remove(d)
            d.errback(NotConnected("relay connection not ready within the timeout"))
        if not self._waiters:
            self._cancel_connect()

    def _cancel_connect(self) -> None:
        """Give up a TCP connection attempt nobody waits for any more."""
        pending, self._connect_d = self._connect_d, None
        if pending is not None and not pending.called:
            pending.cancel()

    def _retry(self) -> None:
        self._retry_timer = None
        if self._waiters and not self._connecting and not self._ready:
            self._connect()

    def _connect(self) -> None:
        self._connecting = True
        s = self.settings
        self._connect_d = websocket.connect(s.reactor, s.url, self, s.max_message, s.connect_timeout)
        self._connect_d.addErrback(self._connect_failed)

    def on_transport_up(self, proto: UpstreamWebSocket) -> None:
        self._live.add(proto)
        self._handshake_timer = self.settings.clock.call_later(self.settings.connect_timeout, self._handshake_expired, proto)

    def _handshake_expired(self, proto: UpstreamWebSocket) -> None:
        self._handshake_timer = None
        if proto is not self._proto and proto.transport is not None:
            cast(ITCPTransport, proto.transport).abortConnection()

    def on_transport_down(self, proto: UpstreamWebSocket) -> None:
        self._live.discard(proto)
        if not self._live:
            gone, self._gone = self._gone, []
            for d in gone:
                d.callback(None)

    def _connect_failed(self, failure: Failure) -> None:
        self._connecting = False
        if failure.check(defer.CancelledError):
            return
        self._note_failure(f"cannot connect: {failure.getErrorMessage()}")

    def _note_failure(self, why: str) -> None:
        self._failures += 1
        delay = self.settings.retry_delay(self._failures)
        self._next_attempt = self.settings.clock.seconds() + delay
        held = self._failure_lines.allow()  # one line a minute, however many identities retry
        if held is not None:
            self._log.info(
                "relay {url} unavailable for {who} ({why}); next attempt in {delay:.2f}s{more}",
                url=self.settings.shown_url,
                who=self.signer.pubkey[:12],
                why=why,
                delay=delay,
                more=f" ({held} more such lines held back)" if held else "",
            )
        if self._waiters and self._retry_timer is None:
            self._retry_timer = self.settings.clock.call_later(delay, self._retry)

    def on_open(self, proto: UpstreamWebSocket) -> None:
        self.settings.clock.cancel(self._handshake_timer)
        self._handshake_timer = None
        self._proto = proto
        self._connecting = False
        self._failures = 0
        self._next_attempt = 0.0
        # A relay that requires NIP-42 sends its challenge on connect: give it a moment.
        self._challenge_timer = self.settings.clock.call_later(self.settings.challenge_wait, self._set_ready)

    def _set_ready(self) -> None:
        self._challenge_timer = None
        if self._proto is None:
            return
        self._ready = True
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.callback(None)

    def on_close(self, proto: UpstreamWebSocket, reason: str) -> None:
        if proto.recycled and proto is not self._proto:
            return  # already accounted for when it was dropped (its close may come during a reconnect)
        if proto is not self._proto:
            if self._connecting:  # the handshake failed
                self._connecting = False
                self._note_failure(reason or "handshake failed")
            return
        self._proto = None
        self._ready = False
        self.authenticated_as = None
        self.settings.clock.cancel(self._challenge_timer)
        self._challenge_timer = None
        publishes, self._publishes = self._publishes, {}
        queries, self._queries = self._queries, {}
        for p in publishes.values():
            self.settings.clock.cancel(p.timer)
            p.resolve(ConnectionLost("relay connection dropped after publish was attempted"))
        for q in queries.values():
            self.settings.clock.cancel(q.timer)
            q.deferred.errback(ConnectionLost("relay connection dropped during a read"))
        if self._waiters:
            self._note_failure(reason or "connection closed")

    def close(self, grace: float = 2.0) -> defer.Deferred[None]:
        """Close the connection; fires once the transport is gone (aborted after C{grace})."""
        clock = self.settings.clock
        clock.cancel(self._retry_timer)
        self._retry_timer = None
        clock.cancel(self._handshake_timer)
        self._handshake_timer = None
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.errback(NotConnected("relay client shutting down"))
        self._cancel_connect()
        if not self._live:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._gone.append(d)
        for proto in list(self._live):
            if proto is self._proto:
                proto.sendClose()
            elif proto.transport is not None:
                proto.transport.loseConnection()
        return clock.cancel_when(d, clock.call_later(grace, self.abort))

    def abort(self) -> None:
        """Drop the connection at once."""
        for proto in list(self._live):
            if proto.transport is not None:
                cast(ITCPTransport, proto.transport).abortConnection()

    # --- messages

    def _send(self, message: list[Any]) -> None:
        """Send one message, or raise L{NotConnected} (nothing sent) when the connection is gone or
        closing: a close handshake under way leaves C{ready} set until the close completes, and
        autobahn raises its own C{Disconnected} on such a send."""
        proto = self._proto
        if proto is None or not proto.can_send:
            raise NotConnected("relay connection is closing")
        try:
            proto.send_text(orjson.dumps(message))
        except Disconnected as e:
            raise NotConnected("relay connection is closing") from e

    def _send_if_open(self, message: list[Any]) -> None:
        """Send a message nothing waits on (a CLOSE, an AUTH answer), if the connection can still take it."""
        try:
            self._send(message)
        except NotConnected:
            pass

    def on_message(self, proto: UpstreamWebSocket, payload: bytes) -> None:
        try:
            msg = orjson.loads(payload)
            kind = msg[0]
        except Exception:
            self._log.debug("ignoring a malformed relay message")
            return
        try:
            if kind == "EVENT":
                q = self._queries.get(msg[1])
                if q is not None and isinstance(msg[2], dict):
                    q.events.append(msg[2])
            elif kind == "EOSE":
                self._finish_query(msg[1], None)
            elif kind == "OK":
                self._ok(str(msg[1]), msg[2] is True, str(msg[3]) if len(msg) > 3 else "")
            elif kind == "CLOSED":
                self._finish_query(msg[1], QueryClosed(str(msg[2]) if len(msg) > 2 else "closed"))
            elif kind == "AUTH":
                self._auth(str(msg[1]))
            elif kind == "NOTICE":
                self._log.info("relay notice: {notice}", notice=str(msg[1])[:200])
        except (IndexError, TypeError, KeyError):
            self._log.debug("ignoring a malformed {kind} message", kind=kind)

    def _auth(self, challenge: str) -> None:
        ev = nostr.auth_event(
            self.signer,
            self.settings.auth_url,
            challenge,
            int(self.settings.wall_clock()),
            self._attestations.get(self.signer.pubkey),
        )
        self._send_if_open(["AUTH", ev])
        self.authenticated_as = self.signer.pubkey
        if self._challenge_timer is not None:
            self.settings.clock.cancel(self._challenge_timer)
            self._set_ready()

    def _ok(self, event_id: str, accepted: bool, message: str) -> None:
        p = self._publishes.pop(event_id, None)
        if p is None and event_id == "" and len(self._publishes) == 1:
            # Some relays answer a refused EVENT with an empty id; with one publish pending it is ours.
            (only,) = self._publishes
            p = self._publishes.pop(only)
        if p is None:
            if not accepted:
                self._log.info("relay refused {id}: {message}", id=event_id[:16], message=message[:200])
            return
        self.settings.clock.cancel(p.timer)
        good = accepted or message.startswith("duplicate:")
        p.resolve((good, message))
        self._outcome(good)

    def _finish_query(self, sub_id: str, error: Exception | None) -> None:
        q = self._queries.pop(sub_id, None)
        if q is None:
            return
        self.settings.clock.cancel(q.timer)
        if error is None:
            self._send_if_open(["CLOSE", sub_id])
            self._outcome(True)
            q.deferred.callback(q.events)
        else:
            self._outcome(False)
            q.deferred.errback(error)

    # --- requests

    async def publish(self, event: Event, timeout: float) -> tuple[bool, str]:
        """Send an EVENT; returns (accepted, relay message). C{duplicate:} counts as accepted.

        @raise NotConnected: the relay was not reachable within the timeout, or the connection is
            closing (nothing sent now).
        @raise ConnectionLost: the connection dropped after sending.
        @raise UpstreamTimeout: no OK within the timeout.
        """
        clock = self.settings.clock
        start = clock.seconds()
        await self.ensure_ready(timeout)
        remaining = max(0.0, timeout - (clock.seconds() - start))
        eid = event["id"]
        existing = self._publishes.get(eid)
        if existing is not None:  # the same event is already in flight: share its answer
            return await existing.wait()
        self._send(["EVENT", event])  # first: when it cannot be sent, nothing waits for an OK
        p = self._publishes[eid] = _Publish(clock.call_later(remaining, self._publish_timeout, eid))
        return await p.wait()

    def _publish_timeout(self, eid: str) -> None:
        p = self._publishes.pop(eid, None)
        if p is not None:
            p.resolve(UpstreamTimeout("no OK from the relay within the timeout"))
            self._outcome(False)

    def _outcome(self, good: bool) -> None:
        """Count consecutive failures; drop a connection that keeps failing so the next demand reconnects.

        A relay may throttle or wedge one connection (an identity's, after refusals) while a
        new one is served normally: keeping the bad one would fail every later request too.
        """
        if good:
            self._strikes = 0
            return
        self._strikes += 1
        if self._strikes >= self.settings.recycle_after and self._proto is not None:
            self._strikes = 0
            self.recycled += 1
            self._log.info(
                "relay {url}: connection for {who} failed {n} times in a row; reconnecting",
                url=self.settings.shown_url,
                who=self.signer.pubkey[:12],
                n=self.settings.recycle_after,
            )
            proto = self._proto
            proto.recycled = True
            self.on_close(proto, "recycled after repeated failures")  # fail what is pending now, forget it
            if proto.transport is not None:
                cast(ITCPTransport, proto.transport).abortConnection()

    async def query(self, filters: list[dict[str, Any]], timeout: float) -> list[Event]:
        """Run a REQ until EOSE and return the stored events it yielded (relay order).

        @raise NotConnected: as for L{publish} (nothing sent now).
        @raise ConnectionLost: the connection dropped before EOSE.
        @raise UpstreamTimeout: no EOSE within the timeout.
        @raise QueryClosed: the relay refused the REQ.
        """
        clock = self.settings.clock
        start = clock.seconds()
        await self.ensure_ready(timeout)
        remaining = max(0.0, timeout - (clock.seconds() - start))
        sub_id = f"q{next(self._sub_ids)}"
        self._send(["REQ", sub_id, *filters])  # first: when it cannot be sent, nothing waits for EOSE
        d: defer.Deferred[list[Event]] = defer.Deferred()
        timer = clock.call_later(remaining, self._query_timeout, sub_id)
        self._queries[sub_id] = _Query(d, timer)
        return await d

    def _query_timeout(self, sub_id: str) -> None:
        q = self._queries.pop(sub_id, None)
        if q is not None:
            self._send_if_open(["CLOSE", sub_id])
            q.deferred.errback(UpstreamTimeout("no EOSE from the relay within the timeout"))
            self._outcome(False)
