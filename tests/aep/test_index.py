"""The subscription index: an event is tested only against subscriptions that can match it.

Unit tests of the pure index (pins, removal, no leak), a differential property against a full
scan, and a real in-process relay with real SSE and WebSocket clients whose filter evaluations are
counted (tests/aep/test_index_redis.py runs the same over Redis, events from another instance).
"""

from __future__ import annotations

from typing import Any, Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from relayd.aep.core.event import Event
from relayd.aep.core.filters import Pin, compile_filter, filter_error, match_all, pin_of
from relayd.aep.core.index import SubscriptionIndex
from relayd.aep.core.relay import Subscriber
from tests.support.aep import AEPRelay, event, open_sse, open_ws, start_relay, subscribe, wait_until


def _event(**fields: Any) -> Event:
    ev = event(fields.pop("session", "S"), fields.pop("seq", 0), fields.pop("type", "session.started"))
    ev.update(fields)
    return Event.of(ev, None)


class _Sub(Subscriber):
    """A subscriber that keeps what it is delivered."""

    __slots__ = ("got",)

    def __init__(self, flt: dict[str, Any]) -> None:
        super().__init__(compile_filter(flt), None, pin_of(flt))
        self.got: list[Event] = []

    def send(self, event: Event) -> None:
        self.got.append(event)


def _selected(index: SubscriptionIndex, event: Event) -> list[Any]:
    """What the index offers C{event} and the filters take (as the relay's fan-out does)."""
    taken = []
    for group, check in index.snapshot().groups(event):
        for sub in group:
            if not check or sub.match is match_all or sub.match(event.ev):
                taken.append(sub)
    return taken


class PinTests(TestCase):
    def test_session_is_chosen_over_every_other_pinned_attribute(self) -> None:
        flt = {"type": "tool.call", "agent": "a", "session": "S", "x1": "v"}
        self.assertEqual(pin_of(flt), Pin("session", ("S",), False))

    def test_a_lone_pin_needs_no_evaluation(self) -> None:
        self.assertEqual(pin_of({"session": ["S", "T", "S"]}), Pin("session", ("S", "T"), True))

    def test_what_is_not_exact_string_equality_is_not_pinned(self) -> None:
        for flt in ({}, {"type": "tool.*"}, {"type": ["a", "tool.*"]}, {"severity": {"gte": "warn"}},
                    {"epoch": 3}, {"ext": True}, {"session": ["S", 1]}):
            self.assertIsNone(pin_of(flt), flt)

    def test_the_broadest_attributes_come_last(self) -> None:
        self.assertEqual(pin_of({"severity": "info", "capture": "full", "type": "t", "ext": "v"}).attr, "ext")
        self.assertEqual(pin_of({"severity": "info", "capture": "full", "type": "t"}).attr, "type")
        self.assertEqual(pin_of({"severity": "info", "capture": "full"}).attr, "capture")


class IndexTests(TestCase):
    def test_removal_leaves_nothing_behind(self) -> None:
        index = SubscriptionIndex()
        filters = [{"session": f"s{i % 7}"} for i in range(50)] + [
            {"session": ["a", "b"], "type": "t"}, {"agent": "x"}, {"type": "tool.*"}, {}, {"ext": ["1", "2", "3"]},
        ]
        for round_ in range(3):
            for i, flt in enumerate(filters):
                index.add((round_, i), object(), pin_of(flt))
            self.assertEqual(len(index), len(filters))
            for i in range(len(filters)):
                self.assertTrue(index.remove((round_, i)))
            self.assertEqual(index.sizes(), (0, 0, 0))
            self.assertFalse(index.remove((round_, 0)))

    def test_replacing_a_key_moves_it_to_its_new_bucket(self) -> None:
        index = SubscriptionIndex()
        old, new = _Sub({"session": "A"}), _Sub({"session": "B"})
        index.add("k", old, old.pin)
        index.add("k", new, new.pin)
        self.assertEqual(index.sizes(), (1, 1, 0))
        self.assertEqual(_selected(index, _event(session="A")), [])
        self.assertEqual(_selected(index, _event(session="B")), [new])

    def test_an_event_is_offered_to_its_own_buckets_and_the_scan_list_only(self) -> None:
        index = SubscriptionIndex()
        subs = {name: _Sub(flt) for name, flt in {
            "mine": {"session": "S"}, "other": {"session": "T"}, "both": {"session": ["S", "T"]},
            "agent": {"agent": "a", "type": "nope"}, "glob": {"type": "session.*"},
        }.items()}
        for name, sub in subs.items():
            index.add(name, sub, sub.pin)
        offered = [sub for group, _ in index.snapshot().groups(_event(session="S")) for sub in group]
        self.assertCountEqual(offered, [subs["mine"], subs["both"], subs["agent"], subs["glob"]])

    def test_defaults_apply_before_the_lookup(self) -> None:
        index = SubscriptionIndex()
        subs = [_Sub({"severity": "info"}), _Sub({"capture": ["metadata"]}), _Sub({"capture": "full"})]
        for i, sub in enumerate(subs):
            index.add(i, sub, sub.pin)
        self.assertCountEqual(_selected(index, _event()), subs[:2])  # neither attribute is set
        self.assertCountEqual(_selected(index, _event(severity=None, capture="full")), [subs[0], subs[2]])

    def test_a_removal_during_a_batch_does_not_disturb_it(self) -> None:
        index = SubscriptionIndex()
        a, b = _Sub({"session": "S"}), _Sub({"agent": "a"})
        index.add("a", a, a.pin)
        index.add("b", b, b.pin)
        snap = index.snapshot()
        first = snap.groups(_event(seq=0))
        index.remove("a")
        index.remove("b")  # drops the bucket and the attribute from the index
        self.assertEqual(index.sizes(), (0, 0, 0))
        second = snap.groups(_event(seq=1))
        self.assertEqual(first, second)  # the batch's copies: nothing fails mid-iteration


