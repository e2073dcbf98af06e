"""relayd.aep.core.relay: once the store has a batch, a failure while fanning it out is logged and the
batch still counts as accepted (the emitter must not be told 503 for events that will be replayed)."""

from __future__ import annotations

import json

from twisted.trial.unittest import TestCase

from relayd.aep.core.event import Event
from relayd.aep.core.filters import match_all
from relayd.aep.core.relay import EventRelay, Subscriber
from relayd.aep.core.store import MemoryEventLog
from tests.support.aep import event


class Broken(Subscriber):
    """A delivery target whose transport fails (a fault no real client can cause on demand)."""

    def send(self, event: Event) -> None:
        raise RuntimeError("transport exploded")


class FailedFanOut(TestCase):
    def test_the_batch_is_accepted_and_the_failure_logged(self) -> None:
        log = MemoryEventLog(10, 10)
        relay = EventRelay(log, token=None, buffer=10, max_from=10, seconds=lambda: 0.0)
        relay.subscribe(object(), Broken(match_all, None))
        ev = event("kept", 0)
        self.successResultOf(relay.ingest([Event(ev, json.dumps(ev).encode())]))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual([e.position for e in self.successResultOf(log.replay("kept", (0, -1))).events], [(0, 0)])
