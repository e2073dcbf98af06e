"""The service shape every HTTP wing shares: listen on its endpoints, then drain on shutdown."""

from __future__ import annotations

from typing import Callable

from twisted.application.internet import StreamServerEndpointService
from twisted.application.service import MultiService
from twisted.internet import defer, endpoints
from twisted.internet.interfaces import IListeningPort, IReactorCore
from twisted.logger import Logger

from relayd.clock import Clock
from relayd.config import is_loopback_endpoint
from relayd.web.site import RelaySite
from relayd.web.twisted_internals import bound_port, listening_service

DEFAULT_GRACE = 5.0
_POLL = 0.05


def add_listeners(
    parent: MultiService, site: RelaySite, listen: list[str], reactor: IReactorCore
) -> list[StreamServerEndpointService]:
    """One child listener of C{parent} per endpoint description, all serving C{site}."""
    listeners = []
    for description in listen:
        # A port that cannot be bound fails startup, as strports does.
        svc = listening_service(endpoints.serverFromString(reactor, description), site)
        svc.description = description  # type: ignore[attr-defined]
        svc.setServiceParent(parent)
        listeners.append(svc)
    return listeners


def bound_ports(listeners: list[StreamServerEndpointService]) -> defer.Deferred[list[IListeningPort]]:
    """Fires with the listeners' ports once every one is bound."""
    return defer.gatherResults([bound_port(svc) for svc in listeners])


class HTTPWingService(MultiService):
    """One wing's listeners over one site.

    Shutdown runs in phases: stop listening; wait for C{settle()} (requests whose answers are still
    being worked out, such as broker actions); C{drain()} (the wing ends its streams with its own
    final frames and answers parked requests); close the site's connections; wait until
    C{remaining()} and the site report nothing open; abort what is left once C{grace} seconds have
    passed since listening stopped; then stop the other children (what they hold is no longer used).
    """

    _log = Logger()

    def __init__(
        self,
        name: str,
        site: RelaySite,
        listen: list[str],
        reactor: IReactorCore,
        clock: Clock,
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
        if getattr(site, "relay", None) is None:
            site.relay = name  # access-log lines and metrics name the relay
        self.clock = clock
        self.grace = grace
        self._settle = settle
        self._drain = drain
        self._remaining = remaining
        self._abort = abort
        self.listeners = add_listeners(self, site, listen, reactor)
        self.drained = True  # False when shutdown had to give up on requests after a grace period
        for description in listen:
            if not is_loopback_endpoint(description):
                self._log.warn(
                    "{relay} listens on a non-loopback interface ({endpoint}): put it behind TLS "
                    "and authentication",
                    relay=name,
                    endpoint=description,
                )

    def ports(self) -> defer.Deferred[list[IListeningPort]]:
        """Fires with the listening ports once every listener is up (for tests and startup logs)."""
        return bound_ports(self.listeners)

    def startService(self) -> None:
        super().startService()
        self.ports().addCallback(self._announce).addErrback(lambda f: None)

    def _announce(self, ports: list[IListeningPort]) -> None:
        for port in ports:
            host = port.getHost()
            self._log.info(
                "{relay} listening on {host}:{port}",
                relay=self.name,
                host=getattr(host, "host", host),
                port=getattr(host, "port", ""),
            )

    async def _stop(self) -> None:
        await defer.gatherResults([defer.maybeDeferred(svc.stopService) for svc in self.listeners])
        self._log.info("{relay}: stopped listening, draining", relay=self.name)
        # One grace period covers settling and draining together.
        started = self.clock.seconds()
        if not await _within(self.clock, self.grace, self._settle()):
            self._log.warn("{relay}: grace period over with requests still in flight", relay=self.name)
            self.drained = False
        self._drain()
        self.site.close_connections()
        waited = self.clock.seconds() - started
        while waited < self.grace and (self._remaining() or self.site.open_connections()):
            await _sleep(self.clock, _POLL)
            waited += _POLL
        if self._remaining() or self.site.open_connections():
            self._log.warn("{relay}: grace period over, aborting open connections", relay=self.name)
            self.drained = False
            self._abort()
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


def _within(clock: Clock, seconds: float, d: defer.Deferred[None]) -> defer.Deferred[bool]:
    """Fires with C{True} when C{d} does within C{seconds}, else with C{False} at that time."""
    outcome: defer.Deferred[bool] = defer.Deferred()
    timer = clock.call_later(seconds, lambda: outcome.called or outcome.callback(False))

    def settled(_: object) -> None:
        if not outcome.called:
            clock.cancel(timer)
            outcome.callback(True)

    d.addBoth(settled)
    return outcome


def _sleep(clock: Clock, seconds: float) -> defer.Deferred[None]:
    d: defer.Deferred[None] = defer.Deferred()
    clock.call_later(seconds, d.callback, None)
    return d
