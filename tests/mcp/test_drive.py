"""relayd.mcp.drive.run: coroutines over Deferreds, synchronous when nothing waits."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.internet.defer import CancelledError, Deferred, fail, succeed

from relayd.mcp.drive import run
from tests.mcp.support import fired


async def add(a: Deferred[int], b: Deferred[int]) -> int:
    return await a + await b


def test_a_coroutine_that_never_waits_has_fired_on_return() -> None:
    assert fired(run(add(succeed(1), succeed(2)))) == 3


def test_an_error_raised_without_waiting_is_a_failed_deferred() -> None:
    d = run(add(succeed(1), fail(ValueError("no"))))
    with pytest.raises(ValueError):
        fired(d)


def test_a_waiting_coroutine_resumes_when_the_deferred_fires() -> None:
    later: Deferred[int] = Deferred()
    d = run(add(succeed(1), later))
    assert not d.called
    later.callback(41)
    assert fired(d) == 42


def test_a_failure_is_thrown_into_the_coroutine_where_it_waits() -> None:
    later: Deferred[int] = Deferred()

    async def guarded() -> str:
        try:
            await later
        except KeyError as e:
            return f"caught {e.args[0]}"
        return "not reached"

    d = run(guarded())
    later.errback(KeyError("k"))
    assert fired(d) == "caught k"


def test_an_uncaught_failure_after_waiting_fails_the_result() -> None:
    later: Deferred[int] = Deferred()
    d = run(add(succeed(1), later))
    later.errback(ValueError("late"))
    with pytest.raises(ValueError):
        fired(d)


def test_cancelling_the_result_cancels_what_the_coroutine_awaits_and_lets_it_clean_up() -> None:
    later: Deferred[int] = Deferred()
    cleaned: list[Any] = []

    async def parked() -> int:
        try:
            return await later
        finally:
            cleaned.append(True)

    d = run(parked())
    d.cancel()
    assert later.called and cleaned == [True]
    with pytest.raises(CancelledError):
        fired(d)
