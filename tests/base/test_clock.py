"""relayd.base.clock: the wall and duration clocks a test fixes, and NextTurn's one run per reactor turn."""

from __future__ import annotations

import time
from typing import Any

from twisted.internet import defer, reactor, task
from twisted.internet.defer import Deferred
from twisted.internet.error import AlreadyCancelled
from twisted.trial.unittest import SynchronousTestCase

from relayd.base.clock import NextTurn, Timekeeper


class Readings(SynchronousTestCase):
    def test_a_test_clock_fixes_the_wall_and_the_durations(self) -> None:
        fake = task.Clock()
        fake.advance(1_700_000_000)
        clock = Timekeeper(fake)
        self.assertEqual(clock.seconds(), 1_700_000_000)
        started = clock.monotonic()
        fake.advance(2.5)
        self.assertEqual(clock.monotonic() - started, 2.5)

    def test_a_real_reactor_measures_durations_on_the_monotonic_clock(self) -> None:
        self.assertIs(Timekeeper(reactor).monotonic, time.monotonic)  # type: ignore[arg-type]


class Deadlines(SynchronousTestCase):
    def test_a_deadline_runs_on_the_clock_and_is_its_owners_to_cancel(self) -> None:
        fake = task.Clock()
        clock = Timekeeper(fake)
        ran: list[str] = []
        call = clock.deadline(2.0, ran.append, "late")
        fake.advance(1.999)
        self.assertEqual(ran, [])
        fake.advance(0.001)
        self.assertEqual(ran, ["late"])
        kept = clock.deadline(5.0, ran.append, "kept")
        clock.shutdown()  # not recorded: its owner (a connection) cancels it
        self.assertTrue(kept.active())
        kept.cancel()
        self.assertFalse(call.active())


class CallsAfterATimeout(SynchronousTestCase):
    def test_each_runs_at_its_time_on_one_reactor_call_and_shutdown_cancels_them(self) -> None:
        fake = task.Clock()
        clock = Timekeeper(fake)
        ran: list[str] = []
        first = clock.call_after_timeout(2.0, ran.append, "first")
        fake.advance(1.0)
        second = clock.call_after_timeout(2.0, ran.append, "second")
        self.assertEqual(len(fake.getDelayedCalls()), 1)  # (one queue of that length, one reactor call)
        self.assertEqual(second.getTime(), 3.0)
        fake.advance(1.0)
        self.assertEqual(ran, ["first"])
        self.assertFalse(first.active())
        clock.cancel(second)  # (as call_later's are cancelled)
        self.assertEqual(fake.getDelayedCalls(), [])
        pending = clock.call_after_timeout(2.0, ran.append, "pending")
        clock.shutdown()  # recorded, as call_later's are: no timeout outlives its service
        self.assertFalse(pending.active())
        self.assertEqual(fake.getDelayedCalls(), [])
        fake.advance(10.0)
        self.assertEqual(ran, ["first"])


