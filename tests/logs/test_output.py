"""Log lines written once per reactor turn (relayd/logs/output.py): one write for a turn's lines, at once
past the bound, what is left at shutdown, straight through before the reactor runs, from another thread
whole and in order; for twistd's text observer and relayd's JSON and text observers."""

from __future__ import annotations

import io
import json
import signal
import threading
from typing import Any, Callable

from twisted.internet.selectreactor import SelectReactor
from twisted.internet.testing import MemoryReactorClock
from twisted.logger import Logger, LogLevel, LogPublisher, textFileLogObserver
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.logs import access, output
from relayd.logs import json as logs_json


class CountingFile:
    """A text stream double: every write is kept as one call, and flushes are counted."""

    def __init__(self) -> None:
        self.writes: list[str] = []
        self.flushes = 0

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        self.flushes += 1

    def text(self) -> str:
        return "".join(self.writes)


class RefusingFile(CountingFile):
    def write(self, text: str) -> None:
        raise OSError(28, "No space left on device")


def access_event(n: int, when: float = 1000.25) -> dict[str, Any]:
    line = f'aep 127.0.0.1 "POST /events" 202 0 request-{n}'
    return {"log_namespace": access.ACCESS_NAMESPACE, "log_level": LogLevel.info, "log_time": when,
            "log_format": "{access_line}", "access_line": line}


def other_event(text: str, when: float = 1000.5) -> dict[str, Any]:
    return {"log_namespace": "relayd.aep", "log_level": LogLevel.warn, "log_time": when,
            "log_format": "{text}", "text": text}


def as_text(events: list[dict[str, Any]], make: Callable[[Any], Any] = textFileLogObserver) -> str:
    """What the observer C{make} makes writes for C{events}, line by line, without a turn writer."""
    plain = io.StringIO()
    observer = make(plain)
    for event in events:
        observer(dict(event))
    return plain.getvalue()


