"""The one owner of time: every delayed call, looping call and reading of the time goes through a
L{Timekeeper} (named so it is never taken for C{twisted.internet.task.Clock}, which tests hand it).

Owning timers in one place means shutdown can cancel whatever is still pending (no timer outlives
its service), and tests drive time deterministically by handing in a C{task.Clock}: the wall clock
(L{Timekeeper.seconds}) and the one for durations (L{Timekeeper.monotonic}) are then that clock too.
tests/test_time_ownership.py fails if a module other than this one reads the time or schedules a
call by itself.

L{NextTurn} is the one way to run something once at the end of the current reactor turn however
often it was asked for during the turn (the flush of every stream written to, say).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, TypeVar

from twisted.application.internet import TimerService
from twisted.internet.defer import CancelledError, Deferred, TimeoutError
from twisted.internet.error import AlreadyCancelled
from twisted.internet.interfaces import IDelayedCall, IReactorCore, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

T = TypeVar("T")


class Timekeeper:
    """Wraps an C{IReactorTime}; records the calls it schedules so L{shutdown} can cancel them.

    @ivar monotonic: seconds on a clock that never goes back, for durations: C{time.monotonic} on
        a real reactor, the wrapped reactor's C{seconds} on a test clock (a C{task.Clock}, which is
        no C{IReactorCore}), so that tests fix durations as they fix the time.
    """

    _log = Logger()

    def __init__(self, reactor: IReactorTime) -> None:
        self.reactor = reactor
        self.monotonic: Callable[[], float] = time.monotonic if IReactorCore.providedBy(reactor) else self.seconds
        self._delayed: set[IDelayedCall] = set()
        self._loops: set[LoopingCall] = set()
        self._stopped = False
        # Bound once (see give_timeouts); a Timekeeper built on no reactor, as some tests make, still constructs.
        self._schedule: Callable[..., IDelayedCall] = getattr(reactor, "callLater", None)  # type: ignore[assignment]
        self._queues: dict[float, _DeadlineQueue] = {}
        self._timeout_queues: dict[float, _DeadlineQueue] = {}  # (L{call_after_timeout}'s: shutdown cancels them)

    def give_timeouts(self, protocol: Any) -> None:
        """Have C{protocol}'s idle timeout (Twisted's C{TimeoutMixin}, which a factory gives the
        reactor's scheduler) scheduled on this clock's reactor through one bound method for every
        connection, instead of one of its own (64 B per held connection)."""
        protocol.callLater = self._schedule

    def give_deadlines(self, protocol: Any) -> None:
        """Have C{protocol}'s own delayed calls (its C{callLater}, which txredisapi times each
        command's reply with) set as L{deadline}s: one reactor call for every pending call of one
        length, where the reactor's C{callLater} sets one per command."""
        protocol.callLater = self.deadline

    def seconds(self) -> float:
        """The wall clock: the current time in seconds since the epoch, from the wrapped reactor
        (for timestamps: receipts, pings, what an operator reads)."""
        return self.reactor.seconds()

    def deadline(self, delay: float, f: Callable[..., Any], *args: Any) -> IDelayedCall:
        """Schedule C{f(*args)} after C{delay} seconds for an owner that always cancels it itself
        (a connection's read deadline: its C{connectionLost} does, and shutdown closes every
        connection). Not recorded for L{shutdown}.

        Deadlines of one length expire in the order they were set, so each length has one queue
        (L{_DeadlineQueue}) and one reactor call for the earliest: setting one is an append and
        cancelling one a flag, where a reactor call of its own was an object and a heap insertion
        per connection."""
        queue = self._queues.get(delay)
        if queue is None:
            queue = self._queues[delay] = _DeadlineQueue(self, delay)
        return queue.add(f, args)

    def call_after_timeout(self, delay: float, f: Callable[..., Any], *args: Any) -> IDelayedCall:
        """Schedule C{f(*args)} after C{delay} seconds, a configured timeout that many calls share (an
        MCP request's): as L{call_later} (L{shutdown} cancels it), set as a L{deadline} is, in the one
        queue of that length (an append and a flag, where L{call_later} made a closure and a reactor
        call, inserted into the reactor's heap and taken out of it, per call)."""
        queue = self._timeout_queues.get(delay)
        if queue is None:
            queue = self._timeout_queues[delay] = _DeadlineQueue(self, delay)
        return queue.add(f, args)

    def call_later(self, delay: float, f: Callable[..., Any], *args: Any, **kw: Any) -> IDelayedCall:
        """Schedule C{f(*args, **kw)} after C{delay} seconds; the call forgets itself once it runs."""

        def run() -> None:
            self._delayed.discard(call)
            f(*args, **kw)

        call = self.reactor.callLater(delay, run)
        self._delayed.add(call)
        return call

    def cancel(self, call: IDelayedCall | None) -> None:
        """Cancel a call made by L{call_later} if it is still pending."""
        if call is not None and call.active():
            call.cancel()
        self._delayed.discard(call)

    def cancel_when(self, d: Deferred[T], call: IDelayedCall) -> Deferred[T]:
        """Cancel C{call} (a timeout, say) when C{d} fires, either way; C{d}'s result passes through."""

        def cancel(result: Any) -> Any:
            self.cancel(call)
            return result

        d.addBoth(cancel)
        return d

    def timeout(self, d: Deferred[T], seconds: float) -> Deferred[T]:
        """Cancel C{d} unless it fires within C{seconds}, and fail it with C{TimeoutError} then, as
        C{Deferred.addTimeout} does (C{seconds} is a configured length: it is a L{deadline}, one
        reactor call for every pending timeout of that length, where C{addTimeout} sets a reactor
        call of its own per Deferred: every Redis command has one)."""
        timed_out = False

        def expire() -> None:
            nonlocal timed_out
            timed_out = True
            d.cancel()

        deadline = self.deadline(seconds, expire)

        def settled(result: Any) -> Any:
            if deadline.active():
                deadline.cancel()
            elif timed_out and isinstance(result, Failure) and result.check(CancelledError):
                raise TimeoutError(seconds, "Deferred")  # (Deferred.addTimeout's)
            return result

        return d.addBoth(settled)

    def looping_call(self, interval: float, f: Callable[[], Any], now: bool = False) -> LoopingCall:
        """Run C{f} every C{interval} seconds; an exception is logged and the loop carries on."""

        def guarded() -> None:
            try:
                f()
            except Exception:
                self._log.failure("periodic task {name} failed", name=getattr(f, "__qualname__", f))

        loop = LoopingCall(guarded)
        loop.clock = self.reactor
        self._loops.add(loop)
        if not self._stopped:
            loop.start(interval, now=now)
        return loop

    def timer_service(self, interval: float, f: Callable[[], object]) -> TimerService:
        """A service that runs C{f} every C{interval} seconds while it runs (its parent stops it, and
        stopping waits for a Deferred C{f} returned to fire): for a periodic task that must finish
        before what it uses closes."""
        service = TimerService(interval, f)
        service.clock = self.reactor
        return service

    def stop_loop(self, loop: LoopingCall) -> None:
        """Stop a loop made by L{looping_call}."""
        if loop.running:
            loop.stop()
        self._loops.discard(loop)

    def shutdown(self) -> None:
        """Cancel every pending delayed call and stop every loop."""
        self._stopped = True
        for call in list(self._delayed):
            if call.active():
                call.cancel()
        self._delayed.clear()
        for queue in self._timeout_queues.values():
            queue.cancel_all()
        for loop in list(self._loops):
            if loop.running:
                loop.stop()
        self._loops.clear()


