"""Composes the MCP tunnel relay wing for C{relayd.tap}: store, tunnel relay core, resource, site, listeners."""

from __future__ import annotations

from functools import partial
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger

from relayd.base.clock import Timekeeper
from relayd.base.config import Resolved, is_loopback_endpoint
from relayd.base.reactor import IReactor
from relayd.logs import scrub
from relayd.mcp import metrics
from relayd.mcp.config import MCPConfig
from relayd.mcp.core.bus import IMcpBus, LocalBus
from relayd.mcp.core.store import IMcpStore, MemoryStore
from relayd.mcp.core.tunnel import TunnelConfig, TunnelRelay
from relayd.mcp.demo import demo_page
from relayd.mcp.endpoint import Endpoint, EndpointConfig
from relayd.mcp.http import KEEPALIVE, KEEPALIVE_INTERVAL, MAX_BODY, McpResource
from relayd.mcp.redis.bus import RedisMcpBus
from relayd.mcp.redis.store import RedisStore
from relayd.web.listen import HTTPWingService
from relayd.web.request import BodyLimit
from relayd.web.site import RelaySite
from relayd.web.streams.sse import SSEHub
from relayd.wing import DEFAULT_GRACE, Plumbing

_log = Logger(namespace="relayd.mcp")


class McpService(HTTPWingService):
    """The MCP wing: its listeners, its tunnel relay's reaper, and a drain that ends streams and polls."""

    def __init__(
        self,
        resource: McpResource,
        site: RelaySite,
        listen: list[str],
        reactor: IReactor,
        clock: Timekeeper,
        startup_line: str,
        *,
        grace: float = DEFAULT_GRACE,
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
            grace=grace,
        )
        self.resource = resource
        self.tunnel = resource.tunnel
        self._startup_line = startup_line
        self.url_path = resource.prefix.decode("utf-8")  # the startup line's URL ends with the prefix

    def _abort_streams(self) -> None:
        for stream in list(self.resource.hub.streams):
            stream.abort()

    def startService(self) -> None:
        self.tunnel.start()
        if self.resource.endpoint is not None:
            self.resource.endpoint.start()
        super().startService()

    def details(self) -> str:
        return self._startup_line

    @defer.inlineCallbacks
    def stopService(self) -> Any:
        _log.info("MCP relay shutting down")
        self.tunnel.stop()
        if self.resource.endpoint is not None:
            self.resource.endpoint.stop()
        yield super().stopService()
        self.resource.hub.stop()
        yield self.tunnel.bus.stop()


def _shared_state(plumbing: Plumbing, mcp: MCPConfig) -> tuple[IMcpStore, IMcpBus]:
    """Redis store and bus with C{--redis} (instances share sessions, queues and streams), else memory;
    the session TTL bounds how long Redis keeps what it counts per client address."""
    redis = plumbing.redis
    if redis is None:
        return MemoryStore(), LocalBus()
    prefix = plumbing.redis_prefix
    # What every instance keeps the shared sessions, queues and buffered total by.
    redis.hold_bounds({
        "mcp-ttl-ms": mcp.ttl_ms, "mcp-max-sessions": mcp.max_sessions, "mcp-queue-frames": mcp.queue_frames,
        "mcp-queue-bytes": mcp.queue_bytes, "mcp-max-buffered-bytes": mcp.max_buffered_bytes,
    })  # fmt: skip
    _log.info("MCP relay state in Redis at {url} (prefix {prefix})", url=str(redis.url), prefix=prefix)
    return RedisStore(redis, prefix, mcp.ttl_ms), RedisMcpBus(redis, prefix)


# What relayd's logs know of this wing: records logged under relayd.mcp are the "mcp" relay's.
LOGS = scrub.WingLogs("relayd.mcp", relay="mcp")


def configured(settings: Resolved) -> MCPConfig | None:
    """The wing's configuration (C{None} with C{--no-mcp}): what L{make_wing} builds from, and what
    C{--check-config} checks.

    @raise relayd.base.config.ConfigError: an origin policy that is refused (C{*} with origins).
    """
    return MCPConfig.from_settings(settings)


