"""The garbage collector's policy (relayd/process/host.py)."""

from __future__ import annotations

import gc
import weakref

from twisted.internet.task import Clock as FakeTime
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.process.host import CollectorPolicy


class Cycle:
    """An object in a reference cycle: only the collector reclaims it."""

    def __init__(self) -> None:
        self.me = self


class CollectorPolicyTests(TestCase):
    def setUp(self) -> None:
        self.time = FakeTime()
        self.clock = Timekeeper(self.time)
        self.addCleanup(self.clock.shutdown)
        self.addCleanup(gc.unfreeze)  # the rest of the test run is collected as usual

    def policy(self, freeze: float, full: float) -> CollectorPolicy:
        policy = CollectorPolicy(self.clock, freeze, full)
        policy.start()
        return policy

    def test_start_freezes_what_exists(self) -> None:
        self.policy(0, 0)
        self.assertGreater(gc.get_freeze_count(), 0)

    def test_survivors_are_frozen_every_interval(self) -> None:
        self.policy(60, 0)
        survivor = Cycle()
        ref = weakref.ref(survivor)
        self.time.advance(59.9)
        del survivor
        gc.collect()
        self.assertIsNone(ref(), "not frozen before the interval: the collector reclaims it")
        survivor = Cycle()
        ref = weakref.ref(survivor)
        self.time.advance(0.1)  # 60 s since start: the survivors are frozen
        del survivor
        gc.collect()
        self.assertIsNotNone(ref(), "frozen: a full pass no longer walks it")

    def test_no_loop_with_interval_zero(self) -> None:
        policy = self.policy(0, 0)
        self.time.advance(3600)
        self.assertEqual((policy.freezes, policy.full_passes), (0, 0))

    def test_frozen_garbage_is_reclaimed_at_the_full_interval(self) -> None:
        policy = self.policy(10, 30)
        survivor = Cycle()
        ref = weakref.ref(survivor)
        self.time.advance(10)  # frozen
        del survivor
        self.time.advance(10)  # 20 s: frozen again, not collected
        gc.collect()
        self.assertIsNotNone(ref())
        self.assertEqual((policy.freezes, policy.full_passes), (2, 0))
        self.time.advance(10)  # 30 s: unfrozen and collected
        self.assertIsNone(ref())
        self.assertEqual((policy.freezes, policy.full_passes), (2, 1))
        self.assertGreater(gc.get_freeze_count(), 0, "what is alive is frozen again")
