"""relayd.base.coroutine.run and run_now: coroutines over Deferreds, synchronous when nothing waits."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred, fail, succeed
from twisted.trial.unittest import TestCase

from relayd.base.coroutine import run, run_now


async def add(a: Deferred[int], b: Deferred[int]) -> int:
    return await a + await b


class Run(TestCase):
    """run() returns a Deferred that has fired on return unless the coroutine waits."""

    def test_a_coroutine_that_never_waits_has_fired_on_return(self) -> None:
        self.assertEqual(self.successResultOf(run(add(succeed(1), succeed(2)))), 3)

    def test_an_error_raised_without_waiting_is_a_failed_deferred(self) -> None:
        d = run(add(succeed(1), fail(ValueError("no"))))
        self.failureResultOf(d, ValueError)

    def test_a_waiting_coroutine_resumes_when_the_deferred_fires(self) -> None:
        later: Deferred[int] = Deferred()
        d = run(add(succeed(1), later))
        self.assertNoResult(d)
        later.callback(41)
        self.assertEqual(self.successResultOf(d), 42)

    def test_a_failure_is_thrown_into_the_coroutine_where_it_waits(self) -> None:
        later: Deferred[int] = Deferred()

        async def guarded() -> str:
            try:
                await later
            except KeyError as e:
                return f"caught {e.args[0]}"
            return "not reached"

        d = run(guarded())
        later.errback(KeyError("k"))
        self.assertEqual(self.successResultOf(d), "caught k")

    def test_an_uncaught_failure_after_waiting_fails_the_result(self) -> None:
        later: Deferred[int] = Deferred()
        d = run(add(succeed(1), later))
        later.errback(ValueError("late"))
        self.failureResultOf(d, ValueError)

    def test_cancelling_the_result_cancels_what_the_coroutine_awaits_and_lets_it_clean_up(self) -> None:
        later: Deferred[int] = Deferred()
        cleaned: list[Any] = []

        async def parked() -> int:
            try:
                return await later
            finally:
                cleaned.append(True)

        d = run(parked())
        d.cancel()
        self.assertTrue(later.called)
        self.assertEqual(cleaned, [True])
        self.failureResultOf(d, CancelledError)


class RunNow(TestCase):
    """run_now() hands back the result itself unless the coroutine waits (or raised): then run()'s Deferred."""

    def test_a_coroutine_that_never_waits_gives_its_result_itself(self) -> None:
        self.assertEqual(run_now(add(succeed(1), succeed(2))), 3)

    def test_an_error_raised_without_waiting_is_a_failed_deferred(self) -> None:
        d = run_now(add(succeed(1), fail(ValueError("no"))))
        assert isinstance(d, Deferred)
        self.failureResultOf(d, ValueError)

    def test_a_waiting_coroutine_gives_a_deferred_for_its_result(self) -> None:
        later: Deferred[int] = Deferred()
        d = run_now(add(succeed(1), later))
        assert isinstance(d, Deferred)
        self.assertNoResult(d)
        later.callback(41)
        self.assertEqual(self.successResultOf(d), 42)