@implementer(IDelayedCall)
class _Deadline:
    """One deadline of a L{_DeadlineQueue}: a delayed call that is never moved (the queue's order
    is its time's), only cancelled."""

    __slots__ = ("time", "f", "args", "live", "queue")

    def __init__(self, time: float, f: Callable[..., Any], args: tuple[Any, ...], queue: _DeadlineQueue) -> None:
        self.time = time
        self.f = f
        self.args = args
        self.live = True
        self.queue = queue

    def getTime(self) -> float:
        return self.time

    def active(self) -> bool:
        return self.live

    def cancel(self) -> None:
        if not self.live:
            raise AlreadyCancelled(self)  # (or called: Twisted's delayed calls refuse both alike)
        self.live = False
        self.queue.forget()

    def delay(self, secondsLater: float) -> None:
        raise NotImplementedError("a deadline is cancelled and set again, never moved")

    def reset(self, secondsFromNow: float) -> None:
        raise NotImplementedError("a deadline is cancelled and set again, never moved")


class _DeadlineQueue:
    """The deadlines of one length, in the order they were set (hence of expiry, on a clock that
    does not go back), with one reactor call at the earliest live one's time while any is live.

    A cancelled deadline stays in the queue until it reaches the front; the reactor call, set for a
    deadline since cancelled, then finds the next one and is set again for it (a call that comes
    early, never late). A call raising is logged, as the reactor logs a delayed call's."""

    _log = Logger()

    def __init__(self, clock: Timekeeper, delay: float) -> None:
        self.clock = clock
        self.delay = delay
        self.entries: deque[_Deadline] = deque()
        self.call: IDelayedCall | None = None
        self.expiring = False  # (a deadline set by one running is not the earliest: _expire sets the call)

    def add(self, f: Callable[..., Any], args: tuple[Any, ...]) -> _Deadline:
        deadline = _Deadline(self.clock.reactor.seconds() + self.delay, f, args, self)
        self.entries.append(deadline)
        if self.call is None and not self.expiring:
            self.call = self.clock._schedule(self.delay, self._expire)
        return deadline

    def forget(self) -> None:
        """A deadline was cancelled: drop the cancelled ones at the front, and the reactor call
        once none is left."""
        entries = self.entries
        while entries and not entries[0].live:
            entries.popleft()
        if not entries and self.call is not None:
            call, self.call = self.call, None
            call.cancel()

    def cancel_all(self) -> None:
        """Cancel every deadline still pending, and the reactor call."""
        for deadline in self.entries:
            deadline.live = False
        self.entries.clear()
        call, self.call = self.call, None
        if call is not None and call.active():
            call.cancel()

    def _expire(self) -> None:
        self.call = None
        self.expiring = True
        entries = self.entries
        now = self.clock.reactor.seconds()
        try:
            while entries and (not entries[0].live or entries[0].time <= now):
                deadline = entries.popleft()
                if deadline.live:
                    deadline.live = False
                    try:
                        deadline.f(*deadline.args)
                    except Exception:
                        self._log.failure("a deadline's call failed")
        finally:
            self.expiring = False
        if entries:
            self.call = self.clock._schedule(max(entries[0].time - now, 0), self._expire)


