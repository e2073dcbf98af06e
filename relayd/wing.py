"""The wing contract: what C{relayd.tap} hands a wing (L{Plumbing}) and what it gets back (L{IWing}).

A wing is a package with two modules (docs/architecture.md "The wing contract"):

- C{config}: C{SETTINGS}, its table of L{relayd.base.config.Setting} rows (the tap builds its C{Options}
  from every wing's), and a frozen config object built from the resolved values;
- C{service}: C{make_wing(plumbing, settings)}, returning an L{IWing} provider, or C{None} when the
  wing is not configured.

This module is the layer between the plumbing below it (relayd.process, relayd.storage, relayd.logs,
relayd.base) and relayd.web and the wings above it: it imports neither (pyproject.toml's C{layers}).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from twisted.application.service import IService
from zope.interface import Attribute

from relayd.base.clock import Timekeeper
from relayd.base.config import ConfigError, Resolved
from relayd.base.reactor import IReactor
from relayd.process.browsers import LOOPBACK_ONLY, BrowserPolicy
from relayd.process.settings import DEFAULT_REDIS_PREFIX, DEFAULT_SITE_SETTINGS, RedisSettings, SiteSettings
from relayd.storage.cluster import redis_client
from relayd.storage.redis import Redis

DEFAULT_GRACE = 5.0  # --shutdown-grace


class IWing(IService):
    """One wing: a service with its listeners over one site, and a phased shutdown.

    L{relayd.web.listen.HTTPWingService} provides it; a wing passes its C{settle}, C{drain},
    C{remaining} and C{abort} to that class's constructor (or overrides the methods).
    """

    site = Attribute("The wing's L{relayd.web.site.RelaySite}, built with the plumbing's site settings")
    grace = Attribute("Seconds shutdown waits for in-flight work and streams before aborting")
    drained = Attribute("False once a shutdown had to give up on requests after the grace period")
    url_path = Attribute("The path the wing serves under, shown in its startup line")

    def ports() -> Any:
        """A Deferred firing with the listening ports once every listener is bound (readiness)."""

    def details() -> str:
        """What the wing's startup line says after its URL (its key settings), or C{""}."""

    def settle() -> Any:
        """A Deferred firing once requests whose answers are being worked out are answered."""

    def drain() -> None:
        """End streams with the wing's final frames and answer parked requests."""

    def remaining() -> int:
        """How many connections the site does not see (WebSockets) are still open."""

    def abort() -> None:
        """Abort what is still open once the grace period is over."""


@dataclass(frozen=True)
class Plumbing:
    """What every wing is built with, made once by the tap from the resolved settings.

    @ivar reactor: the reactor the listeners bind on.
    @ivar clock: the one owner of timers (tests hand in a L{twisted.internet.task.Clock}).
    @ivar redis: the process's one Redis client (C{--redis}), or C{None}: shared by every wing,
        closed by whoever built the plumbing (the tap's root service), never by a wing.
    @ivar redis_prefix: the prefix of every Redis key (C{--redis-prefix}).
    @ivar site: the settings every wing's site is constructed with.
    @ivar grace: the shutdown grace (C{--shutdown-grace}), given to every wing's service.
    @ivar browsers: the C{Host} and C{Origin} a relay without a token answers (C{--allow-host},
        C{--allow-origin}; relayd/process/browsers.py).
    """

    reactor: IReactor
    clock: Timekeeper
    redis: Redis | None = None
    redis_prefix: str = DEFAULT_REDIS_PREFIX
    site: SiteSettings = DEFAULT_SITE_SETTINGS
    grace: float = DEFAULT_GRACE
    browsers: BrowserPolicy = LOOPBACK_ONLY

    @classmethod
    def from_settings(cls, settings: Resolved, reactor: IReactor, clock: Timekeeper) -> Plumbing:
        """The plumbing the resolved settings describe; a table that is absent leaves its defaults.

        With C{--redis} this makes a new client: the caller owns it and closes it.
        """
        redis = RedisSettings.from_settings(settings)
        return cls(
            reactor=reactor,
            clock=clock,
            # The prefix also names the keyspace version key (relayd/storage/redis.py KEYSPACE_VERSION).
            redis=redis_client(
                redis.url, clock, prefix=redis.prefix, wait_replicas=redis.wait_replicas, wait_timeout_ms=redis.wait_timeout_ms
            )
            if redis.url
            else None,
            redis_prefix=redis.prefix,
            site=SiteSettings.from_settings(settings),
            grace=settings.values.get("shutdown-grace", DEFAULT_GRACE),
            browsers=browser_policy(settings),
        )


def browser_policy(settings: Resolved) -> BrowserPolicy:
    """The L{BrowserPolicy} of C{--allow-host} and C{--allow-origin} (loopback only where absent).

    @raise ConfigError: C{*} and names combined across a setting's repeated values.
    """
    values = settings.values
    hosts, origins = values.get("allow-host") or [], values.get("allow-origin") or []
    try:
        BrowserPolicy.from_values(hosts=hosts)
    except ValueError as e:
        raise ConfigError(f"{settings.sources.get('allow-host', '--allow-host')}: {e}") from None
    try:
        return BrowserPolicy.from_values(hosts, origins)
    except ValueError as e:  # (the hosts passed above)
        raise ConfigError(f"{settings.sources.get('allow-origin', '--allow-origin')}: {e}") from None
