"""The fence's twisted.logger half (and twistd's exit status): the reaches relayd's logs make.

relayd.logs puts its secret scrubber ahead of every other observer of the global publisher, gives
twistd's text-file observer a faster access-line formatter and a stream written once per reactor turn,
and watches the publisher's observers (access lines go straight to that stream while it is their only
destination); the tap makes twistd exit 0 after a clean drain. Each reliance is detected once, at import, on the installed Twisted; without it the function
takes the public path (the behaviour each docstring names). tests/compat/test_logger.py checks each
detection and each fallback. This module loads neither twisted.web nor autobahn: formatting a log line
needs neither.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import Any, TypeGuard, cast

from twisted.application import app
from twisted.internet import base
from twisted.internet.interfaces import IReactorCore
from twisted.logger import FileLogObserver, LogPublisher

from relayd.compat.detect import code_uses

# -- the reactor --------------------------------------------------------------------------------------

EXIT_SIGNAL = hasattr(base.ReactorBase, "_exitSignal") and code_uses(app.ApplicationRunner.startReactor, "_exitSignal")
"""twistd re-raises the signal that stopped the reactor (C{_exitSignal}) once it has run."""


POLL_HOOK = code_uses(base.ReactorBase.mainLoop, "runUntilCurrent", "doIteration")
"""The reactor's loop runs its due calls (C{runUntilCurrent}), then waits for and handles I/O
(C{doIteration}), through attributes of the reactor."""


def before_each_poll(reactor: Any, fn: Callable[[], object]) -> bool:
    """Run C{fn} each time C{reactor} is about to wait for I/O, once the turn's work is done (its
    I/O callbacks and its due calls); C{False}, and nothing done, if this reactor has no such hook.

    The log writer's flush costs nothing on a turn with nothing to write this way, where a
    C{callLater(0)} per turn (the fallback) costs ~2 us, as much as the write(2) it saves when the
    turn has one line (docs/performance.md).
    """
    poll = getattr(reactor, "doIteration", None)
    if not (POLL_HOOK and isinstance(reactor, base.ReactorBase) and callable(poll)):
        return False

    def flush_then_poll(timeout: float | None) -> None:
        fn()
        poll(timeout)

    cast(Any, reactor).doIteration = flush_then_poll  # (an instance attribute: mainLoop calls self.doIteration)
    return True


def forget_exit_signal(reactor: IReactorCore) -> None:
    """Make twistd exit 0 after a signal-initiated shutdown that drained cleanly.

    Without it twistd re-raises the SIGTERM that stopped it, and a supervisor cannot tell a clean
    drain from an abort. Without the attribute this does nothing: the exit status is the signal's.
    """
    if EXIT_SIGNAL and getattr(reactor, "_exitSignal", None) is not None:
        cast(Any, reactor)._exitSignal = None  # a private attribute of Twisted's reactors, not of the interface


# -- twisted.logger -----------------------------------------------------------------------------------

PUBLISHER_LIST = code_uses(LogPublisher.addObserver, "_observers") and isinstance(
    getattr(LogPublisher(), "_observers", None), list
)
"""A C{LogPublisher} calls its observers in the order of its C{_observers} list."""
TEXT_FORMATTER = code_uses(FileLogObserver.__call__, "formatEvent")
"""A C{FileLogObserver} formats each event through its C{formatEvent} attribute."""
TEXT_OUTPUT = code_uses(FileLogObserver.__call__, "_outFile") and "_outFile" in vars(FileLogObserver(io.StringIO(), str))
"""A C{FileLogObserver} writes (and flushes) each line to the stream in its C{_outFile} attribute."""
_TEXT_OBSERVER_FORMATTER = "textFileLogObserver.<locals>.formatEvent"


def observe_first(publisher: LogPublisher, observer: Any) -> None:
    """Add C{observer} to C{publisher} ahead of every observer it already has.

    Public API can only append: an observer added before this one would see events first (the
    secret scrubber must run before twistd's or twist's observer, whenever that was added).
    """
    if PUBLISHER_LIST and isinstance(getattr(publisher, "_observers", None), list):
        publisher._observers.insert(0, observer)
    else:
        publisher.addObserver(observer)


def observers(publisher: LogPublisher) -> list[Any]:
    """C{publisher}'s observers (none known if it does not say)."""
    return list(getattr(publisher, "_observers", [])) if PUBLISHER_LIST else []


def wrap_text_formatters(publisher: LogPublisher, wrap: Callable[[Callable[[Any], Any]], Any]) -> None:
    """Replace the formatter of each twistd text-file observer of C{publisher} by C{wrap(formatter)},
    which keeps C{formatter} as its C{format_event} (L{is_text_observer} still knows the observer).

    The access-line formatter reuses each second's time prefix: ~1.2 us down to ~0.1 us per line
    (docs/performance.md). Without the attribute lines keep Twisted's formatting (same bytes).
    """
    if not TEXT_FORMATTER:
        return
    for observer in observers(publisher):
        if is_text_observer(observer) and _is_twisted_formatter(observer.formatEvent):  # (not wrapped yet)
            observer.formatEvent = wrap(observer.formatEvent)


