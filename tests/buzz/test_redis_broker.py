"""Several broker instances on one Redis (issue 5, broker part): retries replay across instances,
concurrent duplicates execute once, and Redis going away is a prompt C{internal} verdict.

Two in-process brokers share one state directory (credentials, keys, agents in SQLite) and one
real redis-server (receipts and pending events), each with its own HTTP listener and relay
connections, as two relayd processes on one host would.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time

from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.trial import unittest

from relayd.buzz.core import contract
from tests.buzz.harness import BrokerUnderTest, new_channel
from tests.support.nostr import shared_nostr_relay
from tests.support.redis import OnCluster, RedisServer, layout_url, shared_redis

_prefixes = itertools.count()


def body(action: str, args: dict, rid: str) -> bytes:
    return contract.freeze(contract.build_request(action, args, rid))


class TwoInstances(unittest.TestCase):
    timeout = 120

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        self.redis_url = layout_url(self)
        self.state = os.path.join(tempfile.mkdtemp(prefix="relayd-redis-broker-"), "state")
        prefix = f"t{next(_prefixes)}:{os.getpid()}:{id(self)}:"
        self.a = BrokerUnderTest(self.state, self.relay.url, redis_url=self.redis_url, redis_prefix=prefix)  # type: ignore[attr-defined]
        self.b = BrokerUnderTest(self.state, self.relay.url, redis_url=self.redis_url, redis_prefix=prefix)  # type: ignore[attr-defined]
        await self.a.start()
        await self.b.start()
        await self._redis_up(self.a)
        await self._redis_up(self.b)
        self.channel = new_channel()
        self.alice = self.a.issue(f"alice-{self.channel[:8]}", "--channel", self.channel)
        self.cred = self.alice["credential"]

    async def tearDown(self) -> None:
        await self.a.stop()
        await self.b.stop()

    async def _redis_up(self, broker: BrokerUnderTest) -> None:
        """Wait (bounded) for the instance's Redis pool and subscriber to connect."""
        service = broker.service
        assert service is not None and service.redis is not None
        for _ in range(500):
            if service.redis.connected and service.redis_receipts.bus.connected:
                return
            await deferLater(reactor, 0.01, lambda: None)  # polling a connection being made
        raise AssertionError("the broker did not connect to Redis")

    def relay_count(self, content: str) -> int:
        return len([e for e in self.relay.events(pubkey=self.alice["agentPubkey"]) if e["content"] == content])  # type: ignore[attr-defined]

    async def test_a_retry_on_the_other_instance_replays_the_verdict(self) -> None:
        b1 = body("message.post", {"channelId": self.channel, "content": "across"}, "req-across")
        status, first = await self.a.post(b1, self.cred)
        assert status == 200 and json.loads(first)["status"] == "succeeded"
        status, again = await self.b.post(b1, self.cred)
        assert status == 200 and again == first[:-1] + b',"replayed":true}'
        assert self.relay_count("across") == 1
        other = body("message.post", {"channelId": self.channel, "content": "different"}, "req-across")
        _, conflict = await self.b.post(other, self.cred)
        assert json.loads(conflict)["error"]["code"] == "request_id_conflict"

    async def test_identical_posts_through_both_instances_in_one_second_are_two_events(self) -> None:
        """The per-identity event clock lives in the shared state: instances cannot hand out one second twice."""
        second = int(time.time()) - 5
        for broker in (self.a, self.b):
            assert broker.service is not None
            broker.service.ops.now = lambda: second  # both clocks held in one second
        ids = []
        for broker, rid in ((self.a, "same-on-a"), (self.b, "same-on-b"), (self.a, "same-on-a-again")):
            _, data = await broker.post(body("message.post", {"channelId": self.channel, "content": "same"}, rid), self.cred)
            verdict = json.loads(data)
            assert verdict["status"] == "succeeded", verdict
            ids.append((verdict["outcome"]["eventId"], verdict["outcome"]["createdAt"]))
        assert [at for _, at in ids] == [second, second + 1, second + 2]
        held = {e["id"] for e in self.relay.events(pubkey=self.alice["agentPubkey"]) if e["content"] == "same"}  # type: ignore[attr-defined]
        assert held == {eid for eid, _ in ids}

    async def test_ten_concurrent_duplicates_over_two_instances_execute_once(self) -> None:
        b1 = body("message.post", {"channelId": self.channel, "content": "ten over two"}, "req-ten")
        calls = [defer.ensureDeferred((self.a if i % 2 else self.b).post(b1, self.cred)) for i in range(10)]
        results = await defer.gatherResults(calls)
        assert all(status == 200 for status, _ in results)
        parsed = [json.loads(data) for _, data in results]
        assert [p["status"] for p in parsed] == ["succeeded"] * 10, parsed
        assert sum(1 for p in parsed if "replayed" not in p) == 1
        assert sum(1 for p in parsed if p.get("replayed") is True) == 9
        assert len({p["outcome"]["eventId"] for p in parsed}) == 1
        assert self.relay_count("ten over two") == 1

    async def test_an_agent_created_on_one_instance_acts_through_the_other(self) -> None:
        create = body(
            "agents.create", {"channelId": self.channel, "displayName": "kid", "systemPrompt": "p"}, "req-kid"
        )
        _, data = await self.a.post(create, self.cred)
        kid = json.loads(data)["outcome"]["agentPubkey"]
        kid_cred = self.b.issue(kid, "--channel", self.channel)["credential"]
        out = await self.b.call(kid_cred, "message.post", {"channelId": self.channel, "content": "from kid"})
        assert out["status"] == "succeeded"
        delete = body("agents.delete", {"target": {"pubkey": kid}}, "req-kid-delete")
        _, gone = await self.b.post(delete, self.cred)
        assert json.loads(gone)["status"] == "succeeded"
        refused = await self.a.call(kid_cred, "message.post", {"channelId": self.channel, "content": "after"})
        assert refused["error"]["code"] == "unauthenticated"


