"""Composes the broker wing for relayd.tap: state, key custody, relay pool, host, HTTP listeners."""

from __future__ import annotations

import os
import sqlite3
from typing import Any, Callable

from twisted.application.service import Service
from twisted.internet import defer
from twisted.logger import Logger

from relayd.base.clock import Timekeeper
from relayd.base.config import ConfigError, Resolved, is_loopback_endpoint, is_tls_endpoint
from relayd.base.reactor import IReactor
from relayd.buzz import metrics
from relayd.buzz.config import KEK_ENV, BuzzConfig
from relayd.buzz.core.host import BrokerHost
from relayd.buzz.core.keys import Custody, KEKError, load_kek
from relayd.buzz.core.operations import Operations
from relayd.buzz.core.state import MAX_RECEIPTS, RECEIPT_RETENTION, IReceiptStore, SQLiteState, StateDB
from relayd.buzz.http import body_limit, make_root
from relayd.buzz.nostr_upstream import NostrRelayPool
from relayd.buzz.upstream import START_WARNING, Upstream, public_url
from relayd.logs import scrub
from relayd.process.settings import DEFAULT_REDIS_PREFIX, DEFAULT_SITE_SETTINGS, SiteSettings
from relayd.storage.redis import Redis
from relayd.web.listen import HTTPWingService
from relayd.web.site import RelaySite
from relayd.wing import DEFAULT_GRACE, Plumbing

_log = Logger(namespace="relayd.buzz")
PRUNE_INTERVAL = 60.0  # seconds between receipt sweeps


def inherited_socket_is_local(description: str) -> bool:
    """Whether a C{systemd:} listener's inherited socket is a Unix socket or bound to loopback.

    The description says nothing about the address: the socket unit does (C{ListenStream=8080} is
    every interface), so the inherited descriptor itself is asked.
    """
    import ipaddress
    import socket

    from twisted.internet import endpoints

    from relayd.base.reactor import installed

    try:
        fd = endpoints.serverFromString(installed(), description).fileno
        sock = socket.socket(fileno=os.dup(fd))
    except (IndexError, ValueError, KeyError, TypeError, AttributeError, OSError):
        return False  # no such inherited socket: refused here rather than at listen time
    try:
        if sock.family == socket.AF_UNIX:
            return True
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return False
        host = sock.getsockname()[0]
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except (OSError, ValueError):
        return False
    finally:
        sock.close()


def check_listeners(listen: list[str]) -> None:
    """Refuse a non-loopback plain-TCP listener: the credential is the agent's whole authority."""
    for description in listen:
        if description.split(":", 1)[0] == "systemd":
            if not inherited_socket_is_local(description):
                raise ConfigError(
                    f"--broker-listen: {description!r}: the inherited socket is not bound to loopback "
                    "(or is missing); the broker serves bearer credentials only over loopback or TLS"
                )
            continue
        if not is_loopback_endpoint(description) and not is_tls_endpoint(description):
            raise ConfigError(
                f"--broker-listen: {description!r} is neither loopback nor TLS; the broker serves "
                "bearer credentials only over loopback or TLS"
            )


# What relayd's logs know of this wing: records logged under relayd.buzz are the "broker" relay's, and
# the secrets it handles are scrubbed wherever they appear: agents' Nostr secret keys (bech32 nsec1...)
# and the credentials it issues (relayd/cli/broker.py: bzh_ + base64url).
LOGS = scrub.WingLogs(
    "relayd.buzz",
    relay="broker",
    secret_formats=(
        scrub.SecretFormat(r"\bnsec1[02-9ac-hj-np-z]{20,}", "nsec1"),
        scrub.SecretFormat(r"\bbzh_[A-Za-z0-9_-]{16,}", "bzh_"),
    ),
)


def configured(settings: Resolved) -> BuzzConfig | None:
    """The wing's configuration (C{None} without C{--broker-nostr-relay}): what L{make_wing} builds
    from, and what C{--check-config} checks. Opens no state directory (that is make_wing's).

    @raise ConfigError: a non-loopback plain-TCP listener.
    """
    config = BuzzConfig.from_settings(settings)
    if config is not None:
        check_listeners(list(config.listen))
    return config


def make_wing(plumbing: Plumbing, settings: Resolved) -> BrokerService | None:
    """The broker wing (relayd/wing.py), or C{None} (with one log line) when no Nostr relay URL is
    configured.

    @raise ConfigError: a non-loopback plain-TCP listener, an unusable state directory or KEK.
    """
    scrub.declare(LOGS)
    config = configured(settings)
    if config is None:
        _log.info("Buzz broker not started: no --broker-nostr-relay (RELAYD_BROKER_NOSTR_RELAY) configured")
        return None
    listen = list(config.listen)
    state_dir = config.state_dir
    try:
        kek = load_kek(state_dir, config.kek_file, os.environ.get(KEK_ENV) or None)
    except KEKError as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"--broker-state-dir: {state_dir!r}: {e.strerror}") from None
    try:
        db = StateDB.in_dir(state_dir)
    except (OSError, sqlite3.Error) as e:
        raise ConfigError(f"--broker-state-dir: {state_dir!r}: cannot open state ({e})") from None
    return BrokerService(
        listen=listen,
        nostr_relay_url=config.nostr_relay,
        auth_url=config.auth_url,
        db=db,
        kek=kek,
        reactor=plumbing.reactor,
        clock=plumbing.clock,
        timeout=config.action_timeout,
        max_agent_depth=config.max_agent_depth,
        max_body=config.max_body,
        runtimes=list(config.runtimes),
        reactions_enabled=config.reactions_enabled,
        receipt_retention=config.receipt_retention,
        max_receipts=config.max_receipts,
        # With --redis, receipts and pending events go to Redis, on the process's one client (shared
        # with the other wings, closed by whoever made the plumbing).
        redis=plumbing.redis,
        redis_prefix=plumbing.redis_prefix,
        grace=plumbing.grace,
        site=plumbing.site,
    )


