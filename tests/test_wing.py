"""The wing contract (relayd/wing.py): every wing provides IWing, is built once on one Plumbing with
its site settings and grace at construction, shares the one Redis client the root service closes,
reads a frozen typed config; and a fourth wing is one package plus one line in relayd.tap.WINGS."""

from __future__ import annotations

import dataclasses
import gc
import importlib
import os
import shutil
import tempfile
from typing import Any

import treq
from prometheus_client import generate_latest
from twisted.internet import reactor
from twisted.python import usage
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool
from zope.interface.verify import verifyObject

from relayd import tap
from relayd.aep.config import AEPConfig
from relayd.base.clock import Timekeeper
from relayd.base.config import Resolved
from relayd.base.metrics import REGISTRY
from relayd.buzz.config import BuzzConfig
from relayd.compat import reactor as compat_reactor
from relayd.mcp.config import MCPConfig
from relayd.process.settings import SiteSettings
from relayd.web import metrics_listener
from relayd.wing import IWing, Plumbing
from tests.support.aep import wait_until
from tests.support.cases import cases, expand
from tests.support.metrics import parse, value
from tests.support.redis import shared_redis

LOOPBACK = "tcp:0:interface=127.0.0.1"
ECHO = "tests.support.echo_wing"
# Process-wide settings other than their defaults, to find on every site and service.
SITE_FLAGS = [
    "--idle-timeout", "7", "--header-timeout", "3", "--body-timeout", "4", "--trust-forwarded-for", "2",
    "--no-access-log", "--shutdown-grace", "9",
]


class _Wings(TestCase):
    def wing_flags(self) -> list[str]:
        """Every wing configured, each on a loopback port of its own (the broker not yet started)."""
        return [
            "--aep-listen", LOOPBACK, "--mcp-listen", LOOPBACK, "--broker-listen", LOOPBACK,
            "--broker-nostr-relay", "ws://127.0.0.1:1", "--broker-state-dir", self.state_dir(),
        ]

    def state_dir(self) -> str:
        path = tempfile.mkdtemp(prefix="relayd-wing-")
        self.addCleanup(shutil.rmtree, path, True)
        return path

    def parse(self, argv: list[str], options: type[tap.Options] = tap.Options) -> tap.Options:
        parsed = options(environ={})
        parsed.parseOptions(argv)
        return parsed

    def settings(self, *extra: str) -> Resolved:
        return self.parse([*self.wing_flags(), *extra]).settings

    def plumbing(self, settings: Resolved) -> Plumbing:
        clock = Timekeeper(reactor)
        self.addCleanup(clock.shutdown)  # the wings' timers (SSE heartbeats) start when they are built
        return Plumbing.from_settings(settings, reactor, clock)

    def make_wing(self, package: str, plumbing: Plumbing, settings: Resolved) -> Any:
        wing = importlib.import_module(f"{package}.service").make_wing(plumbing, settings)
        state = getattr(wing, "state", None)
        if state is not None:  # the broker opened its state directory
            self.addCleanup(state.close)
        return wing


@expand
class Contract(_Wings):
    @cases(aep="relayd.aep", mcp="relayd.mcp", buzz="relayd.buzz")
    def test_every_wing_provides_iwing(self, package: str) -> None:
        settings = self.settings()
        wing = self.make_wing(package, self.plumbing(settings), settings)
        self.assertTrue(verifyObject(IWing, wing))

    def test_the_wings_are_the_tap_tuple(self) -> None:
        self.assertEqual(tap.WINGS, ("relayd.aep", "relayd.mcp", "relayd.buzz"))

    def test_the_metrics_listener_provides_iwing(self) -> None:
        self.assertTrue(verifyObject(IWing, metrics_listener.make_service([LOOPBACK], reactor, Timekeeper(reactor))))

    @cases(aep="relayd.aep", mcp="relayd.mcp", buzz="relayd.buzz")
    def test_site_settings_and_grace_are_given_at_construction(self, package: str) -> None:
        """Right after make_wing, with no tap around: the site and the service have them."""
        settings = self.settings(*SITE_FLAGS)
        wing = self.make_wing(package, self.plumbing(settings), settings)
        site = wing.site
        self.assertEqual(
            (site.timeOut, site.header_timeout, site.body_timeout, site.trust_forwarded_for, site.access_log),
            (7.0, 3.0, 4.0, 2, False),
        )
        self.assertEqual(site.relay, wing.name)
        self.assertEqual(wing.grace, 9.0)

    def test_defaults_without_the_flags(self) -> None:
        settings = self.settings()
        wing = self.make_wing("relayd.aep", self.plumbing(settings), settings)
        site = wing.site
        self.assertEqual((site.timeOut, site.header_timeout, site.body_timeout, site.access_log), (60.0, 20.0, 60.0, True))
        self.assertEqual(wing.grace, 5.0)

    def test_make_service_builds_every_site_with_the_settings(self) -> None:
        options = self.parse([*self.wing_flags(), *SITE_FLAGS, "--metrics-listen", LOOPBACK])
        root = tap.makeService(options, reactor)
        self.addCleanup(root.clock.shutdown)
        self.addCleanup(root.getServiceNamed("broker").state.close)
        wings = root.wings()
        self.assertEqual([wing.name for wing in wings], ["metrics", "aep", "mcp", "broker"])
        for wing in wings:
            site = wing.site
            self.assertEqual((site.timeOut, site.header_timeout, site.trust_forwarded_for), (7.0, 3.0, 2), wing.name)
            self.assertEqual((site.access_log, wing.grace), (False, 9.0), wing.name)


