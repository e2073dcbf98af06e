"""Several MCP relay instances sharing one real redis-server behave as one relay (issue 5, MCP part).

Each instance is a whole in-process MCP wing (its own listener, Redis pool, bus subscription and
clock), as a separate ``twistd`` process would have; they share only Redis. A page on A, an agent on
B and a poller landing on C each time; unregister or expiry on one instance ends streams and parked
polls on the others; Redis restarted during traffic.
"""

from __future__ import annotations

import json
import time
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from relayd.mcp.service import McpService
from tests.support.http import Reply
from tests.support.mcp import TOKEN, disconnect, next_mcp
from tests.support.redis import RedisServer, redis_flags, shared_redis
from tests.support.sse import SSEClient
from tests.support.wing import Wing

SESSION = "multi-01"
REQUEST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
REPLY = {"jsonrpc": "2.0", "id": 1, "result": {"tools": []}}


class Instances(TestCase):
    """Starts C{count} wings on one Redis key prefix; C{self.urls[i]} is instance i's base URL."""

    timeout = 60
    count = 3

    async def setUp(self) -> None:  # type: ignore[override]
        self.redis_url = self.redis_server_url()
        flags = redis_flags(self.redis_url)
        self.wings: list[Wing] = []
        self.services: list[McpService] = []
        self.urls: list[str] = []
        self.streams: list[SSEClient] = []
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(self._stop)
        for _ in range(self.count):
            await self.start_instance(flags)
        await self.post(0, "/register", {"session": SESSION, "token": TOKEN})

    def redis_server_url(self) -> str:
        return shared_redis().url

    async def start_instance(self, flags: dict[str, str]) -> None:
        wing = await Wing.start("mcp", {"mcp-reap-interval-ms": "0", **flags})
        self.wings.append(wing)
        self.services.append(wing.service)
        self.urls.append(wing.url)

    async def _stop(self) -> None:
        for wing in self.wings:
            if wing.service.running:
                await wing.service.stopService()
        for stream in self.streams:
            await disconnect(stream)
            await stream.pool.closeCachedConnections()
        await self.pool.closeCachedConnections()
        for wing in self.wings:
            await wing.stop()

    async def request(self, i: int, method: str, path: str, body: Any = None, timeout: float = 5.0) -> Reply:
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        d = treq.request(method, self.urls[i] + path, data=data, pool=self.pool,
                         headers={"content-type": "application/json"})
        d.addTimeout(timeout, reactor)
        response = await d
        return Reply(response.code, response.headers, await treq.content(response))

    async def post(self, i: int, path: str, body: Any = None) -> Reply:
        return await self.request(i, "POST", path, body if body is not None else b"")

    async def poll(self, i: int, query: str, timeout: float = 5.0) -> Reply:
        return await self.request(i, "GET", f"/{SESSION}/poll?token={TOKEN}{query}", timeout=timeout)

    async def parked(self, i: int) -> None:
        """Until instance i has a poll parked (its tunnel relay counts it)."""
        deadline = time.monotonic() + 5
        while self.services[i].tunnel.parked_polls() == 0:
            assert time.monotonic() < deadline, "the poll never parked"
            await deferLater(reactor, 0.005, lambda: None)  # polling the instance's own state

    async def events(self, i: int, direction: str) -> SSEClient:
        stream = await SSEClient.connect(f"{self.urls[i]}/{SESSION}/events?token={TOKEN}&direction={direction}")
        self.streams.append(stream)
        assert stream.code == 200
        return stream


