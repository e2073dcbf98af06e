"""relayd.aep.core.relay: once the store has a batch, a failure while fanning it out is logged and the
batch still counts as accepted (the emitter must not be told 503 for events that will be replayed);
the relay tells its fan-out which sessions its subscriptions need."""

from __future__ import annotations

import json

from twisted.internet.defer import Deferred, succeed
from twisted.trial.unittest import TestCase

from relayd.aep.core.event import Event
from relayd.aep.core.filters import match_all, pin_of
from relayd.aep.core.relay import EventRelay, Subscriber
from relayd.aep.core.store import MemoryEventLog
from relayd.base.metrics import REGISTRY
from tests.support.aep import event
from tests.support.cases import cases, expand


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
        self.successResultOf(relay.ingest([Event.of(ev, json.dumps(ev).encode())]))
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)
        self.assertEqual([e.position for e in self.successResultOf(log.replay("kept", (0, -1))).events], [(0, 0)])


class Needs:
    """A fan-out that records what the relay says its subscriptions need (no Redis)."""

    def __init__(self, deliver: object) -> None:
        self.held: list[tuple[str, ...] | None] = []
        self.heard: Deferred[None] | None = None  # what need answers

    def publish(self, events: object) -> object:
        return succeed(None)

    def need(self, sessions: tuple[str, ...] | None) -> Deferred[None] | None:
        self.held.append(sessions)
        return self.heard

    def release(self, sessions: tuple[str, ...] | None) -> None:
        self.held.remove(sessions)


class FanoutNeeds(TestCase):
    """The relay tells its fan-out which sessions its subscriptions need, so that a fan-out split by
    session (a Redis Cluster's shard channels, relayd/aep/redis/fanout.py) listens to those only."""

    def test_each_subscription_needs_its_pinned_sessions_or_all_until_it_goes(self) -> None:
        made: list[Needs] = []

        def fanout(deliver: object) -> Needs:
            made.append(Needs(deliver))
            return made[0]

        relay = EventRelay(MemoryEventLog(10, 10), token=None, buffer=10, max_from=10, seconds=lambda: 0.0,
                           fanout=fanout)  # type: ignore[arg-type]  # fmt: skip
        needs = made[0]
        one, two, every, typed = object(), object(), object(), object()
        relay.subscribe(one, Subscriber(match_all, None, pin_of({"session": "X"})))
        relay.subscribe(two, Subscriber(match_all, None, pin_of({"session": ["X", "Y"], "type": "a"})))
        relay.subscribe(every, Subscriber(match_all, None, None))
        relay.subscribe(typed, Subscriber(match_all, None, pin_of({"type": "a"})))  # pins no session: all
        self.assertEqual(needs.held, [("X",), ("X", "Y"), None, None])
        relay.subscribe(one, Subscriber(match_all, None, pin_of({"session": "Z"})))  # replaced
        self.assertEqual(sorted(needs.held, key=str), sorted([("Z",), ("X", "Y"), None, None], key=str))
        for key in (one, two, every, typed):
            self.assertTrue(relay.unsubscribe(key))
        self.assertFalse(relay.unsubscribe(one))  # released once only
        self.assertEqual(needs.held, [])

    def test_a_replay_is_read_once_the_other_instances_events_are_heard(self) -> None:
        """No event of another instance falls between the history read and the live events."""
        made: list[Needs] = []

        def fanout(deliver: object) -> Needs:
            made.append(Needs(deliver))
            return made[0]

        log = MemoryEventLog(10, 10)
        relay = EventRelay(log, token=None, buffer=10, max_from=10, seconds=lambda: 0.0,
                           fanout=fanout)  # type: ignore[arg-type]  # fmt: skip
        ev = event("kept", 0)
        self.successResultOf(log.append([Event.of(ev, json.dumps(ev).encode())]))
        made[0].heard = heard = Deferred()  # the shard channel's SSUBSCRIBE not yet answered
        sub = Subscriber(match_all, None, pin_of({"session": "kept"}))
        relay.subscribe(object(), sub)
        reader = relay.reader(sub, [("kept", (0, -1))], False)
        loaded = reader.load()
        assert isinstance(loaded, Deferred)
        self.assertNoResult(loaded)
        heard.callback(None)
        self.assertTrue(self.successResultOf(loaded))
        item = reader.take()
        assert isinstance(item, Event)
        self.assertEqual(item.position, (0, 0))
        made[0].heard = None  # heard already: the next replay is read at once
        other = Subscriber(match_all, None, pin_of({"session": "kept"}))
        relay.subscribe(object(), other)
        self.assertIs(relay.reader(other, [("kept", (0, -1))], False).load(), True)