class TwoInstancesOnCluster(OnCluster, TwoInstances):
    """The same two brokers on a 3-master Redis Cluster (issue 25)."""


class RedisGoesAway(unittest.TestCase):
    timeout = 120

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)
        state = os.path.join(tempfile.mkdtemp(prefix="relayd-redis-down-"), "state")
        self.broker = BrokerUnderTest(state, self.relay.url, redis_url=self.server.url)  # type: ignore[attr-defined]
        await self.broker.start()
        await TwoInstances._redis_up(self, self.broker)  # type: ignore[arg-type]
        self.channel = new_channel()
        self.alice = self.broker.issue("alice", "--channel", self.channel)
        self.cred = self.alice["credential"]

    async def tearDown(self) -> None:
        await self.broker.stop()

    async def test_internal_at_once_while_down_then_service_resumes(self) -> None:
        kept = body("message.post", {"channelId": self.channel, "content": "before"}, "req-before")
        _, before = await self.broker.post(kept, self.cred)
        assert json.loads(before)["status"] == "succeeded"
        self.server.stop(save=True)
        fresh = body("message.post", {"channelId": self.channel, "content": "while down"}, "req-down")
        started = time.monotonic()
        status, data = await self.broker.post(fresh, self.cred)
        elapsed = time.monotonic() - started
        resp = contract.read_http_response(contract.parse_request(fresh), status, data)
        assert resp.status == "failed" and resp.code == "internal", data
        assert "store is unavailable" in (resp.message or "") and self.server.url not in data.decode()
        assert elapsed < 3.0
        assert not [e for e in self.relay.events() if e["content"] == "while down"]  # type: ignore[attr-defined]
        self.server._spawn()  # same port, same data
        await TwoInstances._redis_up(self, self.broker)  # type: ignore[arg-type]
        # No relayd restart: the same bytes now execute, and the verdict from before is still there.
        _, data = await self.broker.post(fresh, self.cred)
        assert json.loads(data)["status"] == "succeeded", data
        self.broker.service.host.verdicts = type(self.broker.service.host.verdicts)()  # type: ignore[union-attr]
        _, again = await self.broker.post(kept, self.cred)
        assert again == before[:-1] + b',"replayed":true}'


class RedisDoesNotAnswer(unittest.TestCase):
    """Issue 22: a command Redis holds without answering (it is paused with the claim script in its
    socket) is an unknown outcome, answered C{indeterminate} (never C{failed}: "nothing happened"),
    and the retry of the same bytes executes it once."""

    timeout = 120

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        self.server = RedisServer.start()  # a private server: pausing it holds every client of it
        self.addCleanup(self.server.cleanup)
        state = os.path.join(tempfile.mkdtemp(prefix="relayd-redis-held-"), "state")
        self.broker = BrokerUnderTest(state, self.relay.url, redis_url=self.server.url)  # type: ignore[attr-defined]
        await self.broker.start()
        await TwoInstances._redis_up(self, self.broker)  # type: ignore[arg-type]
        self.channel = new_channel()
        self.alice = self.broker.issue("alice", "--channel", self.channel)
        self.cred = self.alice["credential"]

    async def tearDown(self) -> None:
        await self.broker.stop()

    async def test_a_held_claim_is_indeterminate_and_the_retry_executes_once(self) -> None:
        warm = body("message.post", {"channelId": self.channel, "content": "warm"}, "req-warm")
        _, data = await self.broker.post(warm, self.cred)  # Redis has the scripts (EVALSHA runs them)
        assert json.loads(data)["status"] == "succeeded", data
        held = body("message.post", {"channelId": self.channel, "content": "held"}, "req-held")
        self.server.pause(self)  # until after the client's 2 s wait
        status, data = await self.broker.post(held, self.cred)
        resp = contract.read_http_response(contract.parse_request(held), status, data)
        assert (resp.status, resp.code) == ("indeterminate", "internal"), data
        assert "may have recorded this request" in (resp.message or "") and "retry the same bytes" in (resp.message or "")
        await self.server.resume()  # then Redis runs the claim it held
        status, data = await self.broker.post(held, self.cred)
        assert json.loads(data)["status"] == "succeeded", data
        assert len([e for e in self.relay.events() if e["content"] == "held"]) == 1  # type: ignore[attr-defined]


