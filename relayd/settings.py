"""Process-wide settings (not owned by any one relay): metrics, proxies, timeouts, shutdown, access log.

L{relayd.tap} puts these ahead of the wings' tables; the same rules apply (flag > environment >
default, one-line errors, exit 2 before anything listens).
"""

from __future__ import annotations

from relayd.config import Setting, endpoint, non_negative_int
from relayd.web.browsers import host_entry, origin_entry
from relayd.web.site import DEFAULT_MAX_CLIENT_CONNECTIONS, HEALTH_RESERVE


def non_negative_seconds(text: str) -> float:
    """A number of seconds >= 0 (fractions allowed; 0 turns the periodic task off)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("must be a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError("must be a number of seconds >= 0")
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
        20.0,
        "Seconds a client has to send a request line and all headers; slower clients get 408 and are "
        "disconnected (slowloris)",
        parse=positive_seconds,
        env=("RELAYD_HEADER_TIMEOUT",),
        metavar="SECONDS",
    ),
    Setting(
        "body-timeout",
        60.0,
        "Seconds a client has to send a request body once its headers are in; slower uploads get 408 and "
        "are disconnected",
        parse=positive_seconds,
        env=("RELAYD_BODY_TIMEOUT",),
        metavar="SECONDS",
    ),
    Setting(
        "idle-timeout",
        60.0,
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
]