def is_text_observer(observer: Any) -> TypeGuard[FileLogObserver]:
    """Whether C{observer} is a text-file observer as C{textFileLogObserver} makes them (twistd's),
    its formatter Twisted's or one L{wrap_text_formatters} put in its place (which keeps Twisted's as
    its C{format_event})."""
    if not isinstance(observer, FileLogObserver):
        return False
    format_event = getattr(observer, "formatEvent", None)
    return _is_twisted_formatter(getattr(format_event, "format_event", format_event))


def _is_twisted_formatter(format_event: Any) -> bool:
    return getattr(format_event, "__qualname__", "") == _TEXT_OBSERVER_FORMATTER


def wrap_text_output(observer: FileLogObserver, wrap: Callable[[Any], Any]) -> None:
    """Make C{observer} write to C{wrap(stream)} instead of the stream it writes to.

    relayd's turn writer (relayd/logs/output.py) writes a reactor turn's lines at once. Without the
    attribute lines are written and flushed one by one, as Twisted does (same bytes, one write each).
    """
    if TEXT_OUTPUT and hasattr(observer, "_outFile"):
        observer._outFile = wrap(observer._outFile)


# -- watching a publisher's observers -----------------------------------------------------------------

OBSERVERS_WATCHABLE = (
    PUBLISHER_LIST
    and code_uses(LogPublisher.removeObserver, "_observers")
    and code_uses(LogPublisher.__call__, "_observers")
    and not code_uses(LogPublisher.__call__, "removeObserver")
)
"""A C{LogPublisher} keeps its observers in its C{_observers} list and nowhere else (C{addObserver},
C{removeObserver} and publishing read it), and keeps an observer that raised (it logs the failure to
the others)."""
TEXT_ENCODING = code_uses(FileLogObserver.__call__, "_encoding") and "_encoding" in vars(
    FileLogObserver(io.StringIO(), str)
)
"""A C{FileLogObserver} encodes each line with its C{_encoding} attribute (C{None}: writes text)."""


class _WatchedObservers(list[Any]):
    """A publisher's observer list that calls its watchers after each change (under one lock, so the
    last watcher's call sees the last change)."""

    def __init__(self, observers: list[Any]) -> None:
        super().__init__(observers)
        self.watchers: list[Callable[[], object]] = []
        self.lock = threading.RLock()

    def changed(self) -> None:
        with self.lock:
            for watcher in list(self.watchers):
                watcher()


def _reporting(name: str) -> Callable[..., Any]:
    change = getattr(list, name)

    def reporting(self: _WatchedObservers, *args: Any) -> Any:
        with self.lock:
            result = change(self, *args)
            self.changed()
        return result

    reporting.__name__ = name
    return reporting


for _name in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__", "__imul__"):
    setattr(_WatchedObservers, _name, _reporting(_name))


def watch_observers(publisher: LogPublisher, changed: Callable[[], object]) -> bool:
    """Call C{changed} after every change of C{publisher}'s observers from now on (added, removed,
    however: C{addObserver}, C{globalLogBeginner.beginLoggingTo}, L{observe_first}) and after
    L{observers_changed}; C{True} once watched.

    The publisher's list is replaced by an equal one that says when it changes. C{False}, and nothing
    done, for a publisher of another kind or where Twisted keeps observers otherwise: then C{changed}
    is never called, and a watcher must assume any observer may be there.
    """
    if not (OBSERVERS_WATCHABLE and type(publisher) is LogPublisher):
        return False
    current = getattr(publisher, "_observers", None)
    if not isinstance(current, list):
        return False
    if type(current) is not _WatchedObservers:
        current = _WatchedObservers(current)
        publisher._observers = current
    with current.lock:
        current.watchers.append(changed)
    return True


def unwatch_observers(publisher: LogPublisher, changed: Callable[[], object]) -> None:
    """Stop calling C{changed} (L{watch_observers})."""
    current = getattr(publisher, "_observers", None)
    if type(current) is _WatchedObservers:
        with current.lock:
            if changed in current.watchers:
                current.watchers.remove(changed)


def observers_changed(publisher: LogPublisher) -> None:
    """Call C{publisher}'s watchers: one of its observers changed in place (its formatter, its stream)."""
    current = getattr(publisher, "_observers", None)
    if type(current) is _WatchedObservers:
        current.changed()


def text_observer_parts(observer: Any) -> tuple[Any, Any, str | None] | None:
    """The formatter, the stream and the encoding (C{None}: text) of C{observer} if it is a
    C{FileLogObserver} as Twisted makes it (writing C{formatter(event)} to the stream, encoded, then
    flushing it), else C{None} (also where those attributes are not known)."""
    if not (TEXT_FORMATTER and TEXT_OUTPUT and TEXT_ENCODING) or type(observer) is not FileLogObserver:
        return None
    parts = vars(observer)
    try:
        return parts["formatEvent"], parts["_outFile"], parts["_encoding"]
    except KeyError:
        return None
