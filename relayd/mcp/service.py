"""Composes the MCP tunnel relay wing for C{relayd.tap}: store, broker, resource, site, listeners."""

from __future__ import annotations

from typing import Any

from twisted.application.service import IService
from twisted.internet import defer
from twisted.logger import Logger

from relayd import metrics
from relayd.clock import Clock
from relayd.config import Resolved, is_loopback_endpoint
from relayd.mcp.broker import Broker, BrokerConfig
from relayd.mcp.bus import IMcpBus, LocalBus
from relayd.mcp.config import cors_policy, listen_endpoints
from relayd.mcp.demo import demo_page
from relayd.mcp.endpoint import Endpoint, EndpointConfig
from relayd.mcp.http import KEEPALIVE, KEEPALIVE_INTERVAL, MAX_BODY, McpResource
from relayd.mcp.redis_bus import RedisMcpBus
from relayd.mcp.redis_store import RedisStore
from relayd.mcp.store import IMcpStore, MemoryStore
from relayd.redis import redis_for
from relayd.web.body import BodyLimit
from relayd.web.service import HTTPWingService
from relayd.web.site import RelaySite
from relayd.web.sse import SSEHub

_log = Logger(namespace="relayd.mcp")


class McpService(HTTPWingService):
    """The MCP wing: its listeners, its broker's reaper, and a drain that ends streams and polls."""

    def __init__(
        self, resource: McpResource, site: RelaySite, listen: list[str], reactor: Any, clock: Clock, startup_line: str
    ) -> None:
        super().__init__(
            "mcp",
            site,
            listen,
            reactor,
            clock,
            drain=resource.drain,
            remaining=resource.remaining,
            abort=self._abort_streams,
        )
        self.resource = resource
        self.broker = resource.broker
        self._startup_line = startup_line
        self.url_path = resource.prefix.decode("utf-8")  # the startup line's URL ends with the prefix

    def _abort_streams(self) -> None:
        for stream in list(self.resource.hub.streams):
            stream.abort()

    def startService(self) -> None:
        self.broker.start()
        if self.resource.endpoint is not None:
            self.resource.endpoint.start()
        super().startService()

    def details(self) -> str:
        return self._startup_line

    @defer.inlineCallbacks
    def stopService(self) -> Any:
        _log.info("MCP relay shutting down")
        self.broker.stop()
        if self.resource.endpoint is not None:
            self.resource.endpoint.stop()
        yield super().stopService()
        self.resource.hub.stop()
        yield self.broker.bus.stop()


def _shared_state(settings: Resolved, clock: Clock) -> tuple[IMcpStore, IMcpBus]:
    """Redis store and bus with C{--redis} (instances share sessions, queues and streams), else memory."""
    redis = redis_for(settings, clock)
    if redis is None:
        return MemoryStore(), LocalBus()
    prefix: str = settings.values.get("redis-prefix") or "relayd:"
    _log.info("MCP relay state in Redis at {url} (prefix {prefix})", url=str(redis.url), prefix=prefix)
    return RedisStore(redis, prefix), RedisMcpBus(redis, prefix)


def make_service(settings: Resolved, reactor: Any, clock: Clock) -> IService | None:
    """The MCP wing's service, or C{None} with C{--no-mcp}.

    @raise relayd.config.ConfigError: an origin policy that is refused (exit 2 before listening).
    """
    if settings["no-mcp"]:
        _log.info("MCP relay disabled (--no-mcp)")
        return None
    policy = cors_policy(settings)
    listen = listen_endpoints(settings)
    prefix: str = settings["mcp-prefix"]
    ttl: float = settings["mcp-ttl-ms"]
    config = BrokerConfig(
        ttl_ms=ttl,
        reap_interval_ms=settings["mcp-reap-interval-ms"],
        poll_idle_ms=settings["mcp-poll-idle-ms"],
        max_sessions=settings["mcp-max-sessions"],
        queue_max_frames=settings["mcp-queue-frames"],
        queue_max_bytes=settings["mcp-queue-bytes"],
        max_buffered_bytes=settings["mcp-max-buffered-bytes"],
    )
    store, bus = _shared_state(settings, clock)
    broker = Broker(store, clock, config, bus)
    hub = SSEHub(clock, KEEPALIVE_INTERVAL, KEEPALIVE)
    endpoint = Endpoint(
        broker,
        policy,
        hub,
        clock,
        prefix.encode("utf-8"),
        EndpointConfig(
            request_timeout_ms=settings["mcp-request-timeout"],
            client_idle_ms=settings["mcp-client-idle-ms"],
            pending_per_session=config.correlations_per_session,
            stream_max_bytes=config.queue_max_bytes,
        ),
    )
    demo_on = settings["mcp-demo"] or (
        not settings["no-mcp-demo"] and all(is_loopback_endpoint(d) for d in listen)
    )
    resource = McpResource(
        broker,
        policy,
        hub,
        prefix,
        max_frames=config.queue_max_frames,
        max_bytes=config.queue_max_bytes,
        endpoint=endpoint,
        demo=demo_page() if demo_on else None,
    )
    site = RelaySite(resource, body_limit=BodyLimit(MAX_BODY, resource.too_large))
    source = settings.sources.get("mcp-cors", "default")
    line = f"ttl={round(ttl / 1000)}s, cors={policy.describe()} from {source}"
    for description in listen:
        if not is_loopback_endpoint(description):
            _log.warn(
                "binding {endpoint} exposes the MCP relay on non-loopback interfaces. register is "
                "unauthenticated and a leaked session token grants every tool the page exposes. Only do "
                "this behind an authenticating proxy / trusted network.",
                endpoint=description,
            )
    service = McpService(resource, site, listen, reactor, clock, line)
    # Levels for the metrics listener, read at scrape time.
    watching = metrics.Watching()
    watching.add(metrics.connections, broker.open_streams, relay="mcp", transport="sse")
    watching.add(metrics.connections, broker.parked_polls, relay="mcp", transport="longpoll")
    watching.setServiceParent(service)
    return service
