"""Access lines written straight into the text log's turn writer (relayd/logs/access_log.py): the text
log holds the same bytes as when each line is published as an event; the shortcut is taken only while
twistd's text observer (relayd's formatter, a turn writer) and the scrubber are all that observes the
publisher, and every change of the observers is seen at once."""

from __future__ import annotations

import io
import json
import types
from functools import partial
from typing import Any, Callable

from twisted.internet.testing import MemoryReactorClock
from twisted.logger import (
    FilteringLogObserver,
    LogBeginner,
    Logger,
    LogLevel,
    LogLevelFilterPredicate,
    LogPublisher,
    textFileLogObserver,
)
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource

from relayd.base.clock import Timekeeper
from relayd.logs import access, access_log, output, scrub
from relayd.logs import json as logs_json
from relayd.web import site as site_module
from relayd.web.site import RelaySite
from tests.logs.test_output import CountingFile, RefusingFile

START = 1764460800.25  # the clock's time at the start: a second's first quarter


class Relay:
    """A site logging through an access logger on its own publisher (the scrubber first), whose text
    log (a text-file observer with relayd's formatter and a turn writer) writes to C{file}; its clock
    a memory reactor's (running: lines are kept for the turn's end).

    C{direct}: the logger writes access lines straight to the text log where it may (as the tap has it).
    """

    def __init__(
        self,
        test: TestCase,
        direct: bool,
        file: Any = None,
        make: Callable[[Any], Any] = textFileLogObserver,
        more: tuple[Any, ...] = (),
    ) -> None:
        self.file = CountingFile() if file is None else file
        self.publisher = LogPublisher(make(self.file), *more)
        scrub.install_scrubber(self.publisher)
        self.reactor = MemoryReactorClock()
        self.reactor.advance(START)
        self.reactor.running = True
        clock = Timekeeper(self.reactor)
        clock.monotonic = clock.seconds  # (durations on the memory clock: the same in every run)
        access.quicken_access_lines(self.publisher)
        output.write_once_per_turn(self.reactor, clock, self.publisher)
        self.access_log = access_log.AccessLog(self.publisher)
        if direct:
            self.access_log.write_directly()
        test.addCleanup(self.access_log.publish_only)
        test.patch(site_module, "access_logger", self.access_log)
        self.site = RelaySite(Resource(), clock=clock, relay="aep")
        self.log = Logger(namespace="relayd.aep", observer=self.publisher)

    def other(self, level: LogLevel, fmt: str, **fields: Any) -> None:
        """Another line, as C{Logger.emit} makes its event, at the memory clock's time."""
        self.publisher({**fields, "log_logger": self.log, "log_level": level, "log_namespace": self.log.namespace,
                        "log_source": None, "log_format": fmt, "log_time": self.reactor.seconds()})

    def request(self, n: int = 0, peer: str = "127.0.0.1") -> None:
        site_module.access_logger = self.access_log  # (the sites' one logger: this relay's, patched back after the test)
        self.site.access(method=b"POST", path=b"/events?token=x", status=202, sent=n, peer=peer,
                         started=self.reactor.seconds())

    def later(self, seconds: float) -> None:
        """The clock moves on (the pending turn's lines written first)."""
        self.reactor.advance(0)
        self.reactor.advance(seconds)

    def text(self) -> Any:
        self.reactor.advance(0)
        return self.file.text() if isinstance(self.file, CountingFile) else self.file.getvalue()


def traffic(relay: Relay) -> None:
    """Access lines within a second, across second boundaries, other lines among them in one turn."""
    for n in range(5):
        relay.request(n)
    relay.other(LogLevel.warn, "store {what}", what="down")
    relay.request(5)
    relay.later(0.8)  # the next second, its first line
    relay.request(6)
    relay.request(7)
    relay.other(LogLevel.info, "between")
    relay.request(8)
    relay.later(0.2)  # (the same second)
    relay.request(9)
    relay.later(3.0)
    relay.request(10)
    relay.request(11, peer="10.0.0.1")


class Formatted:
    """Counts the access-line formatter's calls (each one an event that reached the text observer)."""

    def __init__(self, test: TestCase) -> None:
        self.calls = 0
        original = access.AccessLines.__call__

        def counting(formatter: access.AccessLines, event: Any) -> Any:
            self.calls += 1
            return original(formatter, event)

        test.patch(access.AccessLines, "__call__", counting)


