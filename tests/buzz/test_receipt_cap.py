"""The per-agent receipt cap (--broker-max-receipts): the state directory's growth is bounded per credential.

Retention bounds receipts in time; the cap bounds them in count, so one busy agent cannot fill the
disk within a retention period. Past the cap the agent's oldest settled receipts go, a tenth at a
time; pending plans (outcome unknown) never do.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.buzz.core.state import MAX_RECEIPTS, SQLiteState, StateDB
from relayd.buzz.redis.state import RedisReceipts
from relayd.buzz.service import make_service
from relayd.tap import Options
from tests.support.redis import connected_redis, shared_redis

A = "a" * 64
B = "b" * 64


def digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


class ReceiptCap(TestCase):
    """docs/decisions.md B-12: at most the cap per agent, oldest settled first, pending plans never."""

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="relayd-cap-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.db = StateDB.in_dir(self.dir)
        self.addCleanup(self.db.close)
        self.db.max_receipts = 10
        self.clock = 1_000_000

        def now() -> float:
            self.clock += 1  # each receipt a second after the last: "oldest" is unambiguous
            return self.clock

        self.db.now = now

    def settle(self, principal: str, *ids: str) -> None:
        for rid in ids:
            self.db.complete(principal, rid, digest(rid), b'{"v":"' + rid.encode() + b'"}', [])

    def kept(self, principal: str) -> list[str]:
        rows = self.db.conn.execute(
            "SELECT request_id FROM receipts WHERE principal = ? ORDER BY created_at", (principal,)
        ).fetchall()
        return [r[0] for r in rows]

    def count(self, principal: str) -> int:
        row = self.db.conn.execute("SELECT n FROM receipt_counts WHERE principal = ?", (principal,)).fetchone()
        return row[0] if row else 0

    def test_exactly_the_cap_is_kept_whole(self) -> None:
        ids = [f"r{i}" for i in range(10)]
        self.settle(A, *ids)
        assert self.kept(A) == ids
        assert self.count(A) == 10

    def test_one_over_the_cap_deletes_the_oldest_tenth_and_one(self) -> None:
        ids = [f"r{i}" for i in range(11)]
        self.settle(A, *ids)
        # 11 > 10: the excess (1) and a tenth of the cap (1) go, oldest first.
        assert self.kept(A) == ids[2:]
        assert self.count(A) == 9
        assert self.db.receipt(A, "r0") is None  # a retry of it is a new request

    def test_never_more_than_the_cap_however_many_are_written(self) -> None:
        for i in range(250):
            self.settle(A, f"r{i}")
            assert self.count(A) <= 10
            assert len(self.kept(A)) == self.count(A)
        assert self.kept(A)[-1] == "r249"

    def test_other_agents_are_untouched(self) -> None:
        self.settle(B, "b0", "b1")
        self.settle(A, *[f"r{i}" for i in range(30)])
        assert self.kept(B) == ["b0", "b1"]

    def test_pending_plans_are_never_deleted_by_the_cap(self) -> None:
        for i in range(5):
            self.db.store_plan(A, f"p{i}", digest(f"p{i}"), b'{"plan":1}')
        self.settle(A, *[f"r{i}" for i in range(40)])
        kept = self.kept(A)
        assert [k for k in kept if k.startswith("p")] == [f"p{i}" for i in range(5)]
        assert len(kept) <= 10
        for i in range(5):
            receipt = self.db.receipt(A, f"p{i}")
            assert receipt is not None and receipt.state == "pending" and receipt.plan == b'{"plan":1}'

    def test_the_receipt_being_settled_is_not_the_one_trimmed(self) -> None:
        # The oldest receipt is a plan settled last: its own verdict must stay on record.
        self.db.store_plan(A, "old", digest("old"), b"{}")
        self.settle(A, *[f"r{i}" for i in range(9)])
        self.settle(A, "old")  # completing it: the count is 10, no trim yet
        self.settle(A, "r9")  # 11: trims the two oldest settled, and "old" is the oldest
        assert "old" not in self.kept(A)  # (the cap is by age; only the one being written is spared)
        self.db.store_plan(A, "old2", digest("old2"), b"{}")
        self.db.max_receipts = 1
        self.settle(A, "old2")
        assert self.db.receipt(A, "old2") is not None

    def test_the_retention_sweep_keeps_the_counts_right(self) -> None:
        self.settle(A, *[f"r{i}" for i in range(6)])
        # Written at seconds 1..6 (after the start); at 7 with 3 s retention, those before 4 go.
        assert self.db.prune(self.clock + 1, retention=3) == 3
        assert self.count(A) == 3 == len(self.kept(A))
        assert self.db.prune(self.clock + 100, retention=3) == 3
        assert self.count(A) == 0
        assert self.db.conn.execute("SELECT COUNT(*) FROM receipt_counts").fetchone()[0] == 0


class CountsOfAnEarlierDatabase(TestCase):
    def test_receipts_written_before_the_counts_existed_are_counted_at_open(self) -> None:
        d = tempfile.mkdtemp(prefix="relayd-cap-")
        self.addCleanup(shutil.rmtree, d, True)
        db = StateDB.in_dir(d)
        for i in range(7):
            db.complete(A, f"r{i}", digest(f"r{i}"), b"{}", [])
        # As an earlier relayd left it: receipts, no counts table, no triggers (schema version 1:
        # relayd/buzz/schema/002-receipt-counts.sql adds them).
        db.conn.executescript(
            "DROP TRIGGER receipts_counted; DROP TRIGGER receipts_uncounted; DROP TABLE receipt_counts;"
            " PRAGMA user_version = 1;"
        )
        path = db.path
        db.close()
        again = StateDB(path)
        self.addCleanup(again.close)
        assert again.conn.execute("SELECT n FROM receipt_counts WHERE principal = ?", (A,)).fetchone() == (7,)
        again.max_receipts = 7
        again.complete(A, "r7", digest("r7"), b"{}", [])  # 8 > 7: one over and a tenth (1) go
        assert again.conn.execute("SELECT COUNT(*) FROM receipts").fetchone() == (6,)


class ThroughTheService(TestCase):
    def test_the_setting_reaches_the_store_and_zero_is_refused(self) -> None:
        o = Options(environ={})
        o.parseOptions(["--broker-max-receipts", "3"])
        assert o.settings["broker-max-receipts"] == 3
        default = Options(environ={})
        default.parseOptions([])
        assert default.settings["broker-max-receipts"] == MAX_RECEIPTS
        with self.assertRaises(SystemExit):
            Options(environ={}).parseOptions(["--broker-max-receipts", "0"])

    async def test_the_service_holds_its_state_to_the_setting(self) -> None:
        d = tempfile.mkdtemp(prefix="relayd-cap-")
        self.addCleanup(shutil.rmtree, d, True)
        o = Options(environ={})
        o.parseOptions(
            ["--broker-nostr-relay", "ws://127.0.0.1:9", "--broker-state-dir", d, "--broker-max-receipts", "4",
             "--broker-listen", "tcp:0:interface=127.0.0.1"]
        )
        svc = make_service(o.settings, reactor, Timekeeper(reactor))
        assert svc is not None
        self.addCleanup(svc.db.close)
        state: SQLiteState = svc.state
        for i in range(20):
            rid = f"r{i}"
            await state.complete(A, rid, digest(rid), b"{}", [])
        n = svc.db.conn.execute("SELECT COUNT(*) FROM receipts WHERE principal = ?", (A,)).fetchone()[0]
        assert 0 < n <= 4


class RedisReceiptCap(TestCase):
    """The same cap when receipts live in Redis (several instances): an agent's index, trimmed past it."""

    timeout = 30

    async def make(self, cap: int) -> RedisReceipts:
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        d = tempfile.mkdtemp(prefix="relayd-cap-")
        self.addCleanup(shutil.rmtree, d, True)
        state = SQLiteState.in_dir(d, reactor)
        self.addCleanup(state.close)
        self.prefix = f"cap{id(self)}:"
        store = RedisReceipts(redis, Timekeeper(reactor), state.apply_effects, prefix=self.prefix, max_receipts=cap)
        self.addCleanup(store.close)
        await store.bus.ready
        self.redis = redis
        return store

    async def settle(self, store: RedisReceipts, principal: str, *ids: str) -> None:
        for rid in ids:
            assert (await store.claim(principal, rid, digest(rid))).status == "new"
            await store.complete(principal, rid, digest(rid), b'{"v":"' + rid.encode() + b'"}', [])
            if store.trimming is not None:
                await store.trimming  # in the background in service; awaited here to see its end

    async def kept(self, store: RedisReceipts, principal: str, ids: list[str]) -> list[str]:
        return [rid for rid in ids if await store.receipt(principal, rid) is not None]

    async def test_exactly_the_cap_is_kept_and_one_over_trims_the_oldest_tenth_and_one(self) -> None:
        store = await self.make(cap=10)
        ids = [f"r{i}" for i in range(11)]
        await self.settle(store, A, *ids[:10])
        self.assertEqual(await self.kept(store, A, ids), ids[:10])
        await self.settle(store, A, ids[10])
        self.assertEqual(await self.kept(store, A, ids), ids[2:])
        index = self.prefix + "buzz:i:{" + A + "}"
        self.assertEqual(await self.redis.execute("probe", "ZCARD", index), 9)
        self.assertEqual((await store.claim(A, "r0", digest("other bytes"))).status, "new")  # forgotten

    async def test_pending_plans_and_other_agents_are_untouched(self) -> None:
        store = await self.make(cap=5)
        assert (await store.claim(A, "p", digest("p"))).status == "new"
        await store.store_plan(A, "p", digest("p"), b'{"plan":1}')
        await store.release(A, "p")
        await self.settle(store, B, "b0")
        await self.settle(store, A, *[f"r{i}" for i in range(30)])
        pending = await store.receipt(A, "p")
        assert pending is not None and pending.state == "pending" and pending.plan == b'{"plan":1}'
        self.assertIsNotNone(await store.receipt(B, "b0"))
        self.assertLessEqual(len(await self.kept(store, A, [f"r{i}" for i in range(30)])), 5)

    async def test_a_request_id_reused_after_its_receipt_expired_keeps_its_pending_plan(self) -> None:
        store = await self.make(cap=5)
        await self.settle(store, A, "r0")  # indexed
        await self.redis.execute("probe", "DEL", self.prefix + "buzz:r:{" + A + ":r0}")  # expired meanwhile
        assert (await store.claim(A, "r0", digest("again"))).status == "new"
        await store.store_plan(A, "r0", digest("again"), b'{"plan":2}')
        await store.release(A, "r0")
        await self.settle(store, A, *[f"r{i}" for i in range(1, 30)])  # r0 is the oldest indexed id
        pending = await store.receipt(A, "r0")
        assert pending is not None and pending.state == "pending" and pending.plan == b'{"plan":2}'
