"""A real ``twistd -n relayd --redis redis+sentinel://...`` (issue 25): it finds the master through
sentinels that require their own password, on data nodes that require another, follows a failover
(logged), and neither password is ever in its log; the multi-instance AEP end-to-end tests
(tests/e2e/test_aep_redis_e2e.py, the MCP one of tests/e2e/test_mcp_e2e.py) pass on a Sentinel layout,
the master killed instead of restarted."""

from __future__ import annotations

import json

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.e2e import test_aep_redis_e2e as standalone
from tests.e2e import test_mcp_e2e
from tests.support.aep import event, ndjson
from tests.support.redis import SentinelGroup
from tests.support.twistd import RelaydProcess

DATA_PASSWORD = "data-pw-7f3e9a"
SENTINEL_PASSWORD = "sentinel-pw-2b8c4d"


class SentinelProcess(TestCase):
    timeout = 90

    def setUp(self) -> None:
        self.group = SentinelGroup.start(password=DATA_PASSWORD, sentinel_password=SENTINEL_PASSWORD)
        self.addCleanup(self.group.cleanup)
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(self.pool.closeCachedConnections)

    async def post(self, port: int, seq: int) -> int:
        response = await treq.post(
            f"http://127.0.0.1:{port}/events", data=ndjson(event("E", seq)), pool=self.pool,
            headers={"aep-version": "0.1", "content-type": "application/x-ndjson", "authorization": "Bearer t"},
        )  # fmt: skip
        await treq.content(response)
        return int(response.code)

    async def until_accepted(self, port: int, seq: int) -> None:
        for _ in range(500):  # a client retrying on 503 while the master moves
            code = await self.post(port, seq)
            if code == 202:
                return
            self.assertEqual(code, 503)
            await deferLater(reactor, 0.02, lambda: None)
        self.fail(f"event {seq} never accepted")

    async def test_follows_the_master_with_both_passwords_kept_secret(self) -> None:
        proc = await RelaydProcess.start_for(
            self, ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp", "--redis", self.group.url],
            env={"AEP_TOKEN": "t"},
        )  # fmt: skip
        await proc.wait_for(rb"connected to Redis at redis\+sentinel://127\.0\.0\.1:\d+,127\.0\.0\.1:\d+,127\.0\.0\.1:\d+/relayd/0 ")
        port = proc.port("aep")
        await self.until_accepted(port, 1)

        first = self.group.master_port()
        self.group.failover()
        await proc.wait_for(rb"Redis master relayd moved from 127\.0\.0\.1:%d to 127\.0\.0\.1:\d+ \(Sentinel\)" % first)
        await self.until_accepted(port, 2)

        response = await treq.get(f"http://127.0.0.1:{port}/stream?live=0&from=" + json.dumps([{"session": "E"}]),
                                  headers={"authorization": "Bearer t"}, pool=self.pool)  # fmt: skip
        body = (await treq.content(response)).decode()
        self.assertEqual([json.loads(line[5:])["seq"] for line in body.splitlines() if line.startswith("data:")], [1, 2])
        log = proc.log.decode(errors="replace")
        self.assertNotIn(DATA_PASSWORD, log)
        self.assertNotIn(SENTINEL_PASSWORD, log)
        self.assertNotIn("Traceback", log)


class ThreeInstancesOnSentinel(standalone.ThreeInstances):
    """tests/e2e/test_aep_redis_e2e.py's processes on a master, two replicas and three sentinels."""

    async def start_cluster(self, count: int = 3) -> list[int]:
        self.group = SentinelGroup.start()
        self.addCleanup(self.group.cleanup)
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        ports = []
        for _ in range(count):
            proc = await RelaydProcess.start_for(
                self, ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp", "--redis", self.group.url],
                env={"AEP_TOKEN": standalone.TOKEN},
            )  # fmt: skip
            await proc.wait_for(rb"connected to Redis at ")
            ports.append(proc.port("aep"))
            self.processes = [*getattr(self, "processes", []), proc]
        self.procs = ports
        return ports

    async def test_redis_restart_during_traffic(self) -> None:
        """Here the master dies (SIGKILL): 503 at once, then served by the promoted replica, the
        history acknowledged before the kill still there."""
        a, b = await self.start_cluster(2)
        self.assertEqual(await self.post(a, event("R", 0)), 202)
        master = self.group.master_port()
        assert master is not None
        self.group.node(master).proc.kill()  # type: ignore[union-attr]
        started = reactor.seconds()
        self.assertEqual(await self.post(a, event("R", 1)), 503)
        self.assertLess(reactor.seconds() - started, 5)
        for port, seq in ((b, 2), (a, 3)):
            deadline = reactor.seconds() + 20
            while reactor.seconds() < deadline:  # each process finds the new master on its own
                code = await self.post(port, event("R", seq))
                if code == 202:
                    break
                self.assertEqual(code, 503)
                await deferLater(reactor, 0.05, lambda: None)
            self.assertEqual(code, 202)
        history = await standalone.SSEClient.connect(f"http://127.0.0.1:{a}/stream?live=0&from=all", standalone.AUTH)
        self.assertEqual(standalone.held_ids(await history.read_until_end()), ["R:0:0", "R:0:2", "R:0:3"])


class TwistdMCPOnSentinel(test_mcp_e2e.TwistdMCPOnRedis):
    """tests/e2e/test_mcp_e2e.py's two MCP processes, on a Sentinel layout."""

    def setUp(self) -> None:
        group = SentinelGroup.start()
        self.addCleanup(group.cleanup)
        self.own_redis_url = group.url  # (tests.support.redis.layout_url)