class SameBytes(TestCase):
    def test_the_text_log_holds_the_same_bytes_with_the_shortcut_and_without(self) -> None:
        published = Relay(self, direct=False)
        traffic(published)
        formatted = Formatted(self)
        direct = Relay(self, direct=True)
        traffic(direct)
        self.assertEqual(direct.text(), published.text())
        lines = direct.text().splitlines()
        self.assertEqual(len(lines), 14)
        self.assertIn('[relayd.access#info] aep 127.0.0.1 "POST /events" 202 0', lines[0])
        self.assertIn("store down", lines[5])  # in order with the other lines of its turn
        self.assertIn('"POST /events" 202 5', lines[6])
        # Twisted formatted the first line of each of the 3 seconds and the 2 other lines: the rest
        # went straight to the turn writer.
        self.assertEqual(formatted.calls, 5)

    def test_a_line_the_formatter_would_not_shorten_is_published(self) -> None:
        published, direct = Relay(self, direct=False), Relay(self, direct=True)
        formatted = Formatted(self)
        for relay in (published, direct):
            relay.request(0)
            relay.request(1, peer="10.0.0.1\nforged line")
        self.assertEqual(direct.text(), published.text())
        self.assertEqual(formatted.calls, 4)  # (the first line of the second, and the one with a newline)

    def test_a_text_log_on_a_bytes_stream_gets_the_same_bytes(self) -> None:
        published, direct = Relay(self, direct=False, file=io.BytesIO()), Relay(self, direct=True, file=io.BytesIO())
        for relay in (published, direct):
            traffic(relay)
        self.assertIsInstance(direct.text(), bytes)
        self.assertEqual(direct.text(), published.text())
        self.assertEqual(len(direct.text().splitlines()), 14)

    def test_a_time_the_formatter_would_not_shorten_is_published(self) -> None:
        direct = Relay(self, direct=True)
        direct.request(0)
        self.assertTrue(direct.access_log.written(START, "line"))
        self.assertFalse(direct.access_log.written(int(START), "line"))  # (not a float: the formatter's test)

    def test_a_stream_that_refuses_the_write_loses_the_lines_as_the_observer_would(self) -> None:
        published, direct = Relay(self, direct=False, file=RefusingFile()), Relay(self, direct=True, file=RefusingFile())
        for relay in (published, direct):
            for n in range(output.BOUND // 50):  # (past the bound: written, and refused, at once)
                relay.request(n)
            relay.reactor.advance(0)
            self.assertEqual(relay.file.writes, [])
        self.assertIsNotNone(direct.access_log._direct)  # (the observer stays, as the publisher keeps it)

    def test_the_lines_of_a_turn_are_one_write(self) -> None:
        direct = Relay(self, direct=True)
        for n in range(20):
            direct.request(n)
        self.assertEqual(direct.file.writes, [])
        direct.reactor.advance(0)
        self.assertEqual(len(direct.file.writes), 1)
        self.assertEqual(len(direct.file.writes[0].splitlines()), 20)


class OtherObservers(TestCase):
    def test_an_observer_added_sees_every_line_and_removing_it_restores_the_shortcut(self) -> None:
        published, direct = Relay(self, direct=False), Relay(self, direct=True)
        formatted = Formatted(self)
        seen: list[str] = []

        def observer(event: Any) -> None:
            seen.append(event["access_line"])

        for relay in (published, direct):
            relay.request(0)
            relay.request(1)
            relay.publisher.addObserver(observer)
            relay.request(2)
            relay.request(3)
            relay.publisher.removeObserver(observer)
            relay.request(4)
        self.assertEqual(direct.text(), published.text())
        line = 'aep 127.0.0.1 "POST /events" 202 {}'
        self.assertEqual(seen, [line.format(2), line.format(3)] * 2)
        # published: 5; direct: the second's first line and the 2 lines the observer saw, not the others.
        self.assertEqual(formatted.calls, 5 + 3)

    def test_a_json_log_beside_the_text_log_gets_every_line_unchanged(self) -> None:
        outputs = []
        for direct in (False, True):
            json_file = CountingFile()
            relay = Relay(self, direct=direct, more=(logs_json.JSONLinesObserver(json_file),))
            traffic(relay)
            outputs.append((relay.text(), json_file.text()))
        self.assertEqual(outputs[1], outputs[0])
        records = [json.loads(line) for line in outputs[1][1].splitlines()]
        self.assertEqual([r["fields"].get("bytes") for r in records if r["namespace"] == "relayd.access"],
                         list(range(12)))

    def test_a_filtered_text_log_is_not_written_to_directly(self) -> None:
        def filtered(level: LogLevel) -> Callable[[Any], Any]:
            def make(file: Any) -> Any:
                # twistd's observer with relayd's formatter and turn writer, behind a level filter.
                text = textFileLogObserver(file)
                alone = LogPublisher(text)
                access.quicken_access_lines(alone)
                stopped = MemoryReactorClock()  # (not running: lines go straight through)
                output.write_once_per_turn(stopped, Timekeeper(stopped), alone)
                return FilteringLogObserver(text, [LogLevelFilterPredicate(level)])

            return make

        for level, lines in ((LogLevel.warn, 1), (LogLevel.info, 14)):  # (the warning alone, or every line)
            published = Relay(self, direct=False, make=filtered(level))
            direct = Relay(self, direct=True, make=filtered(level))
            for relay in (published, direct):
                traffic(relay)
            self.assertEqual(direct.text(), published.text())
            self.assertEqual(len(direct.text().splitlines()), lines)

    def test_a_second_text_log_is_written_by_its_observer(self) -> None:
        second = CountingFile()
        published = Relay(self, direct=False, more=(textFileLogObserver(second),))
        traffic(published)
        published.text()  # (its last turn written)
        expected = second.text()
        second.writes.clear()
        formatted = Formatted(self)
        direct = Relay(self, direct=True, more=(textFileLogObserver(second),))
        traffic(direct)
        self.assertEqual(direct.text(), published.text())
        self.assertEqual(second.text(), expected)
        self.assertEqual(formatted.calls, 2 * 14)

    def test_other_events_are_still_scrubbed_and_a_late_scrubber_keeps_the_shortcut(self) -> None:
        direct = Relay(self, direct=True)
        formatted = Formatted(self)
        direct.request(0)
        direct.other(LogLevel.info, "auth {h}", h="Authorization: Bearer leaked-secret-value")
        self.assertIn("Bearer [scrubbed]", direct.text())
        self.assertNotIn("leaked-secret-value", direct.text())
        # The scrubber put first again (as install_scrubber does before twistd's observer is added).
        direct.publisher.removeObserver(scrub.scrub_in_place)
        scrub.observe_first(direct.publisher, scrub.scrub_in_place)
        direct.request(1)
        direct.other(LogLevel.info, "auth {h}", h="Authorization: Bearer leaked-secret-value")
        self.assertNotIn("leaked-secret-value", direct.text())
        self.assertEqual(formatted.calls, 3)  # the first access line and the two others
        self.assertEqual(len(direct.text().splitlines()), 4)


class Beginning(TestCase):
    def test_the_shortcut_starts_once_twistd_s_log_begins_and_ends_when_it_is_removed(self) -> None:
        # twistd: the beginner's buffer observes until beginLoggingTo replaces it with twistd's observer,
        # which then gets relayd's formatter and turn writer (the shortcut needs both, in either order).
        for formatter_first in (True, False):
            publisher = LogPublisher()
            stdio = types.SimpleNamespace(stdout=io.StringIO(), stderr=io.StringIO())
            beginner = LogBeginner(publisher, io.StringIO(), stdio, types.SimpleNamespace(showwarning=None))
            logger = access_log.AccessLog(publisher)
            logger.write_directly()
            self.addCleanup(logger.publish_only)
            self.assertIsNone(logger._direct)
            text = textFileLogObserver(CountingFile())
            reactor = MemoryReactorClock()
            reactor.running = True
            beginner.beginLoggingTo([text], redirectStandardIO=False)
            self.assertIsNone(logger._direct)  # (neither relayd's formatter nor a turn writer yet)
            steps = [partial(access.quicken_access_lines, publisher),
                     partial(output.write_once_per_turn, reactor, Timekeeper(reactor), publisher)]
            for step in steps if formatter_first else steps[::-1]:
                self.assertIsNone(logger._direct)
                step()
            self.assertIsNotNone(logger._direct)
            publisher.removeObserver(text)  # twistd's AppLogger.stop
            self.assertIsNone(logger._direct)

    def test_without_a_watchable_publisher_every_line_is_published(self) -> None:
        self.patch(access_log, "watch_observers", lambda publisher, changed: False)
        formatted = Formatted(self)
        direct = Relay(self, direct=True)
        traffic(direct)
        self.assertEqual(formatted.calls, 14)
        self.assertEqual(len(direct.text().splitlines()), 14)
