"""Run a coroutine that awaits Deferreds, synchronously as far as it can go.

C{Deferred.fromCoroutine} costs a generator-based trampoline, several Deferreds and a context per
call even when every awaited Deferred has already fired, which is always the case with the
in-memory store. L{run} steps the coroutine itself: a coroutine that never has to wait finishes
inside the call (one already-fired Deferred carries its result), and one that does wait (a Redis
round trip) is resumed from the awaited Deferred's callback, with cancellation passed on to it.
L{run_now} hands back the result itself of a coroutine that never had to wait: no Deferred at all.
"""

from __future__ import annotations

from typing import Any, Callable, Coroutine, TypeVar

from twisted.internet.defer import Deferred, fail, succeed
from twisted.python.failure import Failure

_T = TypeVar("_T")


def run(coro: Coroutine[Any, Any, _T]) -> Deferred[_T]:
    """Start C{coro} now; a Deferred for its result (already fired when it never waited)."""
    return _start(coro, succeed)


def run_now(coro: Coroutine[Any, Any, _T]) -> _T | Deferred[_T]:
    """Start C{coro} now: its result itself when it never waited, else (or when it raised) a
    Deferred for its result, as L{run}'s. For a caller that answers at once what it can (the
    memory store's round trips) and so tells the two apart: C{coro} never returns a Deferred."""
    return _start(coro, _itself)


def _itself(value: _T) -> _T:
    return value


def _start(coro: Coroutine[Any, Any, _T], settled: Callable[[_T], Any]) -> Any:
    try:
        awaited = coro.send(None)
    except StopIteration as done:
        return settled(done.value)
    except BaseException:
        return fail(Failure())
    return _Resumer(coro).wait(awaited)


class _Resumer:
    """Drives a coroutine that had to wait: resumes it each time the Deferred it awaits fires."""

    __slots__ = ("coro", "result", "awaited")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.result: Deferred[Any] = Deferred(self._cancel)
        self.awaited: Deferred[Any] | None = None

    def wait(self, awaited: Any) -> Deferred[Any]:
        self._await(awaited)
        return self.result

    def _await(self, awaited: Any) -> None:
        if not isinstance(awaited, Deferred):
            self._step_throw(TypeError(f"a coroutine run by relayd.base.coroutine awaited {awaited!r}"))
            return
        self.awaited = awaited
        awaited.addBoth(self._resume)

    def _resume(self, outcome: Any) -> None:
        # The coroutine reads the awaited Deferred's result itself (Deferred.__await__), so it must
        # run before this callback returns; returning None then consumes a failure it has seen.
        self.awaited = None
        if isinstance(outcome, Failure):
            # Inside its own callbacks a failed Deferred cannot raise from __await__ yet; throw the
            # error into the coroutine where it awaits.
            error = outcome.value
            assert error is not None  # a Failure always holds its exception
            self._step_throw(error.with_traceback(outcome.getTracebackObject()))
            return None
        try:
            awaited = self.coro.send(None)
        except StopIteration as done:
            self._fire(done.value)
            return None
        except BaseException:
            self._fire(Failure())
            return None
        self._await(awaited)
        return None

    def _step_throw(self, error: BaseException) -> None:
        try:
            awaited = self.coro.throw(error)
        except StopIteration as done:
            self._fire(done.value)
            return
        except BaseException:
            self._fire(Failure())
            return
        self._await(awaited)

    def _fire(self, outcome: Any) -> None:
        # A cancelled result has already fired (CancelledError) while the coroutine cleaned up.
        if not self.result.called:
            self.result.callback(outcome) if not isinstance(outcome, Failure) else self.result.errback(outcome)

    def _cancel(self, _: Deferred[Any]) -> None:
        # Cancelling the awaited Deferred throws CancelledError into the coroutine, which may clean
        # up (and may even await again); its outcome then fires the result.
        awaited = self.awaited
        if awaited is not None:
            awaited.cancel()