class MultiInstanceTests(Instances):
    async def test_page_on_a_agent_on_b_round_trip_with_presence(self) -> None:
        page = await self.events(0, "inbound")
        agent = await self.events(1, "outbound")
        joined = (await next_mcp(page)).json()
        self.assertEqual(joined["method"], "notifications/peer_joined")
        self.assertEqual((await self.post(1, f"/{SESSION}/inbox?token={TOKEN}&client=alice", REQUEST)).code, 200)
        self.assertEqual((await next_mcp(page)).json(), REQUEST)
        self.assertEqual((await self.post(0, f"/{SESSION}/outbox?token={TOKEN}", REPLY)).code, 200)
        self.assertEqual((await next_mcp(agent)).json(), REPLY)
        # The agent leaves B: the page on A hears it.
        await disconnect(agent)
        left = (await next_mcp(page)).json()
        self.assertEqual((left["method"], left["params"]["subscriberId"]),
                         ("notifications/peer_left", joined["params"]["subscriberId"]))

    async def test_poller_landing_on_another_instance_each_time(self) -> None:
        page = await self.events(0, "inbound")
        first = (await self.poll(1, "&direction=outbound&wait=0")).json()
        sub = first["subscriber"]
        self.assertEqual((await next_mcp(page)).json()["params"]["subscriberId"], sub)
        # Adopted on C, not created again: no second peer_joined (the next page event is the request).
        again = await self.poll(2, f"&direction=outbound&wait=0&subscriber={sub}")
        self.assertEqual(again.json(), {"subscriber": sub, "frames": []})
        # A poll parked on C is woken by a reply posted on A.
        parked = Deferred.fromCoroutine(self.poll(2, f"&direction=outbound&wait=20000&subscriber={sub}"))
        await self.parked(2)
        await self.post(1, f"/{SESSION}/inbox?token={TOKEN}", REQUEST)
        self.assertEqual((await next_mcp(page)).json(), REQUEST)
        started = time.monotonic()
        await self.post(0, f"/{SESSION}/outbox?token={TOKEN}", REPLY)
        result = (await parked).json()
        self.assertLess(time.monotonic() - started, 2.0)
        self.assertEqual((result["subscriber"], [json.loads(f) for f in result["frames"]]), (sub, [REPLY]))
        # Queued while no poll is parked anywhere, taken on B.
        await self.post(2, f"/{SESSION}/outbox?token={TOKEN}", {"jsonrpc": "2.0", "method": "n"})
        later = (await self.poll(1, f"&direction=outbound&wait=0&subscriber={sub}")).json()
        self.assertEqual([json.loads(f) for f in later["frames"]], [{"jsonrpc": "2.0", "method": "n"}])

    async def test_labelled_clients_on_different_instances_get_their_own_reply(self) -> None:
        alice = await self.events(1, "outbound&client=alice")
        bob = (await self.poll(2, "&direction=outbound&wait=0&client=bob")).json()["subscriber"]
        page = await self.events(0, "inbound")
        await self.post(1, f"/{SESSION}/inbox?token={TOKEN}&client=alice", REQUEST)
        await self.post(2, f"/{SESSION}/inbox?token={TOKEN}&client=bob", REQUEST)
        seen = [(await next_mcp(page)).json() for _ in range(2)]
        ids = [m["id"] for m in seen]
        self.assertEqual(ids[0], 1)
        self.assertNotEqual(ids[1], 1)  # bob's id collided and was rewritten (decision MCP 6)
        for forwarded in reversed(ids):
            await self.post(0, f"/{SESSION}/outbox?token={TOKEN}", {"jsonrpc": "2.0", "id": forwarded, "result": {}})
        self.assertEqual((await next_mcp(alice)).json()["id"], 1)
        bobs = (await self.poll(0, f"&direction=outbound&wait=0&subscriber={bob}")).json()["frames"]
        self.assertEqual([json.loads(f)["id"] for f in bobs], [1])

    async def test_first_frame_backlog_is_shared(self) -> None:
        await self.post(0, f"/{SESSION}/inbox?token={TOKEN}", REQUEST)
        first = (await self.poll(1, "&direction=inbound&wait=0")).json()
        self.assertEqual([json.loads(f) for f in first["frames"]], [REQUEST])
        self.assertEqual((await self.poll(2, "&direction=inbound&wait=0")).json()["frames"], [])

    async def test_unregister_on_a_ends_stream_on_b_and_releases_poll_on_c_within_1s(self) -> None:
        agent = await self.events(1, "outbound")
        sub = (await self.poll(2, "&direction=inbound&wait=0")).json()["subscriber"]
        parked = Deferred.fromCoroutine(self.poll(2, f"&direction=inbound&wait=20000&subscriber={sub}"))
        await self.parked(2)
        started = time.monotonic()
        self.assertEqual((await self.post(0, f"/{SESSION}/unregister?token={TOKEN}")).json(), {"ok": True})
        await agent.read_until_end(timeout=1.0)
        released = await parked
        self.assertLess(time.monotonic() - started, 1.0)
        self.assertEqual((released.code, released.json()["frames"]), (200, []))
        self.assertEqual((await self.poll(1, "&direction=inbound&wait=0")).code, 410)

    async def test_expiry_reaped_on_one_instance_ends_streams_on_another(self) -> None:
        page = await self.events(1, "inbound")
        tunnel = self.services[0].tunnel
        # Age the session as the TTL would (time is the one thing tests fake), then reap on A.
        await tunnel.store.touch_session(SESSION, tunnel.clock.seconds() - 10 * 3600)
        started = time.monotonic()
        await tunnel.reap()
        await page.read_until_end(timeout=1.0)
        self.assertLess(time.monotonic() - started, 1.0)
        self.assertEqual((await self.poll(2, "&direction=inbound&wait=0")).code, 410)


