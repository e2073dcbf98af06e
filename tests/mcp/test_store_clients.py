"""The client-session part of the IMcpStore contract (standard endpoint), memory and Redis."""

from __future__ import annotations

import itertools

from twisted.trial.unittest import TestCase

from relayd.mcp.core.store import ClientRecord, IMcpStore, MemoryStore
from relayd.mcp.redis.store import RedisStore
from tests.support.redis import connected_redis, shared_redis

_prefixes = itertools.count()


class ClientSessionsContract:
    async def make(self) -> IMcpStore:
        raise NotImplementedError

    async def test_put_get_touch_delete(self) -> None:
        store = await self.make()
        self.assertIsNone(await store.get_client("c1"))
        await store.put_client("c1", ClientRecord("sess", "mcp-1"), 60_000)
        await store.put_client("c2", ClientRecord("sess", "mcp-2", answers_on_stream=True), 60_000)
        self.assertEqual(await store.get_client("c1"), ClientRecord("sess", "mcp-1", False))
        self.assertEqual(await store.get_client("c2"), ClientRecord("sess", "mcp-2", True))
        self.assertEqual(await store.touch_clients(["c1", "gone", "c2"], 60_000), [True, False, True])
        self.assertEqual(await store.touch_clients([], 60_000), [])
        self.assertTrue(await store.delete_client("c1"))
        self.assertFalse(await store.delete_client("c1"))
        self.assertIsNone(await store.get_client("c1"))


class MemoryClientSessions(ClientSessionsContract, TestCase):
    async def make(self) -> IMcpStore:
        return MemoryStore()


class RedisClientSessions(ClientSessionsContract, TestCase):
    async def make(self) -> IMcpStore:
        redis = await connected_redis(shared_redis().url)
        self.addCleanup(redis.close)
        return RedisStore(redis, prefix=f"tc{next(_prefixes)}:{id(self)}:")

    async def test_expires_unless_touched(self) -> None:
        store = await self.make()
        await store.put_client("c1", ClientRecord("sess", "mcp-1"), 1)
        # Redis expires the key within its resolution; a touch after that finds it gone.
        redis = store.redis  # type: ignore[attr-defined]
        ttl = await redis.execute("mcp", "PTTL", store._client_key("c1"))  # type: ignore[attr-defined]
        self.assertLessEqual(int(ttl), 1)
        await store.put_client("c2", ClientRecord("sess", "mcp-2"), 600_000)
        self.assertGreater(int(await redis.execute("mcp", "PTTL", store._client_key("c2"))), 500_000)  # type: ignore[attr-defined]
