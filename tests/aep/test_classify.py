"""classify() is envelope_error() + event_kind() in one pass: same verdict for every input."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from relayd.aep.core.envelope import EventKind, classify, envelope_error, event_kind

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False, width=16),
    st.sampled_from(["", "0.1", "x", "info", "notice", "loud", "full", "none", "S"]),
)
types = st.sampled_from([
    "session.started", "agent.heartbeat", "control.pause", "control.accepted", "attention.routed",
    "x.acme.control.reboot", "x.acme.foo.bar", "Bad.Type", "single", "x.acme.foo", "", "tool.completed",
])
keys = st.sampled_from(["aep", "id", "type", "time", "source", "agent", "session", "seq", "epoch", "severity", "capture", "data"])


def base() -> dict:
    return {"aep": "0.1", "id": "i", "type": "session.started", "time": "t", "source": "s", "agent": "a",
            "session": "S", "seq": 0}


class ClassifyTests(TestCase):
    @settings(max_examples=800, deadline=None)
    @given(
        st.dictionaries(keys, st.one_of(scalars, types), max_size=6),
        st.lists(keys, max_size=3),
        st.booleans(),
    )
    def test_classify_agrees_with_envelope_error_and_event_kind(self, changes: dict, removed: list, from_base: bool) -> None:
        ev = base() if from_base else {}
        ev.update(changes)
        for key in removed:
            ev.pop(key, None)
        expected = envelope_error(ev)
        got = classify(ev)
        if expected is None:
            assert got is event_kind(ev)
        else:
            assert got == expected

    def test_non_objects(self) -> None:
        for value in (None, [], "x", 1, [base()]):
            assert classify(value) == "not an object"

    def test_common_kinds(self) -> None:
        assert classify(base()) is EventKind.SEQUENCED
        assert classify({**base(), "seq": 5.0}) is EventKind.SEQUENCED  # an integral float is an integer
        cmd = {**base(), "type": "control.pause"}
        del cmd["seq"]
        assert classify(cmd) is EventKind.COMMAND
