"""The service shape every HTTP wing shares: listen on its endpoints, then drain on shutdown; and the
URL a listener serves."""

from __future__ import annotations

import os
import re
from typing import Any, Callable

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import MultiService, Service
from twisted.internet import defer, endpoints
from twisted.internet.error import CannotListenError
from twisted.internet.interfaces import IListeningPort, IReactorCore, IStreamServerEndpoint
from twisted.logger import Logger
from zope.interface import implementer

from relayd.base import metrics
from relayd.base.clock import Timekeeper
from relayd.base.config import is_loopback_endpoint, is_tls_endpoint
from relayd.compat.tcp import quick_accept
from relayd.web.site import RelaySite
from relayd.wing import DEFAULT_GRACE, IWing

_POLL = 0.05
# The listen queue relayd asks for where a listener names none (Node and nginx ask for 511 too):
# Twisted's own default, 50, overflows when thousands of clients connect at once (a dashboard storm
# after a deploy), and every overflowed connection then waits out a TCP retransmission (1 s, 3 s, ...).
# The kernel caps it at net.core.somaxconn.
DEFAULT_BACKLOG = 511
_BACKLOG_KINDS = frozenset({"tcp", "tcp6", "ssl", "unix"})
_SEGMENTS = re.compile(r"(?<!\\):")
# Every wing's startup line comes from this one logger, whatever the wing (docs/configuration.md "Logs").
_announcer = Logger(namespace="relayd.listening")


class CannotListen(Exception):
    """A listener that cannot be bound at start: its endpoint description and why, in one line
    (C{cannot listen on tcp:8787:interface=127.0.0.1: address already in use})."""

    def __init__(self, description: str, error: CannotListenError) -> None:
        reason = error.socketError
        if isinstance(reason, OSError) and reason.errno is not None:
            why = os.strerror(reason.errno)
            why = why[:1].lower() + why[1:]
        else:
            why = str(reason)
        super().__init__(f"cannot listen on {description}: {why}")


class StrictListener(StreamServerEndpointService):
    """A service listening on an endpoint that raises a bind error from C{privilegedStartService}
    (as strports does: a port that cannot be bound fails startup), through nothing but
    C{endpoint.listen}."""

    def __init__(self, endpoint: IStreamServerEndpoint, factory: Any) -> None:
        super().__init__(endpoint, factory)
        self.listening: defer.Deferred[IListeningPort] | None = None

    def privilegedStartService(self) -> None:
        Service.privilegedStartService(self)
        failed: list[Any] = []
        starting = True

        def now(failure: Any) -> Any:
            if starting:
                failed.append(failure)
                return None  # raised below
            return failure  # a later failure is for whoever waits on bound_port()

        self.listening = self.endpoint.listen(self.factory)
        self.listening.addCallback(_accepting_quickly)
        self.listening.addErrback(now)
        starting = False
        if failed:
            failed[0].raiseException()

    def startService(self) -> None:
        Service.startService(self)
        if self.listening is None:
            self.privilegedStartService()

    def stopService(self) -> Any:
        listening: Any = self.listening
        self.listening = None
        self.running = False
        if listening is None:
            return defer.succeed(None)
        listening.cancel()
        return listening.addCallback(lambda port: port.stopListening()).addErrback(lambda f: None)

    def bound_port(self) -> defer.Deferred[IListeningPort]:
        """Fires with the port once it is bound (once started)."""
        assert self.listening is not None, "not started"
        return self.listening


def _accepting_quickly(port: IListeningPort) -> IListeningPort:
    quick_accept(port)  # (a connection per request: its socket made without enum conversions)
    return port


def with_default_backlog(description: str) -> str:
    """C{description} with C{backlog=}L{DEFAULT_BACKLOG} where it is a listener that takes one and
    names none (C{systemd:} sockets are listened on by systemd, with the unit's C{Backlog=})."""
    segments = _SEGMENTS.split(description)
    kind = segments[1] if segments[0] == "haproxy" and len(segments) > 1 else segments[0]
    if kind not in _BACKLOG_KINDS or any(segment.startswith("backlog=") for segment in segments):
        return description
    return f"{description}:backlog={DEFAULT_BACKLOG}"


