"""Composes the AEP wing: store, relay core, HTTP resource with SSE, WebSocket, listeners."""

from __future__ import annotations

from typing import Any

from autobahn.twisted.resource import WebSocketResource
from twisted.application.service import IService
from twisted.logger import Logger

from relayd import metrics
from relayd.aep.http import AEPResource
from relayd.aep.redis_cluster import RedisClaims, RedisFanout
from relayd.aep.redis_store import RedisEventLog
from relayd.aep.relay import Relay
from relayd.aep.store import MemoryEventLog
from relayd.aep.websocket import AEPSocketFactory
from relayd.clock import Clock
from relayd.config import Resolved
from relayd.redis import redis_for
from relayd.web.body import BodyLimit
from relayd.web.service import HTTPWingService
from relayd.web.site import RelaySite
from relayd.web.sse import SSEHub, sse_comment

_log = Logger(namespace="relayd.aep")


def make_service(settings: Resolved, reactor: Any, clock: Clock) -> IService | None:
    """The AEP relay as a service, or C{None} with C{--no-aep}."""
    if settings["no-aep"]:
        _log.info("AEP relay disabled (--no-aep)")
        return None
    token = settings["aep-token"]
    buffer = settings["aep-buffer"]
    max_sessions = settings["aep-max-sessions"]
    max_body = settings["aep-max-body"]
    max_from = settings["aep-max-from"] or max_sessions
    heartbeat = settings["aep-heartbeat"]
    max_subscribers = settings["aep-max-subscribers"]

    redis = redis_for(settings, clock)
    if redis is None:
        relay = Relay(MemoryEventLog(buffer, max_sessions), token=token, buffer=buffer, max_from=max_from,
                      seconds=clock.seconds, max_subscribers=max_subscribers)
    else:
        # Several instances share buffers, claims and live fan-out through Redis.
        prefix = settings.values.get("redis-prefix") or "relayd:"
        bus = redis.bus()
        claims = RedisClaims(redis, bus, clock, prefix)
        log = RedisEventLog(redis, buffer, max_sessions, prefix)
        relay = Relay(log, token=token, buffer=buffer,
                      max_from=max_from, seconds=clock.seconds, claims=claims, max_subscribers=max_subscribers)
        relay.fanout = RedisFanout(redis, bus, claims.instance, relay.fan_out_remote, prefix)
        # A batch of stored events is published by the append script itself (sent to Redis once).
        log.publish_with(relay.fanout.channel, relay.fanout.header)
        _log.info("aep relay: shared state in Redis at {url}", url=str(redis.url))
    hub = SSEHub(clock, heartbeat, sse_comment("ping"))
    sockets = AEPSocketFactory(relay, clock, heartbeat=heartbeat, max_message=max_body,
                               max_subscriptions=settings["aep-max-subscriptions"])
    resource = AEPResource(
        relay,
        hub,
        max_body=max_body,
        max_batch=settings["aep-max-batch"],
        socket=WebSocketResource(sockets),
        socket_counts=sockets.listing,
    )
    site = RelaySite(resource, body_limit=BodyLimit(max_body, resource.early_answer))

    def drain() -> None:
        hub.drain(sse_comment("shutting-down"))
        hub.stop()
        sockets.drain()
        if isinstance(relay.claims, RedisClaims):
            relay.claims.stop()

    service = HTTPWingService(
        "aep",
        site,
        settings["aep-listen"],
        reactor,
        clock,
        drain=drain,
        remaining=lambda: len(sockets.connections),
        abort=sockets.abort,
    )
    auth = (
        "auth on"
        if token
        else "auth OFF — control routing disabled (AEP-0004 §4.1); set AEP_TOKEN to enable"
    )
    _log.info("aep relay: buffer {buffer}/session, {auth}", buffer=buffer, auth=auth)
    service.relay = relay  # type: ignore[attr-defined]
    # Levels for the metrics listener, read at scrape time (nothing is counted on the hot path).
    watching = metrics.Watching()
    watching.add(metrics.connections, lambda: len(hub.streams), relay="aep", transport="sse")
    watching.add(metrics.connections, lambda: len(sockets.connections), relay="aep", transport="ws")
    watching.add(metrics.sessions, relay.log.session_count, relay="aep")
    watching.add(metrics.subscribers, lambda: len(relay.subscribers), relay="aep")
    watching.setServiceParent(service)
    return service
