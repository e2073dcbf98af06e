"""Process-wide settings (not owned by any one relay): metrics, proxies, timeouts, shutdown, access log.

L{relayd.tap} puts these ahead of the wings' tables; the same rules apply (flag > environment >
default, one-line errors, exit 2 before anything listens). L{SETTINGS} ends with L{REDIS_SETTINGS}
(C{--redis}: with it every relay keeps its shared state in Redis). Beside the tables, what they become once resolved:
L{SiteSettings} (what every wing's site is built with) and L{RedisSettings}.
"""

from __future__ import annotations

from dataclasses import dataclass

from relayd.base.config import Resolved, Setting, endpoint, integer_at_least, non_negative_int
from relayd.process.browsers import host_entry, origin_entry
from relayd.storage.buckets import redis_prefix
from relayd.storage.redis import DEFAULT_WAIT_TIMEOUT_MS, MAX_WAIT_TIMEOUT_MS, parse_redis_url, redis_url

DEFAULT_HEADER_TIMEOUT = 20.0
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_IDLE_TIMEOUT = 60.0
DEFAULT_MAX_CLIENT_CONNECTIONS = 256
HEALTH_RESERVE = 4
"""Connections a client may open beyond its cap that answer only the health check (503 otherwise)."""
DEFAULT_REDIS_PREFIX = "relayd:"


