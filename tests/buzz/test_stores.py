"""The broker's store contracts: one suite per interface, run against every implementation.

ICredentialStore and IAgentStore have one implementation (SQLite); IReceiptStore has two (SQLite,
and Redis for several instances), and the Redis one adds what only several instances can show:
claims held elsewhere, lapsed leases, and waiters woken by another instance's verdict.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import tempfile
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from zope.interface.verify import verifyObject

from relayd.base.clock import Timekeeper
from relayd.buzz.core.host import credential_hash
from relayd.buzz.core.operations import Plan
from relayd.buzz.core.state import (
    STAMP_DIGEST_BYTES,
    STAMPS_PER_SECOND,
    Agent,
    IAgentStore,
    ICredentialStore,
    IReceiptStore,
    SQLiteState,
    StateDB,
    effects,
)
from relayd.buzz.redis.state import RedisReceipts
from relayd.cli import broker as admin
from tests.support.redis import connected_redis, shared_redis

P = "a" * 64
CHANNEL = "b2c38ca8-9ec3-411e-bab5-f9deab34d52e"  # a credential with channel actions needs one
_prefixes = itertools.count()


def digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def managed(pubkey: str, name: str, owner: str | None = P) -> dict[str, Any]:
    return {
        "op": "create_agent",
        "agent": {
            "pubkey": pubkey,
            "name": name,
            "sealed_key": "01" * 40,
            "owner": owner,
            "depth": 1,
            "channel": "b2c38ca8-9ec3-411e-bab5-f9deab34d52e",
            "settings": {"respondTo": "owner-only"},
            "record_created_at": 7,
        },
    }


def sqlite_state(test: TestCase) -> SQLiteState:
    d = tempfile.mkdtemp(prefix="relayd-stores-")
    state = SQLiteState.in_dir(d, reactor)
    test.addCleanup(state.close)
    return state


# --- credentials and agents (SQLite) ---------------------------------------------------------


class CredentialAndAgentStoreTests(TestCase):
    """ICredentialStore and IAgentStore on SQLite, with the admin command as the other writer."""

    def setUp(self) -> None:
        self.state = sqlite_state(self)
        self.dir = os.path.dirname(self.state.db.path)
        kek = os.path.join(self.dir, "kek")
        with open(kek, "w") as f:
            f.write(os.urandom(32).hex())
        self.kek = kek

    def issue(self, *args: str) -> dict[str, str]:
        out = io.StringIO()
        assert admin.main(["issue", "--state-dir", self.dir, "--kek-file", self.kek, *args], stdout=out) == 0
        import json

        return json.loads(out.getvalue())

    def test_provides_the_interfaces(self) -> None:
        self.assertTrue(verifyObject(ICredentialStore, self.state))
        self.assertTrue(verifyObject(IAgentStore, self.state))

    async def test_credential_lookup_and_revocation_by_another_process(self) -> None:
        issued = self.issue("--agent", "alice", "--actions", "channel.read", "--channel", CHANNEL)
        h = credential_hash(issued["credential"])
        cred = await self.state.credential(h)
        assert cred is not None and not cred.revoked
        assert cred.agent_pubkey == issued["agentPubkey"] and cred.actions == frozenset({"channel.read"})
        assert await self.state.credential(credential_hash("bzh_unknown")) is None
        # The admin command commits on its own connection: the cached credential must not survive it.
        assert admin.main(["revoke", "--state-dir", self.dir, "--id", cred.id], stdout=io.StringIO()) == 0
        again = await self.state.credential(h)
        assert again is not None and again.revoked

    async def test_agent_lookup_sees_other_writers(self) -> None:
        issued = self.issue("--agent", "bob", "--actions", "profile.set")
        agent = await self.state.agent(issued["agentPubkey"])
        assert agent is not None and agent.name == "bob" and agent.owner is None and not agent.deleted
        owner = "79be667ef9dcbbac55a06295ce870b07029bfcdb2dce28d959f2815b16f81798"
        self.issue("--agent", issued["agentPubkey"], "--owner", owner, "--actions", "storage.address")
        changed = await self.state.agent(issued["agentPubkey"])
        assert changed is not None and changed.owner == owner
        assert await self.state.agent("b" * 64) is None

    async def test_effects_create_update_delete(self) -> None:
        issued = self.issue("--agent", "owner", "--channel", CHANNEL)
        kid = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
        await self.state.apply_effects([managed(kid, "kid", issued["agentPubkey"])])
        agent = await self.state.agent(kid)
        assert isinstance(agent, Agent) and agent.managed and agent.depth == 1 and agent.name == "kid"
        assert [a.pubkey for a in await self.state.agents_named(issued["agentPubkey"], "kid")] == [kid]
        # the same effects again (a resumed plan) change nothing
        await self.state.apply_effects([managed(kid, "kid", issued["agentPubkey"])])
        assert len(await self.state.agents_named(issued["agentPubkey"], "kid")) == 1
        await self.state.apply_effects(
            [{"op": "update_agent", "pubkey": kid, "name": "kid2", "settings": {"respondTo": "anyone"}, "record_created_at": 9}]
        )
        updated = await self.state.agent(kid)
        assert updated is not None and updated.name == "kid2" and updated.settings == {"respondTo": "anyone"}
        assert await self.state.agents_named(issued["agentPubkey"], "kid") == []
        kid_cred = self.issue("--agent", kid, "--channel", CHANNEL)
        await self.state.apply_effects([{"op": "delete_agent", "pubkey": kid}])
        deleted = await self.state.agent(kid)
        assert deleted is not None and deleted.deleted and deleted.sealed_key is None
        revoked = await self.state.credential(credential_hash(kid_cred["credential"]))
        assert revoked is not None and revoked.revoked

    async def test_typed_effects_and_their_stored_form_are_one(self) -> None:
        """Issue 23: effects are typed values; the C{{"op": ...}} objects every stored plan holds parse
        to them and back unchanged, either form applies alike, and an unknown C{op} changes nothing."""
        owner = self.issue("--agent", "owner", "--channel", CHANNEL)["agentPubkey"]
        kid = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
        update = {"op": "update_agent", "pubkey": kid, "name": "kid2", "settings": {"a": 1}, "record_created_at": 9}
        stored = [managed(kid, "kid", owner), update, {"op": "delete_agent", "pubkey": kid}]
        typed = effects.parse_all(stored)
        assert [type(e) for e in typed] == [effects.CreateAgent, effects.UpdateAgent, effects.DeleteAgent]
        assert [e.stored() for e in typed] == stored
        assert Plan.from_bytes(Plan("agents.create", {}, [], stored, {}).to_bytes()).effects == stored  # a stored plan
        await self.state.apply_effects([typed[0]])
        created = await self.state.agent(kid)
        assert created is not None and created.name == "kid" and created.sealed_key == bytes.fromhex("01" * 40)
        with self.assertRaises(effects.UnknownEffect):
            await self.state.apply_effects([typed[1], {"op": "rename_agent", "pubkey": kid}])
        unchanged = await self.state.agent(kid)
        assert unchanged is not None and unchanged.name == "kid"
        await self.state.apply_effects([update])
        updated = await self.state.agent(kid)
        assert updated is not None and updated.name == "kid2"

    async def test_a_write_waits_for_another_process_holding_the_lock(self) -> None:
        other = StateDB(self.state.db.path)
        self.addCleanup(other.close)
        other.conn.execute("BEGIN IMMEDIATE")  # the admin command mid-transaction
        kid = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
        d = self.state.apply_effects([managed(kid, "kid")])
        later = self.state.store_plan(P, "r-after", digest(b"x"), b"{}")
        self.assertNoResult(d)
        self.assertNoResult(later)  # handed to the worker thread, the reactor not blocked
        other.conn.execute("COMMIT")
        await d
        await later
        assert (await self.state.agent(kid)) is not None
        receipt = await self.state.receipt(P, "r-after")
        assert receipt is not None and receipt.state == "pending"


    async def test_event_clock_separates_identical_events_and_survives_reopening(self) -> None:
        """IAgentStore.stamp: identical events of one identity never share a second; distinct ones keep it."""
        same, other = b"s" * STAMP_DIGEST_BYTES, b"o" * STAMP_DIGEST_BYTES
        assert await self.state.stamp(P, same, 1000, -1) == 1000
        assert await self.state.stamp(P, other, 1000, -1) == 1000  # distinct: the wall-clock second
        assert await self.state.stamp(P, same, 1000, -1) == 1001  # identical: the next second
        assert await self.state.stamp(P, other, 1000, -1) == 1001  # never earlier than one handed out
        assert await self.state.stamp("b" * 64, same, 1000, -1) == 1000  # per identity
        assert await self.state.stamp(P, b"x" * STAMP_DIGEST_BYTES, 1000, 1005) == 1006  # after `after`
        # another connection (a restart, or another instance on the same state) continues the clock
        other_db = StateDB(self.state.db.path)
        self.addCleanup(other_db.close)
        assert other_db.stamp(P, b"x" * STAMP_DIGEST_BYTES, 900) == 1007
        assert await self.state.stamp(P, b"x" * STAMP_DIGEST_BYTES, 900, -1) == 1008
        # a digest is only found at a digest boundary: a match straddling two stored digests is none
        straddle = b"x" * (STAMP_DIGEST_BYTES // 2) + b"y" * (STAMP_DIGEST_BYTES // 2)
        assert await self.state.stamp(P, b"y" * STAMP_DIGEST_BYTES, 1008, -1) == 1008
        assert await self.state.stamp(P, straddle, 1008, -1) == 1008

    async def test_event_clock_moves_on_after_the_per_second_cap(self) -> None:
        for i in range(STAMPS_PER_SECOND):
            assert self.state.db.stamp(P, i.to_bytes(STAMP_DIGEST_BYTES, "big"), 50) == 50
        assert await self.state.stamp(P, b"z" * STAMP_DIGEST_BYTES, 50, -1) == 51


# --- receipts (SQLite and Redis) ---------------------------------------------------------------


class ReceiptStoreContract:
    """Behaviour every IReceiptStore has; subclasses provide C{make()} (and C{agents})."""

    agents: SQLiteState

    async def make(self) -> IReceiptStore:
        raise NotImplementedError

    async def test_provides_the_interface(self) -> None:
        store = await self.make()
        self.assertTrue(verifyObject(IReceiptStore, store))

    async def test_new_then_done_replays(self) -> None:
        store = await self.make()
        assert await store.receipt(P, "r1") is None
        claim = await store.claim(P, "r1", digest(b"one"))
        assert claim.status == "new"
        stored = await store.complete(P, "r1", digest(b"one"), b'{"verdict":1}', [])
        assert stored == b'{"verdict":1}'
        again = await store.claim(P, "r1", digest(b"one"))
        assert again.status == "done" and again.response == b'{"verdict":1}'
        receipt = await store.receipt(P, "r1")
        assert receipt is not None and receipt.state == "done" and receipt.digest == digest(b"one")

    async def test_other_bytes_conflict_and_principals_are_separate(self) -> None:
        store = await self.make()
        await store.claim(P, "r1", digest(b"one"))
        await store.complete(P, "r1", digest(b"one"), b"{}", [])
        assert (await store.claim(P, "r1", digest(b"two"))).status == "conflict"
        assert (await store.claim("b" * 64, "r1", digest(b"two"))).status == "new"

    async def test_a_stored_plan_is_resumed_until_completed(self) -> None:
        store = await self.make()
        assert (await store.claim(P, "r2", digest(b"post"))).status == "new"
        await store.store_plan(P, "r2", digest(b"post"), b'{"plan":1}')
        receipt = await store.receipt(P, "r2")
        assert receipt is not None and receipt.state == "pending" and receipt.plan == b'{"plan":1}'
        await store.release(P, "r2")  # no verdict (the relay did not answer): the plan stays
        claim = await store.claim(P, "r2", digest(b"post"))
        assert claim.status == "resume" and claim.plan == b'{"plan":1}'
        assert (await store.claim(P, "r2", digest(b"other"))).status == "conflict"
        await store.complete(P, "r2", digest(b"post"), b'{"ok":1}', [])
        receipt = await store.receipt(P, "r2")
        assert receipt is not None and receipt.state == "done" and not receipt.plan
        assert (await store.claim(P, "r2", digest(b"post"))).response == b'{"ok":1}'

    async def test_a_released_bare_claim_leaves_nothing(self) -> None:
        store = await self.make()
        assert (await store.claim(P, "r3", digest(b"x"))).status == "new"
        await store.release(P, "r3")  # e.g. invalid arguments only the host can judge: not recorded
        assert await store.receipt(P, "r3") is None
        assert (await store.claim(P, "r3", digest(b"y"))).status == "new"  # other bytes are no conflict

    async def test_complete_applies_effects(self) -> None:
        store = await self.make()
        kid = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
        await store.claim(P, "r4", digest(b"create"))
        await store.store_plan(P, "r4", digest(b"create"), b"{}")
        await store.complete(P, "r4", digest(b"create"), b"{}", [managed(kid, "kid")])
        agent = await self.agents.agent(kid)
        assert agent is not None and agent.owner == P and agent.managed

    async def test_verdict_bytes_round_trip(self) -> None:
        store = await self.make()
        body = '{"content":"h\u00e9 \U0001f41d \\u0000"}'.encode("utf-8") + bytes(range(256))
        await store.claim(P, "r/5:x", digest(body))
        await store.complete(P, "r/5:x", digest(body), body, [])
        assert (await store.claim(P, "r/5:x", digest(body))).response == body

    async def test_wait_returns_by_its_timeout(self) -> None:
        store = await self.make()
        await store.wait(P, "nobody", 0.01)


class SQLiteReceiptStoreTests(ReceiptStoreContract, TestCase):
    async def make(self) -> IReceiptStore:
        self.agents = sqlite_state(self)
        return self.agents

    async def test_a_receipt_survives_reopening(self) -> None:
        state = await self.make()
        await state.claim(P, "r", digest(b"b"))
        await state.complete(P, "r", digest(b"b"), b"{}", [])
        path = self.agents.db.path
        reopened = SQLiteState(StateDB(path), reactor)
        self.addCleanup(reopened.close)
        assert (await reopened.claim(P, "r", digest(b"b"))).status == "done"


class RedisReceiptStoreTests(ReceiptStoreContract, TestCase):
    async def make(self, prefix: str | None = None, lease: float = 60.0) -> RedisReceipts:
        server = shared_redis()
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        if not hasattr(self, "agents"):
            self.agents = sqlite_state(self)
        if prefix is None:
            prefix = self.prefix = f"t{next(_prefixes)}:{id(self)}:"
        store = RedisReceipts(redis, Timekeeper(reactor), self.agents.apply_effects, prefix=prefix, lease=lease)
        self.addCleanup(store.close)
        await store.bus.ready
        self.redis = redis
        return store

    async def test_a_claim_held_elsewhere_is_busy_until_settled(self) -> None:
        a = await self.make()
        b = await self.make(prefix=self.prefix)  # another instance on the same Redis
        assert (await a.claim(P, "r", digest(b"x"))).status == "new"
        assert (await b.claim(P, "r", digest(b"x"))).status == "busy"
        assert (await b.claim(P, "r", digest(b"y"))).status == "conflict"
        woken = b.wait(P, "r", 30.0)
        self.assertNoResult(woken)
        await a.complete(P, "r", digest(b"x"), b'{"v":1}', [])
        await woken  # the verdict's notification, long before the 30 s timeout
        claim = await b.claim(P, "r", digest(b"x"))
        assert claim.status == "done" and claim.response == b'{"v":1}'

    async def test_a_release_wakes_waiters_and_frees_the_claim(self) -> None:
        a = await self.make()
        b = await self.make(prefix=self.prefix)
        await a.claim(P, "r", digest(b"x"))
        await a.store_plan(P, "r", digest(b"x"), b'{"plan":2}')
        woken = b.wait(P, "r", 30.0)
        await a.release(P, "r")  # the relay did not answer: the plan stays for whoever retries
        await woken
        claim = await b.claim(P, "r", digest(b"x"))
        assert claim.status == "resume" and claim.plan == b'{"plan":2}'

    async def test_a_lapsed_lease_is_taken_over_and_the_old_holder_cannot_store(self) -> None:
        a = await self.make()
        b = await self.make(prefix=self.prefix)
        await a.claim(P, "r", digest(b"x"))
        # The holder crashed: its lease lapses (deleted here rather than waited for).
        await self.redis.execute("t", "DEL", (self.prefix + f"buzz:l:{{{P}:r}}").encode())
        assert (await b.claim(P, "r", digest(b"x"))).status == "new"
        with self.assertRaises(Exception) as info:
            await a.store_plan(P, "r", digest(b"x"), b"{}")
        assert "LEASE" in str(info.exception)
        await b.store_plan(P, "r", digest(b"x"), b'{"plan":3}')
        receipt = await b.receipt(P, "r")
        assert receipt is not None and receipt.plan == b'{"plan":3}'

    async def test_own_stale_lease_does_not_block_this_instance(self) -> None:
        a = await self.make()
        await a.claim(P, "r", digest(b"x"))
        a._tokens.clear()  # the release never reached Redis (it was down): the lease is left behind
        assert (await a.claim(P, "r", digest(b"x"))).status == "new"

    async def test_first_verdict_wins(self) -> None:
        a = await self.make()
        b = await self.make(prefix=self.prefix)
        await a.claim(P, "r", digest(b"x"))
        assert await a.complete(P, "r", digest(b"x"), b'{"first":1}', []) == b'{"first":1}'
        assert await b.complete(P, "r", digest(b"x"), b'{"second":1}', []) == b'{"first":1}'

    async def test_receipts_expire_eventually(self) -> None:
        a = await self.make()
        await a.claim(P, "r", digest(b"x"))
        await a.complete(P, "r", digest(b"x"), b"{}", [])
        ttl = await self.redis.execute("t", "TTL", (self.prefix + f"buzz:r:{{{P}:r}}").encode())
        assert 0 < int(ttl) <= 30 * 24 * 3600

    async def test_redis_down_fails_fast(self) -> None:
        from relayd.base.errors import StoreUnavailable
        from relayd.storage.redis import Redis

        dead = Redis("redis://127.0.0.1:1/0", Timekeeper(reactor))
        self.addCleanup(dead.close)
        store = RedisReceipts(dead, Timekeeper(reactor), self.agents_or_new().apply_effects, prefix="x:")
        self.addCleanup(store.close)
        started = reactor.seconds()
        with self.assertRaises(StoreUnavailable):
            await store.claim(P, "r", digest(b"x"))
        assert reactor.seconds() - started < 1.0

    def agents_or_new(self) -> SQLiteState:
        if not hasattr(self, "agents"):
            self.agents = sqlite_state(self)
        return self.agents
