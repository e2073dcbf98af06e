"""Log lines written once per reactor turn: one write and one flush for all a turn logged.

Twisted's text observer, and relayd's JSON one, write and flush every line: one write(2) per HTTP
request, for its access line. Once the reactor runs, L{write_once_per_turn} puts a L{TurnWriter}
between each of them and its stream: a turn's lines are written together when the turn's work is
done (just before the reactor waits for I/O again, L{relayd.compat.logger.before_each_poll}; on a
reactor without that hook, a L{relayd.base.clock.NextTurn} call), at once past L{BOUND} bytes (memory stays bounded under a
flood), and what is left at reactor shutdown after every service stopped. Every line, access line
or not, goes through the same writer, so the order is kept. Before the reactor runs and after it
stopped, lines go straight through. A crash (SIGKILL) loses at most the current turn's lines.
"""

from __future__ import annotations

import threading
from typing import Any

from twisted.internet.interfaces import IReactorCore
from twisted.logger import LogPublisher, globalLogPublisher

from relayd.base.clock import NextTurn, Timekeeper
from relayd.compat.logger import before_each_poll, is_text_observer, observers, observers_changed, wrap_text_output
from relayd.logs.json import JSONLinesObserver
from relayd.logs.scrub import ScrubbingObserver

BOUND = 64 * 1024
"""Buffered characters (or bytes) past which the lines are written at once, before the turn ends."""


class TurnWriter:
    """A log observer's stream, written to once per reactor turn.

    C{write} from the reactor's thread while the reactor runs keeps the line for the turn's end;
    C{flush} (which the observers call after every line) does nothing: the turn flushes. A line
    from another thread (a worker pool's), or while the reactor does not run, is written through
    at once, after what is buffered, under the lock the buffer is kept under: no line is lost,
    none is cut into another, and the order is the order they were logged in. A line logged while
    the buffer is being written (by a signal handler) waits for the next write.
    """

    def __init__(self, out: Any, clock: Timekeeper, reactor: IReactorCore, bound: int = BOUND) -> None:
        self.out = out
        self._reactor = reactor
        self._bound = bound
        self._parts: list[Any] = []
        self._size = 0
        # Re-entrant: a signal handler runs on the reactor's thread, between any two bytecodes, and
        # logs (twistd's "Received SIGTERM"): with a plain lock, one arriving during a write that
        # holds it (the signal that interrupted the write system call, say) would wait for it forever.
        self._lock = threading.RLock()
        self._thread = threading.get_ident()  # made on the reactor's thread (the service's start)
        # At the end of each turn: before the reactor's wait for I/O if it has that hook, else a
        # call at the end of each turn that logged (NextTurn).
        self._turn: NextTurn | None = None
        if not before_each_poll(reactor, self._turn_ended):
            self._turn = NextTurn(clock, self._turn_ended)
        # Lines logged as the reactor stops (the services' last ones, after its last wait for I/O or
        # after the clock cancelled the fallback's pending call) are written once it has stopped.
        reactor.addSystemEventTrigger("after", "shutdown", self.drain)

    def write(self, text: Any) -> None:
        if self._thread == threading.get_ident() and self._reactor.running:
            with self._lock:
                self._parts.append(text)
                self._size += len(text)
                if self._size <= self._bound:
                    turn = self._turn
                    if turn is not None and turn.scheduled is None:
                        turn.request()
                    return
        else:
            with self._lock:
                self._parts.append(text)
        self.drain()

    def flush(self) -> None:
        """Nothing: the lines are flushed when they are written (L{drain})."""

    def drain(self) -> None:
        """Write and flush every buffered line now, in one write."""
        with self._lock:
            parts = self._parts
            if not parts:
                return
            self._parts, self._size = [], 0  # (a line logged during the write goes to the next one)
            self.out.write(parts[0][:0].join(parts))
            self.out.flush()

    def _turn_ended(self) -> None:
        if not self._parts:
            return
        try:
            self.drain()
        except Exception:
            # A stream that refuses the write (a full disk) loses these lines, as Twisted's observer
            # loses a line it cannot write. Logging why would put a line in this same buffer and fail
            # again at the end of every turn.
            pass


def write_once_per_turn(reactor: IReactorCore, clock: Timekeeper, publisher: LogPublisher | None = None) -> None:
    """Give each of C{publisher}'s (the global one's) log observers that writes a stream a
    L{TurnWriter}: twistd's text-file observer, and L{relayd.logs.json}'s JSON and text observers.
    Called on the reactor's thread, before the reactor runs; calling it again changes nothing."""
    publisher = globalLogPublisher if publisher is None else publisher

    def turn_writer(out: Any) -> Any:
        return out if isinstance(out, TurnWriter) else TurnWriter(out, clock, reactor)

    for observer in observers(publisher):
        inner = observer.observer if isinstance(observer, ScrubbingObserver) else observer
        if isinstance(inner, JSONLinesObserver):
            inner.out = turn_writer(inner.out)
        elif is_text_observer(inner):
            wrap_text_output(inner, turn_writer)
    observers_changed(publisher)  # (an observer's stream is now a turn writer: relayd.logs.access_log)