class BlockingClock:
    """Durations and waits for code that blocks instead of running a reactor: the C{relayd-admin}
    tools (relayd/cli/), which wait between reconnects and retries and measure deadlines and progress
    intervals. They take one (a test hands in one that records the waits and moves time itself), so
    every reading of the system clock stays in this module.
    """

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for intervals and deadlines."""
        return time.monotonic()

    def wall(self) -> float:
        """The wall clock, seconds since the epoch (for stamps and expiry times)."""
        return time.time()

    def sleep(self, seconds: float) -> None:
        """Block for C{seconds}."""
        time.sleep(seconds)


class NextTurn:
    """Runs C{fn} once at the end of the current reactor turn, however often L{request}ed in it.

    The coalescing every fan-out needs: a burst of writes to many streams costs one flush of them
    all per turn, not one per write. A request made while C{fn} runs schedules the next turn. The
    turn is one C{callLater} of a bound method made once here (no closure per turn); the clock
    cancels a pending turn at shutdown.

    On the delivery hot path (a request per stream written to) a caller tests L{scheduled} before
    calling L{request}: one attribute test per write, as the hand-written versions did (the method
    call alone cost a third more per write).

    @ivar scheduled: the pending call, or C{None} when nothing is due (read it; never set it).
    """

    __slots__ = ("_clock", "_fn", "_fire", "scheduled")

    def __init__(self, clock: Timekeeper, fn: Callable[[], object]) -> None:
        self._clock = clock
        self._fn = fn
        self._fire = self._run  # bound once: every turn schedules this same object
        self.scheduled: IDelayedCall | None = None

    def request(self) -> None:
        """Run C{fn} at the end of this turn (once, however many requests the turn makes)."""
        if self.scheduled is None:
            clock = self._clock
            self.scheduled = call = clock.reactor.callLater(0, self._fire)
            clock._delayed.add(call)

    def cancel(self) -> None:
        """Drop a pending run (a later L{request} schedules again)."""
        call, self.scheduled = self.scheduled, None
        if call is not None:
            self._clock.cancel(call)

    def _run(self) -> None:
        call, self.scheduled = self.scheduled, None
        self._clock._delayed.discard(call)
        self._fn()