def non_negative_seconds(text: str) -> float:
    """A number of seconds >= 0 (fractions allowed; 0 turns the periodic task off)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("must be a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a number of seconds >= 0")
    return value


def wait_timeout_ms(text: str) -> int:
    """C{--redis-wait-timeout-ms}: 1 to L{MAX_WAIT_TIMEOUT_MS} (the write and its wait share the
    client's answer timeout)."""
    value = integer_at_least(text, 1, "must be at least 1 ms")
    if value > MAX_WAIT_TIMEOUT_MS:
        raise ValueError(f"must be at most {MAX_WAIT_TIMEOUT_MS} ms (the write and its wait share a 2 s timeout)")
    return value


def positive_seconds(text: str) -> float:
    """A number of seconds > 0 (fractions allowed)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("must be a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise ValueError("must be a positive number of seconds")
    return value


REDIS_SETTINGS = [
    Setting(
        "redis",
        None,
        "Redis URL (redis://[user:password@]host:port/db, rediss:// for TLS; "
        "redis+sentinel://[user:password@]host:port[,host:port...]/master/db to follow Sentinel, "
        "rediss+sentinel:// for TLS to the data nodes; redis+cluster://host:port[,host:port...] for a "
        "Redis Cluster) for shared state and fan-out across relayd instances; without it each process "
        "keeps its state in memory",
        parse=redis_url,
        env=("RELAYD_REDIS",),
        secret=True,  # the URL may carry passwords: only those are scrubbed from the logs
        secret_part=lambda url: parse_redis_url(url).secrets,
        metavar="URL",
    ),
    Setting(
        "redis-prefix",
        DEFAULT_REDIS_PREFIX,
        "Prefix of every Redis key relayd writes (several deployments can share one Redis); no '{' or '}'",
        parse=redis_prefix,
        env=("RELAYD_REDIS_PREFIX",),
        metavar="PREFIX",
    ),
    Setting(
        "redis-wait-replicas",
        None,
        "Replicas that must confirm each acknowledged write (Redis WAIT) before it is answered; "
        "a write fewer confirm is answered 503 and retried by the client (0: no wait)",
        parse=non_negative_int,
        env=("RELAYD_REDIS_WAIT_REPLICAS",),
        metavar="N",
        default_help="1 with redis+sentinel:// and redis+cluster://, else 0",
    ),
    Setting(
        "redis-wait-timeout-ms",
        DEFAULT_WAIT_TIMEOUT_MS,
        f"How long an acknowledged write waits for its replicas (--redis-wait-replicas), in milliseconds "
        f"(1 to {MAX_WAIT_TIMEOUT_MS})",
        parse=wait_timeout_ms,
        env=("RELAYD_REDIS_WAIT_TIMEOUT_MS",),
        metavar="MS",
    ),
]


SETTINGS = [
    Setting(
        "metrics-listen",
        [],
        "Prometheus metrics listen endpoint (strports; repeatable), serving GET /metrics; off unless given",
        parse=endpoint,
        env=("RELAYD_METRICS_LISTEN",),
        repeatable=True,
        metavar="ENDPOINT",
    ),
    Setting(
        "trust-forwarded-for",
        0,
        "Number of reverse proxies in front of relayd whose X-Forwarded-For entries are trusted for the "
        "client address in access logs (0: ignore the header)",
        parse=non_negative_int,
        env=("RELAYD_TRUST_FORWARDED_FOR",),
        metavar="N",
    ),
    Setting(
        "allow-host",
        [],
        "Host names or addresses (any port) a relay without a token answers besides loopback ones "
        "(localhost, *.localhost, 127.0.0.0/8, [::1]): * or a comma list (repeatable); any other Host gets 403",
        parse=host_entry,
        env=("RELAYD_ALLOW_HOST",),
        repeatable=True,
        metavar="HOSTS",
    ),
    Setting(
        "allow-origin",
        [],
        "Browser origins a relay without a token answers besides loopback ones, and CORS allows: * "
        "(any, and CORS *) or a comma list of scheme://host[:port] (repeatable); any other Origin gets 403",
        parse=origin_entry,
        env=("RELAYD_ALLOW_ORIGIN",),
        repeatable=True,
        metavar="ORIGINS",
    ),
    Setting(
        "header-timeout",
        DEFAULT_HEADER_TIMEOUT,
        "Seconds a client has to send a request line and all headers; slower clients get 408 and are "
        "disconnected (slowloris)",
        parse=positive_seconds,
        env=("RELAYD_HEADER_TIMEOUT",),
        metavar="SECONDS",
    ),
    Setting(
        "body-timeout",
        DEFAULT_BODY_TIMEOUT,
        "Seconds a client has to send a request body once its headers are in; slower uploads get 408 and "
        "are disconnected",
        parse=positive_seconds,
        env=("RELAYD_BODY_TIMEOUT",),
        metavar="SECONDS",
    ),
    Setting(
        "idle-timeout",
        DEFAULT_IDLE_TIMEOUT,
        "Seconds an HTTP connection may sit idle between requests (or stall mid-request) before it is closed",
        parse=positive_seconds,
        env=("RELAYD_IDLE_TIMEOUT",),
        metavar="SECONDS",
    ),
    Setting(
        "max-client-connections",
        DEFAULT_MAX_CLIENT_CONNECTIONS,
        "Open HTTP connections one client address (its X-Forwarded-For address with --trust-forwarded-for) may "
        f"hold on each relay's listeners; {HEALTH_RESERVE} more answer only the health check, the rest get 503 "
        "(0: no cap)",
        parse=non_negative_int,
        env=("RELAYD_MAX_CLIENT_CONNECTIONS",),
        metavar="N",
    ),
    Setting(
        "shutdown-grace",
        5.0,
        "Seconds each relay waits at shutdown for streams and in-flight work to drain before aborting",
        parse=positive_seconds,
        env=("RELAYD_SHUTDOWN_GRACE",),
        metavar="SECONDS",
    ),
    Setting(
        "no-access-log",
        False,
        "Do not log one line per HTTP request (method, path without query, status, bytes, peer)",
        env=("RELAYD_NO_ACCESS_LOG",),
        switch=True,
    ),
    Setting(
        "gc-freeze-interval",
        2.0,
        "Seconds between moving every object that survived so far out of the garbage collector's full "
        "passes (gc.freeze), so a pass walks only what arrived since; 0: only what start-up allocated",
        parse=non_negative_seconds,
        env=("RELAYD_GC_FREEZE_INTERVAL",),
        metavar="SECONDS",
    ),
    Setting(
        "gc-full-interval",
        3600.0,
        "Seconds between unfreezing and collecting everything once (reclaims frozen objects that became "
        "cyclic garbage; one long pause); 0: never",
        parse=non_negative_seconds,
        env=("RELAYD_GC_FULL_INTERVAL",),
        metavar="SECONDS",
    ),
    *REDIS_SETTINGS,  # last, as --help has always listed them
]

@dataclass(frozen=True)
class SiteSettings:
    """The process-wide settings every wing's site is built with (L{SETTINGS}).

    @ivar trust_forwarded_for: how many reverse proxies' C{X-Forwarded-For} entries to believe (0:
        none; the peer is the connection's, or the PROXY-protocol source on a C{haproxy:} listener).
    @ivar header_timeout: seconds a request line and its headers may take (C{408} after).
    @ivar body_timeout: seconds a request body may take once the headers are in (C{408} after).
    @ivar idle_timeout: seconds a connection may sit idle (Twisted's C{timeOut}).
    @ivar access_log: whether to log a line per request.
    @ivar max_client_connections: open connections one client (its address, or its forwarded
        address behind trusted proxies) may hold on one wing's listeners (0: no cap); beyond it,
        L{HEALTH_RESERVE} more answer only the health check, and the rest are refused with C{503}.
    """

    trust_forwarded_for: int = 0
    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT
    access_log: bool = True
    max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS

    @classmethod
    def from_settings(cls, settings: Resolved) -> SiteSettings:
        """The site settings of L{SETTINGS}' resolved values (defaults where the table is absent)."""
        values = settings.values
        default = DEFAULT_SITE_SETTINGS
        return cls(
            trust_forwarded_for=values.get("trust-forwarded-for", default.trust_forwarded_for),
            header_timeout=values.get("header-timeout", default.header_timeout),
            body_timeout=values.get("body-timeout", default.body_timeout),
            idle_timeout=values.get("idle-timeout", default.idle_timeout),
            access_log=not values.get("no-access-log", not default.access_log),
            max_client_connections=values.get("max-client-connections", default.max_client_connections),
        )


DEFAULT_SITE_SETTINGS = SiteSettings()


@dataclass(frozen=True)
class RedisSettings:
    """L{REDIS_SETTINGS} resolved.

    @ivar url: C{--redis}, or C{None}: every relay keeps its state in memory.
    @ivar prefix: the prefix of every Redis key (C{--redis-prefix}); it also names the keyspace
        version key (relayd.storage.redis.KEYSPACE_VERSION).
    """

    url: str | None = None
    prefix: str = DEFAULT_REDIS_PREFIX
    wait_replicas: int | None = None
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS

    @classmethod
    def from_settings(cls, settings: Resolved) -> RedisSettings:
        """The Redis settings of the resolved values (no Redis where the table is absent)."""
        values = settings.values
        return cls(
            url=values.get("redis"),
            prefix=values.get("redis-prefix") or DEFAULT_REDIS_PREFIX,
            wait_replicas=values.get("redis-wait-replicas"),
            wait_timeout_ms=values.get("redis-wait-timeout-ms") or DEFAULT_WAIT_TIMEOUT_MS,
        )
