"""A large NDJSON batch is parsed a slice at a time, one slice per reactor turn (relayd.aep.http
PARSE_SLICE), so one client's batch never holds every other connection for the whole parse; and a
client that hangs up mid-parse stops costing CPU."""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet import reactor, task
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from relayd.aep.core.ingest import PARSE_SLICE
from relayd.aep.core.relay import EventRelay
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.http import AEPResource
from relayd.base.clock import Timekeeper
from relayd.web.site import RelaySite
from relayd.web.streams.sse import SSEHub, sse_comment
from tests.support.aep import event, ndjson, wait_until

HEADERS = {"aep-version": "0.1", "content-type": "application/x-ndjson"}


class SlicedParsing(TestCase):
    timeout = 30

    async def _start(self) -> tuple[task.Clock, str, RelaySite, MemoryEventLog]:
        """The AEP resource on a real port, its timers on a clock the test advances."""
        timers = task.Clock()
        log = MemoryEventLog(10 * PARSE_SLICE, 10)
        relay = EventRelay(log, token=None, buffer=10 * PARSE_SLICE, max_from=10, seconds=timers.seconds)
        hub = SSEHub(Timekeeper(timers), 25.0, sse_comment("ping"))
        self.addCleanup(hub.stop)
        site = RelaySite(AEPResource(relay, hub, max_body=2**24, max_batch=10 * PARSE_SLICE))
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        self.addCleanup(site.close_connections, True)
        return timers, f"http://127.0.0.1:{port.getHost().port}", site, log

    def _held(self, log: MemoryEventLog, session: str) -> int:
        return len(self.successResultOf(log.replay(session, (0, -1))).events)

    def _pending(self, timers: task.Clock) -> bool:
        return any(call.getTime() <= timers.seconds() for call in timers.getDelayedCalls())

    async def test_a_batch_takes_one_turn_per_slice(self) -> None:
        timers, url, _, log = await self._start()
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        count = 2 * PARSE_SLICE + 1  # three slices: the third holds one line
        body = ndjson(*(event("big", seq) for seq in range(count)))
        answered: Deferred[Any] = treq.post(url + "/events", data=body, headers=HEADERS, pool=pool)
        responses: list[Any] = []
        answered.addCallback(lambda response: responses.append(response) or response)
        await wait_until(lambda: self._pending(timers))
        # The first slice is read, the next waits for a later turn: nothing answered or stored yet.
        self.assertEqual((responses, self._held(log, "big")), ([], 0))
        timers.advance(0)  # (a task.Clock runs the slices each slice schedules, at once)
        response = await answered
        self.assertEqual(response.code, 202)
        self.assertFalse(self._pending(timers))
        self.assertEqual(self._held(log, "big"), count)

    async def test_a_batch_of_one_slice_is_answered_at_once(self) -> None:
        timers, url, _, _ = await self._start()
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        body = ndjson(*(event("small", seq) for seq in range(PARSE_SLICE)))
        response = await treq.post(url + "/events", data=body, headers=HEADERS, pool=pool)
        self.assertEqual(response.code, 202)
        self.assertFalse(self._pending(timers))

    async def test_an_invalid_line_in_a_later_slice_refuses_the_whole_batch(self) -> None:
        timers, url, _, log = await self._start()
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        lines = [ndjson(event("bad", seq)).rstrip(b"\n") for seq in range(PARSE_SLICE + 5)]
        lines[PARSE_SLICE + 2] = b"{oops"
        answered = treq.post(url + "/events", data=b"\n".join(lines), headers=HEADERS, pool=pool)
        await wait_until(lambda: self._pending(timers))
        timers.advance(0)
        response = await answered
        self.assertEqual(response.code, 400)
        self.assertEqual((await response.json())["error"], "invalid-json")
        self.assertEqual(self._held(log, "bad"), 0)  # all or nothing

    async def test_a_client_that_hangs_up_stops_the_parse(self) -> None:
        timers, url, site, log = await self._start()
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        body = ndjson(*(event("gone", seq) for seq in range(3 * PARSE_SLICE)))
        answered = treq.post(url + "/events", data=body, headers=HEADERS, pool=pool)
        answered.addErrback(lambda _: None)
        await wait_until(lambda: self._pending(timers))
        answered.cancel()  # the client hangs up
        await wait_until(lambda: site.open_connections() == 0)
        timers.advance(0)  # the slice that notices schedules no other
        self.assertFalse(self._pending(timers))
        self.assertEqual(self._held(log, "gone"), 0)
