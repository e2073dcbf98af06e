"""admit() (the ingest fast path: envelope only) agrees with the exact path on every input it takes."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from relayd.aep.envelope import classify
from relayd.aep.event import Event, JSONError, admit, parse_json
from relayd.aep.http import IngestError, parse_batch
from tests.aep.test_classify import base, keys, scalars, types
from tests.support.cases import cases, expand

extras = st.one_of(
    scalars, st.integers(-(2**70), 2**70), st.sampled_from([1e300, -0.0, 5.0, "é", "\u2028"]),
    st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.sampled_from(["m", "n"]), scalars, max_size=2),
)


def exact(raw: bytes) -> Event | str:
    """What the exact path makes of C{raw}: an event, or why not."""
    try:
        value = parse_json(raw)
    except JSONError:
        return "invalid-json"
    kind = classify(value)
    return kind if type(kind) is str else Event(value, raw, kind)  # type: ignore[arg-type]


def same(fast: Event, slow: Event) -> None:
    for name in ("kind", "type", "session", "position", "key", "severity", "capture", "raw"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert fast.ev == slow.ev


@expand
class AdmitTests(TestCase):
    @settings(max_examples=1500, deadline=None)
    @given(
        st.dictionaries(keys, st.one_of(extras, types), max_size=6),
        st.lists(keys, max_size=3),
        st.booleans(),
        st.sampled_from(["compact", "spaced", "reordered"]),
    )
    def test_admit_agrees_with_the_exact_path(self, changes: dict, removed: list, from_base: bool, layout: str) -> None:
        ev = base() if from_base else {}
        ev.update(changes)
        for key in removed:
            ev.pop(key, None)
        if layout == "reordered":
            ev = dict(reversed(list(ev.items())))
        raw = json.dumps(ev, separators=(",", ":") if layout == "compact" else (", ", ": "), ensure_ascii=False).encode()
        fast, slow = admit(raw), exact(raw)
        if fast is not None:  # taken: it must be exactly what the exact path accepts
            assert isinstance(slow, Event), slow
            same(fast, slow)

    @cases(*[
        b'{"aep":"0.1","id":"i","type":"a.b","time":"t","source":"s","agent":"a","session":"S","seq":1,"data":"\xff"}',
        b'{"aep":"0.1","id":"i","type":"a.b","time":"t","source":"s","agent":"a","session":"S","seq":1,"x":"\\ud800"}',
        b'{"aep":"0.1","id":"i","type":"a.b","time":"t","source":"s","agent":"a","session":"S","seq":1,"x":NaN}',
        b'{"aep":"0.1","id":"i","type":"a.b","time":"t","source":"s","agent":"a","session":"S","seq":1,"x":[1,]}',
        b'{"aep":"0.1","id":"i","type":"a.b","time":"t","source":"s","agent":"a","session":"S","seq":1}x',
        b'{"aep":"0.1","id":"i","type":"a.b","time":"t","source":"s","agent":"a","session":"S","seq":1,"d":'
        + b"[" * 256 + b"]" * 256 + b"}",
    ])
    def test_invalid_json_is_never_admitted(self, raw: bytes) -> None:
        assert admit(raw) is None
        assert exact(raw) == "invalid-json"

    def test_what_the_fast_path_leaves_to_the_exact_one(self) -> None:
        line = {**base(), "data": {"m": "x"}}
        assert admit(json.dumps(line).encode()) is not None
        for odd in (
            {**line, "data": {"m": "é"}},  # not ASCII: UTF-8 validity is the exact parser's to judge
            {**line, "seq": 5.0},  # an integral float position
            {**line, "epoch": 1.0},
        ):
            raw = json.dumps(odd, ensure_ascii=False).encode()
            assert admit(raw) is None, odd
            assert isinstance(exact(raw), Event)
        assert admit(b'{"aep":"0.1",\r"id":"i"}') is None  # a line break cannot be forwarded as an SSE data line
        wide = admit(json.dumps({**line, "epoch": 2**70, "seq": 2**64 + 1}).encode())
        assert wide is not None and wide.position == (2**70, 2**64 + 1)  # exact (decision AEP 3)

    def test_admitted_events_are_parsed_only_on_demand(self) -> None:
        raw = json.dumps({**base(), "data": {"m": "x"}, "ext": "v"}).encode()
        event = admit(raw)
        assert event is not None and event._ev is None
        assert event.payload() is raw and event._ev is None  # as posted: no parse
        assert event.ev["ext"] == "v" and event._ev is not None  # a filter on an extension attribute parses once

    def test_numbers_beyond_the_double_range_are_read_as_javascript_does(self) -> None:
        # JSON.parse gives Infinity for 1e400; the reference relay accepts such an event. Both paths agree.
        for data in ('{"x":1e400}', '{"x":-1e400,"é":1}'):
            raw = json.dumps({**base()})[:-1].encode() + b',"data":' + data.encode() + b"}"
            (event,) = parse_batch(raw + b"\n", ndjson=True, max_batch=10)
            assert event.ev["data"]["x"] in (float("inf"), float("-inf"))
            assert event.payload() == raw
        with self.assertRaises(IngestError) as refused:
            parse_batch(b'{"x":NaN}\n', ndjson=True, max_batch=10)
        assert refused.exception.body["error"] == "invalid-json"  # type: ignore[index]

    def test_batch_order_of_checks_with_mixed_paths(self) -> None:
        good = json.dumps(base()).encode()
        bad_event = json.dumps({**base(), "seq": -1}).encode()
        # invalid-json anywhere wins over too-many-events and an earlier invalid event; then the count;
        # then the first invalid event by line.
        with self.assertRaises(IngestError) as e:
            parse_batch(b"\n".join([bad_event, good, b"{oops"]), ndjson=True, max_batch=10)
        assert e.exception.body["error"] == "invalid-json"  # type: ignore[index]
        with self.assertRaises(IngestError) as e:
            parse_batch(b"\n".join([bad_event, good, good]), ndjson=True, max_batch=2)
        assert e.exception.body["error"] == "too-many-events"  # type: ignore[index]
        with self.assertRaises(IngestError) as e:
            parse_batch(b"\n".join([good, bad_event, bad_event]), ndjson=True, max_batch=10)
        assert e.exception.body == {"error": "invalid-event", "line": 1, "detail": "seq required (integer >= 0)"}