class ConcurrentLabelledAgentsTests(Instances):
    """Labelled agents on two instances asking at once with the same ids: the ids the page sees are
    unique whichever instance rewrote them, so every answer reaches its asker under its own id."""

    count = 2
    per_agent = 60

    async def test_every_answer_reaches_its_asker_with_its_own_id_and_none_is_lost(self) -> None:
        page = await self.events(0, "inbound")
        agents = {label: (i % 2, await self.events(i % 2, f"outbound&client={label}"))
                  for i, label in enumerate(("ann", "bob", "cat", "dan"))}
        for _ in agents:
            self.assertEqual((await next_mcp(page)).json()["method"], "notifications/peer_joined")
        asked = [
            self.post(instance, f"/{SESSION}/inbox?token={TOKEN}&client={label}",
                      {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"agent": label, "n": n}})
            for n in range(1, self.per_agent + 1)
            for label, (instance, _) in agents.items()
        ]
        for reply in await gatherResults([Deferred.fromCoroutine(a) for a in asked]):
            self.assertEqual(reply.code, 200, reply.body)
        # Unlabelled posters on both instances reuse those pending ids: rewritten too, by both at once.
        anonymous = [
            self.post(instance, f"/{SESSION}/inbox?token={TOKEN}",
                      {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"agent": None, "n": n}})
            for n in range(1, self.per_agent + 1)
            for instance in (0, 1)
        ]
        for reply in await gatherResults([Deferred.fromCoroutine(a) for a in anonymous]):
            self.assertEqual(reply.code, 200, reply.body)
        seen = [(await next_mcp(page)).json() for _ in asked + anonymous]
        forwarded = [m["id"] for m in seen]
        self.assertEqual(len(set(map(json.dumps, forwarded))), len(forwarded), "the page saw an id twice")
        # The page answers each request with what it asked, half of the answers through each instance
        # (the unlabelled posters' answers reach nobody: labelled readers are there).
        answered = [
            self.post(k % 2, f"/{SESSION}/outbox?token={TOKEN}", {"jsonrpc": "2.0", "id": m["id"], "result": m["params"]})
            for k, m in enumerate(seen)
        ]
        for reply in await gatherResults([Deferred.fromCoroutine(a) for a in answered]):
            self.assertEqual(reply.code, 200, reply.body)
        for label, (_, stream) in agents.items():
            got = [(await next_mcp(stream)).json() for _ in range(self.per_agent)]
            self.assertEqual(
                sorted((m["id"], m["result"]["agent"], m["result"]["n"]) for m in got),
                [(n, label, n) for n in range(1, self.per_agent + 1)],
            )