def make_wing(plumbing: Plumbing, settings: Resolved) -> McpService | None:
    """The MCP wing (relayd/wing.py), or C{None} with C{--no-mcp}.

    @raise relayd.base.config.ConfigError: an origin policy that is refused (exit 2 before listening).
    """
    scrub.declare(LOGS)
    mcp = configured(settings)
    if mcp is None:
        _log.info("MCP relay disabled (--no-mcp)")
        return None
    clock = plumbing.clock
    listen = list(mcp.listen)
    config = TunnelConfig(
        ttl_ms=mcp.ttl_ms,
        reap_interval_ms=mcp.reap_interval_ms,
        poll_idle_ms=mcp.poll_idle_ms,
        max_sessions=mcp.max_sessions,
        sessions_per_address=mcp.max_sessions_per_address,
        queue_max_frames=mcp.queue_frames,
        queue_max_bytes=mcp.queue_bytes,
        max_buffered_bytes=mcp.max_buffered_bytes,
    )
    store, bus = _shared_state(plumbing, mcp)
    tunnel = TunnelRelay(store, clock, config, bus)
    hub = SSEHub(clock, KEEPALIVE_INTERVAL, KEEPALIVE)
    endpoint = Endpoint(
        tunnel,
        mcp.cors,
        hub,
        clock,
        mcp.prefix.encode("utf-8"),
        EndpointConfig(
            request_timeout_ms=mcp.request_timeout_ms,
            client_idle_ms=mcp.client_idle_ms,
            clients_per_address=mcp.max_clients_per_address,
            pending_per_session=config.correlations_per_session,
            stream_max_bytes=config.queue_max_bytes,
        ),
    )
    resource = McpResource(
        tunnel,
        mcp.cors,
        hub,
        mcp.prefix,
        max_frames=config.queue_max_frames,
        max_bytes=config.queue_max_bytes,
        endpoint=endpoint,
        demo=demo_page() if mcp.demo else None,
    )
    # docs/decisions.md MCP-2: an oversize body is a 413 whatever else is wrong (the size first).
    limit = BodyLimit(MAX_BODY, resource.too_large, resource.early_answer, size_first=True)
    site = RelaySite(
        resource, body_limit=limit, settings=plumbing.site, relay="mcp", clock=plumbing.clock,
        health_paths=resource.health_paths,
    )
    # A session's plainest frame and endpoint POSTs are rendered beside twisted.web's Request, through
    # the same route table (docs/performance.md: instructions per endpoint round trip).
    site.simple_posts.claim(resource.prefix + b"/", partial(resource.plain_post, limit=limit))
    line = f"ttl={round(mcp.ttl_ms / 1000)}s, cors={mcp.cors.describe()} from {mcp.cors_source}"
    for description in listen:
        if not is_loopback_endpoint(description):
            _log.warn(
                "binding {endpoint} exposes the MCP relay on non-loopback interfaces. register is "
                "unauthenticated and a leaked session token grants every tool the page exposes. Only do "
                "this behind an authenticating proxy / trusted network.",
                endpoint=description,
            )
    service = McpService(resource, site, listen, plumbing.reactor, clock, line, grace=plumbing.grace)
    # Levels for the metrics listener, read at scrape time.
    watching = metrics.Watching()
    watching.add(metrics.connections, tunnel.open_streams, relay="mcp", transport="sse")
    watching.add(metrics.connections, tunnel.parked_polls, relay="mcp", transport="longpoll")
    watching.setServiceParent(service)
    return service


def make_service(settings: Resolved, reactor: IReactor, clock: Timekeeper) -> McpService | None:
    """L{make_wing} on plumbing made from C{settings} alone (tests; with C{--redis} the caller
    closes the client, the bus's C{redis})."""
    return make_wing(Plumbing.from_settings(settings, reactor, clock), settings)
