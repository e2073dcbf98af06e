"""The stream query's readings table (relayd/aep/query.py): each distinct short C{filter} and C{from}
value is read once, and what a stream gets is what reading it afresh gives."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from twisted.trial.unittest import SynchronousTestCase

from relayd.aep import query
from relayd.aep.query import READING_MAX_BYTES, READINGS_KEPT, BadRequest, stream_query

FILTER = b'{"session":"s1"}'
FROM = b'[{"session":"s1","epoch":0,"seq":4}]'


def ask(**args: bytes) -> Any:
    """A request whose query string is C{args} (all stream_query reads of it)."""
    return SimpleNamespace(args={name.encode(): [value] for name, value in args.items()})


class Readings(SynchronousTestCase):
    def setUp(self) -> None:
        self.patch(query, "_filters", query._Readings())
        self.patch(query, "_froms", query._Readings())

    def test_one_filter_value_is_compiled_once(self) -> None:
        first = stream_query(ask(filter=FILTER), 10)
        second = stream_query(ask(filter=FILTER), 10)
        self.assertIs(second.match, first.match)
        self.assertEqual((second.pin, second.filter_session), (first.pin, "s1"))
        self.assertTrue(first.match({"session": "s1"}))
        self.assertFalse(first.match({"session": "s2"}))

    def test_each_stream_gets_its_own_resume_list(self) -> None:
        first = stream_query(ask(filter=FILTER, **{"from": FROM}), 10)
        self.assertEqual(first.from_value, [("s1", (0, 4))])
        assert isinstance(first.from_value, list)
        first.from_value.append(("s2", (0, 0)))
        second = stream_query(ask(filter=FILTER, **{"from": FROM}), 10)
        self.assertEqual(second.from_value, [("s1", (0, 4))])

    def test_a_kept_from_value_still_meets_each_limit(self) -> None:
        two = b'[{"session":"a"},{"session":"b"}]'
        self.assertEqual(len(stream_query(ask(**{"from": two}), 2).from_value), 2)
        with self.assertRaises(BadRequest) as caught:
            stream_query(ask(**{"from": two}), 1)
        self.assertEqual(str(caught.exception), "from too large")

    def test_refused_values_are_refused_every_time(self) -> None:
        for _ in range(2):
            with self.assertRaises(BadRequest) as caught:
                stream_query(ask(filter=b'{"time":"x"}'), 10)
            self.assertIn("time", str(caught.exception))
            with self.assertRaises(BadRequest) as caught:
                stream_query(ask(**{"from": b'[{"session":1}]'}), 10)
            self.assertEqual(str(caught.exception), "bad from entry: from entry needs a string session")

    def test_the_table_is_bounded(self) -> None:
        first = stream_query(ask(filter=b'{"session":"s0"}'), 10).match
        for i in range(1, READINGS_KEPT + 1):
            stream_query(ask(filter=b'{"session":"s%d"}' % i), 10)
        self.assertEqual(len(query._filters._kept), READINGS_KEPT)
        again = stream_query(ask(filter=b'{"session":"s0"}'), 10).match
        self.assertIsNot(again, first)  # the oldest went first
        long = b'{"session":"%s"}' % (b"x" * READING_MAX_BYTES)
        self.assertIsNot(stream_query(ask(filter=long), 10).match, stream_query(ask(filter=long), 10).match)