# Values drawn from a small pool so filters and events often meet (the defaults among them).
_STRINGS = st.sampled_from(["S", "a", "info", "metadata", "tool.call"])
_VALUES = st.one_of(_STRINGS, _STRINGS, st.integers(0, 1), st.booleans())
_KEYS = st.sampled_from(["session", "agent", "type", "run", "subject", "severity", "capture", "epoch", "ext"])


@st.composite
def _filters(draw: Any) -> dict[str, Any]:
    flt: dict[str, Any] = {}
    for key in draw(st.lists(_KEYS, max_size=3, unique=True)):
        choice = draw(st.integers(0, 3))
        if key == "severity" and choice == 3:
            flt[key] = {op: draw(st.sampled_from(["debug", "info", "warn"])) for op in draw(
                st.lists(st.sampled_from(["gte", "lte"]), max_size=2, unique=True))}
        elif key == "type" and choice == 3:
            flt[key] = draw(st.sampled_from(["tool.*", "session.*"]))
        elif choice >= 2:
            flt[key] = draw(st.lists(_VALUES, min_size=1, max_size=3))
        else:
            flt[key] = draw(_VALUES)
    return flt


@st.composite
def _events(draw: Any) -> Event:
    ev = event(draw(st.sampled_from(["S", "T"])), 0, draw(st.sampled_from(["session.started", "tool.call", "x"])))
    for key in ("agent", "run", "subject", "severity", "capture", "epoch", "ext"):
        if draw(st.booleans()):
            ev[key] = draw(st.one_of(_VALUES, st.none()))
    return Event.of(ev, None)


class DifferentialTests(TestCase):
    @settings(max_examples=500, deadline=None)
    @given(st.lists(_filters(), max_size=12), st.lists(_events(), min_size=1, max_size=4))
    def test_the_index_selects_what_a_full_scan_does(self, filters: list[dict[str, Any]], events: list[Event]) -> None:
        filters = [f for f in filters if filter_error(f) is None]
        index = SubscriptionIndex()
        subs = [_Sub(flt) for flt in filters]
        for i, sub in enumerate(subs):
            index.add(i, sub, sub.pin)
        snap = index.snapshot()
        for posted in events:
            taken: list[Any] = []
            for group, check in snap.groups(posted):
                taken.extend(sub for sub in group if not check or sub.match(posted.ev))
            scanned = [sub for sub, flt in zip(subs, filters, strict=True) if compile_filter(flt)(posted.ev)]
            self.assertEqual(len(taken), len(set(map(id, taken))), "a subscriber was offered an event twice")
            self.assertCountEqual(taken, scanned)


# Evaluation counting on a real relay ----------------------------------------------------------


def _name(sub: Any) -> Any:
    """A WebSocket subscription by its id, an SSE stream by the session it pins."""
    return sub.sub_id if hasattr(sub, "sub_id") else ("sse", sub.pin.values[0])


