"""The one pacer (relayd.web.streams.pacing): a chunk per pull, none while the source waits for its
own, a wake once it is ready, and nothing more once the owner is gone or another source started."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from relayd.web.streams.pacing import Pacer


class Paced(TestCase):
    def setUp(self) -> None:
        self.woken = 0
        self.pacer = Pacer(self.wake)
        self.chunks: list[int] = []
        self.answers: list[Any] = []

    def wake(self) -> None:
        self.woken += 1

    def source(self) -> Any:
        self.chunks.append(len(self.chunks))
        return self.answers.pop(0)

    def test_one_chunk_per_pull_until_the_source_is_done(self) -> None:
        self.answers = [True, True, False]
        self.pacer.start(self.source)
        self.assertEqual(self.woken, 1)
        self.assertEqual([self.pacer.pull(lambda: True) for _ in range(4)], [True, True, False, False])
        self.assertEqual(self.chunks, [0, 1, 2])
        self.assertIsNone(self.pacer.source)

    def test_a_waiting_source_is_not_pulled_and_wakes_its_owner_when_ready(self) -> None:
        page: Deferred[None] = Deferred()
        self.answers = [page, False]
        self.pacer.start(self.source)
        self.assertFalse(self.pacer.pull(lambda: True))
        self.assertFalse(self.pacer.ready)
        self.assertFalse(self.pacer.pull(lambda: True))
        self.assertEqual(self.chunks, [0])
        page.callback(None)
        self.assertEqual(self.woken, 2)
        self.assertTrue(self.pacer.ready)
        self.assertFalse(self.pacer.pull(lambda: True))
        self.assertEqual(self.chunks, [0, 1])

    def test_a_source_that_ends_its_owner_or_starts_another_is_dropped(self) -> None:
        self.answers = [True]
        self.pacer.start(self.source)
        self.assertFalse(self.pacer.pull(lambda: False))  # (the owner closed within the chunk)
        self.assertIsNone(self.pacer.source)

        def starts_another() -> bool:
            self.pacer.start(self.source)
            return True

        self.pacer.start(starts_another)
        self.assertFalse(self.pacer.pull(lambda: True))
        self.assertEqual(self.pacer.source, self.source)  # (the new one is pulled from the next turn)
