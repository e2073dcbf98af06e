"""Tests for relayd.aep.core.filters: attr-match validation and compiled predicates (aep.md section 4.1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from relayd.aep.core.filters import compile_filter, filter_error, match_all
from tests.support.cases import cases, expand

AEP_DATA = Path(__file__).resolve().parent / "data"  # vendored AEP conformance data (see its NOTICE.md)
FIXTURES = AEP_DATA / "fixtures"

# aep.md section 9.3 A, transcribed from conformance/fixtures/attr-match (Apache-2.0).
MATCH_CASES: list[tuple[str, dict, dict, bool]] = [
    ("category glob hits", {"type": ["attention.*"]}, {"type": "attention.requested", "session": "s1"}, True),
    ("category glob does not hit prefix-only", {"type": ["attention.*"]},
     {"type": "tool.completed", "session": "s1"}, False),
    ("exact type", {"type": "tool.completed"}, {"type": "tool.completed"}, True),
    ("vendor glob", {"type": ["x.acme.*"]}, {"type": "x.acme.foo.bar"}, True),
    ("severity gte hits declared", {"severity": {"gte": "notice"}},
     {"type": "attention.requested", "severity": "notice"}, True),
    ("severity gte misses default info", {"severity": {"gte": "notice"}}, {"type": "tool.completed"}, False),
    ("severity band includes default", {"severity": {"gte": "debug", "lte": "info"}}, {"type": "tool.completed"}, True),
    ("agent inclusion", {"agent": ["claude-code", "codex"]}, {"type": "run.started", "agent": "claude-code"}, True),
    ("session equality misses other", {"session": "s_8f2c"}, {"type": "run.started", "session": "s_other"}, False),
    ("epoch default applies", {"epoch": 0}, {"type": "run.started", "session": "s1"}, True),
    ("absent attribute never matches", {"step": "turn-3"}, {"type": "run.started", "session": "s1"}, False),
    ("extension attribute equality", {"acmeregion": "eu-1"}, {"type": "run.started", "acmeregion": "eu-1"}, True),
    ("empty filter matches everything", {}, {"type": "agent.heartbeat"}, True),
    ("conjunction across keys", {"type": ["tool.*"], "severity": {"gte": "info"}, "agent": "codex"},
     {"type": "tool.failed", "severity": "warning", "agent": "codex"}, True),
]  # fmt: skip

REJECTED_CASES: list[tuple[str, dict, str]] = [
    ("seq not filterable", {"seq": 5}, "attribute not filterable: seq"),
    ("data not filterable", {"data": {}}, "attribute not filterable: data"),
    ("time not filterable", {"time": "2026"}, "attribute not filterable: time"),
    ("aep not filterable", {"aep": "0.1"}, "attribute not filterable: aep"),
    ("traceparent not filterable", {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
     "unknown filter key: traceparent"),
    ("bare star not a pattern", {"type": "*"}, "bad type pattern: * (form: prefix.*)"),
    ("malformed key fails closed", {"NotAnAttr": "y"}, "unknown filter key: NotAnAttr"),
    ("gt is not a severity operator", {"severity": {"gt": "info"}}, "severity comparison allows gte/lte only"),
    ("glob on non-type key", {"agent": "claude*"}, 'glob patterns are only legal on "type" (agent)'),
    ("empty inclusion array", {"agent": []}, "empty inclusion array on agent"),
]  # fmt: skip


@expand
class FilterValidationAndMatching(TestCase):
    @cases(**dict(zip([c[0] for c in MATCH_CASES], MATCH_CASES, strict=True)))
    def test_match_cases(self, name: str, f: dict, event: dict, expected: bool) -> None:
        assert filter_error(f) is None
        assert compile_filter(f)(event) is expected

    @cases(**dict(zip([c[0] for c in REJECTED_CASES], REJECTED_CASES, strict=True)))
    def test_rejected_cases(self, name: str, f: dict, message: str) -> None:
        assert filter_error(f) == message
        with self.assertRaises(ValueError) as raised:
            compile_filter(f)
        assert str(raised.exception) == message

    def test_inline_corpus_is_complete(self) -> None:
        assert (len(MATCH_CASES), len(REJECTED_CASES)) == (14, 10)

    # --- validation details ------------------------------------------------------------------------

    @cases(*[None, [], [{}], "{}", 0, True])
    def test_filter_must_be_an_object(self, f: Any) -> None:
        assert filter_error(f) == "filter must be a JSON object"

    @cases(*[
        ({"severity": {"gte": "loud"}}, "unknown severity level: loud"),
        ({"severity": {"lte": None}}, "unknown severity level: null"),
        ({"severity": {"gte": 2}}, "unknown severity level: 2"),
        ({"severity": {"gte": "INFO"}}, "unknown severity level: INFO"),
        ({"severity": {"gte": "info", "eq": "info"}}, "severity comparison allows gte/lte only"),
        ({"severity": {"gte": "bad", "eq": "info"}}, "unknown severity level: bad"),
        # JS orders array-index keys first, so "0" is looked at before "gte".
        ({"severity": {"gte": "bad", "0": "info"}}, "severity comparison allows gte/lte only"),
        ({"severity": None}, "predicate values must be scalars (severity)"),
        ({"severity": [["info"]]}, "predicate values must be scalars (severity)"),
        ({"capture": {"gte": "metadata"}}, "predicate values must be scalars (capture)"),
        ({"agent": None}, "predicate values must be scalars (agent)"),
        ({"agent": ["a", None]}, "predicate values must be scalars (agent)"),
        ({"agent": ["a", {"b": 1}]}, "predicate values must be scalars (agent)"),
        ({"session": ["s1", "s*"]}, 'glob patterns are only legal on "type" (session)'),
        ({"acmeregion": "eu-*"}, 'glob patterns are only legal on "type" (acmeregion)'),
        ({"type": "tool*"}, "bad type pattern: tool* (form: prefix.*)"),
        ({"type": ["tool.*", "*.completed"]}, "bad type pattern: *.completed (form: prefix.*)"),
        ({"type": "Tool.*"}, "bad type pattern: Tool.* (form: prefix.*)"),
        ({"type": "tool.*.x"}, "bad type pattern: tool.*.x (form: prefix.*)"),
        ({"type": "tool.**"}, "bad type pattern: tool.** (form: prefix.*)"),
        ({"type": []}, "empty inclusion array on type"),
        ({"abcdefghijklmnopqrstu": 1}, "unknown filter key: abcdefghijklmnopqrstu"),
        ({"acme_ext": 1}, "unknown filter key: acme_ext"),
        ({"": 1}, "unknown filter key: "),
        ({"Agent": "a"}, "unknown filter key: Agent"),
        # Keys are checked in order; the first failing key decides.
        ({"agent": [], "seq": 1}, "empty inclusion array on agent"),
        ({"seq": 1, "agent": []}, "attribute not filterable: seq"),
        # ...in JS property order, where array-index keys ("5" is a legal extension name) come first.
        ({"agent": [], "10": None, "5": "x*"}, 'glob patterns are only legal on "type" (5)'),
    ])
    def test_validation_messages(self, f: dict, message: str) -> None:
        assert filter_error(f) == message

    @cases(*[
        {},
        {"severity": {}},
        {"severity": "info"},
        {"severity": ["bogus"]},  # scalar severity values are compared, not validated
        {"capture": "bogus"},
        {"type": ["x.ac-me.*", "tool.completed", "a.b.*"]},
        {"type": "tool.completed"},
        {"epoch": [0, 1.5, True, "x"]},
        {"abcdefghijklmnopqrst": 1, "5": "a", "acmeregion": "eu-1"},
        {"id": "01J", "subject": "s", "source": "aep://h", "run": "r", "step": "t", "cause": "c"},
    ])
    def test_valid_filters(self, f: dict) -> None:
        assert filter_error(f) is None
        compile_filter(f)

    # --- matching semantics ------------------------------------------------------------------------

    def test_empty_filters_are_the_constant_predicate(self) -> None:
        assert compile_filter({}) is match_all
        assert compile_filter({"severity": {}}) is match_all
        assert match_all({})

    @cases(*[
        # Strict equality: no string/number coercion, and True is not 1.
        ({"acmeflag": 0}, {"acmeflag": "0"}, False),
        ({"acmeflag": "0"}, {"acmeflag": 0}, False),
        ({"acmeflag": True}, {"acmeflag": 1}, False),
        ({"acmeflag": 1}, {"acmeflag": True}, False),
        ({"acmeflag": [0, 1]}, {"acmeflag": False}, False),
        ({"acmeflag": False}, {"acmeflag": False}, True),
        ({"acmeflag": 1}, {"acmeflag": 1.0}, True),
        ({"acmeflag": 1.0}, {"acmeflag": 1}, True),
        ({"acmeflag": float("nan")}, {"acmeflag": float("nan")}, False),
        ({"epoch": 0}, {"epoch": 0.0}, True),
        ({"epoch": 0}, {"epoch": None}, True),  # JS `??` defaults an explicit null too
        ({"epoch": 1}, {}, False),
        ({"epoch": [3, 0]}, {"epoch": 3}, True),
        # Absent or null attributes never match (defaults apply to severity/capture/epoch only).
        ({"run": "r1"}, {}, False),
        ({"run": "r1"}, {"run": None}, False),
        ({"acmeflag": "x"}, {"acmeflag": ["x"]}, False),
        ({"acmeflag": "x"}, {"acmeflag": {"x": 1}}, False),
        ({"session": ""}, {"session": ""}, True),
        # Defaults.
        ({"capture": "metadata"}, {}, True),
        ({"capture": "metadata"}, {"capture": None}, True),
        ({"capture": ["full", "redacted"]}, {}, False),
        ({"capture": "full"}, {"capture": "full"}, True),
        ({"severity": "info"}, {}, True),
        ({"severity": ["warning", "error"]}, {"severity": "error"}, True),
        ({"severity": "info"}, {"severity": "notice"}, False),
        # Severity bands are inclusive by rank.
        ({"severity": {"lte": "info"}}, {}, True),
        ({"severity": {"lte": "info"}}, {"severity": "notice"}, False),
        ({"severity": {"gte": "warning", "lte": "error"}}, {"severity": "warning"}, True),
        ({"severity": {"gte": "warning", "lte": "error"}}, {"severity": "error"}, True),
        ({"severity": {"gte": "warning", "lte": "error"}}, {"severity": "critical"}, False),
        ({"severity": {"gte": "warning", "lte": "error"}}, {"severity": "notice"}, False),
        ({"severity": {"gte": "error", "lte": "warning"}}, {"severity": "error"}, False),
        ({"severity": {"gte": "debug"}}, {"severity": "debug"}, True),
        # Type globs are prefixes that include the dot; arrays mix globs and exact names.
        ({"type": "tool.*"}, {"type": "toolbox.started"}, False),
        ({"type": "tool.*"}, {"type": "tool"}, False),
        ({"type": "tool.*"}, {"type": "tool.completed"}, True),
        ({"type": "x.acme.*"}, {"type": "x.acme2.foo.bar"}, False),
        ({"type": ["run.*", "tool.completed"]}, {"type": "tool.completed"}, True),
        ({"type": ["run.*", "tool.completed"]}, {"type": "tool.failed"}, False),
        ({"type": ["run.*", "tool.*"]}, {"type": "run.step.started"}, True),
        ({"type": "run.step.*"}, {"type": "run.started"}, False),
        ({"agent": "tool.*"}, {"agent": "tool.x"}, None),  # invalid: globs only on type
        # Conjunction.
        ({"type": "tool.*", "agent": "codex"}, {"type": "tool.failed", "agent": "claude"}, False),
        ({"type": "tool.*", "agent": "codex", "acmeregion": ["eu-1", "us-1"]},
         {"type": "tool.failed", "agent": "codex", "acmeregion": "us-1"}, True),
        ({"type": "tool.*", "agent": "codex", "acmeregion": ["eu-1", "us-1"]},
         {"type": "tool.failed", "agent": "codex"}, False),
    ])  # fmt: skip
    def test_matching(self, f: dict, event: dict, expected: bool | None) -> None:
        if expected is None:
            assert filter_error(f) is not None
            return
        assert compile_filter(f)(event) is expected

    def test_predicate_does_not_mutate_event(self) -> None:
        event = {"type": "tool.completed"}
        assert compile_filter({"severity": "info", "capture": "metadata", "epoch": 0})(event)
        assert event == {"type": "tool.completed"}


# --- property: the compiled predicate agrees with a direct reading of section 4.1 ------------

_KEYS = ["type", "agent", "severity", "capture", "epoch", "run", "acmeflag"]
_SCALARS = st.one_of(
    st.sampled_from(["tool.completed", "tool.failed", "run.started", "codex", "info", "notice", "full", "0", ""]),
    st.sampled_from([0, 1, 2, 0.0, 1.0, 1.5, True, False]),
)
_EVENT_VALUES = st.one_of(_SCALARS, st.none(), st.just(["codex"]))
_LEVELS = ["debug", "info", "notice", "warning", "error", "critical"]


def _type_pred() -> st.SearchStrategy[Any]:
    one = st.one_of(_SCALARS, st.sampled_from(["tool.*", "run.*", "x.acme.*"]))
    return st.one_of(one, st.lists(one, min_size=1, max_size=3))


_PREDICATE = {
    "severity": st.one_of(
        st.fixed_dictionaries({}, optional={"gte": st.sampled_from(_LEVELS), "lte": st.sampled_from(_LEVELS)}),
        st.sampled_from(_LEVELS),
        st.lists(st.sampled_from(_LEVELS), min_size=1, max_size=3),
    ),
    "type": _type_pred(),
}


@st.composite
def _filters(draw: st.DrawFn) -> dict:
    keys = draw(st.lists(st.sampled_from(_KEYS), unique=True, max_size=4))
    f = {}
    for k in keys:
        default = st.one_of(_SCALARS, st.lists(_SCALARS, min_size=1, max_size=3))
        f[k] = draw(_PREDICATE.get(k, default))
    return f


@st.composite
def _events(draw: st.DrawFn) -> dict:
    keys = draw(st.lists(st.sampled_from(_KEYS), unique=True))
    event = {k: draw(_EVENT_VALUES) for k in keys}
    if "severity" in event:
        event["severity"] = draw(st.sampled_from(_LEVELS))
    return event


def _same(a: object, b: object) -> bool:
    """JS ===: same JSON kind and equal value."""
    kind = lambda v: "bool" if isinstance(v, bool) else "num" if isinstance(v, (int, float)) else type(v).__name__  # noqa: E731
    return kind(a) == kind(b) and kind(a) in ("bool", "num", "str") and a == b


def _oracle(f: dict, event: dict) -> bool:
    """A slow, literal reading of the section 4.1 matching rules."""
    defaults = {"severity": "info", "capture": "metadata", "epoch": 0}
    for key, pred in f.items():
        val = event.get(key)
        if val is None:
            val = defaults.get(key)
        if key == "severity" and isinstance(pred, dict):
            rank = _LEVELS.index(val)
            if "gte" in pred and rank < _LEVELS.index(pred["gte"]):
                return False
            if "lte" in pred and rank > _LEVELS.index(pred["lte"]):
                return False
            continue
        if val is None:
            return False
        alternatives = pred if isinstance(pred, list) else [pred]
        hit = False
        for alt in alternatives:
            if key == "type" and isinstance(alt, str) and alt.endswith(".*"):
                hit = isinstance(val, str) and val.startswith(alt[:-1])
            else:
                hit = _same(val, alt)
            if hit:
                break
        if not hit:
            return False
    return True


@expand
class FilterProperty(TestCase):
    @settings(max_examples=400, deadline=None, database=None)
    @given(_filters(), _events())
    def test_compiled_predicate_agrees_with_the_rules(self, f: dict, event: dict) -> None:
        assert filter_error(f) is None
        assert compile_filter(f)(event) is _oracle(f, event)


# --- fixture corpus ----------------------------------------------------------------------------


def _corpus() -> dict:
    path = FIXTURES / "attr-match" / "cases.json"
    return json.loads(path.read_text(encoding="utf-8"))


@expand
class FilterFixtureCorpus(TestCase):
    def test_fixture_match_cases(self) -> None:
        cases = _corpus()["match"]
        assert len(cases) == 14
        results = {c["name"]: compile_filter(c["filter"])(c["event"]) for c in cases}
        assert results == {c["name"]: c["match"] for c in cases}

    def test_fixture_invalid_filters_rejected(self) -> None:
        cases = _corpus()["invalid"]
        assert len(cases) == 10
        messages = {c["name"]: filter_error(c["filter"]) for c in cases}
        assert all(messages.values()), messages
        # Same exact texts as the inline transcription, in corpus order.
        assert list(messages.values()) == [message for _, _, message in REJECTED_CASES]
