"""admit() (the ingest fast path: envelope only) agrees with the exact path on every input it takes."""

from __future__ import annotations

import gc
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from relayd.aep.core.envelope import classify
from relayd.aep.core.event import (
    _DEEP_LINE,
    MAX_DEPTH,
    Event,
    JSONError,
    _read_envelope,
    admit,
    admit_lines,
    parse_json,
    plain_body,
)
from relayd.aep.core.ingest import JSON_TYPE, NDJSON_TYPE, BatchParser, IngestError, IngestPolicy, parse_batch
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
    return kind if type(kind) is str else Event.of(value, raw, kind)  # type: ignore[arg-type]


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

    @cases(short=0, long=_DEEP_LINE)
    def test_a_line_break_or_an_escape_is_seen_in_a_line_of_any_length(self, pad: int) -> None:
        # A line shorter than any too deep is scanned for these without its special bytes copied out
        # (a longer one is counted as well): either way a line break between members (valid JSON, but
        # no SSE data line) and an escaped control character in an identifier go to the exact path.
        def line(separator: bytes, id: str) -> bytes:
            raw = json.dumps({**base(), "id": id, "note": "x" * pad}, separators=(",", ":")).encode()
            return raw.replace(b'"aep":"0.1",', b'"aep":"0.1",' + separator)

        assert (len(line(b"", "i")) < _DEEP_LINE) is (pad == 0)
        plain = admit(line(b"", "i"))
        assert plain is not None and plain.raw == line(b"", "i")
        for separator in (b"\n", b"\r", b"\r\n"):
            raw = line(separator, "i")
            assert admit(raw) is None, separator
            slow = exact(raw)
            assert isinstance(slow, Event) and slow.raw is None  # accepted, forwarded re-encoded
        escaped = line(b"", "a\u0007b")
        assert admit(escaped) is None
        assert exact(escaped) == "control character in id"
        printable = line(b"", "aXb").replace(b'"aXb"', b'"a\\u0041b"')  # an escape of a plain character
        fast = admit(printable)
        assert fast is not None and fast.key == ("s", "aAb")

    def test_admitted_events_are_parsed_only_on_demand(self) -> None:
        raw = json.dumps({**base(), "data": {"m": "x"}, "ext": "v"}).encode()
        event = admit(raw)
        assert event is not None and event._ev is None
        assert event.payload() is raw and event._ev is None  # as posted: no parse
        assert event.ev["ext"] == "v" and event._ev is not None  # a filter on an extension attribute parses once

    def test_events_are_not_tracked_by_the_garbage_collector(self) -> None:
        # (an event refers to nothing that refers back to it: untracked, it is made and freed for less)
        raw = json.dumps(base(), separators=(",", ":")).encode()
        made = [admit(raw), Event.of(parse_json(raw), raw), *admit_lines([raw], plain_body(raw))]
        for event in made:
            assert event is not None
            self.assertFalse(gc.is_tracked(event))
        self.assertRaises(TypeError, Event, parse_json(raw), raw)  # (the constructor takes every field)

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


def lines_of(body: bytes) -> list[bytes]:
    return [line for line in map(bytes.strip, body.split(b"\n")) if line]


def verdicts(events: list[Event | None]) -> list[Any]:
    return [None if e is None else (e.kind, e.type, e.session, e.position, e.key, e.severity, e.capture, e.raw)
            for e in events]


def nested(depth: int) -> bytes:
    """A valid event with C{depth} brackets: its own and C{depth} - 1 nested arrays."""
    ev = json.dumps(base(), separators=(",", ":")).encode()
    assert ev.count(b"{") + ev.count(b"[") == 1
    return ev[:-1] + b',"deep":' + b"[" * (depth - 1) + b"0" + b"]" * (depth - 1) + b"}"


