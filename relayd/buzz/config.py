"""The broker wing's settings (flag > RELAYD_BROKER_* environment > default)."""

from __future__ import annotations

from dataclasses import dataclass

from relayd.base.config import Resolved, Setting, endpoint, non_empty, positive_int


def _nostr_relay_url(text: str) -> str:
    text = text.strip()
    if not (text.startswith("ws://") or text.startswith("wss://")) or len(text) <= len("wss://"):
        raise ValueError("must be a ws:// or wss:// URL")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("must be a number of seconds") from None
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError("must be a positive number of seconds")
    return value


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


SETTINGS: list[Setting] = [
    Setting(
        "broker-listen",
        ["tcp:8789:interface=127.0.0.1"],
        "Buzz broker listen endpoint (strports; repeatable; loopback or TLS only)",
        parse=endpoint,
        env=("RELAYD_BROKER_LISTEN",),
        repeatable=True,
        metavar="ENDPOINT",
    ),
    Setting(
        "broker-nostr-relay",
        None,
        "Nostr relay URL the broker acts on (ws:// or wss://); the broker starts only when set",
        parse=_nostr_relay_url,
        env=("RELAYD_BROKER_NOSTR_RELAY",),
        metavar="URL",
    ),
    Setting(
        "broker-auth-url",
        None,
        "Relay URL to name in NIP-42 AUTH when it differs from --broker-nostr-relay",
        parse=_nostr_relay_url,
        env=("RELAYD_BROKER_AUTH_URL",),
        metavar="URL",
    ),
    Setting(
        "broker-state-dir",
        "./relayd-state",
        "Directory for the broker's SQLite state and generated key-encryption key",
        parse=non_empty,
        env=("RELAYD_BROKER_STATE_DIR",),
        metavar="DIR",
    ),
    Setting(
        "broker-kek-file",
        None,
        "File holding the 64-hex-character key-encryption key (else RELAYD_BROKER_KEK, else generated)",
        parse=non_empty,
        env=("RELAYD_BROKER_KEK_FILE",),
        metavar="FILE",
    ),
    Setting(
        "broker-max-agent-depth",
        4,
        "Longest chain of agents owning agents",
        parse=positive_int,
        env=("RELAYD_BROKER_MAX_AGENT_DEPTH",),
        metavar="N",
    ),
    Setting(
        "broker-action-timeout",
        10.0,
        "Seconds to wait for the relay (connect, AUTH, OK/EOSE) before answering indeterminate",
        parse=_seconds,
        env=("RELAYD_BROKER_ACTION_TIMEOUT",),
        metavar="SECONDS",
    ),
    Setting(
        "broker-max-body",
        2 * 1024 * 1024,
        "Largest request body in bytes",
        parse=positive_int,
        env=("RELAYD_BROKER_MAX_BODY",),
        metavar="BYTES",
    ),
    Setting(
        "broker-receipt-retention",
        30 * 24 * 3600,
        "Seconds a request's receipt (its verdict, or its pending plan) is kept; a retry after that executes anew",
        parse=positive_int,
        env=("RELAYD_BROKER_RECEIPT_RETENTION",),
        metavar="SECONDS",
    ),
    Setting(
        "broker-max-receipts",
        100_000,
        "Receipts kept per agent; past it the agent's oldest settled tenth is deleted (a retry of those executes anew)",
        parse=positive_int,
        env=("RELAYD_BROKER_MAX_RECEIPTS",),
        metavar="N",
    ),
    Setting(
        "broker-runtimes",
        ["buzz-acp"],
        "Comma-separated agent runtimes that agents.create and agents.update accept",
        parse=_csv,
        env=("RELAYD_BROKER_RUNTIMES",),
        metavar="LIST",
    ),
    Setting(
        "broker-disable-reactions",
        False,
        "Answer reaction.add with unsupported",
        switch=True,
        env=("RELAYD_BROKER_DISABLE_REACTIONS",),
    ),
]

# Read directly from the environment by the service (never a flag: it would land in argv / ps).
KEK_ENV = "RELAYD_BROKER_KEK"


@dataclass(frozen=True)
class BuzzConfig:
    """The broker wing's settings, typed (read by relayd/buzz/service.py instead of the table's names)."""

    listen: tuple[str, ...]
    nostr_relay: str
    auth_url: str | None
    state_dir: str
    kek_file: str | None
    max_agent_depth: int
    action_timeout: float
    max_body: int
    receipt_retention: int
    max_receipts: int
    runtimes: tuple[str, ...]
    reactions_enabled: bool

    @classmethod
    def from_settings(cls, settings: Resolved) -> BuzzConfig | None:
        """The configuration from the resolved table, or C{None} without C{--broker-nostr-relay}."""
        url = settings["broker-nostr-relay"]
        if not url:
            return None
        return cls(
            listen=tuple(settings["broker-listen"]),
            nostr_relay=url,
            auth_url=settings["broker-auth-url"],
            state_dir=settings["broker-state-dir"],
            kek_file=settings["broker-kek-file"],
            max_agent_depth=settings["broker-max-agent-depth"],
            action_timeout=settings["broker-action-timeout"],
            max_body=settings["broker-max-body"],
            receipt_retention=settings["broker-receipt-retention"],
            max_receipts=settings["broker-max-receipts"],
            runtimes=tuple(settings["broker-runtimes"]),
            reactions_enabled=not settings["broker-disable-reactions"],
        )
