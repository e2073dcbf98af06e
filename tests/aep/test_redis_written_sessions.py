"""The AEP Redis store keeps the keys of the sessions it appended to lately made (relayd/aep/redis/store.py
L{RedisEventLog._written_session}): bounded, and every append names the keys it named before."""

from __future__ import annotations

import json

from twisted.trial.unittest import TestCase

from relayd.aep.core.event import Event
from relayd.aep.redis import store
from relayd.aep.redis.store import RedisEventLog
from relayd.compat.txredisapi import unframed
from relayd.storage.redis_lua import key_count
from tests.support.aep import event
from tests.support.redis import connected_redis, shared_redis


def _event(session: str, seq: int) -> Event:
    body = event(session, seq)
    return Event.of(body, json.dumps(body).encode())


class WrittenSessions(TestCase):
    async def test_kept_keys_are_the_keys_and_never_more_than_the_bound(self) -> None:
        self.patch(store, "WRITTEN_KEPT", 2)
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        log = RedisEventLog(redis, 10, 10, prefix=f"written:{id(self)}:")
        sessions = ["a", "b", "c", "d", "é"]
        for seq in range(3):
            for session in sessions:
                self.assertEqual(await log.append([_event(session, seq)]), [True])
                self.assertLessEqual(len(log._written), 2)
                tag, name, keys = log._written[session]
                self.assertEqual(name, session.encode("utf-8"))
                self.assertEqual(tag, log.buckets.tag_of(name))
                self.assertEqual(unframed(keys), [*log._bucket(tag), *log._session_keys(name, tag)])
                self.assertEqual(key_count(keys), 7)
        # A batch of several sessions (their keys built per batch) beside them.
        self.assertEqual(await log.append([_event("a", 3), _event("b", 3)]), [True, True])
        for session in sessions:
            replay = await log.replay(session, (0, -1))
            self.assertEqual([e.position for e in replay.events], [(0, 0), (0, 1), (0, 2), (0, 3)][: 4 if session in "ab" else 3])
        self.assertEqual(sorted(await log.sessions()), sorted(sessions))