def add_listeners(
    parent: MultiService, site: RelaySite, listen: list[str], reactor: IReactorCore
) -> list[StrictListener]:
    """One child listener of C{parent} per endpoint description, all serving C{site}."""
    listeners = []
    for description in listen:
        svc = StrictListener(endpoints.serverFromString(reactor, with_default_backlog(description)), site)
        svc.description = description  # type: ignore[attr-defined]
        svc.setServiceParent(parent)
        listeners.append(svc)
    return listeners


def bound_ports(listeners: list[StrictListener]) -> defer.Deferred[list[IListeningPort]]:
    """Fires with the listeners' ports once every one is bound."""
    return defer.gatherResults([svc.bound_port() for svc in listeners])


@implementer(IWing)
class HTTPWingService(MultiService):
    """One wing's listeners over one site (L{IWing}).

    Shutdown runs in phases: stop listening; wait for C{settle()} (requests whose answers are still
    being worked out, such as broker actions); C{drain()} (the wing ends its streams with its own
    final frames and answers parked requests); close the site's connections; wait until
    C{remaining()} and the site report nothing open; abort what is left once C{grace} seconds have
    passed since listening stopped; then stop the other children (what they hold is no longer used).

    Everything is given at construction (the site built with its settings, the C{grace}); while
    it runs, the site's open connections are reported on C{relayd_http_connections}, and those waiting
    for their turn to start on C{relayd_http_connections_waiting}.
    """

    _log = Logger()
    url_path = ""  # the path the wing serves under, shown in its startup line (the MCP prefix)

    def __init__(
        self,
        name: str,
        site: RelaySite,
        listen: list[str],
        reactor: IReactorCore,
        clock: Timekeeper,
        *,
        settle: Callable[[], defer.Deferred[None]] = lambda: defer.succeed(None),
        drain: Callable[[], None] = lambda: None,
        remaining: Callable[[], int] = lambda: 0,
        abort: Callable[[], None] = lambda: None,
        grace: float = DEFAULT_GRACE,
    ) -> None:
        super().__init__()
        self.setName(name)
        self.site = site
        self.clock = clock
        self.grace = grace
        self._settle = settle
        self._drain = drain
        self._remaining = remaining
        self._abort = abort
        self.listeners = add_listeners(self, site, listen, reactor)
        # Read at scrape time by the metrics listener (stopped after the listeners, at drain's end).
        relay = site.relay or name
        watching = metrics.Watching().add(metrics.http_connections, site.open_connections, relay=relay)
        watching.add(metrics.http_connections_waiting, site.admission.waiting.__len__, relay=relay)
        watching.setServiceParent(self)
        self.drained = True  # False when shutdown had to give up on requests after a grace period
        for description in listen:
            if not is_loopback_endpoint(description):
                self._log.warn(
                    "{relay} listens on a non-loopback interface ({endpoint}): put it behind TLS "
                    "and authentication",
                    relay=name,
                    endpoint=description,
                )

    def privilegedStartService(self) -> None:
        """Bind every listener (twistd does this before it drops privileges).

        @raise CannotListen: naming the endpoint description that could not be bound.
        """
        Service.privilegedStartService(self)
        for child in self:
            try:
                child.privilegedStartService()
            except CannotListenError as e:
                raise CannotListen(getattr(child, "description", "?"), e) from None

    def ports(self) -> defer.Deferred[list[IListeningPort]]:
        """Fires with the listening ports once every listener is up (for tests and startup logs)."""
        return bound_ports(self.listeners)

    def startService(self) -> None:
        super().startService()
        self.ports().addCallback(self._announce).addErrback(lambda f: None)

    def details(self) -> str:
        """What the startup line says after the URL (the wing's key settings), or nothing."""
        return ""

    def settle(self) -> defer.Deferred[None]:
        """Fires once requests whose answers are being worked out are answered (shutdown's phase 2)."""
        return self._settle()

    def drain(self) -> None:
        """End the wing's streams with its own final frames; answer parked requests."""
        self._drain()

    def remaining(self) -> int:
        """Connections the site does not see (WebSockets) that are still open."""
        return self._remaining()

    def abort(self) -> None:
        """Abort what is still open once the grace period is over."""
        self._abort()

    def _announce(self, ports: list[IListeningPort]) -> None:
        """One line per listener: C{"<wing> listening on <url>[ (<details>)]"}."""
        details = self.details()
        for svc, port in zip(self.listeners, ports, strict=True):
            self._announce_one(listener_url(port, getattr(svc, "description", ""), self.url_path), details)

    def _announce_one(self, url: str, details: str) -> None:
        if details:
            _announcer.info("{relay} listening on {url} ({details})", relay=self.name, url=url, details=details)
        else:
            _announcer.info("{relay} listening on {url}", relay=self.name, url=url)

    async def _stop(self) -> None:
        await defer.gatherResults([defer.maybeDeferred(svc.stopService) for svc in self.listeners])
        self._log.info("{relay}: stopped listening, draining", relay=self.name)
        # One grace period covers settling and draining together.
        started = self.clock.seconds()
        if not await _within(self.clock, self.grace, self.settle()):
            self._log.warn("{relay}: grace period over with requests still in flight", relay=self.name)
            self.drained = False
        self.drain()
        self.site.close_connections()
        waited = self.clock.seconds() - started
        while waited < self.grace and (self.remaining() or self.site.open_connections()):
            await _sleep(self.clock, _POLL)
            waited += _POLL
        if self.remaining() or self.site.open_connections():
            self._log.warn("{relay}: grace period over, aborting open connections", relay=self.name)
            self.drained = False
            self.abort()
            self.site.close_connections(abort=True)
        # Other children (metrics callbacks, ...) stop once the connections are gone.
        others = [svc for svc in self if svc not in self.listeners and svc.running]
        await defer.gatherResults([defer.maybeDeferred(svc.stopService) for svc in others])

    def stopService(self) -> defer.Deferred[None]:
        self.running = False
        d = defer.Deferred.fromCoroutine(self._stop())
        # The reactor swallows a failing shutdown trigger silently: say what went wrong.
        d.addErrback(lambda f: self._log.failure("{relay}: drain failed", f, relay=self.name))
        return d