class DeadInstanceTests(Instances):
    count = 2

    async def test_streams_of_an_instance_that_stopped_listening_are_forgotten(self) -> None:
        page = await self.events(0, "inbound")
        await self.events(1, "outbound")
        joined = (await next_mcp(page)).json()["params"]["subscriberId"]
        await self.services[1].tunnel.bus.stop()  # B is gone as far as Redis can tell
        refused = await self.post(0, f"/{SESSION}/outbox?token={TOKEN}", REPLY)
        self.assertEqual((refused.code, refused.json()), (503, {"error": "store_unavailable", "store": "mcp"}))
        left = (await next_mcp(page)).json()
        self.assertEqual((left["method"], left["params"]["subscriberId"]), ("notifications/peer_left", joined))
        # The retry no longer counts on B's stream: it waits in the backlog for the next agent.
        self.assertEqual((await self.post(0, f"/{SESSION}/outbox?token={TOKEN}", REPLY)).code, 200)
        first = (await self.poll(0, "&direction=outbound&wait=0")).json()
        self.assertEqual([json.loads(f) for f in first["frames"]], [REPLY])


class RedisRestartTests(Instances):
    """Redis goes away during traffic and comes back: prompt 503s, then service without a restart."""

    count = 2

    def redis_server_url(self) -> str:
        self.redis_server = RedisServer.start()
        self.addCleanup(self.redis_server.cleanup)
        return self.redis_server.url

    async def test_restart_during_traffic(self) -> None:
        # Acknowledged before the restart: a frame queued for a poller.
        sub = (await self.poll(1, "&direction=outbound&wait=0")).json()["subscriber"]
        self.assertEqual((await self.post(0, f"/{SESSION}/outbox?token={TOKEN}", REPLY)).json(), {"ok": True})
        page = await self.events(0, "inbound")
        parked = Deferred.fromCoroutine(self.poll(1, "&direction=inbound&wait=1000", timeout=10.0))
        await self.parked(1)

        self.redis_server.stop(save=True)
        started = time.monotonic()
        refused = await self.post(1, f"/{SESSION}/inbox?token={TOKEN}", REQUEST)
        self.assertLess(time.monotonic() - started, 5.0)
        self.assertEqual((refused.code, refused.json()), (503, {"error": "store_unavailable", "store": "mcp"}))
        gone = await parked  # in flight when Redis went: it answers (its wait ended without Redis)
        self.assertLess(time.monotonic() - started, 5.0)
        self.assertEqual(gone.code, 503)

        self.redis_server._spawn()
        deadline = time.monotonic() + 20
        while True:
            reply = await self.post(1, f"/{SESSION}/inbox?token={TOKEN}", {"jsonrpc": "2.0", "method": "ping"})
            if reply.code == 200:
                break
            self.assertEqual(reply.code, 503)
            self.assertLess(time.monotonic(), deadline, "relayd did not reconnect to Redis")
            await deferLater(reactor, 0.1, lambda: None)  # retrying as a client would, until Redis is back
        # The stream on A lived through an outage of its bus: it is ended so its client re-subscribes.
        await page.read_until_end(timeout=10.0)
        for wing in self.wings:
            await wing.ready()
        page = await self.events(0, "inbound")
        # Acknowledged data survived, and traffic flows across instances again.
        kept = (await self.poll(0, f"&direction=outbound&wait=0&subscriber={sub}")).json()
        self.assertEqual([json.loads(f) for f in kept["frames"]], [REPLY])
        self.assertEqual((await self.post(1, f"/{SESSION}/inbox?token={TOKEN}", REQUEST)).code, 200)
        while (message := (await next_mcp(page)).json()) != REQUEST:
            self.assertEqual(message, {"jsonrpc": "2.0", "method": "ping"})  # held while no page listened
