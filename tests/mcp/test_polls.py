"""relayd.mcp.core.polls.ParkedPoll on its own: one poll's life against a recording keeper (no store).

The tunnel relay is the keeper in the wing (tests/mcp/test_tunnel.py); here each callback a parked
poll makes is recorded, so the order of parking, waking, cancelling and answering is checked alone.
"""

from __future__ import annotations

from twisted.internet import task
from twisted.internet.defer import CancelledError, Deferred
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.mcp.core.polls import ParkedPoll, PollResult
from relayd.mcp.core.store import INBOUND, POLL, SubscriberRecord

FRAMES = [b'"frame"']


class RecordingKeeper:
    """A L{relayd.mcp.core.polls.PollKeeper} that records its calls; C{take_frames} answers when told."""

    def __init__(self) -> None:
        self.reactor = task.Clock()
        self.clock = Timekeeper(self.reactor)
        self.calls: list[str] = []
        self.taking: Deferred[PollResult] | None = None
        self.returned: list[PollResult] = []

    def unpark(self, poll: ParkedPoll) -> None:
        self.calls.append("unpark")
        if poll.timer is not None:
            self.clock.cancel(poll.timer)
            poll.timer = None

    def poll_abandoned(self, poll: ParkedPoll) -> None:
        self.calls.append("abandoned")

    def take_frames(self, poll: ParkedPoll) -> Deferred[PollResult]:
        self.calls.append("take")
        self.taking = Deferred()
        return self.taking

    def return_frames(self, result: PollResult) -> None:
        self.calls.append("return")
        self.returned.append(result)

    def frames_taken(self) -> PollResult:
        """Fire the pending C{take_frames} with one frame."""
        assert self.taking is not None
        result = PollResult("a" * 16, list(FRAMES))
        self.taking.callback(result)
        return result


def parked(wait: float = 20.0) -> tuple[ParkedPoll, RecordingKeeper]:
    """A poll past its auth, parked for C{wait} seconds on an empty queue."""
    keeper = RecordingKeeper()
    poll = ParkedPoll(keeper, wait)
    poll.record = SubscriberRecord("a" * 16, "sess", INBOUND, POLL, None, 0.0)
    poll.begun(False)
    return poll, keeper


class ParkedPollLife(TestCase):
    """Park, wake, time out, cancel: what the keeper is asked to do, in order."""

    def test_a_ready_queue_is_answered_without_parking(self) -> None:
        keeper = RecordingKeeper()
        poll = ParkedPoll(keeper, 20.0)
        poll.begun(True)
        result = keeper.frames_taken()
        self.assertEqual((keeper.calls, self.successResultOf(poll.deferred)), (["unpark", "take"], result))
        self.assertEqual(keeper.reactor.getDelayedCalls(), [])

    def test_a_parked_poll_is_answered_when_its_wait_runs_out(self) -> None:
        poll, keeper = parked(wait=20.0)
        keeper.reactor.advance(19.9)
        self.assertEqual(keeper.calls, [])
        keeper.reactor.advance(0.1)
        self.assertEqual(keeper.calls, ["unpark", "take"])
        result = keeper.frames_taken()
        self.assertEqual(self.successResultOf(poll.deferred), result)

    def test_a_wake_while_parked_answers_at_once(self) -> None:
        poll, keeper = parked()
        poll.wake()
        keeper.frames_taken()
        self.assertEqual(keeper.calls, ["unpark", "take"])
        self.assertEqual(self.successResultOf(poll.deferred).frames, FRAMES)
        self.assertEqual(keeper.reactor.getDelayedCalls(), [])

    def test_a_wake_racing_the_queue_check_answers_once_the_check_is_done(self) -> None:
        keeper = RecordingKeeper()
        poll = ParkedPoll(keeper, 20.0)
        poll.wake()  # a frame arrived between "listen" and "look"
        self.assertEqual(keeper.calls, [])
        poll.begun(False)  # the look found nothing, but the wake-up counts
        self.assertEqual(keeper.calls, ["unpark", "take"])

    def test_a_client_gone_while_parked_takes_nothing(self) -> None:
        poll, keeper = parked()
        poll.deferred.cancel()
        self.failureResultOf(poll.deferred, CancelledError)
        self.assertEqual(keeper.calls, ["unpark", "abandoned"])
        keeper.reactor.advance(60)  # the timer went with it
        self.assertEqual(keeper.calls, ["unpark", "abandoned"])

    def test_a_client_gone_before_the_park_takes_nothing(self) -> None:
        keeper = RecordingKeeper()
        poll = ParkedPoll(keeper, 20.0)
        poll.deferred.cancel()
        self.failureResultOf(poll.deferred, CancelledError)
        poll.begun(False)
        self.assertEqual(keeper.calls, ["unpark", "abandoned"])
        self.assertEqual(keeper.reactor.getDelayedCalls(), [])

    def test_frames_taken_for_a_client_gone_meanwhile_go_back(self) -> None:
        poll, keeper = parked()
        poll.wake()
        poll.deferred.cancel()
        self.failureResultOf(poll.deferred, CancelledError)
        result = keeper.frames_taken()
        self.assertEqual((keeper.calls, keeper.returned), (["unpark", "take", "return"], [result]))

    def test_a_failed_take_reaches_the_request(self) -> None:
        poll, keeper = parked()
        poll.wake()
        assert keeper.taking is not None
        keeper.taking.errback(RuntimeError("store down"))
        self.failureResultOf(poll.deferred, RuntimeError)
        self.assertEqual(keeper.calls, ["unpark", "take", "unpark"])

