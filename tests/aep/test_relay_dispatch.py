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


class Recording(Subscriber):
    def __init__(self) -> None:
        super().__init__(match_all, None)
        self.sent: list[Event] = []

    def send(self, event: Event) -> None:
        self.sent.append(event)


class IngestNow(TestCase):
    """A batch a POST sent is ingested within the call on the in-memory log (no Deferred to answer
    its 202 from), as L{EventRelay.ingest} would ingest it; a log that stores later declines it."""

    def test_stored_and_fanned_out_within_the_call(self) -> None:
        log = MemoryEventLog(10, 10)
        relay = EventRelay(log, token=None, buffer=10, max_from=10, seconds=lambda: 0.0)
        subscriber = Recording()
        relay.subscribe(object(), subscriber)
        batch = [event("now", 0), event("now", 1), event("now", 0)]  # (the last a duplicate: fanned out too)
        self.assertIs(relay.ingest_now([Event(ev, json.dumps(ev).encode()) for ev in batch]), True)
        self.assertEqual(
            [e.position for e in self.successResultOf(log.replay("now", (0, -1))).events], [(0, 0), (0, 1)]
        )
        self.assertEqual([e.position for e in subscriber.sent], [(0, 0), (0, 1), (0, 0)])

    def test_a_failed_fan_out_is_logged_and_the_batch_accepted(self) -> None:
        log = MemoryEventLog(10, 10)
        relay = EventRelay(log, token=None, buffer=10, max_from=10, seconds=lambda: 0.0)
        relay.subscribe(object(), Broken(match_all, None))
        ev = event("kept", 0)
        self.assertIs(relay.ingest_now([Event(ev, json.dumps(ev).encode())]), True)
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual([e.position for e in self.successResultOf(log.replay("kept", (0, -1))).events], [(0, 0)])

    def test_a_log_that_stores_later_declines_with_nothing_done(self) -> None:
        class Later(MemoryEventLog):
            append_now = None  # (a log whose write answers later: Redis)

        log = Later(10, 10)
        relay = EventRelay(log, token=None, buffer=10, max_from=10, seconds=lambda: 0.0)
        subscriber = Recording()
        relay.subscribe(object(), subscriber)
        ev = event("later", 0)
        self.assertIs(relay.ingest_now([Event(ev, json.dumps(ev).encode())]), False)
        self.assertEqual(log.session_count(), 0)
        self.assertEqual(subscriber.sent, [])
