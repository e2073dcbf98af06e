"""Composes the AEP wing: store, relay core, HTTP resource with SSE, WebSocket, listeners."""

from __future__ import annotations

from typing import Callable

from autobahn.twisted.resource import WebSocketResource
from twisted.logger import Logger

from relayd.aep import metrics
from relayd.aep.config import AEPConfig
from relayd.aep.core.relay import EventRelay
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.http import AEPResource
from relayd.aep.redis.claims import RedisClaims
from relayd.aep.redis.fanout import RedisFanout
from relayd.aep.redis.store import RedisEventLog
from relayd.aep.websocket import AEPSocketFactory
from relayd.base.clock import Timekeeper
from relayd.base.config import Resolved
from relayd.base.reactor import IReactor
from relayd.logs import scrub
from relayd.web.listen import HTTPWingService
from relayd.web.request import BodyLimit
from relayd.web.site import RelaySite
from relayd.web.streams.sse import SSEHub, sse_comment
from relayd.wing import Plumbing

_log = Logger(namespace="relayd.aep")


class AEPService(HTTPWingService):
    """The AEP wing's service; C{relay} is its core (tests and tools reach the relay's state there)."""

    def __init__(
        self,
        relay: EventRelay,
        site: RelaySite,
        listen: list[str],
        plumbing: Plumbing,
        *,
        drain: Callable[[], None],
        remaining: Callable[[], int],
        abort: Callable[[], None],
    ) -> None:
        super().__init__(
            "aep", site, listen, plumbing.reactor, plumbing.clock,
            drain=drain, remaining=remaining, abort=abort, grace=plumbing.grace,
        )
        self.relay = relay


def make_relay(config: AEPConfig, plumbing: Plumbing) -> EventRelay:
    """The relay core: in memory, or sharing buffers, claims and live fan-out through Redis."""
    clock = plumbing.clock
    redis = plumbing.redis
    if redis is None:
        return EventRelay(MemoryEventLog(config.buffer, config.max_sessions), token=config.token, buffer=config.buffer,
                     max_from=config.max_from, seconds=clock.monotonic, max_subscribers=config.max_subscribers)
    prefix = plumbing.redis_prefix
    # Every instance trims the shared sessions and evicts among them by these.
    redis.hold_bounds({"aep-buffer": config.buffer, "aep-max-sessions": config.max_sessions})
    bus = redis.bus()
    claims = RedisClaims(redis, bus, clock, prefix)
    _log.info("aep relay: shared state in Redis at {url}", url=str(redis.url))
    # A batch of stored events is published by the append script itself (sent to Redis once).
    log = RedisEventLog(redis, config.buffer, config.max_sessions, prefix, publisher=claims.instance)
    return EventRelay(
        log,
        token=config.token,
        buffer=config.buffer,
        max_from=config.max_from,
        seconds=clock.monotonic,
        claims=claims,
        fanout=lambda deliver: RedisFanout(redis, bus, claims.instance, deliver, prefix),
        max_subscribers=config.max_subscribers,
    )


# What relayd's logs know of this wing: records logged under relayd.aep are the "aep" relay's.
LOGS = scrub.WingLogs("relayd.aep", relay="aep")


def configured(settings: Resolved) -> AEPConfig | None:
    """The wing's configuration (C{None} with C{--no-aep}): what L{make_wing} builds from, and what
    C{--check-config} checks (the AEP relay refuses no combination of its settings)."""
    return AEPConfig.from_settings(settings)


def make_wing(plumbing: Plumbing, settings: Resolved) -> AEPService | None:
    """The AEP relay as a wing (relayd/wing.py), or C{None} with C{--no-aep}."""
    scrub.declare(LOGS)
    config = configured(settings)
    if config is None:
        _log.info("AEP relay disabled (--no-aep)")
        return None
    clock = plumbing.clock
    relay = make_relay(config, plumbing)
    hub = SSEHub(clock, config.heartbeat, sse_comment("ping"))
    sockets = AEPSocketFactory(relay, clock, heartbeat=config.heartbeat, max_message=config.max_body,
                               max_subscriptions=config.max_subscriptions, hello_timeout=config.hello_timeout)
    resource = AEPResource(
        relay,
        hub,
        max_body=config.max_body,
        max_batch=config.max_batch,
        socket=WebSocketResource(sockets),
        socket_counts=sockets.listing,
        browsers=plumbing.browsers,
    )
    site = RelaySite(
        resource, body_limit=BodyLimit(config.max_body, resource.too_large, resource.early_answer),
        settings=plumbing.site, relay="aep", clock=plumbing.clock, health_paths=frozenset({b"/healthz"}),
    )
    # The plainest ingest POSTs are answered beside twisted.web's Request, at about a fifth less CPU per
    # event (docs/performance.md), through the same wall and ingest policy; on Redis after the write.
    site.simple_posts[b"/events"] = resource.simple_ingest
    # A subscription's start is a newcomer's work: one count per turn with the site's new connections.
    sockets.admission = site.admission

    def drain() -> None:
        hub.drain(sse_comment("shutting-down"))
        hub.stop()
        sockets.drain()
        if isinstance(relay.claims, RedisClaims):
            relay.claims.stop()

    service = AEPService(
        relay,
        site,
        list(config.listen),
        plumbing,
        drain=drain,
        remaining=lambda: len(sockets.connections),
        abort=sockets.abort,
    )
    auth = (
        "auth on"
        if config.token
        else "auth OFF — control routing disabled (AEP-0004 §4.1); set AEP_TOKEN to enable; "
        f"browsers: {plumbing.browsers.describe()} (--allow-host, --allow-origin)"
    )
    _log.info("aep relay: buffer {buffer}/session, {auth}", buffer=config.buffer, auth=auth)
    # Levels for the metrics listener, read at scrape time (nothing is counted on the hot path).
    watching = metrics.Watching()
    watching.add(metrics.connections, lambda: len(hub.streams), relay="aep", transport="sse")
    watching.add(metrics.connections, lambda: len(sockets.connections), relay="aep", transport="ws")
    watching.add(metrics.sessions, relay.log.session_count, relay="aep")
    watching.add(metrics.subscribers, lambda: len(relay.subscribers), relay="aep")
    watching.setServiceParent(service)
    return service


def make_service(settings: Resolved, reactor: IReactor, clock: Timekeeper) -> AEPService | None:
    """L{make_wing} on plumbing made from C{settings} alone (tests; with C{--redis} the caller
    closes the client, C{service.relay.log.redis})."""
    return make_wing(Plumbing.from_settings(settings, reactor, clock), settings)
