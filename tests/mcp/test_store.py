"""The IMcpStore contract, run against the in-memory and the Redis implementation."""

from __future__ import annotations

import itertools

from twisted.trial.unittest import TestCase
from zope.interface.verify import verifyObject

from relayd.mcp.core.store import (
    INBOUND,
    OUTBOUND,
    POLL,
    SSE,
    Correlation,
    IMcpStore,
    MemoryStore,
    SessionRecord,
    SubscriberRecord,
    queue_key,
)
from relayd.mcp.redis.store import RedisStore
from tests.support.redis import connected_redis, shared_redis

_prefixes = itertools.count()


def sub(id: str = "a" * 16, direction: str = OUTBOUND, kind: str = POLL, label: str | None = None,
        seen: float = 100.0, session: str = "sess", instance: str = "") -> SubscriberRecord:
    return SubscriberRecord(id, session, direction, kind, label, seen, 0, instance)


class McpStoreContract:
    """Behaviour every IMcpStore must have; subclasses provide C{make()}."""

    async def make(self) -> IMcpStore:
        raise NotImplementedError

    async def test_provides_the_interface(self) -> None:
        store = await self.make()
        self.assertTrue(verifyObject(IMcpStore, store))

    async def test_sessions(self) -> None:
        store = await self.make()
        self.assertIsNone(await store.get_session("sess"))
        await store.put_session(SessionRecord("sess", "ab" * 32, 100.5))
        await store.put_session(SessionRecord("other", "cd" * 32, 200.0))
        self.assertEqual(await store.get_session("sess"), SessionRecord("sess", "ab" * 32, 100.5))
        self.assertEqual(await store.session_count(), 2)
        await store.touch_session("sess", 300.25)
        await store.touch_session("never", 300.0)  # no-op for an unknown session
        self.assertEqual((await store.get_session("sess")).last_seen, 300.25)
        self.assertIsNone(await store.get_session("never"))
        # Strictly older than the cutoff.
        self.assertEqual(await store.expired_session_ids(300.25), ["other"])
        self.assertEqual(sorted(await store.expired_session_ids(301)), ["other", "sess"])
        self.assertTrue(await store.delete_session("other"))
        self.assertFalse(await store.delete_session("other"))
        self.assertEqual(await store.session_count(), 1)

    async def test_check_session_authenticates_and_slides_the_ttl(self) -> None:
        store = await self.make()
        await store.put_session(SessionRecord("sess", "ab" * 32, 100.0))
        self.assertEqual(await store.check_session("never", "ab" * 32, 200.0), "session_gone")
        self.assertEqual(await store.check_session("sess", "cd" * 32, 200.0), "invalid_token")
        self.assertEqual((await store.get_session("sess")).last_seen, 100.0)  # a wrong token touches nothing
        self.assertIsNone(await store.check_session("sess", "ab" * 32, 200.5))
        self.assertEqual((await store.get_session("sess")).last_seen, 200.5)
        self.assertEqual(await store.expired_session_ids(200.5), [])

    async def test_subscribers_in_arrival_order_with_labels_and_instances(self) -> None:
        store = await self.make()
        await store.add_subscriber(sub("b" * 16, label="alice", kind=SSE, instance="i1"))
        await store.add_subscriber(sub("a" * 16, label=None))
        await store.add_subscriber(sub("c" * 16, label="", direction=INBOUND))
        found = await store.subscribers("sess", OUTBOUND)
        self.assertEqual([r.id for r in found], ["b" * 16, "a" * 16])
        self.assertEqual([(r.kind, r.label, r.instance) for r in found], [(SSE, "alice", "i1"), (POLL, None, "")])
        self.assertEqual((await store.subscribers("sess", INBOUND))[0].label, "")
        self.assertEqual(await store.subscribers("nope", OUTBOUND), [])
        self.assertEqual(await store.get_subscriber("sess", OUTBOUND, "a" * 16), sub("a" * 16))
        self.assertIsNone(await store.get_subscriber("sess", INBOUND, "a" * 16))
        self.assertEqual(found[0].queue_key, queue_key("sess", OUTBOUND, "b" * 16))
        inbound, outbound = await store.all_subscribers("sess")
        self.assertEqual(([r.id for r in inbound], [r.id for r in outbound]), (["c" * 16], ["b" * 16, "a" * 16]))
        self.assertEqual(await store.all_subscribers("nope"), ([], []))

    async def test_find_subscriber_in_both_directions(self) -> None:
        store = await self.make()
        await store.add_subscriber(sub("a" * 16, direction=INBOUND))
        await store.add_subscriber(sub("a" * 16, direction=OUTBOUND, kind=SSE))
        found = await store.find_subscriber("sess", "a" * 16)
        self.assertEqual(sorted((r.direction, r.kind) for r in found), [(INBOUND, POLL), (OUTBOUND, SSE)])
        self.assertEqual(await store.find_subscriber("sess", "f" * 16), [])

    async def test_update_and_idle_pollers(self) -> None:
        store = await self.make()
        await store.add_subscriber(sub("a" * 16, seen=100.0))
        await store.add_subscriber(sub("b" * 16, seen=100.0))
        await store.add_subscriber(sub("c" * 16, seen=100.0, kind=SSE))
        await store.update_subscriber("sess", OUTBOUND, "a" * 16, 150.0, 1)  # parked
        await store.update_subscriber("sess", OUTBOUND, "zz", 150.0, 1)  # gone: no-op
        record = await store.get_subscriber("sess", OUTBOUND, "a" * 16)
        self.assertEqual((record.last_seen, record.parked), (150.0, 1))
        idle = await store.idle_pollers(200.0)
        self.assertEqual([r.id for r in idle], ["b" * 16])  # parked and SSE subscribers are never idle
        await store.update_subscriber("sess", OUTBOUND, "a" * 16, None, -1)
        self.assertEqual(sorted(r.id for r in await store.idle_pollers(200.0)), ["a" * 16, "b" * 16])
        self.assertEqual(await store.idle_pollers(100.0), [])  # strictly older than the cutoff

    async def test_remove_subscriber_drops_its_queue(self) -> None:
        store = await self.make()
        record = sub()
        await store.add_subscriber(record)
        await store.push(record.queue_key, b'"x"', 10, 1000)
        removed = await store.remove_subscriber("sess", OUTBOUND, record.id)
        self.assertEqual(removed.id, record.id)
        self.assertIsNone(await store.remove_subscriber("sess", OUTBOUND, record.id))
        self.assertEqual(await store.size(record.queue_key), 0)
        self.assertEqual(await store.subscribers("sess", OUTBOUND), [])
        self.assertEqual(await store.idle_pollers(1e12), [])

    async def test_queue_bounds_take_and_put_back(self) -> None:
        store = await self.make()
        key = queue_key("sess", OUTBOUND, "a" * 16)
        dropped = [await store.push(key, b'"%d"' % i, 3, 1000) for i in range(5)]
        self.assertEqual(dropped, [0, 0, 0, 1, 1])
        self.assertEqual(await store.size(key), 3)
        items, lost = await store.take(key)
        self.assertEqual((items, lost), ([b'"2"', b'"3"', b'"4"'], 2))
        self.assertEqual(await store.take(key), ([], 0))
        await store.put_back(key, [b'"a"', b'"b"'])
        await store.push(key, b'"c"', 10, 1000)
        await store.put_back(key, [])
        self.assertEqual(await store.take(key), ([b'"a"', b'"b"', b'"c"'], 0))
        # The byte bound keeps at least the newest item.
        await store.push(key, b"x" * 10, 100, 15)
        self.assertEqual(await store.push(key, b"y" * 10, 100, 15), 1)
        self.assertEqual(await store.push(key, b"z" * 20, 100, 15), 1)
        self.assertEqual(await store.take(key), ([b"z" * 20], 2))

    async def test_backlog_is_capped_and_taken_whole(self) -> None:
        store = await self.make()
        for i in range(5):
            await store.append_backlog("sess", INBOUND, b"%d" % i, 3)
        self.assertEqual(await store.take_backlog("sess", OUTBOUND), [])
        self.assertEqual(await store.take_backlog("sess", INBOUND), [b"2", b"3", b"4"])
        self.assertEqual(await store.take_backlog("sess", INBOUND), [])

    async def test_correlations_consumed_once_and_evicted_oldest_first(self) -> None:
        store = await self.make()
        await store.record_correlation("sess", b"1", Correlation("alice"), 2)
        await store.record_correlation("sess", b'"1"', Correlation("bob", b"7"), 2)
        self.assertTrue(await store.correlation_pending("sess", b"1"))
        await store.record_correlation("sess", b"1", Correlation("carol"), 2)  # refreshed: now newest
        await store.record_correlation("sess", b"2", Correlation("dave"), 2)
        self.assertFalse(await store.correlation_pending("sess", b'"1"'))  # evicted
        self.assertEqual(await store.consume_correlation("sess", b"1"), Correlation("carol"))
        self.assertIsNone(await store.consume_correlation("sess", b"1"))
        await store.record_correlation("sess", b"3", Correlation("erin", b'"x"'), 5)
        self.assertEqual(await store.consume_correlation("sess", b"3"), Correlation("erin", b'"x"'))
        self.assertIsNone(await store.consume_correlation("other", b"3"))

    async def test_session_room_counts_per_address_and_offers_the_least_recently_seen_without_readers(self) -> None:
        store = await self.make()
        for name, seen, owner in (("s-1", 1.0, "192.0.2.1"), ("s-2", 2.0, "192.0.2.1"), ("s-3", 3.0, "192.0.2.2")):
            await store.put_session(SessionRecord(name, "h" * 64, seen, owner))
        self.assertEqual(await store.session_room("192.0.2.1", 3), (0, []))  # room for one more
        self.assertEqual(await store.session_room("192.0.2.1", 2), (1, ["s-1"]))  # at the bound
        await store.add_subscriber(sub(session="s-1"))  # a reader: never offered
        self.assertEqual(await store.session_room("192.0.2.1", 2), (1, ["s-2"]))
        self.assertEqual(await store.session_room("192.0.2.1", 1), (2, ["s-2"]))  # fewer than must end
        self.assertEqual(await store.session_room(None, 3), (1, ["s-2"]))
        self.assertEqual(await store.session_room("192.0.2.9", 1), (0, []))
        await store.delete_session("s-2")
        self.assertEqual(await store.session_room("192.0.2.1", 2), (0, []))  # an ended session is not counted
        self.assertEqual(await store.session_room("192.0.2.1", 1), (1, []))

    async def test_a_claimed_correlation_is_recorded_only_when_its_id_is_free(self) -> None:
        store = await self.make()
        await store.record_correlation("sess", b"1", Correlation("alice"), 10)
        self.assertFalse(await store.claim_correlation("sess", b"1", Correlation("bob", b"1"), 10))
        self.assertTrue(await store.claim_correlation("sess", b'"r-1"', Correlation("bob", b"1"), 10))
        self.assertFalse(await store.claim_correlation("sess", b'"r-1"', Correlation("carol", b"1"), 10))
        self.assertEqual(await store.consume_correlation("sess", b"1"), Correlation("alice"))
        self.assertEqual(await store.consume_correlation("sess", b'"r-1"'), Correlation("bob", b"1"))
        for n in range(3):  # claims count against the cap like any pending request
            self.assertTrue(await store.claim_correlation("sess", b"%d" % n, Correlation("dave"), 2))
        self.assertFalse(await store.correlation_pending("sess", b"0"))

    async def test_drop_session_state_removes_everything_of_one_session(self) -> None:
        store = await self.make()
        await store.add_subscriber(sub("a" * 16))
        await store.add_subscriber(sub("b" * 16, direction=INBOUND, kind=SSE))
        await store.add_subscriber(sub("c" * 16, session="keep"))
        await store.push(queue_key("sess", OUTBOUND, "a" * 16), b'"x"', 10, 100)
        await store.append_backlog("sess", OUTBOUND, b"f", 64)
        await store.record_correlation("sess", b"1", Correlation("alice"), 10)
        removed = await store.drop_session_state("sess")
        self.assertEqual(sorted(r.id for r in removed), ["a" * 16, "b" * 16])
        self.assertEqual(await store.subscribers("sess", OUTBOUND), [])
        self.assertEqual(await store.size(queue_key("sess", OUTBOUND, "a" * 16)), 0)
        self.assertEqual(await store.take_backlog("sess", OUTBOUND), [])
        self.assertFalse(await store.correlation_pending("sess", b"1"))
        self.assertEqual(len(await store.subscribers("keep", OUTBOUND)), 1)
        self.assertEqual([r.id for r in await store.idle_pollers(1e12)], ["c" * 16])

    async def test_buffered_bytes_follow_every_frame_in_and_out(self) -> None:
        store = await self.make()
        key = queue_key("sess", OUTBOUND, "a" * 16)
        await store.add_subscriber(sub("a" * 16))
        self.assertEqual(await store.buffered_bytes(), 0)
        await store.push(key, b"x" * 10, 2, 1000)
        await store.push(key, b"y" * 20, 2, 1000)
        await store.push(key, b"z" * 30, 2, 1000)  # evicts the 10
        self.assertEqual(await store.buffered_bytes(), 50)
        items, _ = await store.take(key)
        self.assertEqual(await store.buffered_bytes(), 0)
        await store.put_back(key, items)  # a poll whose client went away
        self.assertEqual(await store.buffered_bytes(), 50)
        for size in (5, 6, 7, 8):  # a backlog of 3: the 5 is dropped
            await store.append_backlog("sess", INBOUND, b"b" * size, 3)
        await store.append_backlog("other", INBOUND, b"o" * 100, 3)
        self.assertEqual(await store.buffered_bytes(), 50 + 21 + 100)
        self.assertEqual(len(await store.take_backlog("other", INBOUND)), 1)
        self.assertEqual(await store.buffered_bytes(), 71)
        await store.remove_subscriber("sess", OUTBOUND, "a" * 16)
        self.assertEqual(await store.buffered_bytes(), 21)
        await store.add_subscriber(sub("b" * 16))
        await store.push(queue_key("sess", OUTBOUND, "b" * 16), b"q" * 40, 10, 1000)
        await store.drop_session_state("sess")  # its queue and its backlog
        self.assertEqual(await store.buffered_bytes(), 0)


class MemoryStoreTests(McpStoreContract, TestCase):
    async def make(self) -> IMcpStore:
        return MemoryStore()


class RedisStoreTests(McpStoreContract, TestCase):
    async def make(self) -> IMcpStore:
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        return RedisStore(redis, prefix=f"t{next(_prefixes)}:{id(self)}:")