class DeadlinesOfOneLength(SynchronousTestCase):
    """Deadlines of one length share one reactor call, for the earliest live one: each still runs
    at its own time, in order; a cancelled one never runs; none left, no reactor call."""

    def setUp(self) -> None:
        self.fake = task.Clock()
        self.clock = Timekeeper(self.fake)
        self.ran: list[str] = []

    def set(self, name: str, delay: float = 20.0) -> Any:
        return self.clock.deadline(delay, self.ran.append, name)

    def test_each_runs_at_its_own_time_with_one_reactor_call(self) -> None:
        self.set("a")
        self.fake.advance(5)
        self.set("b")
        self.fake.advance(5)
        c = self.set("c")
        self.assertEqual(len(self.fake.getDelayedCalls()), 1)
        self.assertEqual(c.getTime(), 30.0)
        self.fake.advance(9.999)
        self.assertEqual(self.ran, [])
        self.fake.advance(0.001)  # 20: a's
        self.assertEqual(self.ran, ["a"])
        self.fake.advance(4.999)
        self.assertEqual(self.ran, ["a"])
        self.fake.advance(0.001)  # 25: b's
        self.assertEqual(self.ran, ["a", "b"])
        self.fake.advance(5)  # 30: c's
        self.assertEqual(self.ran, ["a", "b", "c"])
        self.assertFalse(c.active())
        self.assertEqual(self.fake.getDelayedCalls(), [])

    def test_a_cancelled_one_never_runs_and_the_next_keeps_its_time(self) -> None:
        a = self.set("a")
        self.fake.advance(5)
        self.set("b")
        b2 = self.set("b2")
        b2.cancel()
        a.cancel()  # the earliest: the reactor call, due at 20, finds b (due at 25) and waits again
        self.assertEqual(len(self.fake.getDelayedCalls()), 1)
        self.fake.advance(15)
        self.assertEqual(self.ran, [])
        self.fake.advance(4.999)
        self.assertEqual(self.ran, [])
        self.fake.advance(0.001)
        self.assertEqual(self.ran, ["b"])
        self.assertEqual(self.fake.getDelayedCalls(), [])
        self.assertRaises(AlreadyCancelled, b2.cancel)

    def test_one_set_by_a_running_deadline_leaves_the_next_its_time(self) -> None:
        self.clock.deadline(20.0, self.set, "c")  # at 20 it sets c, due at 40
        self.fake.advance(5)
        self.set("b")  # due at 25: still b's time, not c's
        self.fake.advance(15)
        self.assertEqual(self.ran, [])
        self.assertEqual(len(self.fake.getDelayedCalls()), 1)
        self.fake.advance(5)
        self.assertEqual(self.ran, ["b"])
        self.fake.advance(15)
        self.assertEqual(self.ran, ["b", "c"])
        self.assertEqual(self.fake.getDelayedCalls(), [])

    def test_none_left_no_reactor_call(self) -> None:
        calls = [self.set(str(n)) for n in range(3)]
        for call in reversed(calls):  # (the last cancelled is the earliest)
            call.cancel()
        self.assertEqual(self.fake.getDelayedCalls(), [])
        self.fake.advance(60)
        self.assertEqual(self.ran, [])

    def test_lengths_apart_and_a_failing_call_logged(self) -> None:
        self.clock.deadline(20.0, lambda: 1 / 0)
        self.set("b")
        self.set("short", 5.0)
        self.fake.advance(5)
        self.assertEqual(self.ran, ["short"])
        self.fake.advance(15)
        self.assertEqual(self.ran, ["short", "b"])  # after the failing one, at its own time
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)


class NextTurnTests(SynchronousTestCase):
    def setUp(self) -> None:
        self.fake = task.Clock()
        self.clock = Timekeeper(self.fake)
        self.runs = 0
        self.turn = NextTurn(self.clock, self.count)

    def count(self) -> None:
        self.runs += 1

    def test_requests_in_one_turn_run_once_at_its_end(self) -> None:
        for _ in range(5):
            self.turn.request()
        self.assertEqual(self.runs, 0)
        self.assertEqual(len(self.fake.getDelayedCalls()), 1)
        self.assertIsNotNone(self.turn.scheduled)
        self.fake.advance(0)
        self.assertEqual(self.runs, 1)
        self.assertIsNone(self.turn.scheduled)
        self.fake.advance(0)
        self.assertEqual(self.runs, 1)  # nothing requested since

    def test_a_request_after_the_run_schedules_the_next_turn(self) -> None:
        self.turn.request()
        self.fake.advance(0)
        self.turn.request()
        self.fake.advance(0)
        self.assertEqual(self.runs, 2)

    def test_a_request_made_while_it_runs_schedules_again(self) -> None:
        scheduled: list[bool] = []

        def count_and_request() -> None:
            self.count()
            if self.runs < 3:
                again.request()
                scheduled.append(again.scheduled is not None)

        again = NextTurn(self.clock, count_and_request)
        again.request()
        self.fake.advance(0)  # (task.Clock runs what a run schedules for now in the same advance)
        self.assertEqual((self.runs, scheduled), (3, [True, True]))
        self.assertIsNone(again.scheduled)

    def test_a_failing_run_still_allows_the_next(self) -> None:
        def boom() -> None:
            self.runs += 1
            raise ValueError("boom")

        failing = NextTurn(self.clock, boom)
        failing.request()
        self.assertRaises(ValueError, self.fake.advance, 0)
        failing.request()
        self.assertRaises(ValueError, self.fake.advance, 0)
        self.assertEqual(self.runs, 2)

    def test_cancel_drops_the_pending_run(self) -> None:
        self.turn.request()
        self.turn.cancel()
        self.assertEqual(self.fake.getDelayedCalls(), [])
        self.fake.advance(0)
        self.assertEqual(self.runs, 0)
        self.turn.request()  # and a later request schedules again
        self.fake.advance(0)
        self.assertEqual(self.runs, 1)

    def test_shutdown_cancels_a_pending_run(self) -> None:
        self.turn.request()
        self.clock.shutdown()
        self.assertEqual(self.fake.getDelayedCalls(), [])
        self.fake.advance(0)
        self.assertEqual(self.runs, 0)

    def test_a_run_is_forgotten_by_the_clock(self) -> None:
        self.turn.request()
        self.fake.advance(0)
        self.assertEqual(self.clock._delayed, set())

    def test_a_turn_schedules_the_same_bound_method_every_time(self) -> None:
        # The hot path allocates no closure per turn: the scheduled callable is made once.
        self.turn.request()
        first = self.fake.getDelayedCalls()[0].func
        self.fake.advance(0)
        self.turn.request()
        self.assertIs(self.fake.getDelayedCalls()[0].func, first)


