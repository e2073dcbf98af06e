"""HTTPWingService shutdown phases: settle (bounded by the grace period), then drain, then close."""

from __future__ import annotations

from twisted.internet import reactor, task
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource

from relayd.base.clock import Timekeeper
from relayd.web.service import HTTPWingService
from relayd.web.site import RelaySite


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
