"""The IEventLog contract, run against the in-memory and the Redis implementation."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

from twisted.trial.unittest import TestCase
from zope.interface.verify import verifyObject

from relayd.aep.core.envelope import MAX_POSITION_DIGITS
from relayd.aep.core.event import Event
from relayd.aep.core.store import IEventLog, MemoryEventLog
from relayd.aep.redis.store import RedisEventLog, decode_position, encode_position
from relayd.base.errors import OutcomeUnknown
from relayd.storage import redis as redis_module
from relayd.storage.buckets import BUCKETS, Buckets, key_slot
from relayd.storage.cluster import ClusterRedis
from tests.support.aep import event
from tests.support.cases import cases, expand
from tests.support.redis import OnCluster, connected_redis, layout_url, shared_redis

_prefixes = itertools.count()
# One bucket: the whole keyspace is one LRU, as the contract and the model describe it (the
# deployment's 64 buckets make --aep-max-sessions a quota per bucket: RedisBuckets below).
ONE_BUCKET = Buckets(1)


def ev(session: str = "S", seq: int = 0, epoch: int | None = None, **extra) -> Event:
    e = event(session, seq, "progress.status", **extra)
    if epoch is not None:
        e["epoch"] = epoch
    raw = json.dumps(e, separators=(",", ":")).encode()
    return Event.of(json.loads(raw), raw)


class EventLogContract:
    """Behaviour every IEventLog must have; subclasses provide C{make(capacity, max_sessions)}."""

    async def make(self, capacity: int = 10, max_sessions: int = 10) -> IEventLog:
        raise NotImplementedError

    async def test_provides_the_interface(self) -> None:
        log = await self.make()
        self.assertTrue(verifyObject(IEventLog, log))

    async def test_append_dedupes_on_source_and_id(self) -> None:
        log = await self.make()
        flags = await log.append([ev(seq=0), ev(seq=1), ev(seq=0)])
        self.assertEqual(flags, [True, True, False])
        replay = await log.replay("S", (0, -1))
        self.assertEqual([e.position for e in replay.events], [(0, 0), (0, 1)])
        self.assertIsNone(replay.exhausted)

    async def test_same_id_from_another_source_is_kept(self) -> None:
        log = await self.make()
        self.assertEqual(await log.append([ev(seq=0, id="x"), ev(seq=1, id="x", source="aep://other")]), [True, True])

    async def test_ordered_by_position_and_equal_positions_keep_arrival(self) -> None:
        log = await self.make()
        await log.append([ev(seq=5, id="a"), ev(seq=2, id="b"), ev(seq=5, id="c"), ev(seq=1, epoch=1, id="d")])
        replay = await log.replay("S", (0, -1))
        self.assertEqual([e.ev["id"] for e in replay.events], ["b", "a", "c", "d"])

    async def test_huge_epochs_order_exactly(self) -> None:
        log = await self.make()
        big = 2**53 + 1
        await log.append([ev(seq=0, epoch=big, id="hi"), ev(seq=0, epoch=big - 1, id="lo"), ev(seq=7, epoch=8192, id="mid")])
        replay = await log.replay("S", (8192, 7))
        self.assertEqual([e.ev["id"] for e in replay.events], ["lo", "hi"])
        self.assertEqual(replay.events[-1].position, (big, 0))

    async def test_the_widest_positions_are_kept(self) -> None:
        # (The Redis log frames a position with one byte for its length.)
        log = await self.make()
        widest = 10**MAX_POSITION_DIGITS - 1
        await log.append([ev(seq=widest, epoch=widest, id="w"), ev(seq=widest - 1, epoch=widest, id="v")])
        replay = await log.replay("S", (widest, widest - 2))
        self.assertEqual([e.position for e in replay.events], [(widest, widest - 1), (widest, widest)])

    async def test_replay_after_a_position_and_from_an_epoch(self) -> None:
        log = await self.make()
        await log.append([ev(seq=i) for i in range(5)] + [ev(seq=0, epoch=2, id="e2")])
        replay = await log.replay("S", (0, 2))
        self.assertEqual([e.position for e in replay.events], [(0, 3), (0, 4), (2, 0)])
        replay = await log.replay("S", (2, -1))
        self.assertEqual([e.position for e in replay.events], [(2, 0)])
        self.assertEqual(list((await log.replay("nope", (0, -1))).events), [])

    async def test_trim_drops_the_lowest_position_and_forgets_its_id(self) -> None:
        log = await self.make(capacity=3)
        await log.append([ev(seq=i) for i in range(5)])
        replay = await log.replay("S", (0, -1))
        self.assertEqual([e.position for e in replay.events], [(0, 2), (0, 3), (0, 4)])
        self.assertEqual(await log.append([ev(seq=0)]), [True])  # forgotten, so admitted again

    async def test_exhausted_marker_names_the_earliest_held_position(self) -> None:
        log = await self.make(capacity=3)
        await log.append([ev(seq=i, epoch=1) for i in range(6)])
        replay = await log.replay("S", (1, 0))
        self.assertEqual(replay.exhausted, (1, 3))
        self.assertEqual(len(replay.events), 3)
        self.assertIsNone((await log.replay("S", (1, 2))).exhausted)  # the next one is held
        self.assertIsNone((await log.replay("S", (1, -1))).exhausted)  # seq -1: "from the start"

    async def test_least_recently_written_session_is_evicted(self) -> None:
        log = await self.make(max_sessions=2)
        await log.append([ev("a", 0)])
        await log.append([ev("b", 0)])
        await log.append([ev("a", 0)])  # a duplicate still refreshes recency
        await log.append([ev("c", 0)])
        self.assertEqual(await log.sessions(), ["a", "c"])
        self.assertEqual(log.session_count(), 2)
        self.assertEqual(list((await log.replay("b", (0, -1))).events), [])

    async def test_payload_bytes_round_trip(self) -> None:
        log = await self.make()
        raw = b'{"aep":"0.1", "id":"x","type":"progress.status","time":"t","source":"s","agent":"a","session":"S","seq":0,"data":{"m":"\\u00e9\xc3\xa9"}}'
        await log.append([Event.of(json.loads(raw), raw)])
        replay = await log.replay("S", (0, -1))
        self.assertEqual(replay.events[0].payload(None), raw)


class MemoryEventLogTests(EventLogContract, TestCase):
    async def make(self, capacity: int = 10, max_sessions: int = 10) -> IEventLog:
        return MemoryEventLog(capacity, max_sessions)


class RedisEventLogTests(EventLogContract, TestCase):
    async def make(self, capacity: int = 10, max_sessions: int = 10) -> IEventLog:
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        return RedisEventLog(redis, capacity, max_sessions, prefix=f"t{next(_prefixes)}:{id(self)}:", buckets=ONE_BUCKET)


@expand
class PositionEncoding(TestCase):
    def test_position_encoding_sorts_like_integers(self) -> None:
        positions = [(0, 0), (0, 9), (0, 10), (1, 0), (9, 99), (10, 0), (2**70, 3)]
        encoded = [encode_position(p) for p in positions]
        assert encoded == sorted(encoded)
        assert [decode_position(e) for e in encoded] == positions


class ReferenceLog:
    """The IEventLog rules one event at a time, written as plainly as possible (a model to check against)."""

    def __init__(self, capacity: int, max_sessions: int) -> None:
        self.capacity, self.max_sessions = capacity, max_sessions
        self.buffers: dict[str, list[Event]] = {}  # insertion order = recency

    def append(self, events: list[Event]) -> list[bool]:
        admitted = []
        for e in events:
            buffer = self.buffers.pop(e.session, None)  # type: ignore[arg-type]
            if buffer is None:
                buffer = []
                if len(self.buffers) >= self.max_sessions:
                    del self.buffers[next(iter(self.buffers))]
            self.buffers[e.session] = buffer  # type: ignore[index]
            if any(held.key == e.key for held in buffer):
                admitted.append(False)
                continue
            index = len(buffer)
            while index and buffer[index - 1].position > e.position:
                index -= 1
            buffer.insert(index, e)
            if len(buffer) > self.capacity:
                del buffer[0]
            admitted.append(True)
        return admitted


@expand
class MemoryLogProperty(TestCase):
    @cases(*[3, 4])  # with session evictions; with long runs that compact buffers
    def test_memory_log_matches_the_one_event_at_a_time_rules(self, max_sessions: int) -> None:
        # Batches that mix sessions, duplicates and out-of-order positions, checked against the plain
        # model after every batch.
        rng = random.Random(7)
        log = MemoryEventLog(capacity=5, max_sessions=max_sessions)
        model = ReferenceLog(capacity=5, max_sessions=max_sessions)
        seq = itertools.count()
        for _ in range(1500):
            batch = []
            for _ in range(rng.choice([1, 3, 8])):
                session = rng.choice("abcd")
                position = next(seq) if rng.random() < 0.8 else rng.randrange(0, 40)
                reused = {"id": f"again-{rng.randrange(3)}"} if rng.random() < 0.1 else {}
                batch.append(ev(session, position, **reused))
            assert self.successResultOf(log.append(batch)) == model.append(batch)
            assert self.successResultOf(log.sessions()) == list(model.buffers)
            for session, held in model.buffers.items():
                assert list(self.successResultOf(log.replay(session, (0, -1))).events) == held

    @cases(*[2, 3])
    def test_batches_of_one_session_match_the_one_event_at_a_time_rules(self, max_sessions: int) -> None:
        # The usual batch (one session, in order, new keys) takes a path of its own: batches longer
        # than the capacity, runs long enough to compact, and the duplicates and late positions
        # that send a batch back to the general path.
        rng = random.Random(13)
        log = MemoryEventLog(capacity=5, max_sessions=max_sessions)
        model = ReferenceLog(capacity=5, max_sessions=max_sessions)
        seq = itertools.count()
        for _ in range(1500):
            session = rng.choice("abc")
            batch = []
            for _ in range(rng.choice([2, 4, 7, 12])):
                position = next(seq) if rng.random() < 0.97 else rng.randrange(0, 40)
                reused = {"id": f"again-{rng.randrange(3)}"} if rng.random() < 0.02 else {}
                batch.append(ev(session, position, **reused))
            assert self.successResultOf(log.append(batch)) == model.append(batch)
            assert self.successResultOf(log.sessions()) == list(model.buffers)
            for session, held in model.buffers.items():
                assert list(self.successResultOf(log.replay(session, (0, -1))).events) == held


@expand
class RedisLogProperty(TestCase):
    @cases(*[3, 4])  # with session evictions (of sessions in the batch and of others); long runs
    async def test_redis_log_matches_the_one_event_at_a_time_rules(self, max_sessions: int) -> None:
        # The Lua append keeps per-run recency, per-session counters and deferred drops of evicted
        # sessions (relayd/aep/lua/append.lua): its answers and contents must still be the plain
        # model's after every batch.
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        log = RedisEventLog(
            redis, capacity=5, max_sessions=max_sessions, prefix=f"t{next(_prefixes)}:{id(self)}:", buckets=ONE_BUCKET
        )
        model = ReferenceLog(capacity=5, max_sessions=max_sessions)
        rng = random.Random(11)
        seq = itertools.count()
        for _ in range(300):
            batch = []
            for _ in range(rng.choice([1, 3, 8])):
                session = rng.choice("abcde")
                position = next(seq) if rng.random() < 0.8 else rng.randrange(0, 40)
                reused = {"id": f"again-{rng.randrange(3)}"} if rng.random() < 0.1 else {}
                batch.append(ev(session, position, **reused))
            assert await log.append(batch) == model.append(batch)
            assert await log.sessions() == list(model.buffers)
            for session in "abcde":
                held = [e.payload(None) for e in model.buffers.get(session, [])]
                replayed = (await log.replay(session, (0, -1))).events
                assert [e.payload(None) for e in replayed] == held, session

    @cases(*[2, 3])  # with session evictions; with capacity trims of a batch longer than the capacity
    async def test_batches_of_one_session_match_the_one_event_at_a_time_rules(self, max_sessions: int) -> None:
        # The usual batch (one session, no key held or repeated) takes a path of its own in the
        # Lua append (a few variadic calls for the whole batch): batches longer than the capacity,
        # and the duplicates (held, or repeated in the batch), late and equal positions that send
        # a batch back to the per-event loop. Checked against the plain model and the memory log
        # (its own fast path) after every batch, with the dedupe keys held and the paged replay.
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        prefix = f"t{next(_prefixes)}:{id(self)}:"
        log = RedisEventLog(redis, capacity=5, max_sessions=max_sessions, prefix=prefix, publisher="i", buckets=ONE_BUCKET)
        memory = MemoryEventLog(capacity=5, max_sessions=max_sessions)
        model = ReferenceLog(capacity=5, max_sessions=max_sessions)
        rng = random.Random(17)
        seq = itertools.count()
        last: dict[str, list[Event]] = {}
        for _ in range(400):
            session = rng.choice("abc")
            batch = []
            for _ in range(rng.choice([1, 2, 4, 7, 12])):
                roll = rng.random()
                if roll < 0.9:
                    position = next(seq)
                elif roll < 0.95:
                    position = rng.randrange(0, 40)  # late
                else:
                    position = batch[-1].position[1] if batch else next(seq)  # equal
                reused = {"id": f"again-{rng.randrange(3)}"} if rng.random() < 0.03 else {}
                batch.append(ev(session, position, **reused))
            roll = rng.random()
            if roll < 0.08 and session in last:
                batch = last[session]  # a retry: every key held (unless trimmed or evicted since)
            elif roll < 0.16 and session in last:
                batch.insert(rng.randrange(len(batch) + 1), rng.choice(last[session]))  # one of them held
            last[session] = batch
            expected = model.append(batch)
            assert await log.append(batch, publish=rng.random() < 0.5) == expected  # (a header before the events)
            assert await memory.append(batch) == expected
            assert await log.sessions() == list(model.buffers)
            for name in "abc":
                held = [e.payload(None) for e in model.buffers.get(name, [])]
                assert [e.payload(None) for e in (await log.replay(name, (0, -1))).events] == held, name
                paged, cursor = [], None
                while True:
                    page = await log.replay(name, (0, -1), limit=2, cursor=cursor)
                    paged += [e.payload(None) for e in page.events]
                    if page.cursor is None:
                        break
                    cursor = page.cursor
                assert paged == held, name
                # Every trimmed event's key is forgotten: the dedupe hash holds the held events' keys.
                dedupe = await redis.execute("test", "HKEYS", log._session_keys(name.encode())[2])
                keys = {f"{e.key[0]}\x00{e.key[1]}".encode() for e in model.buffers.get(name, [])}
                assert set(dedupe) == keys, name
                await self._messages_held_in_part_at_most_one(redis, log._session_keys(name.encode())[1], name)

    async def _messages_held_in_part_at_most_one(self, redis, key: bytes, name: str) -> None:  # type: ignore[no-untyped-def]
        # A batch stored as one message (append.lua) stays while any of its events is held: only
        # one message of a session may be held in part, and none once all its events are gone.
        fields = await redis.execute("test", "HGETALL", key)
        stored = dict(zip(fields[::2], fields[1::2], strict=True))
        partial = 0
        for field, value in stored.items():
            if field[:1] in (b"c", b"h"):
                assert field[1:] in stored, (name, field)
                continue
            if b"c" + field not in stored:
                continue  # an event stored alone
            held = int(stored[b"c" + field])
            lines = value[int(stored[b"h" + field]) :].count(b"\n") + 1
            assert 0 < held <= lines, (name, field, held, lines)
            partial += held < lines
        assert partial <= 1, name

    async def test_a_batch_over_128_kib_is_stored_event_by_event(self) -> None:
        # (append.lua: a replay reads a batch's message whole for each page, so a large one is not
        # kept as one.) Its events are trimmed one by one like any others.
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        prefix = f"t{next(_prefixes)}:{id(self)}:"
        log = RedisEventLog(redis, capacity=5, max_sessions=3, prefix=prefix, publisher="i", buckets=ONE_BUCKET)
        model = ReferenceLog(capacity=5, max_sessions=3)
        pad = "p" * 50_000
        for first in range(0, 12, 3):
            batch = [ev("big", seq, pad=pad) for seq in range(first, first + 3)]
            assert await log.append(batch, publish=True) == model.append(batch)
            replayed = (await log.replay("big", (0, -1))).events
            assert [e.payload(None) for e in replayed] == [e.payload(None) for e in model.buffers["big"]]
            fields = await redis.execute("test", "HKEYS", log._session_keys(b"big")[1])
            assert len(fields) == len(replayed) and all(f.isdigit() for f in fields), fields
        assert await log.append([ev("big", 0, pad=pad)]) == [True]  # trimmed, so its key was forgotten


def _sessions_by_bucket(count: int, per_bucket: int) -> list[list[str]]:
    """C{count} buckets' worth of session names, C{per_bucket} in each (the deployment's buckets)."""
    found: dict[int, list[str]] = {}
    for n in itertools.count():
        name = f"s{n}"
        found.setdefault(BUCKETS.index_of(name.encode()), []).append(name)
        full = [names[:per_bucket] for names in found.values() if len(names) >= per_bucket]
        if len(full) == count:
            return full
    raise AssertionError("unreachable")


class RedisBuckets(TestCase):
    """Keyspace version 4: sessions in buckets, --aep-max-sessions a quota per bucket (⌈max / 64⌉),
    and a batch over several buckets stored as one script per bucket, all sent on one connection
    (one per master on a Redis Cluster: RedisBucketsOnCluster)."""

    timeout = 60

    async def make(self, max_sessions: int, publisher: str | None = None) -> RedisEventLog:
        redis = await connected_redis(layout_url(self))
        self.addCleanup(redis.close)
        return RedisEventLog(redis, 5, max_sessions, prefix=f"t{next(_prefixes)}:{id(self)}:", publisher=publisher)

    def masters_of(self, log: RedisEventLog, sessions: list[str]) -> set[object]:
        """The masters that hold these sessions' buckets (one: a single primary)."""
        redis = log.redis
        if not isinstance(redis, ClusterRedis):
            return {None}
        return {redis._slots[key_slot(BUCKETS.tag_of(s.encode()))] for s in sessions}

    async def test_a_batch_over_many_buckets_is_one_connection_per_master(self) -> None:
        sessions = [names[0] for names in _sessions_by_bucket(24, 1)]
        log = await self.make(max_sessions=500, publisher="i")
        await log.append([ev(s, 0) for s in sessions])  # the script loaded on every master
        sent: list[tuple[int, bytes]] = []
        execute_command = redis_module._Protocol.execute_command

        def recording(connection: object, *command: object, **options: object) -> object:
            if command[0] in (b"EVALSHA", b"EVAL"):
                sent.append((id(connection), command[1]))  # type: ignore[arg-type]
            return execute_command(connection, *command, **options)  # type: ignore[arg-type]

        self.patch(redis_module._Protocol, "execute_command", recording)
        self.assertEqual(await log.append([ev(s, 1) for s in sessions], publish=True), [True] * len(sessions))
        self.assertEqual(len(sent), len(sessions))  # one script per bucket
        # (Each on a connection picked at random, 24 scripts would use several of a master's 4.)
        self.assertEqual(len({connection for connection, _ in sent}), len(self.masters_of(log, sessions)))

    async def test_listing_the_sessions_is_one_connection_per_master(self) -> None:
        log = await self.make(max_sessions=500)
        await log.append([ev("a", 0)])
        sent: list[int] = []
        execute_command = redis_module._Protocol.execute_command

        def recording(connection: object, *command: object, **options: object) -> object:
            if command[0] in (b"ZRANGE", "ZRANGE"):
                sent.append(id(connection))
            return execute_command(connection, *command, **options)  # type: ignore[arg-type]

        self.patch(redis_module._Protocol, "execute_command", recording)
        self.assertEqual(await log.sessions(), ["a"])
        self.assertEqual(len(sent), BUCKETS.count)  # one read per bucket, one write per master
        redis = log.redis
        masters = {redis._slots[key_slot(tag)] for tag in BUCKETS.tags} if isinstance(redis, ClusterRedis) else {None}
        self.assertEqual(len(set(sent)), len(masters))

    async def test_each_buckets_answer_goes_to_its_events(self) -> None:
        sessions = [names[0] for names in _sessions_by_bucket(20, 1)]
        log = await self.make(max_sessions=500)
        held = sessions[::3]  # every third session already holds its first event
        self.assertEqual(await log.append([ev(s, 0) for s in held]), [True] * len(held))
        batch = [ev(s, seq) for seq in (0, 1) for s in sessions]
        expected = [not (seq == 0 and s in held) for seq in (0, 1) for s in sessions]
        self.assertEqual(await log.append(batch, publish=False), expected)
        for s in sessions:
            self.assertEqual([e.position for e in (await log.replay(s, (0, -1))).events], [(0, 0), (0, 1)], s)

    async def test_a_batch_over_several_buckets_reloads_flushed_scripts(self) -> None:
        sessions = [names[0] for names in _sessions_by_bucket(6, 1)]
        log = await self.make(max_sessions=500)
        await log.append([ev(s, 0) for s in sessions])  # the script loaded
        redis = log.redis
        nodes = list(redis._nodes.values()) if isinstance(redis, ClusterRedis) else [redis]
        for node in nodes:
            await node.execute("test", b"SCRIPT", b"FLUSH")  # every EVALSHA of the next batch: NOSCRIPT
        self.assertEqual(await log.append([ev(s, 1) for s in sessions]), [True] * len(sessions))
        for s in sessions:
            self.assertEqual(len((await log.replay(s, (0, -1))).events), 2, s)

    async def test_eviction_is_least_recently_written_within_a_bucket(self) -> None:
        (a, b, c), (x, y, z) = _sessions_by_bucket(2, 3)
        log = await self.make(max_sessions=2 * BUCKETS.count)  # two per bucket
        for session in (a, x, b, y, a, c, z):  # c evicts b (a was written again); z evicts x
            await log.append([ev(session, 0)])
        self.assertEqual(sorted(await log.sessions()), sorted([a, c, y, z]))
        self.assertEqual(log.session_count(), 4)
        for gone in (b, x):
            self.assertEqual(list((await log.replay(gone, (0, -1))).events), [])

    async def test_a_batch_over_several_buckets_is_stored_whole_and_answered_in_order(self) -> None:
        sessions = [names[0] for names in _sessions_by_bucket(3, 1)]
        log = await self.make(max_sessions=500)
        batch = [ev(sessions[i % 3], i // 3) for i in range(9)]
        batch.append(ev(sessions[1], 0))  # a duplicate, in the middle bucket
        self.assertEqual(await log.append(batch, publish=False), [True] * 9 + [False])
        for session in sessions:
            self.assertEqual([e.position for e in (await log.replay(session, (0, -1))).events], [(0, 0), (0, 1), (0, 2)])
        self.assertEqual(sorted(await log.sessions()), sorted(sessions))
        self.assertEqual(log.session_count(), 3)

    async def test_the_empty_session_and_braces_are_sessions_like_any_other(self) -> None:
        log = await self.make(max_sessions=500)
        names = ["", "{x}", "}", "a}b", "{", "é☃"]
        self.assertEqual(await log.append([ev(name, 0) for name in names]), [True] * len(names))
        for name in names:
            self.assertEqual(len((await log.replay(name, (0, -1))).events), 1, name)


class RedisBucketsOnCluster(OnCluster, RedisBuckets):
    """The same on a Redis Cluster: each master's buckets in one write, each redirected on its own."""

    async def test_a_moved_bucket_in_the_middle_of_a_masters_group_is_sent_where_it_went(self) -> None:
        sessions = [names[0] for names in _sessions_by_bucket(24, 1)]
        log = await self.make(max_sessions=500)
        await log.append([ev(s, 0) for s in sessions])  # the script loaded on every master
        redis = log.redis
        assert isinstance(redis, ClusterRedis)
        slots = [key_slot(BUCKETS.tag_of(s.encode())) for s in sessions]
        # One bucket believed on the master of the first (a stale map): its script goes in that
        # master's group, between the others, and is answered MOVED.
        stale = next(i for i, slot in enumerate(slots) if redis._slots[slot] != redis._slots[slots[0]])
        redis._slots[slots[stale]] = redis._slots[slots[0]]
        self.patch(redis, "refresh", lambda: None)  # (the map stays stale but for what MOVED says)
        moved: list[str] = []
        redirected = redis._redirected

        def recording(f: Any, *args: Any) -> Any:
            moved.append(str(f.value).split()[0])
            return redirected(f, *args)

        self.patch(redis, "_redirected", recording)
        batch = [ev(s, seq) for seq in (1, 2) for s in sessions]
        self.assertEqual(await log.append(batch, publish=False), [True] * len(batch))
        self.assertEqual(moved, ["MOVED"])
        for s in sessions:
            self.assertEqual([e.position for e in (await log.replay(s, (0, -1))).events], [(0, 0), (0, 1), (0, 2)], s)


class RedisBucketsUnconfirmed(TestCase):
    """A batch over several buckets acknowledged only once replicas confirm it (one C{WAIT} after
    every bucket's script on the connection)."""

    async def test_a_batch_over_several_buckets_unconfirmed_by_replicas_is_outcome_unknown(self) -> None:
        sessions = [names[0] for names in _sessions_by_bucket(6, 1)]
        loader = await connected_redis(shared_redis().url)
        self.addCleanup(loader.close)
        # The script loaded first: a NOSCRIPT would send each bucket's script again, each with its own WAIT.
        await RedisEventLog(loader, 5, 500, prefix=f"t{next(_prefixes)}:{id(self)}:").append([ev("a", 0)])
        redis = await connected_redis(shared_redis().url, wait_replicas=1)  # a primary without replicas
        self.addCleanup(redis.close)
        log = RedisEventLog(redis, 5, 500, prefix=f"t{next(_prefixes)}:{id(self)}:")
        failure = await self.assertFailure(log.append([ev(s, 0) for s in sessions]), OutcomeUnknown)
        self.assertIn("confirmed by 0 of 1 replicas", str(failure))
        for s in sessions:  # written on the primary all the same (one WAIT after every bucket's script)
            self.assertEqual(len((await log.replay(s, (0, -1))).events), 1, s)