class Timeouts(SynchronousTestCase):
    """L{Timekeeper.timeout}: C{Deferred.addTimeout}'s outcome, on the deadlines of one length."""

    def setUp(self) -> None:
        self.fake = task.Clock()
        self.clock = Timekeeper(self.fake)

    def test_a_deferred_not_fired_in_time_fails_with_twisteds_timeout_error(self) -> None:
        d: Deferred[str] = Deferred()
        self.clock.timeout(d, 2.0)
        self.fake.advance(1.999)
        self.assertNoResult(d)
        self.fake.advance(0.001)
        failure = self.failureResultOf(d, defer.TimeoutError)
        self.assertEqual(failure.value.args, (2.0, "Deferred"))  # as addTimeout words it
        self.assertEqual(self.fake.getDelayedCalls(), [])

    def test_a_result_in_time_passes_and_leaves_no_reactor_call(self) -> None:
        d: Deferred[str] = Deferred()
        self.clock.timeout(d, 2.0)
        d.callback("answer")
        self.assertEqual(self.successResultOf(d), "answer")
        self.assertEqual(self.fake.getDelayedCalls(), [])
        self.fake.advance(5)  # (nothing left to fire)

    def test_a_failure_in_time_passes_unchanged(self) -> None:
        d: Deferred[str] = Deferred()
        self.clock.timeout(d, 2.0)
        d.errback(ValueError("refused"))
        self.failureResultOf(d, ValueError)

    def test_a_cancel_that_is_not_the_timeouts_stays_a_cancel(self) -> None:
        d: Deferred[str] = Deferred()
        self.clock.timeout(d, 2.0)
        d.cancel()
        self.failureResultOf(d, defer.CancelledError)
        self.assertEqual(self.fake.getDelayedCalls(), [])

    def test_a_canceller_that_answers_otherwise_is_left_its_answer(self) -> None:
        d: Deferred[str] = Deferred(lambda d: d.callback("gave up politely"))
        self.clock.timeout(d, 2.0)
        self.fake.advance(2)
        self.assertEqual(self.successResultOf(d), "gave up politely")

    def test_many_pending_timeouts_of_one_length_share_one_reactor_call(self) -> None:
        """What it saves: C{addTimeout} sets a reactor call per Deferred (a Redis command each)."""
        pending = []
        for _ in range(50):
            d: Deferred[int] = Deferred()
            pending.append(self.clock.timeout(d, 2.0))
            self.fake.advance(0.25)
        self.assertEqual(len(self.fake.getDelayedCalls()), 1)
        for d in pending[:43]:  # set 2 s ago or more
            self.failureResultOf(d, defer.TimeoutError)
        for d in pending[43:-1]:
            d.callback(1)
        self.fake.advance(1.75)  # 2 s after the last was set
        self.failureResultOf(pending[-1], defer.TimeoutError)
        self.assertEqual([self.successResultOf(d) for d in pending[43:-1]], [1] * 6)  # answered in time
        self.assertEqual(self.fake.getDelayedCalls(), [])