@expand
class AdmitLinesTests(TestCase):
    """admit_lines (what a whole NDJSON body settles, checked once) gives admit's verdict per line."""

    @settings(max_examples=500, deadline=None)
    @given(st.lists(st.tuples(st.dictionaries(keys, st.one_of(extras, types), max_size=4), st.booleans(),
                              st.sampled_from([b"", b"\\u0041", b"\r", b"[[", b"{", "é".encode()])),
                    min_size=1, max_size=8))
    def test_agrees_with_admit_line_by_line(self, specs: list) -> None:
        raws = []
        for changes, from_base, tail in specs:
            ev = base() if from_base else {}
            ev.update(changes)
            if tail:
                ev["note"] = tail.decode("utf-8")
            raws.append(json.dumps(ev, separators=(",", ":"), ensure_ascii=False).encode())
        body = b"\n".join(raws) + b"\n"
        lines = lines_of(body)
        self.assertEqual(verdicts(admit_lines(lines, plain_body(body))), verdicts([admit(line) for line in lines]))

    def test_the_events_of_a_batch_share_their_repeated_strings(self) -> None:
        # Fewer objects per buffered event to free when it is trimmed (docs/performance.md).
        raws = [json.dumps({**base(), "id": f"e{n}", "seq": n}, separators=(",", ":")).encode() for n in range(3)]
        first, *rest = admit_lines(raws, plain_body(b"\n".join(raws)))
        assert first is not None
        for event in rest:
            assert event is not None
            self.assertIs(event.session, first.session)
            self.assertIs(event.type, first.type)
            self.assertIs(event.key[0], first.key[0])
            self.assertIsNot(event.key[1], first.key[1])

    @cases(at_the_limit=(MAX_DEPTH, True), one_over=(MAX_DEPTH + 1, False))
    def test_one_line_at_the_bracket_limit(self, brackets: int, admitted: bool) -> None:
        body = nested(brackets) + b"\n"
        self.assertEqual(body.count(b"[") + body.count(b"{"), brackets)
        (event,) = admit_lines(lines_of(body), plain_body(body))
        self.assertEqual(event is not None, admitted)
        self.assertEqual(event is not None, admit(body.strip()) is not None)

    @cases(at_the_limit=MAX_DEPTH, one_over=MAX_DEPTH + 1)
    def test_a_body_over_the_limit_checks_each_line(self, total: int) -> None:
        # Shallow lines whose brackets add up to the limit or one over: each is admitted.
        line = nested(1)
        per = line.count(b"{") + line.count(b"[")
        count, rest = divmod(total, per)
        body = b"\n".join([line] * count + ([nested(rest)] if rest else [])) + b"\n"
        self.assertEqual(body.count(b"{") + body.count(b"["), total)
        plain = plain_body(body)
        assert plain is not None
        self.assertEqual(plain.shallow, total <= MAX_DEPTH)
        self.assertEqual(verdicts(admit_lines(lines_of(body), plain)), verdicts([admit(x) for x in lines_of(body)]))
        self.assertNotIn(None, admit_lines(lines_of(body), plain))

    def test_the_shortest_line_too_deep_is_counted(self) -> None:
        # The shortest line that reads as an envelope (all msgspec checks before the scope) and nests
        # deeper than MAX_DEPTH is _DEEP_LINE bytes: a body whose longest line is that long counts
        # its brackets, one a byte shorter does not.
        shortest = b'{"aep":"0.1","id":"-","type":"-","time":"-","source":"-","agent":"-","":'
        deep = shortest + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}"
        self.assertEqual(len(deep), _DEEP_LINE)
        _read_envelope(deep)
        with self.assertRaises(JSONError):
            parse_json(deep)
        body = deep + b"\n"
        for longest, shallow in ((_DEEP_LINE, False), (_DEEP_LINE - 1, True)):
            plain = plain_body(body, longest)
            assert plain is not None
            self.assertEqual(plain.shallow, shallow)
            self.assertTrue(plain.arrays)

    def test_short_lines_need_no_count_of_their_brackets(self) -> None:
        # Lines shorter than any too deep: brackets adding up past MAX_DEPTH over the body, or in one
        # line's strings, are admitted as the exact path accepts them.
        line = json.dumps({**base(), "note": "{" * (MAX_DEPTH + 1)}, separators=(",", ":")).encode()
        assert len(line) < _DEEP_LINE
        body = b"\n".join([line, nested(3), nested(3)] * 100) + b"\n"
        plain = plain_body(body, max(map(len, lines_of(body))))
        assert plain is not None
        self.assertTrue(plain.shallow)
        events = admit_lines(lines_of(body), plain)
        self.assertNotIn(None, events)
        self.assertEqual(verdicts(events), verdicts([admit(x) for x in lines_of(body)]))
        for event, raw in zip(events, lines_of(body), strict=True):
            same(event, exact(raw))  # type: ignore[arg-type]
        self.assertEqual(verdicts(parse_batch(body, ndjson=True, max_batch=1000)), verdicts(events))

    @cases(
        blank_line=b"",
        not_an_object=b"[1,2]",
        duplicate_keys=b'{"aep":"0.1","id":"d","type":"session.started","type":"x.y","time":"t","source":"s",'
        b'"agent":"a","session":"S","seq":1}',
        lone_surrogate=b'{"aep":"0.1","id":"d","type":"session.started","time":"t","source":"s","agent":"a",'
        b'"session":"S","seq":1,"note":"\\ud800"}',
        too_deep=json.dumps({**base(), "id": "d"}).encode()[:-1] + b',"d":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",
        brackets_in_a_string=json.dumps({**base(), "id": "b", "note": "{" * (MAX_DEPTH + 1)}).encode(),
        over_long_number=json.dumps({**base(), "id": "n"}).encode()[:-1] + b',"n":' + b"1" * 4301 + b"}",
    )
    def test_a_batch_answers_as_the_exact_path(self, odd: bytes) -> None:
        # Beside short lines (whose brackets are not counted), any line: the batch's answer (its
        # events, or the refusal with its line) is the exact path's, with LF or CRLF.
        good = [json.dumps({**base(), "id": f"g{n}", "seq": n + 2}, separators=(",", ":")).encode() for n in range(3)]

        def answer(body: bytes) -> Any:
            try:
                return verdicts(parse_batch(body, ndjson=True, max_batch=10))  # type: ignore[arg-type]
            except IngestError as e:
                return e.status, e.body

        def exact_answer(body: bytes) -> Any:
            # The batch's rules over the exact path alone: the first invalid-json, then the
            # first invalid-event, by line.
            made = []
            for index, line in enumerate(lines_of(body)):
                try:
                    parse_json(line)
                except JSONError as e:
                    return 400, {"error": "invalid-json", "line": index, "detail": str(e)}
                made.append(exact(line))
            for index, verdict in enumerate(made):
                if type(verdict) is str:
                    return 400, {"error": "invalid-event", "line": index, "detail": verdict}
            return verdicts(made)  # type: ignore[arg-type]

        for end in (b"\n", b"\r\n"):
            body = end.join([good[0], odd, good[1], good[2]]) + end
            self.assertEqual(answer(body), exact_answer(body))

    @cases(backslash=b'"\\u0041"', carriage_return=b'"a"\r', not_ascii='"\u00e9"'.encode())
    def test_a_body_it_cannot_settle_is_checked_line_by_line(self, value: bytes) -> None:
        line = json.dumps(base(), separators=(",", ":")).encode()[:-1] + b',"note":' + value + b"}"
        body = line + b"\n" + line + b"\n"
        self.assertIsNone(plain_body(body))
        self.assertEqual(verdicts(admit_lines(lines_of(body), None)), verdicts([admit(x) for x in lines_of(body)]))

    @settings(max_examples=1000, deadline=None)
    @given(st.lists(st.sampled_from([b"\n", b"\r", b" ", b"\t", b"\x0b", b"\x0c", b"\x00", b"{}", b"a", b"\xe9"]),
                    max_size=40).map(b"".join))
    def test_the_lines_of_a_body_are_its_stripped_pieces_between_line_feeds(self, body: bytes) -> None:
        # (BatchParser cuts them otherwise, by BytesIO.readlines, for speed: the same lines)
        self.assertEqual(BatchParser(body, ndjson=True, max_batch=10).lines, lines_of(body))


