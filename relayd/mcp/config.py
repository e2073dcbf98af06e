"""The MCP tunnel relay's settings (flag > environment > default).

Only C{RELAYD_MCP_*} variables are read: the Node relay's generic names (C{PORT}, C{HOST}, C{PREFIX},
C{TTL_MS}, C{CORS_ALLOW_ORIGIN}) are set by many environments for other programs (C{PREFIX=/usr/local})
and moved the relay without a word.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from relayd.base.config import (
    ConfigError,
    Resolved,
    Setting,
    endpoint,
    is_loopback_endpoint,
    non_negative_int,
    positive_int,
)
from relayd.process.browsers import origin_entry
from relayd.process.cors import CorsPolicyError, OriginPolicy, parse_origins

DEFAULT_LISTEN = "tcp:8788:interface=127.0.0.1"


def prefix(text: str) -> str:
    """A URL path prefix such as C{/mcp-relay}; one trailing C{/} is stripped, C{""} means none."""
    text = text.strip()
    if text.endswith("/"):
        text = text[:-1]
    if text and not text.startswith("/"):
        raise ValueError("must start with / (e.g. /mcp-relay)")
    if any(ch in text for ch in "?# "):
        raise ValueError("must be a plain path")
    return text


def ttl_ms(text: str) -> float:
    """A finite number of milliseconds > 0 (non-integers accepted, as the Node relay does)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("must be a number of milliseconds") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a finite number of milliseconds > 0")
    return value


def port(text: str) -> int:
    """A TCP port, 1..65535."""
    value = positive_int(text)
    if value > 65535:
        raise ValueError("must be a port from 1 to 65535")
    return value


def _cors_policy(entries: list[str]) -> object:
    """What a CORS setting means: two spellings of one policy draw no override warning (docs/mcp.md, CORS)."""
    try:
        policy = parse_origins(list(entries))
    except CorsPolicyError:
        return tuple(entries)
    return policy.any, frozenset(policy.origins)


SETTINGS: list[Setting] = [
    Setting(
        "mcp-listen",
        [DEFAULT_LISTEN],
        "MCP relay listen endpoint (strports; repeatable)",
        parse=endpoint,
        env=("RELAYD_MCP_LISTEN",),
        repeatable=True,
        metavar="ENDPOINT",
    ),
    Setting(
        "mcp-port",
        None,
        "MCP relay port, when --mcp-listen is not given",
        parse=port,
        env=("RELAYD_MCP_PORT",),
        metavar="PORT",
        default_help="8788",
    ),
    Setting(
        "mcp-host",
        None,
        "MCP relay bind address, when --mcp-listen is not given",
        env=("RELAYD_MCP_HOST",),
        metavar="ADDR",
        default_help="127.0.0.1",
    ),
    Setting("no-mcp", False, "Do not start the MCP tunnel relay", env=("RELAYD_NO_MCP",), switch=True),
    Setting(
        "mcp-prefix",
        "",
        "URL path prefix of every MCP relay route, e.g. /mcp-relay behind a proxy (none by default)",
        parse=prefix,
        env=("RELAYD_MCP_PREFIX",),
        metavar="PATH",
    ),
    Setting(
        "mcp-ttl-ms",
        14_400_000.0,
        "MCP session inactivity timeout in milliseconds",
        parse=ttl_ms,
        env=("RELAYD_MCP_TTL_MS",),
        metavar="MS",
    ),
    Setting(
        "mcp-cors",
        ["*"],
        "Browser origins allowed to read MCP relay responses: * or a comma list (repeatable)",
        parse=origin_entry,  # one CORS value (C{*} or a comma list), validated on its own; combined later
        env=("RELAYD_MCP_CORS_ALLOW_ORIGIN",),
        repeatable=True,
        metavar="ORIGINS",
        canonical=_cors_policy,
    ),
    Setting(
        "mcp-max-sessions",
        10_000,
        "Most MCP sessions at once; at the bound the least recently seen session without readers "
        "ends, or (every session has one) the register answers 503",
        parse=positive_int,
        env=("RELAYD_MCP_MAX_SESSIONS",),
        metavar="N",
    ),
    Setting(
        "mcp-max-sessions-per-address",
        1000,
        "Most MCP sessions registered from one client address (an IPv6 one: its /64; with "
        "--trust-forwarded-for, the forwarded one); beyond it the address's oldest session without readers ends, or the "
        "register answers 503 (0: no per-address bound)",
        parse=non_negative_int,
        env=("RELAYD_MCP_MAX_SESSIONS_PER_ADDRESS",),
        metavar="N",
    ),
    Setting(
        "mcp-poll-idle-ms",
        60_000,
        "Milliseconds after which a long-poll subscriber that has not polled is dropped",
        parse=positive_int,
        env=("RELAYD_MCP_POLL_IDLE_MS",),
        metavar="MS",
    ),
    Setting(
        "mcp-reap-interval-ms",
        60_000,
        "Milliseconds between reaps of expired sessions and idle pollers (0 disables)",
        parse=non_negative_int,
        env=("RELAYD_MCP_REAP_INTERVAL_MS",),
        metavar="MS",
    ),
    Setting(
        "mcp-queue-frames",
        1000,
        "Most frames queued per subscriber before the oldest are dropped (or an SSE client is cut)",
        parse=positive_int,
        env=("RELAYD_MCP_QUEUE_FRAMES",),
        metavar="N",
    ),
    Setting(
        "mcp-queue-bytes",
        8 * 1024 * 1024,
        "Most bytes queued per subscriber",
        parse=positive_int,
        env=("RELAYD_MCP_QUEUE_BYTES",),
        metavar="BYTES",
    ),
    Setting(
        "mcp-max-buffered-bytes",
        64 * 1024 * 1024,
        "Most bytes of frames held for absent readers (first-frame backlogs and poll queues), all "
        "sessions together (with --redis: the whole deployment); a post beyond answers 503 buffer_full",
        parse=positive_int,
        env=("RELAYD_MCP_MAX_BUFFERED_BYTES",),
        metavar="BYTES",
    ),
]


