"""A Twisted Nostr relay client (autobahn WebSocket): one NIP-42-authenticated connection per identity.

Each L{RelayConnection} speaks for one signer: on connect it waits briefly for the relay's AUTH
challenge, answers it with a kind-22242 event signed by that identity, and from then on sends
EVENTs (tracked until their C{OK} or a timeout) and REQs (collected until C{EOSE}, then CLOSEd).
A relay that never answers the AUTH with C{OK} is normal (PyPI nostr-relay does not); messages on
one connection are processed in order, so what follows the AUTH is judged authenticated.

An C{OK} whose message starts with C{duplicate:} means the relay already holds the event, which is
success whatever its boolean. A dropped connection fails what is pending on it (callers turn a
publish in flight into C{outcome_unknown}); the next demand reconnects, after an exponential backoff
when connecting keeps failing. Every timer goes through the L{relayd.clock.Clock}.
"""

from __future__ import annotations

import itertools
import os
import struct
from typing import Any, Callable, cast
from urllib.parse import urlsplit

import orjson
from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from autobahn.websocket.protocol import WebSocketProtocol
from autobahn.websocket.xormasker import create_xor_masker
from twisted.internet import defer, endpoints
from twisted.internet.interfaces import IDelayedCall, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.buzz import nostr
from relayd.buzz.upstream import REPEAT_EVERY, Throttle, public_url
from relayd.clock import Clock
from relayd.web.transport import write_now
from relayd.web.twisted_internals import ws_data_received, ws_frames_direct, ws_parser_idle

Event = dict[str, Any]


class RelayError(Exception):
    """Base class of relay-side failures."""


class NotConnected(RelayError):
    """The relay could not be reached (nothing was sent in this attempt)."""


class ConnectionLost(RelayError):
    """The connection dropped while a request was outstanding: its fate is unknown."""


class RelayTimeout(RelayError):
    """No OK/EOSE within the timeout."""


class QueryClosed(RelayError):
    """The relay refused a subscription (C{CLOSED}); the message is the relay's."""


_OPEN = WebSocketProtocol.STATE_OPEN
_TEXT_FIN = 0x81  # FIN + text opcode, no RSV bits
_SMALL_MASK = 1024  # below this, masking with Python integers beats building autobahn's masker


