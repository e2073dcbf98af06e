"""A relayd left on a demoted master (a plain redis:// URL after a failover it cannot follow: the node
it talks to became a replica of another) answers 503 on every wing, never 500 (issue 25, item 3):
AEP ingest, the MCP tunnel (register, inbox, outbox, poll), the MCP standard endpoint, the broker's
receipts. Reads the replica can serve (an AEP replay) are still served."""

from __future__ import annotations

import json

from twisted.internet import defer
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.base.errors import StoreRefused
from relayd.buzz.redis.state import RedisReceipts
from tests.storage.test_redis import until
from tests.support.aep import event, open_sse, start_relay
from tests.support.http import HttpClient
from tests.support.mcp import INIT
from tests.support.redis import RedisServer, command, connected_redis, role
from tests.support.wing import Wing

TOKEN = "t" * 32
SESSION = "replica1"
UNAVAILABLE_AEP = (503, {"error": "store-unavailable", "store": "aep"})
UNAVAILABLE_MCP = (503, {"error": "store_unavailable", "store": "mcp"})


def synced(port: int) -> bool:
    return b"master_link_status:up" in (command(port, "INFO", "replication") or b"")


class OnADemotedMaster(TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.old = RedisServer.start()
        self.addCleanup(self.old.cleanup)
        self.new = RedisServer.start("--replicaof", "127.0.0.1", str(self.old.port))
        self.addCleanup(self.new.cleanup)

    async def demote(self) -> None:
        """A failover done by hand: the replica promoted, the old master made its replica."""
        await until(self, lambda: synced(self.new.port), "the replica never synced")
        command(self.new.port, "REPLICAOF", "NO", "ONE")
        command(self.old.port, "REPLICAOF", "127.0.0.1", str(self.new.port))
        await until(self, lambda: role(self.old.port) == b"slave" and synced(self.old.port), "never demoted")

    async def test_every_wing_answers_503_never_500(self) -> None:
        flags = {"redis": self.old.url, "redis-prefix": "demoted:"}
        aep = await start_relay(self, redis=self.old.url, redis_prefix="demoted:")
        mcp = await Wing.start("mcp", {**flags, "mcp-reap-interval-ms": "0"})
        self.addCleanup(mcp.stop)
        page = HttpClient(self, mcp.url + mcp.settings["mcp-prefix"])
        redis = await connected_redis(self.old.url)
        self.addCleanup(redis.close)
        receipts = RedisReceipts(redis, Timekeeper(redis.clock.reactor), lambda effects: defer.succeed(None), prefix="b:")
        self.addCleanup(receipts.close)
        await receipts.bus.ready

        response, _ = await aep.post(event("S", 1))
        self.assertEqual(response.code, 202)
        reply = await page.post("/register", json.dumps({"session": SESSION, "token": TOKEN}).encode())
        self.assertEqual(reply.code, 200, reply.body)

        await self.demote()

        response, body = await aep.post(event("S", 2))
        self.assertEqual((response.code, json.loads(body)), UNAVAILABLE_AEP)
        history = await open_sse(self, aep, live="0", from_=[{"session": "S"}])  # a read: still served
        self.assertEqual([m.json()["seq"] for m in await history.read_until_end() if m.comment is None], [1])

        tunnel = {
            "register": ("POST", "/register", json.dumps({"session": "other1", "token": TOKEN}).encode()),
            "inbox": ("POST", f"/{SESSION}/inbox?token={TOKEN}", b'{"jsonrpc":"2.0","id":7,"method":"ping"}'),
            "outbox": ("POST", f"/{SESSION}/outbox?token={TOKEN}", b'{"jsonrpc":"2.0","method":"notifications/x"}'),
            "poll": ("GET", f"/{SESSION}/poll?token={TOKEN}&wait=0", None),
        }
        for name, (method, path, data) in tunnel.items():
            reply = await (page.post(path, data) if method == "POST" else page.get(path))  # type: ignore[arg-type]
            self.assertEqual((reply.code, reply.json()), UNAVAILABLE_MCP, name)
        reply = await page.post(
            f"/{SESSION}/mcp", json.dumps(INIT).encode(),
            authorization=f"Bearer {TOKEN}", accept="application/json, text/event-stream",
            **{"content-type": "application/json"},
        )  # fmt: skip
        self.assertEqual(reply.code, 503, reply.body)

        failure = await self.assertFailure(receipts.claim("p", "r", b"d" * 32), StoreRefused)
        self.assertEqual(failure.code, "READONLY")
