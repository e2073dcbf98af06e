"""Whether the broker's Nostr relay can be reached, for the log, C{/healthz} and C{relayd-admin status}.

The broker's own connections are opened on demand, one per identity (docs/decisions.md B-7), so a
broker nobody asks would not notice that its relay is gone. L{Upstream} holds one WebSocket
connection of its own (it sends nothing on it) from start to stop: open means reachable; when it
cannot open, or drops, it is reopened with backoff. What it logs (docs/decisions.md B-13):

- a warning naming the relay (no credentials) when the first attempt fails, or has not completed
  L{START_WARNING} seconds after start;
- at most one line per L{REPEAT_EVERY} seconds while an outage lasts (or while the relay keeps
  accepting and dropping the connection);
- one line when the relay is reachable again (after an outage that was logged).

A connection that had stayed open L{STABLE} seconds and drops (relays may close idle connections) is
reopened at once without a word; only if that fails is the relay unreachable.

Every timer goes through the L{relayd.base.clock.Timekeeper}.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Callable, cast
from urllib.parse import urlsplit, urlunsplit

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from twisted.internet import defer, endpoints
from twisted.internet.interfaces import IDelayedCall, ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.base.clock import Timekeeper
from relayd.base.reactor import IReactor

START_WARNING = 5.0  # seconds after start without a connection before the broker warns
REPEAT_EVERY = 60.0  # seconds between lines about an outage that goes on
BACKOFF_BASE = 1.0
BACKOFF_CAP = 30.0
LOOK_AGAIN = 1.0  # seconds: an action during an outage re-checks the relay at most this often
STABLE = 10.0  # seconds a connection stays open before its loss is no longer a failing attempt

_log = Logger(namespace="relayd.buzz.upstream")


def public_url(url: str) -> str:
    """C{url} without what may be a secret: user information, query and fragment."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "(unparseable relay URL)"
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def iso(seconds: float) -> str:
    """UTC ISO 8601 with seconds, as the logs' C{time} writes it."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Throttle:
    """Lets one line through per C{interval} seconds and counts the ones it held back."""

    def __init__(self, clock: Timekeeper, interval: float) -> None:
        self.clock = clock
        self.interval = interval
        self._last: float | None = None
        self.held = 0

    def allow(self) -> int | None:
        """C{None}: say nothing now; else the number of lines held back since the last one let through."""
        now = self.clock.seconds()
        if self._last is not None and now - self._last < self.interval:
            self.held += 1
            return None
        self._last = now
        held, self.held = self.held, 0
        return held


class _Probe(WebSocketClientProtocol):
    """The monitor's connection: it says when it opens and when it is gone, nothing else."""

    def connectionMade(self) -> None:
        super().connectionMade()
        self.factory.upstream._transport_up(self)

    def onOpen(self) -> None:
        self.factory.upstream._opened(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        pass  # a NIP-42 challenge or a notice: nothing to do, the connection is only a probe

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        self.factory.upstream._lost(self, reason)


class Upstream:
    """The broker's view of its Nostr relay: connected or not, since when, the last error."""

    def __init__(
        self,
        url: str,
        reactor: IReactor,
        clock: Timekeeper,
        *,
        wall_clock: Callable[[], float] | None = None,
        connect_timeout: float = 10.0,
        start_warning: float = START_WARNING,
        repeat_every: float = REPEAT_EVERY,
        backoff_base: float = BACKOFF_BASE,
        backoff_cap: float = BACKOFF_CAP,
    ) -> None:
        self.url = url
        self.shown_url = public_url(url)
        self.reactor = reactor
        self.clock = clock
        self.wall_clock = wall_clock if wall_clock is not None else clock.seconds
        self.connect_timeout = connect_timeout
        self.start_warning = start_warning
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self.connected = False
        self.since = self.wall_clock()  # when C{connected} last changed (or the start)
        self.last_error: str | None = None
        self.failures = 0  # attempts that failed since a connection last stayed up (backoff)
        self._reported = False  # this outage has been logged
        self._ever_open = False
        self._opened_at = 0.0
        self._timed_out = False
        self._repeat = Throttle(clock, repeat_every)
        self._running = False
        self._proto: _Probe | None = None
        self._live: set[_Probe] = set()
        self._connect_d: defer.Deferred[Any] | None = None
        self._attempted_at = 0.0  # clock time of the last connection attempt
        self._retry_timer: IDelayedCall | None = None
        self._start_timer: IDelayedCall | None = None
        self._handshake_timer: IDelayedCall | None = None
        self._gone: list[defer.Deferred[None]] = []
        self._outcomes: list[defer.Deferred[bool]] = []

    def next_outcome(self) -> defer.Deferred[bool]:
        """Fires with the outcome of the next connection attempt (C{True}: open), or with C{False}
        when the open connection drops (for tests and tools that wait for a change)."""
        d: defer.Deferred[bool] = defer.Deferred()
        self._outcomes.append(d)
        return d

    def _tell(self, outcome: bool) -> None:
        waiting, self._outcomes = self._outcomes, []
        for d in waiting:
            d.callback(outcome)

    # --- what the broker reports

    def status(self) -> dict[str, Any]:
        """The C{upstream} member of the broker's C{/healthz}."""
        return {
            "url": self.shown_url,
            "connected": self.connected,
            "since": iso(self.since),
            "last_error": self.last_error,
        }

    def outage(self) -> str | None:
        """Why the relay is known to be unreachable (the last check failed), or C{None}: connected,
        or not checked yet. An action then answers at once instead of waiting out its own timeout."""
        if self.connected or self.failures == 0:
            return None
        if self._retry_timer is not None and self.clock.seconds() - self._attempted_at >= LOOK_AGAIN:
            # Someone wants the relay: look again now rather than after the backoff (up to
            # BACKOFF_CAP), so a relay that is back serves the next action, not one 30 s later.
            self._retry_timer.cancel()
            self._retry_timer = None
            self._retry()
        return f"the upstream relay has been unreachable since {iso(self.since)} ({self.last_error})"

    # --- lifecycle

    def start(self) -> None:
        """Connect, and warn if that has not worked within C{start_warning} seconds."""
        self._running = True
        self.since = self.wall_clock()
        self._start_timer = self.clock.call_later(self.start_warning, self._start_check)
        self._connect()

    def stop(self) -> defer.Deferred[None]:
        """Stop retrying and close the connection; fires once it is gone."""
        self._running = False
        for name in ("_retry_timer", "_start_timer", "_handshake_timer"):
            self.clock.cancel(getattr(self, name))
            setattr(self, name, None)
        pending, self._connect_d = self._connect_d, None
        if pending is not None and not pending.called:
            pending.cancel()
        if not self._live:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._gone.append(d)
        for proto in list(self._live):
            if proto.transport is not None:
                cast(ITCPTransport, proto.transport).abortConnection()  # nothing was sent on it: no close handshake owed
        return d

    def _start_check(self) -> None:
        self._start_timer = None
        if not self.connected and not self._reported and self._repeat.allow() is not None:
            self._reported = True
            _log.warn(
                "broker: upstream relay {upstream} not reachable {seconds:g}s after start ({why}); actions "
                "answer failed or indeterminate until it is",
                upstream=self.shown_url,
                seconds=self.start_warning,
                why=self.last_error or "still connecting",
            )

    # --- the probe connection

    def _connect(self) -> None:
        from relayd.buzz.nostr_upstream.websocket import tcp_endpoint as _endpoint

        factory = WebSocketClientFactory(self.url)
        factory.noisy = False  # no "Starting factory" / "Stopping factory" per attempt
        factory.protocol = _Probe
        factory.upstream = self  # type: ignore[attr-defined]
        # autobahn's handshake timers run outside the clock: ours guards the handshake instead.
        factory.setProtocolOptions(openHandshakeTimeout=0, closeHandshakeTimeout=0, autoPingInterval=0)
        parts = urlsplit(self.url)
        host = parts.hostname or "127.0.0.1"
        port = parts.port or (443 if parts.scheme == "wss" else 80)
        ep: Any = _endpoint(self.reactor, host, port, self.connect_timeout)
        if parts.scheme == "wss":
            from twisted.internet.ssl import optionsForClientTLS

            ep = endpoints.wrapClientTLS(optionsForClientTLS(host), ep)
        self._attempted_at = self.clock.seconds()
        d = self._connect_d = ep.connect(factory)
        d.addErrback(self._connect_failed)

    def _connect_failed(self, failure: Failure) -> None:
        self._connect_d = None
        if failure.check(defer.CancelledError) or not self._running:
            return
        self._down(failure.getErrorMessage() or type(failure.value).__name__)

    def _transport_up(self, proto: _Probe) -> None:
        self._connect_d = None
        self._live.add(proto)
        self._handshake_timer = self.clock.call_later(self.connect_timeout, self._handshake_expired, proto)

    def _handshake_expired(self, proto: _Probe) -> None:
        self._handshake_timer = None
        if proto is not self._proto and proto.transport is not None:
            self._timed_out = True
            cast(ITCPTransport, proto.transport).abortConnection()

    def _opened(self, proto: _Probe) -> None:
        self.clock.cancel(self._handshake_timer)
        self._handshake_timer = None
        self._proto = proto
        self._opened_at = self.clock.seconds()
        outage = self.wall_clock() - self.since
        self.connected = True
        self.since = self.wall_clock()
        if self._reported:  # the outage was logged: say it is over
            self._reported = False
            _log.info(
                "broker: upstream relay {upstream} reachable again after {down:.0f}s", upstream=self.shown_url, down=outage
            )
        elif not self._ever_open:
            _log.info("broker: upstream relay {upstream} reachable", upstream=self.shown_url)
        self._ever_open = True
        self._tell(True)

    def _lost(self, proto: _Probe, reason: Failure) -> None:
        self._live.discard(proto)
        if not self._live:
            gone, self._gone = self._gone, []
            for d in gone:
                d.callback(None)
        if not self._running:
            return
        if proto is not self._proto:
            self.clock.cancel(self._handshake_timer)
            self._handshake_timer = None
            timed_out, self._timed_out = self._timed_out, False
            self._down("no WebSocket handshake within the timeout" if timed_out
                       else f"WebSocket handshake failed: {reason.getErrorMessage()}")
            return
        self._proto = None
        self.connected = False
        self.since = self.wall_clock()
        why = f"connection lost: {reason.getErrorMessage()}"
        if self.clock.seconds() - self._opened_at >= STABLE:
            # A connection that had been up a while (a relay may close idle ones): one attempt at
            # once, and nothing said unless it fails too.
            self.failures = 0
            self.last_error = why
            self._tell(False)
            self._connect()
            return
        self._down(why)  # open, then gone at once: a failing attempt, with backoff

    def _down(self, why: str) -> None:
        """An attempt failed (or the connection dropped): say so (within limits) and retry later.

        One throttle spans outages, so a relay that keeps accepting and dropping gets at most a line
        a minute; a recovery is logged only when its outage was.
        """
        self.last_error = why
        self.failures += 1
        delay = min(self.backoff_cap, self.backoff_base * 2 ** (self.failures - 1))
        if self._repeat.allow() is not None:
            if not self._reported:
                self._reported = True
                _log.warn(
                    "broker: upstream relay {upstream} unreachable ({why}); actions answer failed or "
                    "indeterminate until it is back; retrying in {delay:g}s",
                    upstream=self.shown_url,
                    why=why,
                    delay=delay,
                )
            else:
                _log.warn(
                    "broker: upstream relay {upstream} still unreachable after {attempts} attempts since {since} "
                    "({why}); retrying in {delay:g}s",
                    upstream=self.shown_url,
                    attempts=self.failures,
                    since=iso(self.since),
                    why=why,
                    delay=delay,
                )
        if self._retry_timer is None:
            self._retry_timer = self.clock.call_later(delay, self._retry)
        self._tell(False)

    def _retry(self) -> None:
        self._retry_timer = None
        if self._running and self._proto is None and self._connect_d is None and not self._live:
            self._connect()
