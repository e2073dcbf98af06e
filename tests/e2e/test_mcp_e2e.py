"""End to end: a real ``twistd -n relayd`` serving the MCP tunnel relay (issue 3, acceptance 5)."""

from __future__ import annotations

import json
import signal

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.support.redis import OnCluster, layout_url
from tests.support.sse import SSEClient
from tests.support.twistd import RelaydProcess

TOKEN = "e2e_abcdefghijklmnopqrstuvwxyz"


class TwistdMCP(TestCase):
    timeout = 60

    async def test_round_trip_then_sigterm_ends_streams_and_releases_polls(self) -> None:
        proc = await RelaydProcess.start_for(
            self,
            ["--mcp-listen", "tcp:0:interface=127.0.0.1", "--no-aep", "--mcp-cors", "https://page.example"],
            wait_for=("mcp",),
        )
        base = f"http://127.0.0.1:{proc.port('mcp')}"
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)

        async def post(path: str, body: bytes) -> int:
            response = await treq.post(base + path, data=body, headers={"content-type": "application/json"}, pool=pool)
            await treq.content(response)
            return response.code

        self.assertEqual(await post("/register", json.dumps({"session": "e2e-1", "token": TOKEN}).encode()), 200)
        page = await SSEClient.connect(f"{base}/e2e-1/events?token={TOKEN}&direction=inbound")
        agent = await SSEClient.connect(f"{base}/e2e-1/events?token={TOKEN}&direction=outbound")
        self.assertEqual((page.code, agent.code), (200, 200))
        self.assertEqual(page.header("access-control-allow-origin"), None)  # no Origin sent
        self.assertEqual(page.header("vary"), "Origin")

        self.assertEqual(await post(f"/e2e-1/inbox?token={TOKEN}", b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}'), 200)
        seen = []
        while len(seen) < 2:
            msg = await page.next()
            assert msg is not None
            if msg.event == "mcp":
                seen.append(json.loads(msg.data or ""))
        self.assertEqual([m.get("method") for m in seen], ["notifications/peer_joined", "tools/list"])
        self.assertEqual(await post(f"/e2e-1/outbox?token={TOKEN}", b'{"jsonrpc":"2.0","id":1,"result":{"tools":[]}}'), 200)
        while True:
            msg = await agent.next()
            assert msg is not None
            if msg.event == "mcp":
                self.assertEqual(json.loads(msg.data or ""), {"jsonrpc": "2.0", "id": 1, "result": {"tools": []}})
                break

        # A poll parked for up to 20 s: shutdown must answer it, not drop it.
        parked = treq.get(f"{base}/e2e-1/poll?token={TOKEN}&direction=outbound&wait=20000", pool=pool)
        # Wait until the poll is known to be parked: the page sees the new poller's peer_joined.
        while True:
            msg = await page.next()
            assert msg is not None
            if msg.event == "mcp" and json.loads(msg.data or "").get("method") == "notifications/peer_joined":
                break

        status_d: Deferred[int] = Deferred.fromCoroutine(proc.terminate(signal.SIGTERM))
        page_rest = await page.read_until_end()
        agent_rest = await agent.read_until_end()
        self.assertIn("relay shutting down", [m.comment for m in page_rest])
        self.assertIn("relay shutting down", [m.comment for m in agent_rest])
        response = await parked
        self.assertEqual(response.code, 200)
        body = json.loads(await treq.content(response))
        self.assertEqual((sorted(body), body["frames"]), (["frames", "subscriber"], []))
        self.assertEqual(await status_d, 0)
        log = proc.log.decode(errors="replace")
        self.assertNotIn("Traceback", log)
        self.assertNotIn(TOKEN, log)
        self.assertIn("cors=https://page.example from --mcp-cors", log)

    async def test_refused_origin_policy_exits_2_with_one_line(self) -> None:
        proc = await RelaydProcess.start(["--mcp-cors", "null", "--no-aep"], wait_for=())
        self.assertEqual(await proc.exited, 2)
        lines = [line for line in proc.log.decode().splitlines() if line.strip()]
        self.assertEqual(len(lines), 1, lines)
        self.assertTrue(lines[0].startswith("relayd: error: --mcp-cors:"), lines)

    async def test_env_policy_error_names_the_variable(self) -> None:
        proc = await RelaydProcess.start(
            ["--no-aep"], env={"RELAYD_MCP_CORS_ALLOW_ORIGIN": "*,https://a.example"}, wait_for=()
        )
        self.assertEqual(await proc.exited, 2)
        self.assertIn(b"RELAYD_MCP_CORS_ALLOW_ORIGIN", proc.log)
        self.assertNotIn(b"Traceback", proc.log)


class TwistdMCPOnRedis(TestCase):
    """Two real relayd processes sharing one redis-server behave as one relay (issue 5, acceptance 2)."""

    timeout = 60

    async def test_page_on_a_agent_on_b_and_unregister_on_a_ends_the_stream_on_b(self) -> None:
        options = ["--mcp-listen", "tcp:0:interface=127.0.0.1", "--no-aep", "--redis", layout_url(self),
                   "--redis-prefix", f"e2e{id(self)}:"]
        a = await RelaydProcess.start_for(self, options, wait_for=("mcp",))
        b = await RelaydProcess.start_for(self, options, wait_for=("mcp",))
        base_a, base_b = f"http://127.0.0.1:{a.port('mcp')}", f"http://127.0.0.1:{b.port('mcp')}"
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)

        async def post(url: str, body: bytes) -> int:
            response = await treq.post(url, data=body, headers={"content-type": "application/json"}, pool=pool)
            await treq.content(response)
            return response.code

        # A fresh process answers 503 until its Redis pool is up: retry as a client would.
        register = json.dumps({"session": "e2e-redis", "token": TOKEN}).encode()
        for base in (base_a, base_b):
            for _ in range(200):
                if await post(base + "/register", register) == 200:
                    break
                await deferLater(reactor, 0.05, lambda: None)
            else:
                self.fail("relayd never reached Redis")
        page = await SSEClient.connect(f"{base_a}/e2e-redis/events?token={TOKEN}&direction=inbound")
        for _ in range(200):  # B subscribes to its bus channel just after start: until A can reach B's stream
            agent = await SSEClient.connect(f"{base_b}/e2e-redis/events?token={TOKEN}&direction=outbound")
            if await post(f"{base_a}/e2e-redis/outbox?token={TOKEN}", b'{"jsonrpc":"2.0","method":"hello"}') == 200:
                break
            await agent.close()
            await deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(await mcp_event(agent), {"jsonrpc": "2.0", "method": "hello"})
        self.assertEqual(await post(f"{base_b}/e2e-redis/inbox?token={TOKEN}", b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}'), 200)
        self.assertEqual((await mcp_event(page))["method"], "tools/list")  # presence skipped
        self.assertEqual(await post(f"{base_a}/e2e-redis/outbox?token={TOKEN}", b'{"jsonrpc":"2.0","id":1,"result":{}}'), 200)
        self.assertEqual((await mcp_event(agent))["id"], 1)

        started = reactor.seconds()
        self.assertEqual(await post(f"{base_a}/e2e-redis/unregister?token={TOKEN}", b""), 200)
        await agent.read_until_end(timeout=1.0)
        self.assertLess(reactor.seconds() - started, 1.0)
        await page.read_until_end(timeout=1.0)
        self.assertEqual(await a.terminate(signal.SIGTERM), 0)
        self.assertEqual(await b.terminate(signal.SIGTERM), 0)
        self.assertNotIn(b"Traceback", a.log + b.log)


async def mcp_event(stream: SSEClient) -> dict:
    """The next C{event: mcp} message that is not presence."""
    while True:
        msg = await stream.next()
        assert msg is not None, "stream ended"
        if msg.event == "mcp":
            message = json.loads(msg.data or "")
            if not str(message.get("method", "")).startswith("notifications/peer_"):
                return message


class TwistdMCPOnCluster(OnCluster, TwistdMCPOnRedis):
    """The same two processes on a 3-master Redis Cluster (issue 25)."""
