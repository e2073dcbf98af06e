"""The one backlog policy (relayd.aep.core.backlog): what SSE and WebSocket consumers alike drop,
keep and are cut off for (docs/aep.md, "Slow consumers")."""

from __future__ import annotations

import json

from twisted.trial.unittest import TestCase

from relayd.aep.core import backlog
from relayd.aep.core.backlog import HARD_BACKLOG, SOFT_BACKLOG
from relayd.aep.core.event import Event, admit
from tests.support.aep import event


def live(severity: str) -> Event:
    found = admit(json.dumps(event("B", 0, "progress.status", severity=severity)).encode())
    assert found is not None
    return found


def dropped() -> float:
    return backlog.SLOW_CONSUMER._value.get()


class Backlog(TestCase):
    def test_below_notice_is_dropped_past_the_soft_bound_and_counted(self) -> None:
        before = dropped()
        self.assertFalse(backlog.sheds(live("info"), SOFT_BACKLOG))
        self.assertTrue(backlog.sheds(live("info"), SOFT_BACKLOG + 1))
        self.assertFalse(backlog.sheds(live("notice"), HARD_BACKLOG * 2))  # (its transport's own bound applies)
        self.assertEqual(dropped(), before + 1)

    def test_a_held_event_is_kept_dropped_or_cuts_the_consumer_off(self) -> None:
        before = dropped()
        self.assertEqual(backlog.hold(live("info"), SOFT_BACKLOG), "keep")
        self.assertEqual(backlog.hold(live("info"), SOFT_BACKLOG + 1), "drop")
        self.assertEqual(backlog.hold(live("info"), HARD_BACKLOG + 1), "drop")  # (dropping it keeps it under)
        self.assertEqual(backlog.hold(live("notice"), HARD_BACKLOG), "keep")
        self.assertEqual(backlog.hold(live("error"), HARD_BACKLOG + 1), "cut-off")
        self.assertEqual(dropped(), before + 2)
