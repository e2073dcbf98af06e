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
from relayd.web.listen import HTTPWingService, StrictListener
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
        await parent.stopService()
        self.assertFalse(port.connected)


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
