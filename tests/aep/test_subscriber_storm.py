"""A subscriber storm on the AEP wing (issue 24): thousands of SSE streams opening at once, each with
a filter and a resume position, are started a slice per reactor turn (relayd.web.admission), and
every one is primed with the same bytes as a stream opened alone; a health probe and a live event
to a subscriber already connected do not wait for the storm. In memory, one reactor turn at a
time (TurnByTurn)."""

from __future__ import annotations

from typing import Any

from twisted.trial.unittest import TestCase

from relayd.web.admission import NEWCOMERS_PER_TURN
from tests.support.aep import INGEST, aep_in_memory, event, ndjson, post_in_memory, query
from tests.support.inmemory import Connection, InMemoryWing, request_bytes

SESSIONS = 3
HELD = 10  # events held per session
REPLAY = 5  # each stream resumes this many events back
STORM = 3 * NEWCOMERS_PER_TURN + 5


def _params(n: int) -> dict[str, Any]:
    session = f"s{n % SESSIONS}"
    return {"filter": {"session": session}, "from_": [{"session": session, "epoch": 0, "seq": HELD - REPLAY - 1}]}


class SubscriberStorm(TestCase):
    def setUp(self) -> None:
        self.relay: InMemoryWing = aep_in_memory(self, aep_buffer=64)
        for k in range(SESSIONS):
            self.assertEqual(post_in_memory(self.relay, *[event(f"s{k}", n) for n in range(HELD)]).code, 202)

    def storm(self) -> list[Connection]:
        """STORM streams whose requests arrive in one reactor turn."""
        return [self.relay.open("GET", "/stream" + query(**_params(n))) for n in range(STORM)]

    def primed(self, streams: list[Connection]) -> int:
        return sum(1 for s in streams if len([m for m in s.events() if m.id is not None]) >= REPLAY)

    def test_a_storm_is_started_a_slice_per_turn(self) -> None:
        streams = self.storm()
        started = []
        for _ in range(6):
            started.append(sum(1 for s in streams if s.received()))
            self.relay.turn()
        per_turn = [b - a for a, b in zip([0, *started], started, strict=False)]
        # (The first turn's share is what the setup's connections left of it: at least half.)
        self.assertLessEqual(max(per_turn), NEWCOMERS_PER_TURN, per_turn)
        self.assertGreaterEqual(per_turn[0], NEWCOMERS_PER_TURN // 2)
        self.assertEqual(per_turn[1:3], [NEWCOMERS_PER_TURN, NEWCOMERS_PER_TURN])
        self.assertEqual(started[-1], STORM)
        self.assertEqual(self.primed(streams), STORM)

    def test_every_stream_is_primed_with_the_bytes_of_a_stream_opened_alone(self) -> None:
        streams = self.storm()
        for _ in range(8):
            self.relay.turn()
        for n, stream in enumerate(streams):
            alone = self.relay.open("GET", "/stream" + query(**_params(n)))
            self.relay.turn()
            self.assertEqual(stream.head().code, 200)
            self.assertEqual(stream.body(), alone.body())
            ids = [m.id for m in stream.events() if m.id is not None]
            self.assertEqual(len(ids), REPLAY, stream.body()[:300])

    def test_a_health_probe_is_answered_before_the_storm_is_over(self) -> None:
        streams = self.storm()
        probe = self.relay.open("GET", "/healthz")  # a new connection, behind every stream of the storm
        self.assertEqual(probe.reply().code, 200)
        self.assertLess(sum(1 for s in streams if s.received()), STORM)  # streams not even started

    def test_a_live_event_reaches_a_subscriber_already_connected_before_the_storm_is_over(self) -> None:
        live = self.relay.open("GET", "/stream" + query(filter={"session": "live"}))
        self.relay.turn()
        self.assertEqual(live.status(), 200)
        poster = self.relay.connect()  # a client that has posted before the storm: no newcomer then
        poster.send(_post(event("live", 0)))
        self.assertEqual(poster.reply().code, 202)
        self.relay.turn()
        streams = self.storm()
        poster.send(_post(event("live", 1)))
        self.assertEqual([r.code for r in poster.replies()], [202, 202])
        self.relay.turn()
        self.assertEqual([m.id for m in live.events() if m.id is not None], ["live:0:0", "live:0:1"])
        self.assertLess(sum(1 for s in streams if s.received()), STORM)


def _post(envelope: dict[str, Any]) -> bytes:
    return request_bytes("POST", "/events", ndjson(envelope), INGEST)
