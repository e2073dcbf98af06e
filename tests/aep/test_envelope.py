"""Tests for relayd.aep.core.envelope: relay-grade envelope checks (aep.md section 2), kinds, positions."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from twisted.trial.unittest import TestCase

from relayd.aep.core.envelope import UNDEFINED, EventKind, envelope_error, event_kind, is_command_type, js_str, position
from tests.support.cases import cases, expand

AEP_DATA = Path(__file__).resolve().parent / "data"  # vendored AEP conformance data (see its NOTICE.md)
FIXTURES = AEP_DATA / "fixtures"

BASE: dict[str, Any] = {
    "aep": "0.1",
    "id": "E1",
    "type": "progress.status",
    "time": "2026-07-03T10:00:00Z",
    "source": "aep://h/agent/a",
    "agent": "a",
    "session": "s1",
    "seq": 0,
}


def ev(**changes: Any) -> dict:
    """BASE with changes applied; a value of UNDEFINED removes the attribute."""
    out = dict(BASE)
    for k, v in changes.items():
        if v is UNDEFINED:
            out.pop(k, None)
        else:
            out[k] = v
    return out


# --- golden events (a representative sample of fixtures/golden, Apache-2.0) ---------------------

_SRC = "aep://host-a/agent/claude-code/session/s_8f2c"
_CC = {"aep": "0.1", "time": "2026-07-03T10:15:00.000Z", "source": _SRC, "agent": "claude-code", "session": "s_8f2c"}
GOLDEN: list[tuple[dict, EventKind]] = [
    ({**_CC, "id": "G01", "type": "session.started", "seq": 0, "epoch": 0, "severity": "info", "capture": "metadata",
      "acmeregion": "eu-1", "data": {"client": {"name": "claude-code", "version": "2.1.0"}}}, EventKind.SEQUENCED),
    ({**_CC, "id": "G04", "type": "tool.completed", "subject": "Bash", "run": "r_0042", "step": "turn-3", "seq": 3,
      "epoch": 0, "cause": "G03", "severity": "info", "capture": "metadata",
      "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
      "data": {"tool": {"name": "Bash", "call_id": "t_91"}, "status": "success", "duration_ms": 1240}},
     EventKind.SEQUENCED),
    ({**_CC, "id": "G05", "type": "attention.requested", "subject": "Bash", "seq": 4, "epoch": 0, "severity": "notice",
      "capture": "redacted", "data": {"kind": "permission", "prompt": "Permission requested: Bash",
                                      "options": [{"id": "allow", "label": "Allow"}]}}, EventKind.SEQUENCED),
    ({"aep": "0.1", "id": "G06", "type": "attention.routed", "subject": "G05", "time": "2026-07-03T10:15:05.400Z",
      "source": "aep://host-b/agent/telegram-sink", "agent": "telegram-sink", "session": "s_8f2c", "cause": "G05",
      "capture": "metadata"}, EventKind.FOREIGN),
    ({"aep": "0.1", "id": "G07", "type": "control.attention.respond", "subject": "G05", "time": "2026-07-03T10:15:09Z",
      "source": "aep://host-b/agent/telegram-sink", "agent": "telegram-sink", "session": "s_8f2c", "cause": "G05",
      "capture": "metadata", "data": {"answer": {"option": "allow"}}}, EventKind.COMMAND),
    ({**_CC, "id": "G08", "type": "control.accepted", "seq": 5, "epoch": 0, "cause": "G07", "capture": "metadata"},
     EventKind.SEQUENCED),
    ({**_CC, "id": "G12", "type": "x.claude-code.session.config_change", "seq": 9, "epoch": 0, "severity": "debug",
      "capture": "metadata"}, EventKind.SEQUENCED),
    ({"aep": "0.1", "id": "G21", "type": "control.cancel", "time": "2026-07-03T10:15:58Z",
      "source": "aep://host-b/agent/mission-control", "agent": "mission-control", "session": "s_8f2c", "run": "r_0044",
      "cause": "G20", "capture": "redacted", "data": {"scope": "run", "reason": "stuck waiting on permission"}},
     EventKind.COMMAND),
    ({"aep": "0.1", "id": "G25", "type": "agent.presence", "time": "2026-07-03T10:16:00Z",
      "source": "aep://host-a/agent/claude-code", "agent": "claude-code", "severity": "debug", "capture": "metadata",
      "data": {"state": "online"}}, EventKind.AGENT_SCOPED),
    ({"aep": "0.1", "id": "G26", "type": "progress.status", "time": "2026-07-03T10:16:01Z",
      "source": "aep://host-a/agent/bash-floor", "agent": "bash-floor", "session": "s_min", "seq": 0},
     EventKind.SEQUENCED),
    ({**_CC, "id": "G34", "type": "run.finished", "session": "s_epoch", "run": "r_e1", "seq": 0, "epoch": 1,
      "data": {"duration_ms": 29000}}, EventKind.SEQUENCED),
    ({"aep": "0.1", "id": "G55", "type": "agent.heartbeat", "time": "2026-07-03T10:19:00Z",
      "source": "aep://host-a/agent/claude-code", "agent": "claude-code", "data": {"tick": 42, "interval_ms": 30000}},
     EventKind.AGENT_SCOPED),
]  # fmt: skip


@expand
class GoldenSample(TestCase):
    @cases(**dict(zip([e["id"] for e, _ in GOLDEN], GOLDEN, strict=True)))
    def test_golden_sample_accepted(self, event: dict, kind: EventKind) -> None:
        before = copy.deepcopy(event)
        assert envelope_error(event) is None
        assert event_kind(event) is kind
        assert event == before


# --- the relay-grade invalid cases (aep.md section 2; fixtures/invalid) -------------------------

RELAY_GRADE_INVALID: list[tuple[str, dict, str]] = [
    ("session-scoped without session", ev(type="run.started", session=UNDEFINED), "session required"),
    ("session-scoped without seq", ev(type="run.started", seq=UNDEFINED), "seq required (integer >= 0)"),
    ("agent-scoped with session", ev(type="agent.presence", seq=UNDEFINED), "agent-scoped events omit session/seq"),
    ("agent-scoped with seq", ev(type="agent.heartbeat", session=UNDEFINED, seq=3),
     "agent-scoped events omit session/seq"),
    ("command with seq", ev(type="control.cancel", seq=1, data={"scope": "run"}), "command events omit seq"),
    ("single-segment type", ev(type="tool"), "bad type syntax: tool"),
    ("uppercase in type", ev(type="tool.Completed"), "bad type syntax: tool.Completed"),
    ("unknown severity", ev(severity="fatal"), "bad severity"),
    ("unsupported envelope version", ev(aep="0.2"), "unsupported aep version: 0.2"),
    ("negative seq", ev(seq=-1), "seq required (integer >= 0)"),
]  # fmt: skip

# Decision 4: with a seq, attention.routed is rejected like a command (the reference accepts it).
ROUTED_WITH_SEQ = "attention.routed with seq"


@expand
class RelayGradeInvalid(TestCase):
    @cases(**dict(zip([c[0] for c in RELAY_GRADE_INVALID], RELAY_GRADE_INVALID, strict=True)))
    def test_relay_grade_invalid(self, name: str, event: dict, message: str) -> None:
        assert envelope_error(event) == message


# Invalid per the full schema but out of relay-grade scope: must pass the relay check.
NEEDS_FULL_VALIDATION: list[tuple[str, dict]] = [
    ("unknown category", ev(type="banana.peeled")),
    ("vendor type too short", ev(type="x.acme.foo")),
    ("extension name over 20 chars", ev(acmeveryveryverylongext1="v")),
    ("extension object value", ev(acmemeta={"k": 1})),
    ("extension illegal charset", ev(acme_ext="v")),
    ("malformed traceparent", ev(traceparent="not-a-traceparent")),
    ("non-object data", ev(data="text")),
    ("null optional attribute", ev(run=None, cause=None)),
    ("epoch unchecked", ev(epoch="abc")),
]


@expand
class RelayGradeScope(TestCase):
    @cases(**dict(zip([c[0] for c in NEEDS_FULL_VALIDATION], NEEDS_FULL_VALIDATION, strict=True)))
    def test_outside_relay_grade_scope_is_accepted(self, name: str, event: dict) -> None:
        assert envelope_error(event) is None

    # --- decision 4: attention.routed ---------------------------------------------------------------

    def test_attention_routed_without_seq_accepted(self) -> None:
        routed = ev(type="attention.routed", seq=UNDEFINED)
        assert envelope_error(routed) is None
        assert event_kind(routed) is EventKind.FOREIGN

    @cases(*[
        ({"seq": 3}, "foreign-emitter events omit seq"),
        ({"seq": None}, "foreign-emitter events omit seq"),
        ({"seq": UNDEFINED, "session": UNDEFINED}, "foreign-emitter events require session"),
        ({"seq": UNDEFINED, "session": 5}, "foreign-emitter events require session"),
        ({"seq": 3, "session": UNDEFINED}, "foreign-emitter events require session"),
    ])
    def test_attention_routed_rejections(self, changes: dict, message: str) -> None:
        assert envelope_error(ev(type="attention.routed", **changes)) == message

    # --- check order and exact texts ---------------------------------------------------------------

    @cases(*[None, [], [BASE], "x", 0, True, 1.5])
    def test_not_an_object(self, value: Any) -> None:
        assert envelope_error(value) == "not an object"

    @cases(*[(UNDEFINED, "undefined"), (None, "null"), (0.1, "0.1"), (1.0, "1"), (True, "true"), ("0.10", "0.10"),
         ({}, "[object Object]"), (["0.1"], "0.1"), (1e-7, "1e-7"), (1e21, "1e+21")])  # fmt: skip
    def test_aep_version_message(self, aep: Any, shown: str) -> None:
        # The version check runs before everything else, even the required strings.
        assert envelope_error(ev(aep=aep, id=UNDEFINED)) == f"unsupported aep version: {shown}"

    @cases(**{f"{key}_{i}": (key, value) for key in ["id", "type", "time", "source", "agent"]
              for i, value in enumerate([UNDEFINED, "", None, 5, ["x"]])})
    def test_required_strings(self, key: str, value: Any) -> None:
        assert envelope_error(ev(**{key: value})) == f"missing/invalid {key}"

    def test_required_strings_checked_in_order_before_type_syntax(self) -> None:
        assert envelope_error(ev(id="", agent="", type="BAD")) == "missing/invalid id"
        assert envelope_error(ev(time=1, type="BAD")) == "missing/invalid time"
        assert envelope_error(ev(type="BAD", agent=None)) == "missing/invalid agent"

    @cases(*["log.emitted", "foo.bar", "x.acme.foo", "x.ac-me.foo.bar", "x.claude-code.session.config_change",
         "a_b.c_d.e", "tool.completed"])  # fmt: skip
    def test_type_syntax_accepted(self, type_: str) -> None:
        assert envelope_error(ev(type=type_)) is None

    @cases(*["tool", "tool.", ".tool", "tool..done", "ac-me.foo", "x.acme.fo-o.bar", "Tool.completed", "tool.completed\n",
         "tool.completed ", "tool.*", "x..foo.bar", "tool.compl\u00e9ted"])  # fmt: skip
    def test_type_syntax_rejected(self, type_: str) -> None:
        assert envelope_error(ev(type=type_)) == f"bad type syntax: {type_}"

    def test_agent_scope(self) -> None:
        agent = ev(type="agent.idle", session=UNDEFINED, seq=UNDEFINED)
        assert envelope_error(agent) is None
        assert envelope_error({**agent, "run": "r1", "step": "s"}) is None  # run/step are not checked
        assert envelope_error({**agent, "session": None}) == "agent-scoped events omit session/seq"
        assert envelope_error({**agent, "seq": None}) == "agent-scoped events omit session/seq"

    @cases(*["control.attention.respond", "control.cancel", "control.pause", "control.resume", "x.acme.control.reboot"])
    def test_command_scope(self, type_: str) -> None:
        command = ev(type=type_, seq=UNDEFINED)
        assert envelope_error(command) is None
        assert event_kind(command) is EventKind.COMMAND
        assert envelope_error({**command, "session": None}) == "command events require session (target)"
        assert envelope_error(ev(type=type_, session=UNDEFINED, seq=UNDEFINED)) == "command events require session (target)"
        # Session is checked before seq; any seq, even null, is refused.
        assert envelope_error(ev(type=type_, session=UNDEFINED)) == "command events require session (target)"
        assert envelope_error({**command, "seq": None}) == "command events omit seq"
        assert envelope_error({**command, "seq": 0}) == "command events omit seq"

    @cases(*["control.accepted", "control.rejected", "control.restart", "x.acme.controls.go"])
    def test_acks_and_other_control_types_are_sequenced(self, type_: str) -> None:
        assert envelope_error(ev(type=type_)) is None
        assert event_kind(ev(type=type_)) is EventKind.SEQUENCED
        assert envelope_error(ev(type=type_, seq=UNDEFINED)) == "seq required (integer >= 0)"

    @cases(*["", "s:1", "\u00e9"])
    def test_any_string_session_passes(self, session: str) -> None:
        assert envelope_error(ev(session=session)) is None

    @cases(*[None, 1, True, ["s1"]])
    def test_session_must_be_a_string(self, session: Any) -> None:
        assert envelope_error(ev(session=session)) == "session required"

    @cases(*[0, 5, 5.0, -0.0, 2**63, 1e300])
    def test_seq_integers(self, seq: Any) -> None:
        assert envelope_error(ev(seq=seq)) is None

    @cases(*[-1, -1.0, 5.5, True, False, "5", None, float("nan"), float("inf"), [1], {}])
    def test_seq_non_integers(self, seq: Any) -> None:
        assert envelope_error(ev(seq=seq)) == "seq required (integer >= 0)"

    def test_scope_before_severity_before_capture(self) -> None:
        assert envelope_error(ev(seq=-1, severity="loud", capture="x")) == "seq required (integer >= 0)"
        assert envelope_error(ev(severity="loud", capture="x")) == "bad severity"
        assert envelope_error(ev(capture="x")) == "bad capture"

    @cases(*["debug", "info", "notice", "warning", "error", "critical"])
    def test_severity_levels(self, severity: str) -> None:
        assert envelope_error(ev(severity=severity)) is None

    @cases(*[None, "INFO", "fatal", 1, ["info"]])
    def test_bad_severity_and_capture(self, value: Any) -> None:
        assert envelope_error(ev(severity=value)) == "bad severity"
        assert envelope_error(ev(capture=value)) == "bad capture"

    @cases(*["none", "metadata", "redacted", "full"])
    def test_capture_levels(self, capture: str) -> None:
        assert envelope_error(ev(capture=capture)) is None

    # --- is_command_type / event_kind --------------------------------------------------------------

    @cases(*[
        ("control.attention.respond", True), ("control.cancel", True), ("control.pause", True),
        ("control.resume", True), ("x.acme.control.reboot", True), ("x.ac-me.control.a.b", True),
        ("control.accepted", False), ("control.rejected", False), ("control.attention", False),
        ("control.cancelled", False), ("control.cancel.x", False), ("x.acme.control", False),
        ("acme.control.reboot", False), ("control.cancel\n", False), ("x.acme.control.a\nb", False),
        ("attention.routed", False), ("", False),
    ])  # fmt: skip
    def test_is_command_type(self, type_: str, expected: bool) -> None:
        assert is_command_type(type_) is expected

    # --- positions (decision 3) --------------------------------------------------------------------

    def test_position_exact_ints(self) -> None:
        assert position(ev(seq=7)) == (0, 7)
        p = position(ev(seq=7.0, epoch=2.0))
        assert p == (2, 7) and all(type(x) is int for x in p)
        assert position(ev(seq=1, epoch=None)) == (0, 1)
        assert position(ev(seq=1, epoch="abc")) == (0, 1)  # epoch is unchecked: non-integers count as 0
        assert position(ev(seq=1, epoch=True)) == (0, 1)

    @cases(*[{"seq": UNDEFINED, "type": "control.cancel"}, {"seq": None}, {"seq": 1.5}])
    def test_position_requires_integer_seq(self, changes: dict) -> None:
        with self.assertRaises(ValueError):
            position(ev(**changes))

    def test_large_epoch_ordering_is_exact(self) -> None:
        # From epoch 8192 on, the reference's float key epoch * 2**40 + seq collides for adjacent seqs.
        epoch = 8192
        a, b = ev(epoch=epoch, seq=0), ev(epoch=epoch, seq=1)
        assert float(epoch) * 2**40 + 0 == float(epoch) * 2**40 + 1  # the defect being avoided
        assert position(a) < position(b)
        timestamp_epoch = 1_767_225_600_000  # a millisecond-timestamp-seeded epoch
        events = [ev(id=f"e{i}", epoch=e, seq=s) for i, (e, s) in enumerate(
            [(timestamp_epoch + 1, 0), (timestamp_epoch, 3), (timestamp_epoch, 2**53 + 1), (timestamp_epoch, 2**53),
             (epoch, 2**40 + 5), (epoch + 1, 0)]
        )]  # fmt: skip
        ordered = [position(e) for e in sorted(events, key=position)]
        assert ordered == [
            (epoch, 2**40 + 5), (epoch + 1, 0), (timestamp_epoch, 3), (timestamp_epoch, 2**53),
            (timestamp_epoch, 2**53 + 1), (timestamp_epoch + 1, 0),
        ]  # fmt: skip
        # A resume point strictly after (epoch, seq) includes the very next seq.
        after = (timestamp_epoch, 2**53)
        assert [p for p in ordered if p > after] == [(timestamp_epoch, 2**53 + 1), (timestamp_epoch + 1, 0)]

    # --- js_str ------------------------------------------------------------------------------------

    @cases(*[(UNDEFINED, "undefined"), (None, "null"), (True, "true"), (0, "0"), (-0.0, "0"), (10**21, "1e+21"),
         (123.0, "123"), (0.1, "0.1"), (1.5e-7, "1.5e-7"), (0.000001, "0.000001"), (1e21, "1e+21"),
         (123456789012345680000.0, "123456789012345680000"), (-2.5, "-2.5"), (float("nan"), "NaN"),
         (float("-inf"), "-Infinity"), ([1, None, "a", [2, 3]], "1,,a,2,3"), ({"a": 1}, "[object Object]")])  # fmt: skip
    def test_js_str(self, value: Any, text: str) -> None:
        assert js_str(value) == text


# --- fixture corpora ---------------------------------------------------------------------------


def _golden() -> list[dict]:
    path = FIXTURES / "golden" / "golden.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@expand
class GoldenCorpus(TestCase):
    def test_golden_corpus_all_accepted(self) -> None:
        events = _golden()
        assert len(events) == 64
        assert {e["id"]: envelope_error(e) for e in events} == {e["id"]: None for e in events}
        kinds = [event_kind(e) for e in events]
        assert [e["type"] for e, k in zip(events, kinds, strict=True) if k is EventKind.FOREIGN] == ["attention.routed"]
        assert sorted(e["type"] for e, k in zip(events, kinds, strict=True) if k is EventKind.COMMAND) == [
            "control.attention.respond",
            "control.cancel",
        ]
        for e, k in zip(events, kinds, strict=True):
            if k is EventKind.SEQUENCED:
                assert all(type(x) is int for x in position(e))

    def test_invalid_corpus_relay_grade_subset(self) -> None:
        path = FIXTURES / "invalid" / "cases.json"
        cases = json.loads(path.read_text(encoding="utf-8"))["cases"]
        assert len(cases) == 35
        rejected = {}
        for case in cases:
            errors = [envelope_error(e) for e in case.get("events") or [case["event"]]]
            if any(errors):
                rejected[case["name"]] = [e for e in errors if e]
        expected = {name: [message] for name, _, message in RELAY_GRADE_INVALID}
        expected[ROUTED_WITH_SEQ] = ["foreign-emitter events omit seq"]
        # Exactly the reference's ten plus decision 4; the other 24 need full validation.
        assert rejected == expected