class Setting:
    """A publisher with one observer writing to a counting file, turned per-turn on a memory reactor."""

    def __init__(
        self, make: Callable[[Any], Any] = textFileLogObserver, running: bool = True, file: CountingFile | None = None
    ) -> None:
        self.file = CountingFile() if file is None else file
        self.make = make
        self.publisher = LogPublisher(make(self.file))
        self.reactor = MemoryReactorClock()
        self.reactor.running = running
        access.quicken_access_lines(self.publisher)
        output.write_once_per_turn(self.reactor, Timekeeper(self.reactor), self.publisher)

    def log(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            self.publisher(dict(event))

    def shut_down(self) -> None:
        """As the reactor stops: the 'during' phase stops it running, then the 'after' triggers run."""
        self.reactor.stop()
        for f, args, kw in self.reactor.triggers.get("after", {}).get("shutdown", []):
            f(*args, **kw)


class OncePerTurn(TestCase):
    def test_a_turns_lines_reach_the_file_in_one_write_after_the_turn_in_order(self) -> None:
        setting = Setting()
        events = [access_event(n) for n in range(50)] + [other_event("a warning")] + [access_event(50)]
        setting.log(events)
        self.assertEqual(setting.file.writes, [])  # not before the turn's work is done
        setting.reactor.advance(0)
        self.assertEqual(len(setting.file.writes), 1)
        self.assertEqual(setting.file.flushes, 1)
        self.assertEqual(setting.file.text(), as_text(events))
        # The next turn's lines: one more write.
        setting.log([access_event(51)])
        setting.reactor.advance(0)
        self.assertEqual(len(setting.file.writes), 2)
        self.assertEqual(setting.file.text(), as_text([*events, access_event(51)]))

    def test_on_a_reactor_with_the_hook_the_lines_go_before_its_next_wait_for_io(self) -> None:
        # (The other tests run on a memory reactor, which has no such hook: a call per turn instead.)
        polling = SelectReactor()
        self.addCleanup(polling.waker.connectionLost, None)
        file = CountingFile()
        publisher = LogPublisher(textFileLogObserver(file))
        output.write_once_per_turn(polling, Timekeeper(polling), publisher)
        polling.running = True
        self.addCleanup(setattr, polling, "running", False)
        events = [access_event(n) for n in range(10)]
        for event in events:
            publisher(dict(event))
        self.assertEqual(file.writes, [])
        self.assertEqual(polling.getDelayedCalls(), [])  # no call scheduled per turn
        polling.doIteration(0)
        self.assertEqual(file.writes, [as_text(events)])
        polling.doIteration(0)  # a turn with nothing logged writes nothing
        self.assertEqual(len(file.writes), 1)

    def test_the_json_observer_writes_a_turns_lines_at_once(self) -> None:
        setting = Setting(logs_json.JSONLinesObserver)
        events = [access_event(n) for n in range(20)]
        setting.log(events)
        self.assertEqual(setting.file.writes, [])
        setting.reactor.advance(0)
        self.assertEqual(len(setting.file.writes), 1)
        lines = setting.file.text().splitlines()
        self.assertEqual([json.loads(line)["event"] for line in lines], [e["access_line"] for e in events])

    def test_the_scrubbed_text_observer_writes_a_turns_lines_at_once(self) -> None:
        def make(out: Any) -> Any:
            self.patch(logs_json.sys, "stdout", out)
            return logs_json.text_observer()

        setting = Setting(make)
        events = [access_event(n) for n in range(20)]
        setting.log(events)
        self.assertEqual(setting.file.writes, [])
        setting.reactor.advance(0)
        self.assertEqual(len(setting.file.writes), 1)
        self.assertEqual(setting.file.text(), as_text(events))

    def test_a_flood_past_the_bound_is_written_before_the_turn_ends(self) -> None:
        setting = Setting()
        line = len(as_text([access_event(0)]))
        events = [access_event(n) for n in range(output.BOUND // line + 10)]
        setting.log(events)
        self.assertEqual(len(setting.file.writes), 1)  # the bound was passed once
        self.assertGreater(len(setting.file.writes[0]), output.BOUND)
        self.assertLess(len(setting.file.writes[0]), output.BOUND + 2 * line)
        setting.reactor.advance(0)
        self.assertEqual(len(setting.file.writes), 2)
        self.assertEqual(setting.file.text(), as_text(events))

    def test_before_the_reactor_runs_lines_go_straight_through(self) -> None:
        setting = Setting(running=False)
        setting.log([other_event("starting"), other_event("listening")])
        self.assertEqual(len(setting.file.writes), 2)
        self.assertEqual(setting.file.flushes, 2)
        self.assertEqual(setting.reactor.getDelayedCalls(), [])

    def test_shutdown_writes_what_is_left_and_later_lines_follow_it(self) -> None:
        setting = Setting()
        clock = Timekeeper(setting.reactor)
        output.write_once_per_turn(setting.reactor, clock, setting.publisher)  # (again: changes nothing)
        events = [access_event(n) for n in range(5)]
        setting.log(events)
        # The root service's stop cancels every pending call of the clock (the turn with them).
        for call in setting.reactor.getDelayedCalls():
            call.cancel()
        setting.reactor.stop()  # (the 'during' phase: the reactor no longer runs)
        last = [other_event("Main loop terminated.")]
        setting.log(last)
        self.assertEqual(setting.file.text(), as_text(events + last))
        setting.log([access_event(5)])
        setting.shut_down()
        self.assertEqual(setting.file.text(), as_text(events + last + [access_event(5)]))

    def test_the_after_shutdown_trigger_writes_what_the_turn_did_not(self) -> None:
        setting = Setting()
        events = [access_event(n) for n in range(5)]
        setting.log(events)
        self.assertEqual(setting.file.writes, [])
        setting.shut_down()
        self.assertEqual(len(setting.file.writes), 1)
        self.assertEqual(setting.file.text(), as_text(events))

    def test_an_observer_removed_keeps_its_pending_lines(self) -> None:
        setting = Setting()
        observer = setting.publisher._observers[0]  # type: ignore[attr-defined]
        events = [access_event(n) for n in range(3)]
        setting.log(events)
        setting.publisher.removeObserver(observer)
        setting.reactor.advance(0)
        self.assertEqual(setting.file.text(), as_text(events))

    def test_a_line_from_another_thread_is_written_at_once_after_the_buffered_ones(self) -> None:
        setting = Setting()
        before = [access_event(n) for n in range(3)]
        setting.log(before)
        from_thread = other_event("from a worker thread")
        worker = threading.Thread(target=setting.log, args=([from_thread],))
        worker.start()
        worker.join()
        # Written through at once (the reactor's turn may never come), after what was buffered.
        self.assertEqual(setting.file.text(), as_text([*before, from_thread]))
        setting.reactor.advance(0)
        self.assertEqual(setting.file.text(), as_text([*before, from_thread]))

    def test_lines_from_threads_and_the_reactor_thread_are_neither_lost_nor_cut(self) -> None:
        setting = Setting()
        per_thread = 300

        def worker(name: str) -> None:
            log = Logger(namespace="relayd.worker", observer=setting.publisher)
            for n in range(per_thread):
                log.info("{name} line {n} " + "x" * 40, name=name, n=n)

        threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(3)]
        for thread in threads:
            thread.start()
        reactor_lines = [access_event(n) for n in range(per_thread)]
        for event in reactor_lines:
            setting.publisher(dict(event))
            if event["access_line"].endswith("0"):
                setting.reactor.advance(0)
        for thread in threads:
            thread.join()
        setting.reactor.advance(0)
        text = setting.file.text()
        for chunk in setting.file.writes:
            self.assertTrue(chunk.endswith("\n"))
        lines = text.splitlines()
        self.assertEqual(len(lines), 4 * per_thread)
        for i in range(3):
            mine = [line for line in lines if f" t{i} line " in line]
            self.assertEqual([int(line.split(" line ")[1].split()[0]) for line in mine], list(range(per_thread)))
        ours = [line for line in lines if "[relayd.access#info]" in line]
        self.assertEqual([line.split("request-")[1] for line in ours], [str(n) for n in range(per_thread)])

    def test_a_line_a_signal_handler_logs_during_the_write_goes_in_the_next_one(self) -> None:
        # twistd's SIGTERM handler logs; Python runs it on the reactor's thread between two bytecodes,
        # so also while the buffer is being written (the signal interrupted the write system call).
        interrupted = other_event("Received SIGTERM, shutting down.")

        class InterruptedFile(CountingFile):
            def write(self, text: str) -> None:
                super().write(text)
                if len(self.writes) == 1:
                    signal.raise_signal(signal.SIGUSR2)

        setting = Setting(file=InterruptedFile())

        def give_up(signum: int, frame: Any) -> None:
            raise TimeoutError("the handler's line waited for the writer's lock forever")

        for signum, handler in ((signal.SIGUSR2, lambda signum, frame: setting.publisher(dict(interrupted))),
                                (signal.SIGALRM, give_up)):
            self.addCleanup(signal.signal, signum, signal.signal(signum, handler))
        signal.setitimer(signal.ITIMER_REAL, 5)
        self.addCleanup(signal.setitimer, signal.ITIMER_REAL, 0)
        events = [access_event(n) for n in range(3)]
        setting.log(events)
        setting.reactor.advance(0)  # (a memory clock runs the next turn's call in the same advance)
        self.assertEqual(setting.file.writes, [as_text(events), as_text([interrupted])])

    def test_a_refused_write_at_the_turns_end_loses_that_turn_and_loops_not(self) -> None:
        file = RefusingFile()
        publisher = LogPublisher(textFileLogObserver(file))
        reactor = MemoryReactorClock()
        reactor.running = True
        output.write_once_per_turn(reactor, Timekeeper(reactor), publisher)
        publisher(other_event("lost"))
        reactor.advance(0)  # (no exception reaches the reactor, which would log it into the buffer again)
        self.assertEqual(reactor.getDelayedCalls(), [])
