"""Two real ``twistd -n relayd`` broker processes on one state directory and one redis-server
behave as one broker (issue 5): a retry on the other process replays, duplicates spread over both
execute once, and both drain and exit 0 on SIGTERM.
"""

from __future__ import annotations

import json
import os
import tempfile

import treq
from twisted.internet import defer, reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from relayd.buzz.core import contract
from tests.buzz.harness import issue, new_channel
from tests.support.nostr import shared_nostr_relay
from tests.support.redis import RedisServer
from tests.support.twistd import RelaydProcess


def body(content: str, rid: str, channel: str) -> bytes:
    return contract.freeze(contract.build_request("message.post", {"channelId": channel, "content": content}, rid))


class TwoProcesses(TestCase):
    timeout = 90

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        self.redis = RedisServer.start()
        self.addCleanup(self.redis.cleanup)
        self.http = HTTPConnectionPool(reactor, persistent=False)
        state = os.path.join(tempfile.mkdtemp(prefix="relayd-twistd-broker-"), "state")
        os.makedirs(state)
        kek = os.path.join(state, "test.kek")
        with open(kek, "w") as f:
            f.write(os.urandom(32).hex())
        self.channel = new_channel()
        self.alice = issue(state, "--agent", "alice", "--channel", self.channel, kek_file=kek)
        options = [
            "--no-aep", "--no-mcp",
            "--broker-nostr-relay", self.relay.url,  # type: ignore[attr-defined]
            "--broker-listen", "tcp:0:interface=127.0.0.1",
            "--broker-state-dir", state, "--broker-kek-file", kek,
            "--redis", self.redis.url,
        ]  # fmt: skip
        self.procs = []
        for _ in range(2):
            proc = await RelaydProcess.start(options, wait_for=("broker",))
            self.addCleanup(proc.kill)
            self.procs.append(proc)
        self.ports = [p.port("broker") for p in self.procs]

    async def post(self, port: int, data: bytes) -> dict:
        response = await treq.post(
            f"http://127.0.0.1:{port}/v1/action",
            data=data,
            headers={"authorization": ["Bearer " + self.alice["credential"]], "content-type": ["application/json"]},
            pool=self.http,
        )
        assert response.code == 200
        return json.loads(await treq.content(response))

    async def until_redis(self, port: int, data: bytes) -> dict:
        """Send until the process's Redis client is up: 'store unavailable' promises nothing was done."""
        for _ in range(300):
            verdict = await self.post(port, data)
            if verdict.get("error", {}).get("code") != "internal":
                return verdict
            await deferLater(reactor, 0.02, lambda: None)  # polling another process's connection
        self.fail(f"broker never reached Redis: {verdict}")

    async def test_retry_replays_across_processes_and_duplicates_execute_once(self) -> None:
        a, b = self.ports
        first = await self.until_redis(a, body("on a", "req-a", self.channel))
        assert first["status"] == "succeeded", first
        await self.until_redis(b, body("on b", "req-b", self.channel))
        again = await self.post(b, body("on a", "req-a", self.channel))
        assert again.pop("replayed") is True and again == first
        ten = body("ten", "req-ten", self.channel)
        verdicts = await defer.gatherResults([defer.ensureDeferred(self.post(self.ports[i % 2], ten)) for i in range(10)])
        assert [v["status"] for v in verdicts] == ["succeeded"] * 10, verdicts
        assert sum(1 for v in verdicts if "replayed" not in v) == 1
        stored = [e for e in self.relay.events(pubkey=self.alice["agentPubkey"]) if e["content"] in ("on a", "ten")]  # type: ignore[attr-defined]
        assert sorted(e["content"] for e in stored) == ["on a", "ten"]
        for proc in self.procs:
            assert await proc.terminate() == 0
