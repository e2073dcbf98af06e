"""Long-polls: the park window a request asks for, a poll's answer, and one poll's life while parked.

A parked poll is an object with a timer, not a suspended coroutine: a relay holds thousands. What a
poll takes from or gives back to the store is its keeper's business (L{PollKeeper}, the tunnel
relay); this module holds no store and does no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from relayd.base.clock import Timekeeper
from relayd.mcp.core.store import INBOUND, SubscriberRecord

POLL_MAX_WAIT_MS = 25_000
POLL_DEFAULT_WAIT_MS = 20_000

# A subscriber id a poll may name with C{subscriber=} (the form the relay makes: 8 random bytes, hex).
SUBSCRIBER_ID = re.compile(r"[a-f0-9]{16}")

_WAIT = re.compile(r"\s*([+-]?)0*([0-9]*)")


def parse_wait_ms(value: str | None) -> int:
    """The poll park window: JavaScript C{parseInt(v, 10)} clamped to 0..25000; absent is 20000.

    Total over any text: only ASCII digits count (as for parseInt), and a literal of any length is
    clamped without converting more digits than the bound has.
    """
    if value is None:
        return POLL_DEFAULT_WAIT_MS
    match = _WAIT.match(value)
    assert match is not None  # every part of the pattern may be empty
    sign, digits = match.groups()
    if sign == "-" or not digits:
        return 0  # negative, or no digits (NaN in JavaScript): no parking
    if len(digits) > len(str(POLL_MAX_WAIT_MS)):
        return POLL_MAX_WAIT_MS
    return min(POLL_MAX_WAIT_MS, int(digits))


@dataclass
class PollResult:
    """One poll's answer: the subscriber id, frames as JSON string literals, and whether it was new."""

    subscriber: str
    frames: list[bytes]
    created: bool = False
    direction: str = INBOUND
    session: str = ""

    def body(self) -> bytes:
        """The response body, C{subscriber} first (frames are already encoded)."""
        return b'{"subscriber":"' + self.subscriber.encode() + b'","frames":[' + b",".join(self.frames) + b"]}"


class PollKeeper(Protocol):
    """What a L{ParkedPoll} calls back on: the tunnel relay that owns its subscriber and queue."""

    clock: Timekeeper

    def unpark(self, poll: ParkedPoll) -> None:
        """Stop the poll's timer and forget it as a waiter on its queue."""

    def poll_abandoned(self, poll: ParkedPoll) -> None:
        """The client went away before anything was taken: only the parked count goes."""

    def take_frames(self, poll: ParkedPoll) -> Deferred[PollResult]:
        """Take the poll's queued frames (and its parked count) for its answer."""

    def return_frames(self, result: PollResult) -> None:
        """The client went away while its frames were being taken: they go back to its queue."""


_BEGIN, _PARKED, _FINISHING, _DONE, _CANCELLED = range(5)


class ParkedPoll:
    """One poll request between its auth and its answer; while parked, all the relay keeps of it."""

    __slots__ = ("keeper", "deferred", "record", "created", "wait", "state", "timer", "woken")

    def __init__(self, keeper: PollKeeper, wait: float) -> None:
        self.keeper = keeper
        self.deferred: Deferred[PollResult] = Deferred(self._cancel)
        self.record: SubscriberRecord | None = None
        self.created = False
        self.wait = wait
        self.state = _BEGIN
        self.timer: Any = None
        self.woken = False

    def begun(self, ready: bool) -> None:
        """Auth, subscriber and parked count are done; C{ready}: answer without parking."""
        if self.state == _CANCELLED:
            self.keeper.unpark(self)
            self.keeper.poll_abandoned(self)
        elif ready or self.woken:
            self.keeper.unpark(self)
            self.finish()
        else:
            self.state = _PARKED
            self.timer = self.keeper.clock.call_later(self.wait, self.wake)

    def failed(self, failure: Failure) -> None:
        """The poll was refused or its store failed: the request gets the failure."""
        self.keeper.unpark(self)
        self.state = _DONE
        if not self.deferred.called:
            self.deferred.errback(failure)

    def wake(self) -> None:
        """A frame arrived, the wait ran out, or the session or relay is ending."""
        if self.state == _BEGIN:
            self.woken = True  # a wake-up raced the queue check: answer as soon as it is done
        elif self.state == _PARKED:
            self.keeper.unpark(self)
            self.finish()

    def finish(self) -> None:
        """Take the frames and answer."""
        self.state = _FINISHING
        self.keeper.take_frames(self).addCallbacks(self._answer, self.failed)

    def _answer(self, result: PollResult) -> None:
        self.state = _DONE
        if self.deferred.called:
            # The client went away while the frames were being taken: they go back.
            self.keeper.return_frames(result)
        else:
            self.deferred.callback(result)

    def _cancel(self, _: Deferred[PollResult]) -> None:
        # The client went away (docs/mcp.md): a parked wait takes nothing.
        state, self.state = self.state, _CANCELLED
        if state == _PARKED:
            self.keeper.unpark(self)
            self.keeper.poll_abandoned(self)
        elif state == _FINISHING:
            self.state = _FINISHING  # _answer puts the taken frames back