def _mask(payload: bytes, key: bytes) -> bytes:
    """RFC 6455 masking: XOR with the 4-byte key repeated."""
    n = len(payload)
    if n >= _SMALL_MASK:
        return create_xor_masker(key, n).process(payload)
    pad = (key * ((n >> 2) + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")


class _Protocol(WebSocketClientProtocol):
    """autobahn's client with a fast path for the frames a relay conversation consists of.

    Per message, autobahn's generic machinery (debug-log argument formatting, a masker object, a
    frame header object, four callbacks and traffic statistics) cost more CPU than everything the
    broker does with the message. While the connection is open and no partial frame is buffered,
    whole unfragmented text frames are parsed here and handed straight to the connection, and text
    messages are framed and masked here; anything else (control frames, fragments, partial frames,
    oversize or non-minimal lengths, the handshake) goes through autobahn unchanged.
    """

    conn: "RelayConnection"

    # An incomplete plain text frame at the end of a read is held here (as chunks, joined once it
    # is complete) instead of going to autobahn, which would then take every following frame.
    _held: list[bytes] | None = None
    _held_len = 0
    _need = 0  # bytes the held frame needs in all (its header's size while that is incomplete)
    recycled = False  # dropped by its connection for failing (RelayConnection._outcome)
    maxMessagePayloadSize: int  # autobahn's, copied from the factory when the connection opens

    def dataReceived(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
            self._held_len += len(data)
            if self._held_len < self._need:
                return
            data = b"".join(self._held)
            self._held = None
        if (
            self.state == _OPEN
            and ws_parser_idle(self)
        ):
            used, need = self._fast_frames(data)
            if need:
                self._held = [data[used:] if used else data]
                self._held_len = len(data) - used
                self._need = need
                return
            if used == len(data):
                return
            if used:
                data = data[used:]
        ws_data_received(self, data)  # autobahn's path, minus its per-call debug-log formatting

    def _fast_frames(self, data: bytes) -> tuple[int, int]:
        """Deliver the complete plain text frames at the head of C{data}.

        Returns (bytes consumed, bytes needed): C{needed} is non-zero when what is left starts a
        plain text frame that is not complete yet (its full size, or its header's while that is
        cut); zero when what is left (if anything) is for autobahn.
        """
        n = len(data)
        i = 0
        limit = self.maxMessagePayloadSize
        conn = self.factory.conn
        while i < n:
            if data[i] != _TEXT_FIN:
                return i, 0
            avail = n - i
            if avail < 2:
                return i, 2
            b1 = data[i + 1]
            if b1 & 0x80:  # a masked server frame: autobahn refuses it
                return i, 0
            length = b1
            header = 2
            if length == 126:
                if avail < 4:
                    return i, 4
                (length,) = struct.unpack_from("!H", data, i + 2)
                header = 4
                if length < 126:
                    return i, 0
            elif length == 127:
                if avail < 10:
                    return i, 10
                (length,) = struct.unpack_from("!Q", data, i + 2)
                header = 10
                if length < 65536:
                    return i, 0
            if limit and length > limit:
                return i, 0
            if header + length > avail:
                return i, header + length
            end = i + header + length
            conn._message(self, data[i + header : end])
            i = end
            if self.state != _OPEN:
                return i, 0  # the message closed the connection: autobahn handles what follows
        return i, 0

    def send_text(self, payload: bytes) -> None:
        """Send one text message (framed and masked here while the connection is plainly open)."""
        if self.state != _OPEN or not ws_frames_direct(self) or self.transport is None:
            self.sendMessage(payload)
            return
        n = len(payload)
        if n < 126:
            header = bytes((_TEXT_FIN, 0x80 | n))
        elif n < 65536:
            header = struct.pack("!BBH", _TEXT_FIN, 0xFE, n)
        else:
            header = struct.pack("!BBQ", _TEXT_FIN, 0xFF, n)
        key = os.urandom(4)
        # Sent at once when nothing is queued: Twisted's write would cost a reactor turn and two
        # epoll registrations per request frame.
        write_now(self.transport, header + key + _mask(payload, key))

    def connectionMade(self) -> None:
        super().connectionMade()
        # autobahn means to disable Nagle but reads its option before copying it from the factory
        # (the AttributeError is swallowed). With Nagle on, a small frame written while an earlier
        # one is unacknowledged waits for the relay's delayed ACK: ~40 ms per request/response turn.
        try:
            cast(ITCPTransport, self.transport).setTcpNoDelay(True)
        except (AttributeError, OSError):  # not a TCP transport
            pass
        self.factory.conn._transport_up(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        self.factory.conn._transport_down(self)

    def onOpen(self) -> None:
        self.factory.conn._opened(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.factory.conn._message(self, payload)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        self.factory.conn._closed(self, reason or "")


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


class RelayConnection:
    """The connection the host uses to act as one identity."""

    _log = Logger()
    _sub_ids = itertools.count(1)

    def __init__(
        self,
        pool: "RelayPool",
        signer: nostr.Signer,
    ) -> None:
        self.pool = pool
        self.signer = signer
        self._proto: _Protocol | None = None
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
        self._live: set[_Protocol] = set()  # transports not yet lost (open or handshaking)
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
        clock = self.pool.clock
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
        pool = self.pool
        factory = WebSocketClientFactory(pool.url)
        factory.noisy = False  # no "Starting factory" / "Stopping factory" lines per attempt
        factory.protocol = _Protocol
        factory.conn = self  # type: ignore[attr-defined]
        # autobahn's own handshake timers run on txaio's batched timer, outside the Clock (and are
        # left behind when cancelled): disable them and guard the handshake with our own timer.
        factory.setProtocolOptions(
            maxMessagePayloadSize=pool.max_message,
            maxFramePayloadSize=pool.max_message,
            openHandshakeTimeout=0,
            closeHandshakeTimeout=0,
            utf8validateIncoming=False,  # orjson rejects invalid UTF-8 anyway
        )
        parts = urlsplit(pool.url)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if parts.scheme == "wss" else 80)
        ep: Any = _endpoint(pool.reactor, host, port, pool.connect_timeout)
        if parts.scheme == "wss":
            from twisted.internet.ssl import optionsForClientTLS

            ep = endpoints.wrapClientTLS(optionsForClientTLS(host), ep)
        self._connect_d = ep.connect(factory)
        self._connect_d.addErrback(self._connect_failed)

    def _transport_up(self, proto: _Protocol) -> None:
        self._live.add(proto)
        self._handshake_timer = self.pool.clock.call_later(self.pool.connect_timeout, self._handshake_expired, proto)

    def _handshake_expired(self, proto: _Protocol) -> None:
        self._handshake_timer = None
        if proto is not self._proto and proto.transport is not None:
            cast(ITCPTransport, proto.transport).abortConnection()

    def _transport_down(self, proto: _Protocol) -> None:
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
        delay = min(self.pool.backoff_cap, self.pool.backoff_base * (2 ** (self._failures - 1)))
        self._next_attempt = self.pool.clock.seconds() + delay
        held = self.pool.failure_lines.allow()  # one line a minute, however many identities retry
        if held is not None:
            self._log.info(
                "relay {url} unavailable for {who} ({why}); next attempt in {delay:.2f}s{more}",
                url=self.pool.shown_url,
                who=self.signer.pubkey[:12],
                why=why,
                delay=delay,
                more=f" ({held} more such lines held back)" if held else "",
            )
        if self._waiters and self._retry_timer is None:
            self._retry_timer = self.pool.clock.call_later(delay, self._retry)

    def _opened(self, proto: _Protocol) -> None:
        self.pool.clock.cancel(self._handshake_timer)
        self._handshake_timer = None
        self._proto = proto
        self._connecting = False
        self._failures = 0
        self._next_attempt = 0.0
        # A relay that requires NIP-42 sends its challenge on connect: give it a moment.
        self._challenge_timer = self.pool.clock.call_later(self.pool.challenge_wait, self._set_ready)

    def _set_ready(self) -> None:
        self._challenge_timer = None
        if self._proto is None:
            return
        self._ready = True
        waiters, self._waiters = self._waiters, []
        for d in waiters:
            d.callback(None)

    def _closed(self, proto: _Protocol, reason: str) -> None:
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
        self.pool.clock.cancel(self._challenge_timer)
        self._challenge_timer = None
        publishes, self._publishes = self._publishes, {}
        queries, self._queries = self._queries, {}
        for p in publishes.values():
            self.pool.clock.cancel(p.timer)
            p.resolve(ConnectionLost("relay connection dropped after publish was attempted"))
        for q in queries.values():
            self.pool.clock.cancel(q.timer)
            q.deferred.errback(ConnectionLost("relay connection dropped during a read"))
        if self._waiters:
            self._note_failure(reason or "connection closed")

    def close(self, grace: float = 2.0) -> defer.Deferred[None]:
        """Close the connection; fires once the transport is gone (aborted after C{grace})."""
        clock = self.pool.clock
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
        assert self._proto is not None
        self._proto.send_text(orjson.dumps(message))

    def _message(self, proto: _Protocol, payload: bytes) -> None:
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
            self.pool.auth_url,
            challenge,
            int(self.pool.clock_now()),
            self.pool.attestations.get(self.signer.pubkey),
        )
        self._send(["AUTH", ev])
        self.authenticated_as = self.signer.pubkey
        if self._challenge_timer is not None:
            self.pool.clock.cancel(self._challenge_timer)
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
        self.pool.clock.cancel(p.timer)
        good = accepted or message.startswith("duplicate:")
        p.resolve((good, message))
        self._outcome(good)

    def _finish_query(self, sub_id: str, error: Exception | None) -> None:
        q = self._queries.pop(sub_id, None)
        if q is None:
            return
        self.pool.clock.cancel(q.timer)
        if error is None:
            if self._proto is not None:
                self._send(["CLOSE", sub_id])
            self._outcome(True)
            q.deferred.callback(q.events)
        else:
            self._outcome(False)
            q.deferred.errback(error)

    # --- requests

    async def publish(self, event: Event, timeout: float) -> tuple[bool, str]:
        """Send an EVENT; returns (accepted, relay message). C{duplicate:} counts as accepted.

        @raise NotConnected: the relay was not reachable within the timeout (nothing sent now).
        @raise ConnectionLost: the connection dropped after sending.
        @raise RelayTimeout: no OK within the timeout.
        """
        clock = self.pool.clock
        start = clock.seconds()
        await self.ensure_ready(timeout)
        remaining = max(0.0, timeout - (clock.seconds() - start))
        eid = event["id"]
        existing = self._publishes.get(eid)
        if existing is not None:  # the same event is already in flight: share its answer
            return await existing.wait()
        p = self._publishes[eid] = _Publish(clock.call_later(remaining, self._publish_timeout, eid))
        d = p.wait()
        self._send(["EVENT", event])
        return await d

    def _publish_timeout(self, eid: str) -> None:
        p = self._publishes.pop(eid, None)
        if p is not None:
            p.resolve(RelayTimeout("no OK from the relay within the timeout"))
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
        if self._strikes >= self.pool.recycle_after and self._proto is not None:
            self._strikes = 0
            self.recycled += 1
            self._log.info(
                "relay {url}: connection for {who} failed {n} times in a row; reconnecting",
                url=self.pool.shown_url,
                who=self.signer.pubkey[:12],
                n=self.pool.recycle_after,
            )
            proto = self._proto
            proto.recycled = True
            self._closed(proto, "recycled after repeated failures")  # fail what is pending now, forget it
            if proto.transport is not None:
                cast(ITCPTransport, proto.transport).abortConnection()

    async def query(self, filters: list[dict[str, Any]], timeout: float) -> list[Event]:
        """Run a REQ until EOSE and return the stored events it yielded (relay order)."""
        clock = self.pool.clock
        start = clock.seconds()
        await self.ensure_ready(timeout)
        remaining = max(0.0, timeout - (clock.seconds() - start))
        sub_id = f"q{next(self._sub_ids)}"
        d: defer.Deferred[list[Event]] = defer.Deferred()
        timer = clock.call_later(remaining, self._query_timeout, sub_id)
        self._queries[sub_id] = _Query(d, timer)
        self._send(["REQ", sub_id, *filters])
        return await d

    def _query_timeout(self, sub_id: str) -> None:
        q = self._queries.pop(sub_id, None)
        if q is not None:
            if self._proto is not None:
                self._send(["CLOSE", sub_id])
            q.deferred.errback(RelayTimeout("no EOSE from the relay within the timeout"))
            self._outcome(False)


def _endpoint(reactor: Any, host: str, port: int, timeout: float) -> Any:
    """A plain TCP endpoint for an IP literal (HostnameEndpoint leaves a timer behind when cancelled)."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return endpoints.HostnameEndpoint(reactor, host, port, timeout=timeout)
    cls = endpoints.TCP6ClientEndpoint if ip.version == 6 else endpoints.TCP4ClientEndpoint
    return cls(reactor, host, port, timeout=timeout)


class RelayPool:
    """Connections to one relay, one per identity, opened on demand."""

    _log = Logger()

    def __init__(
        self,
        url: str,
        reactor: Any,
        clock: Clock,
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
        self.url = url
        self.shown_url = public_url(url)  # for logs: no credentials a URL might carry
        self.auth_url = auth_url or url
        self.reactor = reactor
        self.clock = clock
        self.connect_timeout = connect_timeout
        self.challenge_wait = challenge_wait
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.max_message = max_message
        self.clock_now = wall_clock or clock.seconds
        self.recycle_after = recycle_after  # consecutive failures (timeout, refusal) that drop a connection
        self.failure_lines = Throttle(clock, REPEAT_EVERY)  # connection failures logged at most once a minute
        self._conns: dict[str, RelayConnection] = {}
        # Owner attestations (NIP-OA tags) of managed identities, sent in their AUTH events.
        self.attestations: dict[str, list[str]] = {}
        self._closing: list[defer.Deferred[None]] = []

    def connection(self, signer: nostr.Signer) -> RelayConnection:
        """The connection that speaks as C{signer}."""
        conn = self._conns.get(signer.pubkey)
        if conn is None:
            conn = self._conns[signer.pubkey] = RelayConnection(self, signer)
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
