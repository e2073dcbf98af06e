"""The fence's twisted.logger half (and twistd's exit status): the reaches relayd's logs make.

relayd.logs puts its secret scrubber ahead of every other observer of the global publisher, gives
twistd's text-file observer a faster access-line formatter and a stream written once per reactor turn; the tap makes twistd exit 0 after a clean
drain. Each reliance is detected once, at import, on the installed Twisted; without it the function
takes the public path (the behaviour each docstring names). tests/compat/test_logger.py checks each
detection and each fallback. This module loads neither twisted.web nor autobahn: formatting a log line
needs neither.
"""

from __future__ import annotations

import io
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