class Wiring(unittest.TestCase):
    async def test_the_shared_redis_setting_puts_receipts_on_redis(self) -> None:
        from relayd.base.clock import Timekeeper
        from relayd.base.config import resolve
        from relayd.buzz.config import SETTINGS
        from relayd.buzz.redis.state import RedisReceipts
        from relayd.buzz.service import make_service
        from relayd.process import settings

        state = tempfile.mkdtemp(prefix="relayd-wiring-")
        flags = {"broker-nostr-relay": "ws://127.0.0.1:1", "broker-state-dir": state}
        plain = make_service(resolve(settings.REDIS_SETTINGS + SETTINGS, flags, {}), reactor, Timekeeper(reactor))
        assert plain is not None and plain.host.receipts is plain.state  # type: ignore[attr-defined]
        await plain.state.close()  # type: ignore[attr-defined]
        env = {"RELAYD_REDIS": shared_redis().url, "RELAYD_REDIS_PREFIX": "wiring:"}
        svc = make_service(resolve(settings.REDIS_SETTINGS + SETTINGS, flags, env), reactor, Timekeeper(reactor))
        assert svc is not None
        receipts = svc.host.receipts  # type: ignore[attr-defined]
        assert isinstance(receipts, RedisReceipts) and receipts.prefix == b"wiring:"
        await svc.state.close()  # type: ignore[attr-defined]
        await svc.redis.close()  # type: ignore[attr-defined]  # the process's shared client


class RedisReceiptRetention(unittest.TestCase):
    """Defect 4 with Redis: a read's receipt keeps the digest only; receipts expire after the retention."""

    timeout = 120

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        self.redis = shared_redis()
        self.prefix = f"ret{next(_prefixes)}:{os.getpid()}:{id(self)}:"
        state = os.path.join(tempfile.mkdtemp(prefix="relayd-redis-ret-"), "state")
        self.broker = BrokerUnderTest(
            state, self.relay.url, redis_url=self.redis.url, redis_prefix=self.prefix, receipt_retention=777  # type: ignore[attr-defined]
        )
        await self.broker.start()
        await TwoInstances._redis_up(self, self.broker)  # type: ignore[arg-type]
        self.channel = new_channel()
        self.cred = self.broker.issue(f"r-{self.channel[:8]}", "--channel", self.channel)["credential"]

    async def tearDown(self) -> None:
        await self.broker.stop()

    async def test_read_receipt_holds_no_page_and_receipts_expire(self) -> None:
        service = self.broker.service
        assert service is not None and service.redis is not None
        _, posted = await self.broker.post(body("message.post", {"channelId": self.channel, "content": "page me"}, "w1"), self.cred)
        assert json.loads(posted)["status"] == "succeeded"
        read = body("channel.read", {"channelId": self.channel}, "r1")
        _, page = await self.broker.post(read, self.cred)
        assert b"page me" in page
        redis = service.redis
        keys = [k for k in await redis.execute("test", "KEYS", self.prefix + "*") if "r1" in str(k) or "w1" in str(k)]
        dumped = {}
        for k in keys:
            if str(await redis.execute("test", "TYPE", k)) in ("hash", "b'hash'"):
                dumped[str(k)] = str(await redis.execute("test", "HGETALL", k))
        assert len(dumped) == 2, dumped  # the post's receipt and the read's
        assert not any("page me" in v for k, v in dumped.items() if "r1" in k), dumped  # no page stored
        assert any("spent" in v for k, v in dumped.items() if "r1" in k), dumped
        ttls = [await redis.execute("test", "TTL", k) for k in keys]
        assert all(0 < int(t) <= 777 for t in ttls), ttls  # --broker-receipt-retention
        other = body("channel.read", {"channelId": self.channel, "limit": 3}, "r1")
        _, conflict = await self.broker.post(other, self.cred)
        assert json.loads(conflict)["error"]["code"] == "request_id_conflict"
