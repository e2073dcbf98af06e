"""A listener that fails startup on a port in use, and HTTPWingService shutdown phases: settle (bounded
by the grace period), then drain, then close."""

from __future__ import annotations

from twisted.application.service import MultiService
from twisted.internet import endpoints, reactor, task
from twisted.internet.defer import Deferred
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource

from relayd.base.clock import Timekeeper
from relayd.compat.tcp import _QuickAccept
from relayd.web.listen import DEFAULT_BACKLOG, HTTPWingService, StrictListener, with_default_backlog
from relayd.web.site import RelaySite


class Listening(TestCase):
    async def test_a_bound_port_and_a_port_in_use(self) -> None:
        parent = MultiService()
        svc = StrictListener(endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1"), Factory())
        svc.setServiceParent(parent)
        parent.startService()
        port = await svc.bound_port()
        number = port.getHost().port
        taken = StrictListener(endpoints.serverFromString(reactor, f"tcp:{number}:interface=127.0.0.1"), Factory())
        self.assertRaises(CannotListenError, taken.startService)  # at start, not in a log line
        self.assertIsInstance(port.socket, _QuickAccept)  # (its connections' sockets made without enums)
        await parent.stopService()
        self.assertFalse(port.connected)


class Backlog(TestCase):
    """Issue 24: a storm of thousands of connections overflowed Twisted's default listen queue (50),
    and each overflowed client waited out a TCP retransmission; a listener asks for 511 unless it
    names its own."""

    def test_the_default_is_added_only_where_none_is_named(self) -> None:
        assert with_default_backlog("tcp:8787:interface=127.0.0.1") == "tcp:8787:interface=127.0.0.1:backlog=511"
        assert with_default_backlog("tcp6:8787:interface=\\:\\:1").endswith(":backlog=511")
        assert with_default_backlog("haproxy:tcp:8787").endswith(":backlog=511")
        assert with_default_backlog("unix:/run/relayd/aep.sock:mode=660").endswith(":backlog=511")
        assert with_default_backlog("tcp:8787:backlog=64") == "tcp:8787:backlog=64"
        assert with_default_backlog("systemd:domain=INET:index=0") == "systemd:domain=INET:index=0"

    async def test_a_wings_listener_listens_with_the_default_backlog(self) -> None:
        wing = HTTPWingService("test", RelaySite(Resource()), ["tcp:0:interface=127.0.0.1"], reactor, Timekeeper(task.Clock()))
        wing.startService()
        [port] = await wing.ports()
        self.addCleanup(wing.stopService)
        assert port.backlog == DEFAULT_BACKLOG  # type: ignore[attr-defined]


class SettlePhase(TestCase):
    async def stopping(self, in_flight: Deferred[None]) -> tuple[HTTPWingService, Deferred[None], task.Clock, list[str]]:
        """A wing on a real port, told to stop, once its listeners are closed and it waits on C{in_flight}."""
        time = task.Clock()
        steps: list[str] = []
        in_flight.addCallback(lambda _: steps.append("settled"))
        settling: Deferred[None] = Deferred()

        def settle() -> Deferred[None]:
            # Resume the test on the next reactor turn: the wing arms its grace timer right after this returns.
            reactor.callLater(0, settling.callback, None)
            return in_flight

        wing = HTTPWingService(
            "test", RelaySite(Resource()), ["tcp:0:interface=127.0.0.1"], reactor, Timekeeper(time),
            settle=settle, drain=lambda: steps.append("drain"), grace=5.0,
        )
        wing.startService()
        await wing.ports()
        stopped = wing.stopService()
        await settling
        return wing, stopped, time, steps

    async def test_drain_waits_for_requests_in_flight(self) -> None:
        in_flight: Deferred[None] = Deferred()
        wing, stopped, time, steps = await self.stopping(in_flight)
        time.advance(4.9)
        self.assertEqual(steps, [])  # still within the grace period: nothing is drained yet
        in_flight.callback(None)
        await stopped
        self.assertEqual(steps, ["settled", "drain"])
        self.assertTrue(wing.drained)

    async def test_the_grace_period_bounds_the_wait(self) -> None:
        in_flight: Deferred[None] = Deferred()
        wing, stopped, time, steps = await self.stopping(in_flight)
        time.advance(5.0)
        await stopped
        self.assertEqual(steps, ["drain"])
        self.assertFalse(wing.drained)
        in_flight.callback(None)  # the late answer fires nothing twice
        self.assertEqual(steps, ["drain", "settled"])
