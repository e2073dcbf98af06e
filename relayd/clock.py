"""The one owner of timers: every delayed call and looping call goes through a L{Clock}.

Owning them in one place means shutdown can cancel whatever is still pending (no timer outlives its
service), and tests drive time deterministically by handing in a C{task.Clock}.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IDelayedCall, IReactorTime
from twisted.internet.task import LoopingCall
from twisted.logger import Logger

T = TypeVar("T")


class Clock:
    """Wraps an C{IReactorTime}; records the calls it schedules so L{shutdown} can cancel them."""

    _log = Logger()

    def __init__(self, reactor: IReactorTime) -> None:
        self.reactor = reactor
        self._delayed: set[IDelayedCall] = set()
        self._loops: set[LoopingCall] = set()
        self._stopped = False

    def seconds(self) -> float:
        """The current time, in seconds since the epoch, from the wrapped reactor."""
        return self.reactor.seconds()

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
        for loop in list(self._loops):
            if loop.running:
                loop.stop()
        self._loops.clear()


class BlockingClock:
    """Durations and waits for code that blocks instead of running a reactor: the C{relayd-admin}
    tools (relayd/cli/), which wait between reconnects and retries and measure deadlines and progress
    intervals. They take one (a test hands in one that records the waits and moves time itself), so
    every reading of the system clock stays in this module.
    """

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back, for intervals and deadlines."""
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Block for C{seconds}."""
        time.sleep(seconds)