_LINE = json.dumps({**base(), "data": {"m": "x" * 300}}, separators=(",", ":")).encode()


@expand
class PlainEvents(TestCase):
    """IngestPolicy.plain_events: a JSON body of one plainly valid event read without a BatchParser,
    as the parser reads it; anything else is left to the parser."""

    @cases(
        plain=(_LINE, True),
        spaced=(b" \t" + _LINE + b"\r\n", True),
        long=(json.dumps({**base(), "data": "x" * 4000}).encode(), True),
        empty=(b"", False),
        invalid_json=(b"{nope", False),
        invalid_event=(b'{"aep":"0.1"}', False),
        two_lines=(_LINE + b"\n" + _LINE, False),
        a_line_break_inside=(_LINE.replace(b'"id":', b'\n"id":'), False),
        a_float_position=(_LINE.replace(b'"seq":0', b'"seq":0.0'), False),
    )
    def test_a_json_body_reads_as_the_parser_reads_it(self, body: bytes, plain: bool) -> None:
        fast = IngestPolicy(1 << 20, 5).plain_events(body, JSON_TYPE)
        self.assertEqual(fast is not None, plain)
        if fast is not None:
            self.assertEqual(verdicts(fast), verdicts(parse_batch(body, ndjson=False, max_batch=5)))  # type: ignore[arg-type]

    def test_a_body_the_batch_limit_refuses_is_left_to_the_parser(self) -> None:
        self.assertIsNone(IngestPolicy(1 << 20, 0).plain_events(_LINE, JSON_TYPE))
        with self.assertRaises(IngestError) as refused:
            parse_batch(_LINE, ndjson=False, max_batch=0)
        self.assertEqual(refused.exception.status, 413)

    def test_an_ndjson_body_is_left_to_the_parser(self) -> None:
        self.assertIsNone(IngestPolicy(1 << 20, 5).plain_events(_LINE + b"\n", NDJSON_TYPE))