@expand
class FrozenConfig(_Wings):
    @cases(
        aep=(AEPConfig, "max_body", 1),
        mcp=(MCPConfig, "ttl_ms", 1.0),
        buzz=(BuzzConfig, "max_body", 1),
    )
    def test_a_wing_config_is_frozen(self, kind: Any, field: str, value: Any) -> None:
        config = kind.from_settings(self.settings())
        self.assertIsNotNone(config)
        self.assertRaises(dataclasses.FrozenInstanceError, setattr, config, field, value)

    def test_plumbing_and_site_settings_are_frozen(self) -> None:
        plumbing = self.plumbing(self.settings(*SITE_FLAGS))
        self.assertEqual(plumbing.site, SiteSettings(2, 3.0, 4.0, 7.0, False))
        self.assertRaises(dataclasses.FrozenInstanceError, setattr, plumbing, "grace", 1.0)
        self.assertRaises(dataclasses.FrozenInstanceError, setattr, plumbing.site, "idle_timeout", 1.0)

    @cases(aep=(AEPConfig, "--no-aep"), mcp=(MCPConfig, "--no-mcp"))
    def test_a_wing_switched_off_has_no_config(self, kind: Any, switch: str) -> None:
        self.assertIsNone(kind.from_settings(self.settings(switch)))

    def test_no_broker_config_without_a_nostr_relay(self) -> None:
        self.assertIsNone(BuzzConfig.from_settings(self.parse([]).settings))


class FourthWing(_Wings):
    """tests/support/echo_wing is a package; adding it to the tuple is all it takes."""

    def setUp(self) -> None:
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(self.pool.closeCachedConnections)
        self.addCleanup(gc.unfreeze)  # RelaydService.startService freezes what start-up allocated

    async def test_a_wing_reports_its_open_http_connections_with_no_tap(self) -> None:
        """HTTPWingService itself watches its site on relayd_http_connections while it runs."""
        settings = self.parse(["--echo-listen", LOOPBACK], tap.options_for((ECHO,))).settings
        echo = self.make_wing(ECHO, self.plumbing(settings), settings)
        kept = HTTPConnectionPool(reactor, persistent=True)  # the connection stays open after the answer
        echo.startService()
        try:
            (port,) = await echo.ports()
            response = await treq.get(f"http://127.0.0.1:{port.getHost().port}/", pool=kept)
            await response.content()
            self.assertEqual(value(parse(generate_latest(REGISTRY).decode()), "relayd_http_connections", relay="echo"), 1)
        finally:
            await kept.closeCachedConnections()
            await echo.stopService()
        self.assertEqual(value(parse(generate_latest(REGISTRY).decode()), "relayd_http_connections", relay="echo"), 0)

    async def test_the_started_root_hands_its_reactor_to_the_fence_s_dispatch(self) -> None:
        """The root service's start has the fence give the process's reactor its event dispatch
        (relayd/compat/reactor.py, tested there)."""
        handed: list[Any] = []
        quick_dispatch = compat_reactor.quick_dispatch
        self.patch(compat_reactor, "quick_dispatch", lambda given: handed.append(given) or quick_dispatch(given))
        options = self.parse(["--no-aep", "--no-mcp", "--echo-listen", LOOPBACK], tap.options_for((*tap.WINGS, ECHO)))
        root = tap.makeService(options, reactor)
        root.startService()
        await root.stopService()
        self.assertEqual(handed, [reactor])

    def test_without_the_line_its_flag_is_unknown(self) -> None:
        self.assertRaises(usage.UsageError, self.parse, ["--echo-listen", LOOPBACK])

    async def test_one_line_in_the_tuple_starts_it_and_it_answers(self) -> None:
        wings = (*tap.WINGS, ECHO)
        options = self.parse(["--no-aep", "--no-mcp", "--echo-listen", LOOPBACK], tap.options_for(wings))
        root = tap.makeService(options, reactor)
        echo = root.getServiceNamed("echo")
        self.assertTrue(verifyObject(IWing, echo))
        root.startService()
        try:
            (port,) = await echo.ports()
            response = await treq.get(f"http://127.0.0.1:{port.getHost().port}/", pool=self.pool)
            self.assertEqual((response.code, await response.content()), (200, b"echo\n"))
        finally:
            await root.stopService()
        self.assertTrue(echo.drained)


class SharedRedis(_Wings):
    timeout = 60

    def setUp(self) -> None:
        self.addCleanup(gc.unfreeze)

    async def test_one_client_for_every_wing_closed_once_by_the_root(self) -> None:
        server = shared_redis()
        prefix = f"wing:{os.getpid()}:{id(self)}:"
        options = self.parse([*self.wing_flags(), "--redis", server.url, "--redis-prefix", prefix])
        root = tap.makeService(options, reactor)
        redis = root.redis
        assert redis is not None
        aep, mcp, broker = (root.getServiceNamed(name) for name in ("aep", "mcp", "broker"))
        users = [aep.relay.log, aep.relay.claims, aep.relay.fanout, mcp.tunnel.store, mcp.tunnel.bus, broker]
        self.assertEqual([user.redis for user in users], [redis] * len(users))
        closes: list[None] = []
        close = redis.close

        def counted() -> Any:
            closes.append(None)
            return close()

        self.patch(redis, "close", counted)
        root.startService()
        try:
            await wait_until(lambda: redis.connected)
            for wing in root.wings():
                await wing.ports()
        finally:
            await root.stopService()
        self.assertEqual(len(closes), 1)
        self.assertFalse(redis.connected)
