"""The AEP relay's settings (flag > environment > default; the reference's env names work)."""

from __future__ import annotations

from dataclasses import dataclass

from relayd.base.config import Resolved, Setting, endpoint, non_empty, positive_int
from relayd.process.settings import positive_seconds

DEFAULT_LISTEN = "tcp:8787:interface=127.0.0.1"

SETTINGS = [
    Setting(
        "aep-listen",
        [DEFAULT_LISTEN],
        "AEP relay listen endpoint (strports; repeatable)",
        parse=endpoint,
        env=("RELAYD_AEP_LISTEN",),
        repeatable=True,
        metavar="ENDPOINT",
    ),
    Setting("no-aep", False, "Do not run the AEP relay", env=("RELAYD_NO_AEP",), switch=True),
    Setting(
        "aep-token",
        None,
        "Bearer token for every AEP endpoint but /healthz; without it the relay is watch-only "
        "(control commands refused)",
        parse=non_empty,
        env=("AEP_TOKEN", "RELAYD_AEP_TOKEN"),
        secret=True,
        metavar="TOKEN",
    ),
    Setting(
        "aep-buffer",
        10000,
        "Events kept per session for replay",
        parse=positive_int,
        env=("AEP_BUFFER",),
        metavar="N",
    ),
    Setting(
        "aep-max-sessions",
        500,
        "Sessions kept; the least recently written is evicted",
        parse=positive_int,
        env=("AEP_MAX_SESSIONS",),
        metavar="N",
    ),
    Setting(
        "aep-max-body",
        16 * 1024 * 1024,
        "Largest ingest body in bytes (413 payload-too-large)",
        parse=positive_int,
        env=("AEP_MAX_BODY",),
        metavar="BYTES",
    ),
    Setting(
        "aep-max-batch",
        10000,
        "Most events in one NDJSON batch (413 too-many-events)",
        parse=positive_int,
        env=("AEP_MAX_BATCH",),
        metavar="N",
    ),
    Setting(
        "aep-max-from",
        None,
        "Most resume positions in one `from`",
        parse=positive_int,
        env=("AEP_MAX_FROM",),
        metavar="N",
        default_help="the value of --aep-max-sessions",
    ),
    Setting(
        "aep-max-subscriptions",
        64,
        "Most subscriptions one WebSocket connection holds (error limit-exceeded)",
        parse=positive_int,
        env=("AEP_MAX_SUBSCRIPTIONS",),
        metavar="N",
    ),
    Setting(
        "aep-max-subscribers",
        10000,
        "Most subscribers (SSE streams and WebSocket subscriptions) at once (SSE 503, WebSocket error "
        "limit-exceeded)",
        parse=positive_int,
        env=("AEP_MAX_SUBSCRIBERS",),
        metavar="N",
    ),
    Setting(
        "aep-heartbeat",
        25,
        "Seconds between SSE `: ping` comments and WebSocket ping frames",
        parse=positive_int,
        env=("RELAYD_AEP_HEARTBEAT",),
        metavar="SECONDS",
    ),
    Setting(
        "aep-hello-timeout",
        10.0,
        "Seconds a WebSocket connection has to send its hello; after, error hello-timeout and close 1002",
        parse=positive_seconds,
        env=("RELAYD_AEP_HELLO_TIMEOUT",),
        metavar="SECONDS",
    ),
]


@dataclass(frozen=True)
class AEPConfig:
    """The AEP wing's settings, typed (read by relayd/aep/service.py instead of the table's names)."""

    listen: tuple[str, ...]
    token: str | None
    buffer: int
    max_sessions: int
    max_body: int
    max_batch: int
    max_from: int
    max_subscriptions: int
    max_subscribers: int
    heartbeat: int
    hello_timeout: float

    @classmethod
    def from_settings(cls, settings: Resolved) -> AEPConfig | None:
        """The configuration from the resolved table, or C{None} with C{--no-aep}."""
        if settings["no-aep"]:
            return None
        max_sessions: int = settings["aep-max-sessions"]
        return cls(
            listen=tuple(settings["aep-listen"]),
            token=settings["aep-token"],
            buffer=settings["aep-buffer"],
            max_sessions=max_sessions,
            max_body=settings["aep-max-body"],
            max_batch=settings["aep-max-batch"],
            max_from=settings["aep-max-from"] or max_sessions,
            max_subscriptions=settings["aep-max-subscriptions"],
            max_subscribers=settings["aep-max-subscribers"],
            heartbeat=settings["aep-heartbeat"],
            hello_timeout=settings["aep-hello-timeout"],
        )
