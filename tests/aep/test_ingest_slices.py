"""A large NDJSON batch is parsed a slice at a time, one slice per reactor turn (relayd.aep.http
PARSE_SLICE), so one client's batch never holds every other connection for the whole parse; and a
client that hangs up mid-parse stops costing CPU."""

from __future__ import annotations

from twisted.internet import task
from twisted.trial.unittest import TestCase

from relayd.aep.core.ingest import PARSE_SLICE
from relayd.aep.core.relay import EventRelay
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.http import AEPResource
from relayd.base.clock import Timekeeper
from relayd.web.streams.sse import SSEHub, sse_comment
from tests.support.aep import event, ndjson
from tests.support.inmemory import InMemorySite

HEADERS = {"aep-version": "0.1", "content-type": "application/x-ndjson"}


class SlicedParsing(TestCase):
    def setUp(self) -> None:
        """The AEP resource served in memory, its timers and its site's on a clock the test advances."""
        self.timers = task.Clock()
        self.log = MemoryEventLog(10 * PARSE_SLICE, 10)
        relay = EventRelay(self.log, token=None, buffer=10 * PARSE_SLICE, max_from=10, seconds=self.timers.seconds)
        clock = Timekeeper(self.timers)
        hub = SSEHub(clock, 25.0, sse_comment("ping"))
        self.addCleanup(hub.stop)
        resource = AEPResource(relay, hub, max_body=2**24, max_batch=10 * PARSE_SLICE)
        self.site = InMemorySite.over(resource, clock=clock)
        self.addCleanup(self.site.close)

    def _held(self, session: str) -> int:
        return len(self.successResultOf(self.log.replay(session, (0, -1))).events)

    def _pending(self) -> bool:
        return any(call.getTime() <= self.timers.seconds() for call in self.timers.getDelayedCalls())

    def test_a_batch_takes_one_turn_per_slice(self) -> None:
        count = 2 * PARSE_SLICE + 1  # three slices: the third holds one line
        posted = self.site.open("POST", "/events", ndjson(*(event("big", seq) for seq in range(count))), HEADERS)
        # The first slice is read, the next waits for a later turn: nothing answered or stored yet.
        self.assertTrue(self._pending())
        self.assertEqual((posted.received(), self._held("big")), (b"", 0))
        self.timers.advance(0)  # (a task.Clock runs the slices each slice schedules, at once)
        self.assertEqual(posted.reply().code, 202)
        self.assertFalse(self._pending())
        self.assertEqual(self._held("big"), count)

    def test_a_batch_of_one_slice_is_answered_at_once(self) -> None:
        body = ndjson(*(event("small", seq) for seq in range(PARSE_SLICE)))
        self.assertEqual(self.site.post("/events", body, HEADERS).code, 202)
        self.assertFalse(self._pending())

    def test_an_invalid_line_in_a_later_slice_refuses_the_whole_batch(self) -> None:
        lines = [ndjson(event("bad", seq)).rstrip(b"\n") for seq in range(PARSE_SLICE + 5)]
        lines[PARSE_SLICE + 2] = b"{oops"
        posted = self.site.open("POST", "/events", b"\n".join(lines), HEADERS)
        self.assertTrue(self._pending())
        self.timers.advance(0)
        response = posted.reply()
        self.assertEqual(response.code, 400)
        self.assertEqual(response.json()["error"], "invalid-json")
        self.assertEqual(self._held("bad"), 0)  # all or nothing

    def test_a_client_that_hangs_up_stops_the_parse(self) -> None:
        posted = self.site.open("POST", "/events", ndjson(*(event("gone", seq) for seq in range(3 * PARSE_SLICE))), HEADERS)
        self.assertTrue(self._pending())
        posted.lose()  # the client hangs up
        self.timers.advance(0)  # the slice that notices schedules no other
        self.assertFalse(self._pending())
        self.assertEqual(self._held("gone"), 0)
