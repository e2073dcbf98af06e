"""Fan-out by runs (relayd/aep/core/relay.py, EventRelay._fan_out_runs): consecutive events of a batch
offered to the same subscribers go to each as one run. The deliveries are those of one event at a
time (a differential property), and an SSE subscriber writes a run once, framed once for all."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from relayd.aep.core.backlog import CUT_OFF, SLOW_CONSUMER, SOFT_BACKLOG
from relayd.aep.core.envelope import EventKind
from relayd.aep.core.event import Event
from relayd.aep.core.filters import compile_filter, filter_error, match_all, pin_of
from relayd.aep.core.relay import EventRelay, Subscriber
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.http import SSESubscriber
from relayd.aep.wire import sse_forms, sse_frame
from relayd.web.streams.sse import http_chunk
from tests.aep.test_index import _filters
from tests.support.aep import event


class _Sub(Subscriber):
    """Keeps what it is delivered, and how: one event at a time or as a run."""

    __slots__ = ("got", "runs")

    def __init__(self, flt: dict[str, Any]) -> None:
        super().__init__(compile_filter(flt), None, pin_of(flt))
        self.got: list[tuple[str, str]] = []
        self.runs = 0

    def send(self, event: Event) -> None:
        self.got.append(event.key)

    def deliver_run(self, events: Any, memo: dict[Any, Any]) -> None:
        self.runs += 1
        super().deliver_run(events, memo)


def _relay() -> EventRelay:
    return EventRelay(MemoryEventLog(100, 10), token=None, buffer=100, max_from=10, seconds=lambda: 0.0)


def _one_at_a_time(relay: EventRelay, events: list[Event]) -> int:
    """The reference: each event fanned out alone, in order."""
    snapshot = relay.index.snapshot()
    return sum(relay.fan_out(e, snapshot) for e in events if e.kind is not EventKind.COMMAND)


@st.composite
def _batches(draw: Any) -> list[Event]:
    """Runs of one session and type, as a POST mostly is, with other events between them."""
    events = []
    for _ in range(draw(st.integers(1, 6))):
        session = draw(st.sampled_from(["S", "T"]))
        type_ = draw(st.sampled_from(["session.started", "tool.call", "x"]))
        for _ in range(draw(st.integers(1, 4))):
            ev = event(session, len(events), type_)
            if draw(st.booleans()):
                ev["agent"] = draw(st.sampled_from(["a", "b"]))
            ev["id"] = f"e{len(events)}"
            events.append(Event.of(ev, None))
    return events


class Runs(TestCase):
    @settings(max_examples=300, deadline=None)
    @given(st.lists(_filters(), max_size=10), _batches())
    def test_runs_deliver_what_one_event_at_a_time_does(self, filters: list[dict[str, Any]], events: list[Event]) -> None:
        filters = [f for f in filters if filter_error(f) is None]
        by_runs, alone = _relay(), _relay()
        subs_runs = [_Sub(f) for f in filters]
        subs_alone = [_Sub(f) for f in filters]
        for i, (a, b) in enumerate(zip(subs_runs, subs_alone, strict=True)):
            by_runs.subscribe(i, a)
            alone.subscribe(i, b)
        delivered = by_runs._fan_out_runs(events, by_runs.index.snapshot(), None)
        self.assertEqual(delivered, _one_at_a_time(alone, events))
        self.assertEqual([s.got for s in subs_runs], [s.got for s in subs_alone])

    def test_a_batch_of_one_session_is_one_run_per_subscriber(self) -> None:
        relay = _relay()
        everything, pinned, other = _Sub({}), _Sub({"session": "S"}), _Sub({"session": "T"})
        for key, sub in (("all", everything), ("S", pinned), ("T", other)):
            relay.subscribe(key, sub)
        events = [Event.of(event("S", seq), None) for seq in range(10)]
        self.assertEqual(relay._fan_out_runs(events, relay.index.snapshot(), None), 20)
        self.assertEqual((everything.runs, pinned.runs, other.runs), (1, 1, 0))
        self.assertEqual(len(pinned.got), 10)

    def test_a_command_between_events_splits_the_run_and_keeps_the_order(self) -> None:
        relay = _relay()
        sub = _Sub({})
        relay.subscribe("all", sub)
        self.patch(relay, "route_command", lambda event, sender: sub.got.append(("routed", event.key[1])))
        command = Event.of({**event("S", None, "control.pause"), "id": "c"}, None)
        self.assertIs(command.kind, EventKind.COMMAND)
        events = [Event.of(event("S", 0), None), Event.of(event("S", 1), None), command, Event.of(event("S", 2), None)]
        self.assertEqual(relay._fan_out_runs(events, relay.index.snapshot(), None), 3)
        self.assertEqual(sub.got, [events[0].key, events[1].key, ("routed", "c"), events[3].key])
        self.assertEqual(sub.runs, 1)  # [0, 1] as a run; the command routed; [2] alone


class _Stream:
    """What an SSESubscriber writes to, recorded."""

    discarded = 0

    def __init__(self, paused: bool = False, backlog: int = 0, closed: bool = False) -> None:
        self.paused = paused
        self.closed = closed
        self._backlog = backlog
        self.writes: list[tuple[bytes, bytes | None]] = []

    @property
    def backlog(self) -> int:
        return self._backlog if self.paused else 0

    def write(self, chunk: bytes, encoded: bytes | None = None) -> bool:
        if self.closed:
            return False
        self.writes.append((chunk, encoded))
        return True


class SSERuns(TestCase):
    def setUp(self) -> None:
        self.relay = _relay()
        self.events = [Event.of(event("S", seq), None) for seq in range(10)]

    def subscriber(self, stream: _Stream, ceiling: str | None = None) -> SSESubscriber:
        sub = SSESubscriber(match_all, ceiling, stream)  # type: ignore[arg-type]
        self.relay.subscribe(object(), sub)
        return sub

    def test_a_run_is_one_write_framed_once_for_every_stream(self) -> None:
        first, second = _Stream(), _Stream()
        self.subscriber(first)
        self.subscriber(second)
        self.relay._fan_out_runs(self.events, self.relay.index.snapshot(), None)
        frames = b"".join(sse_frame(e) for e in self.events)
        self.assertEqual(first.writes, [(frames, http_chunk(frames))])
        self.assertIs(first.writes[0][0], second.writes[0][0])  # made once, written to both

    def test_a_paused_stream_or_a_capture_ceiling_takes_the_events_one_by_one(self) -> None:
        paused, ceiled = _Stream(paused=True), _Stream()
        self.subscriber(paused)
        self.subscriber(ceiled, ceiling="metadata")
        self.relay._fan_out_runs(self.events, self.relay.index.snapshot(), None)
        self.assertEqual([len(paused.writes), len(ceiled.writes)], [10, 10])
        self.assertEqual([w[0] for w in paused.writes], [sse_frame(e) for e in self.events])

    def test_a_stream_holding_for_its_replay_holds_the_run(self) -> None:
        stream = _Stream()
        sub = self.subscriber(stream)
        sub.hold()
        self.relay._fan_out_runs(self.events, self.relay.index.snapshot(), None)
        self.assertEqual(stream.writes, [])
        sub.release()
        self.assertEqual([w[0] for w in stream.writes], [sse_frame(e) for e in self.events])


class SSEDeliveries(TestCase):
    """One event offered alone (a POST of one event): a live subscriber without a ceiling whose
    client reads is written the event's stored frame and chunk, made once for every stream
    (SSESubscriber.deliver); every other goes through the backlog policy and the capture ceiling."""

    def setUp(self) -> None:
        self.relay = _relay()

    def subscriber(self, stream: _Stream, ceiling: str | None = None) -> SSESubscriber:
        sub = SSESubscriber(match_all, ceiling, stream)  # type: ignore[arg-type]
        self.relay.subscribe(object(), sub)
        return sub

    def test_a_reading_stream_is_written_the_frame_and_chunk_made_once_for_all(self) -> None:
        first, second = _Stream(), _Stream()
        self.subscriber(first)
        self.subscriber(second)
        one = Event.of(event("S", 0), None)
        self.assertEqual(self.relay.fan_out(one), 2)
        self.assertEqual(first.writes, [(sse_frame(one), http_chunk(sse_frame(one)))])
        self.assertIs(first.writes[0][1], second.writes[0][1])

    def test_a_paused_stream_past_the_soft_bound_sheds_what_is_below_notice(self) -> None:
        stream = _Stream(paused=True, backlog=SOFT_BACKLOG + 1)
        sub = self.subscriber(stream)
        before = SLOW_CONSUMER._value.get()
        self.relay.fan_out(Event.of(event("S", 0, severity="info"), None))
        self.assertEqual((stream.writes, sub.dropped), ([], 1))
        self.assertEqual(SLOW_CONSUMER._value.get(), before + 1)
        notice = Event.of(event("S", 1, severity="notice"), None)
        self.relay.fan_out(notice)  # (kept: the stream's own bound cuts it off if it keeps lagging)
        self.assertEqual(stream.writes, [(sse_frame(notice), http_chunk(sse_frame(notice)))])

    def test_a_subscriber_holding_for_its_replay_holds_the_event(self) -> None:
        stream = _Stream()
        sub = self.subscriber(stream)
        sub.hold()
        one = Event.of(event("S", 0), None)
        self.relay.fan_out(one)
        self.assertEqual((stream.writes, sub.held_bytes > 0), ([], True))
        sub.release()
        self.assertEqual(stream.writes, [(sse_frame(one), http_chunk(sse_frame(one)))])

    def test_a_capture_ceiling_sends_the_downlevelled_frame(self) -> None:
        stream = _Stream()
        sub = self.subscriber(stream, ceiling="metadata")
        full = Event.of(event("S", 0, capture="full", data={"secret": "x"}), None)
        level = sub.level(full)
        self.assertIsNotNone(level)
        self.relay.fan_out(full)
        self.assertEqual(stream.writes, [sse_forms(full, level)])
        self.assertNotEqual(stream.writes[0][0], sse_frame(full))

    def test_a_closed_stream_refuses_the_event_and_nothing_is_counted(self) -> None:
        stream = _Stream(closed=True)
        sub = self.subscriber(stream)
        before = CUT_OFF._value.get()
        self.relay.fan_out(Event.of(event("S", 0), None))
        self.assertEqual((stream.writes, sub.dropped, CUT_OFF._value.get()), ([], 0, before))


class FromOtherInstances(TestCase):
    def test_a_command_from_another_instance_is_offered_never_routed_again(self) -> None:
        # Another instance routed it and publishes it for its audit (EventRelay._route): routing it
        # here again could hand it to an emitter that claimed the session since.
        relay = _relay()
        sub = _Sub({})
        relay.subscribe("all", sub)
        routed: list[Event] = []
        self.patch(relay, "route_command", lambda event, sender: routed.append(event))
        command = Event.of({**event("S", None, "control.pause"), "id": "c"}, None)
        events = [Event.of(event("S", 0), None), command, Event.of(event("S", 1), None)]
        relay.fan_out_remote(events)
        self.assertEqual(routed, [])
        self.assertEqual(sub.got, [e.key for e in events])
