"""The fence's twisted.logger half (relayd/compat/logger.py): each reliance detected on the installed
Twisted, and each fallback's behaviour (the scrubber then runs after observers added before it, the
access lines keep Twisted's formatting and are written one by one, twistd's exit status stays the
signal's)."""

from __future__ import annotations

import io
from typing import Any

from twisted.internet import reactor
from twisted.internet.selectreactor import SelectReactor
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import LogLevel, LogPublisher, globalLogPublisher, textFileLogObserver
from twisted.trial.unittest import TestCase

from relayd.compat import logger as fence
from tests.support.cases import cases, expand

# -- the reactor ------------------------------------------------------------------------------------------


@expand
class ExitSignal(TestCase):
    def test_exit_signal_is_detected_on_the_running_reactor(self) -> None:
        self.assertTrue(fence.EXIT_SIGNAL)
        self.assertTrue(hasattr(reactor, "_exitSignal"))

    @cases(detected=True, fallback=False)
    def test_forget(self, detected: bool) -> None:
        self.patch(fence, "EXIT_SIGNAL", detected)
        self.patch(reactor, "_exitSignal", 15)
        fence.forget_exit_signal(reactor)
        # Without the attribute twistd's exit status stays the signal's (documented, no error).
        self.assertEqual(reactor._exitSignal, None if detected else 15)


# -- twisted.logger ----------------------------------------------------------------------------------------


@expand
class Logging(TestCase):
    def test_logger_state_is_detected(self) -> None:
        self.assertTrue(fence.PUBLISHER_LIST)
        self.assertTrue(fence.TEXT_FORMATTER)
        self.assertTrue(fence.TEXT_OUTPUT)
        self.assertTrue(fence.OBSERVERS_WATCHABLE)
        self.assertTrue(fence.TEXT_ENCODING)
        self.assertIsInstance(globalLogPublisher._observers, list)

    @cases(detected=True, fallback=False)
    def test_observe_first(self, detected: bool) -> None:
        self.patch(fence, "PUBLISHER_LIST", detected)
        seen: list[str] = []
        publisher = LogPublisher(lambda e: seen.append("theirs"))
        fence.observe_first(publisher, lambda e: seen.append("ours"))
        publisher({"log_format": "x"})
        # The fallback can only append: the scrubber then runs after observers added before it.
        self.assertEqual(seen, ["ours", "theirs"] if detected else ["theirs", "ours"])

    @cases(detected=True, fallback=False)
    def test_wrapped_text_formatters_write_the_same_bytes(self, detected: bool) -> None:
        self.patch(fence, "TEXT_FORMATTER", detected)
        out = io.StringIO()
        observer = textFileLogObserver(out)
        publisher = LogPublisher(observer)
        wrapped: list[Any] = []

        def wrap(format_event: Any) -> Any:
            wrapped.append(format_event)
            return lambda event: format_event(event)

        fence.wrap_text_formatters(publisher, wrap)
        event = {"log_format": "hello {who}", "who": "you", "log_time": 1.0, "log_namespace": "n",
                 "log_level": LogLevel.info}
        publisher(dict(event))
        self.assertEqual(len(wrapped), 1 if detected else 0)
        plain = io.StringIO()
        textFileLogObserver(plain)(dict(event))
        self.assertEqual(out.getvalue(), plain.getvalue())

    def test_wrapping_the_formatters_again_changes_nothing(self) -> None:
        observer = textFileLogObserver(io.StringIO())
        publisher = LogPublisher(observer)
        wrapped: list[Any] = []

        class Wrapper:
            def __init__(self, format_event: Any) -> None:
                wrapped.append(format_event)
                self.format_event = format_event

            def __call__(self, event: Any) -> Any:
                return self.format_event(event)

        fence.wrap_text_formatters(publisher, Wrapper)
        fence.wrap_text_formatters(publisher, Wrapper)
        self.assertEqual(len(wrapped), 1)
        # ...and the observer is still known for twistd's, its formatter wrapped (the turn writer's wrap).
        self.assertTrue(fence.is_text_observer(observer))
        self.assertFalse(fence.is_text_observer(lambda event: None))

    @cases(detected=True, fallback=False)
    def test_wrapped_text_output(self, detected: bool) -> None:
        self.patch(fence, "TEXT_OUTPUT", detected)
        out = io.StringIO()
        observer = textFileLogObserver(out)
        writes: list[str] = []

        class Recorder:
            def write(self, text: str) -> None:
                writes.append(text)
                out.write(text)

            def flush(self) -> None:
                pass

        fence.wrap_text_output(observer, lambda stream: Recorder())
        event = {"log_format": "hello", "log_time": 1.0, "log_namespace": "n", "log_level": LogLevel.info}
        observer(dict(event))
        # Without the attribute the observer writes to its stream itself, as Twisted does (same bytes).
        self.assertEqual(len(writes), 1 if detected else 0)
        plain = io.StringIO()
        textFileLogObserver(plain)(dict(event))
        self.assertEqual(out.getvalue(), plain.getvalue())