class Counted:
    """Wraps every registered subscriber's compiled filter; counts its calls by L{_name}."""

    def __init__(self, relay: AEPRelay) -> None:
        self.calls: dict[Any, int] = {}
        for sub in relay.core.subscribers.values():
            self.calls[_name(sub)] = 0
            sub.match = self._counting(_name(sub), sub.match)

    def _counting(self, name: Any, match: Callable[[dict[str, Any]], bool]) -> Callable[[dict[str, Any]], bool]:
        def counted(ev: dict[str, Any]) -> bool:
            self.calls[name] += 1
            return match(ev)

        return counted


class EvaluationCounting:
    """Non-matching SSE and WebSocket subscriptions on the consumer relay are never evaluated for
    events of session S posted to the emitter relay (the same one in memory; another over Redis)."""

    EVENTS = 5

    async def relays(self) -> tuple[AEPRelay, AEPRelay]:
        raise NotImplementedError

    async def test_non_matching_subscriptions_are_never_evaluated(self) -> None:
        emitter, consumer = await self.relays()
        others = await open_ws(self, consumer, hello={"role": "consumer"})
        for i in range(20):  # pinned elsewhere, with a second condition that would be evaluated
            await subscribe(self, others, f"other{i}", filter={"session": f"other{i}", "type": "session.started"})
        await subscribe(self, others, "agent", filter={"agent": "nobody", "type": "session.started"})
        ws = await open_ws(self, consumer, hello={"role": "consumer"})
        await subscribe(self, ws, "mine", filter={"session": "S", "type": "session.started"})
        await subscribe(self, ws, "scan", filter={"type": "session.*"})
        for i in range(5):
            await open_sse(self, consumer, filter={"session": f"sse{i}", "agent": "a"})
        mine = await open_sse(self, consumer, filter={"session": "S", "agent": "a"})
        self.assertEqual(len(consumer.core.subscribers), 29)
        counted = Counted(consumer)

        response, _ = await emitter.post(*[event("S", seq) for seq in range(self.EVENTS)])
        self.assertEqual(response.code, 202)
        for seq in range(self.EVENTS):
            self.assertEqual((await mine.next_event()).json()["seq"], seq)
        received = [await ws.recv() for _ in range(2 * self.EVENTS)]  # "mine" and "scan"
        self.assertEqual(sorted(m["seq"] for m in received), sorted(2 * list(range(self.EVENTS))))
        self.assertEqual(await others.roundtrip(), [])

        calls = counted.calls
        self.assertEqual(calls.pop("mine"), self.EVENTS)
        self.assertEqual(calls.pop(("sse", "S")), self.EVENTS)
        self.assertEqual(calls.pop("scan"), self.EVENTS)  # the counter counts: an unpinned filter is asked
        self.assertEqual(calls, {name: 0 for name in calls})
        self.assertEqual(len(calls), 26)

    async def test_unsubscribe_and_disconnect_leave_nothing_indexed(self) -> None:
        _, consumer = await self.relays()
        ws = await open_ws(self, consumer, hello={"role": "consumer"})
        for i in range(10):
            await subscribe(self, ws, i, filter={"session": ["S", f"T{i}"], "agent": "a"})
        await subscribe(self, ws, "again", filter={"agent": "a"})
        await subscribe(self, ws, "again", filter={"run": "r"})  # a replacement moves it
        await subscribe(self, ws, "all", filter={})
        streams = [await open_sse(self, consumer, filter=flt) for flt in ({"session": "S"}, {"type": "tool.*"})]
        core = consumer.core
        self.assertEqual(core.index.sizes(), (14, 12, 2))  # buckets S, T0..T9, run r (the SSE one is in S)
        ws.send({"type": "unsubscribe", "id": 3})
        self.assertEqual((await ws.recv())["type"], "unsubscribed")
        self.assertEqual(core.index.sizes(), (13, 11, 2))
        await ws.close()
        await wait_until(lambda: len(core.subscribers) == 2)
        self.assertEqual(core.index.sizes(), (2, 1, 1))
        for stream in streams:
            await stream.close()
        await wait_until(lambda: not core.subscribers)
        self.assertEqual(core.index.sizes(), (0, 0, 0))


class InMemoryEvaluationTests(EvaluationCounting, TestCase):
    async def relays(self) -> tuple[AEPRelay, AEPRelay]:
        relay = await start_relay(self)
        return relay, relay