def make_service(settings: Resolved, reactor: IReactor, clock: Timekeeper) -> BrokerService | None:
    """L{make_wing} on plumbing made from C{settings} alone (tests; with C{--redis} the caller
    closes the client, C{service.redis})."""
    return make_wing(Plumbing.from_settings(settings, reactor, clock), settings)


class BrokerService(HTTPWingService):
    """The broker wing. Stop: stop listening, let in-flight actions finish (at most C{grace}
    seconds), close connections, then the upstream Nostr relay connections and the state."""

    def __init__(
        self,
        *,
        listen: list[str],
        nostr_relay_url: str,
        auth_url: str | None,
        db: StateDB,
        kek: bytes,
        reactor: IReactor,
        clock: Timekeeper,
        timeout: float = 10.0,
        max_agent_depth: int = 4,
        max_body: int = 2 * 1024 * 1024,
        runtimes: list[str] | None = None,
        reactions_enabled: bool = True,
        now: Callable[[], float] | None = None,
        challenge_wait: float = 1.0,
        grace: float = DEFAULT_GRACE,
        redis: Redis | None = None,
        redis_prefix: str = DEFAULT_REDIS_PREFIX,
        site: SiteSettings = DEFAULT_SITE_SETTINGS,
        receipt_retention: int = RECEIPT_RETENTION,
        max_receipts: int = MAX_RECEIPTS,
        upstream_warning: float = START_WARNING,
    ) -> None:
        self.reactor = reactor
        self.receipt_retention = receipt_retention
        self.now = now = now if now is not None else clock.seconds  # the wall clock, fixed by a test
        self.db = db
        db.now = now  # its stamps (receipts, credentials, agents) by the same clock
        db.max_receipts = max_receipts
        self.custody = Custody(kek)
        self.state = SQLiteState(db, reactor)
        self.pool = NostrRelayPool(
            nostr_relay_url, reactor, clock, auth_url=auth_url, connect_timeout=timeout, challenge_wait=challenge_wait,
            wall_clock=now,
        )
        # Whether the upstream Nostr relay can be reached, for the log, /healthz and relayd-admin status.
        self.upstream = Upstream(
            nostr_relay_url, reactor, clock, wall_clock=now, connect_timeout=timeout, start_warning=upstream_warning
        )
        self.ops = Operations(
            self.state,
            self.pool,
            self.custody,
            timeout=timeout,
            now=now,
            runtimes=runtimes if runtimes is not None else ["buzz-acp"],
            reactions_enabled=reactions_enabled,
        )
        # The client handed in (the plumbing's) is shared: whoever made it closes it.
        self.redis: Redis | None = redis
        self.redis_receipts: Any = None
        receipts: IReceiptStore = self.state
        if self.redis is not None:
            from relayd.buzz.redis.state import RedisReceipts

            # The lease outlasts the longest execution: a few queries and two publishes, each
            # bounded by the action timeout.
            # Every instance expires and trims the shared receipts by these.
            self.redis.hold_bounds({"broker-receipt-retention": receipt_retention, "broker-max-receipts": max_receipts})
            self.redis_receipts = receipts = RedisReceipts(
                self.redis, clock, self.state.apply_effects, prefix=redis_prefix, lease=6 * timeout + 5,
                retention=receipt_retention, max_receipts=max_receipts,
            )
        self.host = BrokerHost(
            self.state, self.state, receipts, self.ops, max_agent_depth=max_agent_depth,
            relay_outage=self.upstream.outage,
        )
        root = make_root(self.host, self.upstream.status)
        relay_site = RelaySite(
            root, body_limit=body_limit(max_body, root.early_answer), settings=site, relay="broker", clock=clock,
            health_paths=frozenset({b"/healthz"}),
        )
        super().__init__("broker", relay_site, listen, reactor, clock, settle=self.host.wait_idle, grace=grace)
        # Read at scrape time by the metrics listener; registered while the service runs.
        self.watching = metrics.Watching().add(metrics.nostr_connections, self.pool.states)
        self.watching.setServiceParent(self)
        _Closing(self._close).setServiceParent(self)
        # Receipts older than the retention go (SQLite; Redis expires its own): a sweep a minute,
        # on the worker thread, so the state directory holds at most one retention's worth.
        # Added after _Closing, so it is stopped (and its sweep awaited) before the state closes.
        clock.timer_service(PRUNE_INTERVAL, self._prune).setServiceParent(self)

    def _prune(self) -> "defer.Deferred[None]":
        d = self.state.prune(int(self.now()), self.receipt_retention)

        def failed(f: Any) -> None:
            _log.warn("broker receipt sweep failed: {why}", why=f.getErrorMessage())

        return d.addCallbacks(lambda n: None, failed)

    def details(self) -> str:
        return f"upstream relay {public_url(self.pool.url)}"

    def startService(self) -> None:
        super().startService()
        self.upstream.start()
        if self.redis is not None:
            _log.info("Buzz broker receipts and pending events on {redis}", redis=str(self.redis.url))

    async def _close(self) -> None:
        """Once the connections are gone: the relay connections, the receipts, then the state."""
        await self.upstream.stop()
        await self.pool.close()
        if self.redis_receipts is not None:
            await self.redis_receipts.close()
        await self.state.close()


class _Closing(Service):
    """A child that runs C{close()} when its parent stops it (after the wing's connections)."""

    def __init__(self, close: Callable[[], Any]) -> None:
        self._close = close

    def stopService(self) -> defer.Deferred[None]:
        super().stopService()
        return defer.Deferred.fromCoroutine(self._close())