# What an ingest counts: the events, the commands nobody could take, the fan-outs timed.
COUNTS = (
    ("relayd_events_ingested_total", {"relay": "aep"}),
    ("relayd_events_dropped_total", {"relay": "aep", "reason": "unroutable"}),
    ("relayd_fanout_seconds_count", {"relay": "aep"}),
)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Recording(Subscriber):
    def __init__(self) -> None:
        super().__init__(match_all, None)
        self.sent: list[Event] = []

    def send(self, event: Event) -> None:
        self.sent.append(event)


@expand
class IngestNow(TestCase):
    """A batch a POST sent is ingested within the call on the in-memory log (no Deferred to answer
    its 202 from), as L{EventRelay.ingest} would ingest it; a log that stores later declines it."""

    def test_stored_and_fanned_out_within_the_call(self) -> None:
        log = MemoryEventLog(10, 10)
        relay = EventRelay(log, token=None, buffer=10, max_from=10, seconds=lambda: 0.0)
        subscriber = Recording()
        relay.subscribe(object(), subscriber)
        batch = [event("now", 0), event("now", 1), event("now", 0)]  # (the last a duplicate: fanned out too)
        self.assertIs(relay.ingest_now([Event.of(ev, json.dumps(ev).encode()) for ev in batch]), True)
        self.assertEqual(
            [e.position for e in self.successResultOf(log.replay("now", (0, -1))).events], [(0, 0), (0, 1)]
        )
        self.assertEqual([e.position for e in subscriber.sent], [(0, 0), (0, 1), (0, 0)])

    @cases(sequenced=event("one", 0), command=event("one", None, "control.pause"), agent=event(None, None, "agent.x"))
    def test_one_event_alone_is_ingested_as_a_batch_of_it_is(self, ev: dict) -> None:
        # One event per POST takes its own way through ingest_now (no list of the sequenced, the
        # count added to directly): stored, fanned out, routed and counted as by ingest, with a
        # subscriber and without one.
        def ingested(now: bool, subscribed: bool) -> tuple[object, ...]:
            log = MemoryEventLog(10, 10)
            relay = EventRelay(log, token="t", buffer=10, max_from=10, seconds=lambda: 0.0)
            subscriber = Recording()
            if subscribed:
                relay.subscribe(object(), subscriber)
            before = {name: sample(name, **labels) for name, labels in COUNTS}
            one = [Event.of(ev, json.dumps(ev).encode())]
            if now:
                self.assertIs(relay.ingest_now(one), True)
            else:
                self.successResultOf(relay.ingest(one))
            stored = {s: [e.raw for e in self.successResultOf(log.replay(s, (0, -1))).events] for s in log._buffers}
            counted = {name: sample(name, **labels) - before[name] for name, labels in COUNTS}
            return stored, [e.raw for e in subscriber.sent], counted

        for subscribed in (False, True):
            self.assertEqual(ingested(True, subscribed), ingested(False, subscribed), subscribed)
        stored, sent, counted = ingested(True, True)
        self.assertEqual(counted["relayd_events_ingested_total"], 1)
        self.assertEqual(counted["relayd_events_dropped_total"], 1 if ev["type"] == "control.pause" else 0)
        self.assertEqual(counted["relayd_fanout_seconds_count"], 1)
        self.assertEqual(stored, {"one": [json.dumps(ev).encode()]} if "seq" in ev else {})
        self.assertEqual(sent, [] if ev["type"] == "control.pause" else [json.dumps(ev).encode()])

    def test_a_failed_fan_out_is_logged_and_the_batch_accepted(self) -> None:
        log = MemoryEventLog(10, 10)
        relay = EventRelay(log, token=None, buffer=10, max_from=10, seconds=lambda: 0.0)
        relay.subscribe(object(), Broken(match_all, None))
        ev = event("kept", 0)
        self.assertIs(relay.ingest_now([Event.of(ev, json.dumps(ev).encode())]), True)
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
        self.assertIs(relay.ingest_now([Event.of(ev, json.dumps(ev).encode())]), False)
        self.assertEqual(log.session_count(), 0)
        self.assertEqual(subscriber.sent, [])
