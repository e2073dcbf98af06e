"""An entry in Redis that this relayd cannot read back (an older relayd accepted a number or text
that ingest refuses now) is skipped on replay and counted, never a failed replay for its session."""

from __future__ import annotations

import json

from twisted.trial.unittest import TestCase

from relayd.aep import metrics
from relayd.aep.core.event import Event
from relayd.aep.redis.store import RedisEventLog
from tests.support.aep import event
from tests.support.redis import connected_redis, shared_redis


class UnreadableEntries(TestCase):
    async def test_skipped_and_counted(self) -> None:
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        log = RedisEventLog(redis, 10, 10, prefix=f"unreadable:{id(self)}:")
        good = [event("old", seq) for seq in (0, 2)]
        poisoned = event("old", 1)
        # What an older relayd stored: an integer longer than anything ingest reads back today.
        raw = json.dumps(poisoned).encode()[:-1] + b', "n": ' + b"9" * 5000 + b"}"
        await log.append([Event.of(good[0], json.dumps(good[0]).encode()), Event.of(poisoned, raw),
                          Event.of(good[1], json.dumps(good[1]).encode())])
        counter = metrics.events_dropped.labels(relay="aep", reason="unreadable")
        before = counter._value.get()
        replay = await log.replay("old", (0, -1))
        self.assertEqual([e.position for e in replay.events], [(0, 0), (0, 2)])
        self.assertEqual(counter._value.get() - before, 1)