@expand
class WatchedObservers(TestCase):
    @cases(detected=True, fallback=False)
    def test_every_change_of_the_observers_is_told(self, detected: bool) -> None:
        self.patch(fence, "OBSERVERS_WATCHABLE", detected)
        first, second, third = (lambda e: None), (lambda e: None), (lambda e: None)
        publisher = LogPublisher(first)
        told: list[list[Any]] = []
        # Without the list's attribute nothing is watched: the watcher is never told, and says so.
        self.assertEqual(fence.watch_observers(publisher, lambda: told.append(fence.observers(publisher))), detected)
        publisher.addObserver(second)
        publisher.addObserver(second)  # (already there: no change, nothing told)
        fence.observe_first(publisher, third)
        publisher.removeObserver(first)
        observers = publisher._observers
        observers[0] = first
        observers += [third]
        del observers[-1]
        observers.extend([third])
        observers.pop()
        observers.clear()
        fence.observers_changed(publisher)
        expected: list[list[Any]] = [[first, second], [third, first, second], [third, second], [first, second],
                                     [first, second, third], [first, second], [first, second, third],
                                     [first, second], [], []]
        self.assertEqual(told, expected if detected else [])
        publisher({"log_format": "x"})  # (publishing reads the list as before)

    def test_a_publisher_of_another_kind_is_not_watched(self) -> None:
        class Counting(LogPublisher):
            pass

        self.assertFalse(fence.watch_observers(Counting(), lambda: None))

    def test_a_watcher_is_told_no_more_once_it_stops(self) -> None:
        publisher = LogPublisher()
        told: list[int] = []

        def watcher() -> None:
            told.append(1)

        self.assertTrue(fence.watch_observers(publisher, watcher))
        publisher.addObserver(lambda e: None)
        fence.unwatch_observers(publisher, watcher)
        publisher.addObserver(lambda e: None)
        self.assertEqual(told, [1])

    @cases(detected=True, fallback=False)
    def test_the_parts_of_a_text_observer(self, detected: bool) -> None:
        self.patch(fence, "TEXT_ENCODING", detected)
        text, data = io.StringIO(), io.BytesIO()
        observer = textFileLogObserver(text)
        # Without the attribute no observer is known for Twisted's: access lines are then always published.
        parts = fence.text_observer_parts(observer)
        self.assertEqual(parts, (observer.formatEvent, text, None) if detected else None)
        parts = fence.text_observer_parts(textFileLogObserver(data))
        self.assertEqual(parts and parts[1:], (data, "utf-8") if detected else None)
        self.assertIsNone(fence.text_observer_parts(lambda event: None))


@expand
class BeforeEachPoll(TestCase):
    def test_the_loop_is_detected(self) -> None:
        self.assertTrue(fence.POLL_HOOK)

    @cases(detected=True, fallback=False)
    def test_fn_runs_before_each_wait_for_io(self, detected: bool) -> None:
        self.patch(fence, "POLL_HOOK", detected)
        polling = SelectReactor()
        self.addCleanup(polling.waker.connectionLost, None)
        seen: list[str] = []
        poll = polling.doIteration
        polling.doIteration = lambda timeout: (seen.append(f"poll {timeout}"), poll(timeout))  # type: ignore[method-assign]
        # Without the hook nothing is wrapped: the log writer then schedules a call per turn itself.
        self.assertEqual(fence.before_each_poll(polling, lambda: seen.append("fn")), detected)
        polling.doIteration(0)
        self.assertEqual(seen, ["fn", "poll 0"] if detected else ["poll 0"])

    def test_a_reactor_of_another_kind_is_left_alone(self) -> None:
        memory = MemoryReactorClock()
        self.assertFalse(fence.before_each_poll(memory, lambda: None))
        self.assertFalse(hasattr(memory, "doIteration"))