SETTINGS += [
    Setting(
        "mcp-request-timeout-ms",
        60_000,
        "Standard MCP endpoint: milliseconds after which a request the page has not answered gets a "
        "JSON-RPC error",
        parse=positive_int,
        env=("RELAYD_MCP_REQUEST_TIMEOUT_MS",),
        metavar="MS",
    ),
    Setting(
        "mcp-request-timeout",
        None,
        "Deprecated: the old name of --mcp-request-timeout-ms (milliseconds); logs a warning",
        parse=positive_int,
        env=("RELAYD_MCP_REQUEST_TIMEOUT",),
        metavar="MS",
        replaced_by="mcp-request-timeout-ms",
    ),
    Setting(
        "mcp-client-idle-ms",
        1_800_000,
        "Standard MCP endpoint: milliseconds after which an unused client session ends (an open GET "
        "stream is use)",
        parse=positive_int,
        env=("RELAYD_MCP_CLIENT_IDLE_MS",),
        metavar="MS",
    ),
    Setting(
        "mcp-max-clients-per-address",
        1000,
        "Standard MCP endpoint: most client sessions one client address (an IPv6 one: its /64) holds "
        "on this process; beyond "
        "it the address's least recently used idle client session ends, or the initialize answers "
        "503 (0: no per-address bound)",
        parse=non_negative_int,
        env=("RELAYD_MCP_MAX_CLIENTS_PER_ADDRESS",),
        metavar="N",
    ),
    Setting(
        "mcp-demo",
        False,
        "Serve the demo page at {prefix}/demo even on non-loopback listeners",
        env=("RELAYD_MCP_DEMO",),
        switch=True,
    ),
    Setting(
        "no-mcp-demo",
        False,
        "Do not serve the demo page (it is on by default when every MCP listener is loopback)",
        env=("RELAYD_NO_MCP_DEMO",),
        switch=True,
    ),
]


def cors_policy(settings: Resolved) -> OriginPolicy:
    """The origin policy from C{mcp-cors} (repeated values are combined, as if comma-joined).

    @raise ConfigError: naming where the value came from (C{*} combined with origins across flags).
    """
    try:
        return parse_origins(list(settings["mcp-cors"]))
    except CorsPolicyError as e:
        raise ConfigError(f"{settings.sources.get('mcp-cors', '--mcp-cors')}: {e}") from None


def listen_endpoints(settings: Resolved) -> list[str]:
    """C{mcp-listen}, or the endpoint PORT/HOST describe when no listen endpoint was configured."""
    if settings.sources.get("mcp-listen", "default") != "default":
        return list(settings["mcp-listen"])
    host, port_ = settings.values.get("mcp-host"), settings.values.get("mcp-port")
    if host is None and port_ is None:
        return list(settings["mcp-listen"])
    host = host or "127.0.0.1"
    return [f"tcp:{port_ or 8788}:interface={host.strip('[]').replace(':', chr(92) + ':')}"]


@dataclass(frozen=True)
class MCPConfig:
    """The MCP wing's settings, typed (read by relayd/mcp/service.py instead of the table's names).

    @ivar listen: the endpoints (C{--mcp-listen}, or what C{--mcp-port}/C{--mcp-host} describe).
    @ivar cors: the origin policy; C{cors_source} says where it came from (the startup line).
    @ivar demo: whether the demo page is served (C{--mcp-demo}, or every listener is loopback
        and C{--no-mcp-demo} is not given).
    """

    listen: tuple[str, ...]
    prefix: str
    ttl_ms: float
    cors: OriginPolicy
    cors_source: str
    max_sessions: int
    max_sessions_per_address: int
    poll_idle_ms: int
    reap_interval_ms: int
    queue_frames: int
    queue_bytes: int
    max_buffered_bytes: int
    request_timeout_ms: int
    client_idle_ms: int
    max_clients_per_address: int
    demo: bool

    @classmethod
    def from_settings(cls, settings: Resolved) -> MCPConfig | None:
        """The configuration from the resolved table, or C{None} with C{--no-mcp}.

        @raise ConfigError: an origin policy that is refused (exit 2 before listening).
        """
        if settings["no-mcp"]:
            return None
        listen = listen_endpoints(settings)
        return cls(
            listen=tuple(listen),
            prefix=settings["mcp-prefix"],
            ttl_ms=settings["mcp-ttl-ms"],
            cors=cors_policy(settings),
            cors_source=settings.sources.get("mcp-cors", "default"),
            max_sessions=settings["mcp-max-sessions"],
            max_sessions_per_address=settings["mcp-max-sessions-per-address"],
            poll_idle_ms=settings["mcp-poll-idle-ms"],
            reap_interval_ms=settings["mcp-reap-interval-ms"],
            queue_frames=settings["mcp-queue-frames"],
            queue_bytes=settings["mcp-queue-bytes"],
            max_buffered_bytes=settings["mcp-max-buffered-bytes"],
            request_timeout_ms=settings["mcp-request-timeout-ms"],
            client_idle_ms=settings["mcp-client-idle-ms"],
            max_clients_per_address=settings["mcp-max-clients-per-address"],
            demo=settings["mcp-demo"]
            or (not settings["no-mcp-demo"] and all(is_loopback_endpoint(d) for d in listen)),
        )