def listener_url(port: IListeningPort, description: str = "", path: str = "") -> str:
    """The URL a listener serves: C{http://host:port}, C{https://} when the endpoint terminates
    TLS, C{[v6]} literals bracketed; C{unix:/path} for a Unix socket (clients say how to reach it)."""
    address = port.getHost()
    host = getattr(address, "host", None)
    number = getattr(address, "port", None)
    if host is None or number is None:
        name = getattr(address, "name", None)
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        return f"unix:{name}" if name else str(address)
    scheme = "https" if is_tls_endpoint(description) else "http"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{number}{path}"


def _within(clock: Timekeeper, seconds: float, d: defer.Deferred[None]) -> defer.Deferred[bool]:
    """Fires with C{True} when C{d} does within C{seconds}, else with C{False} at that time."""
    outcome: defer.Deferred[bool] = defer.Deferred()
    def expired() -> None:
        if not outcome.called:
            outcome.callback(False)

    timer = clock.call_later(seconds, expired)

    def settled(_: object) -> None:
        if not outcome.called:
            clock.cancel(timer)
            outcome.callback(True)

    d.addBoth(settled)
    return outcome


def _sleep(clock: Timekeeper, seconds: float) -> defer.Deferred[None]:
    d: defer.Deferred[None] = defer.Deferred()
    clock.call_later(seconds, d.callback, None)
    return d
