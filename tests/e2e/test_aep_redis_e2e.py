"""Several real ``twistd -n relayd`` processes sharing one real Redis behave as one AEP relay (issue 5),
on a single redis-server and on a 3-master Redis Cluster (issue 25)."""

from __future__ import annotations

import json
import subprocess
from collections import Counter

import treq
from twisted.internet import reactor, threads
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from relayd.storage.buckets import BUCKETS, key_slot
from tests.support.aep import event, ndjson
from tests.support.redis import OnCluster, RedisCluster, RedisServer, connected_redis, layout_url
from tests.support.sse import SSEClient
from tests.support.twistd import RelaydProcess
from tests.support.ws import WSClient

TOKEN = "cluster-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def held_ids(messages: list) -> list[str]:
    """The SSE ids of a replay (its comments have none)."""
    return [m.id for m in messages if m.id]


class Instances(TestCase):
    """Relayd processes on one Redis: a private redis-server (C{self.redis}) unless C{shared}, then
    the test's layout (tests/support/redis.py L{layout_url}) under a key prefix of its own."""

    timeout = 90
    shared = False
    redis_url: str | None = None  # a Redis of the test's own (a private Redis Cluster)
    redis_options: tuple[str, ...] = ()  # more flags for it

    async def start_cluster(self, count: int = 3) -> list[int]:
        if self.redis_url is not None:
            redis = ["--redis", self.redis_url, *self.redis_options]
        elif self.shared:
            redis = ["--redis", layout_url(self), "--redis-prefix", f"e2e{id(self)}:"]
        else:
            self.redis = RedisServer.start()
            self.addCleanup(self.redis.cleanup)
            redis = ["--redis", self.redis.url]

        self.pool = HTTPConnectionPool(reactor, persistent=False)
        ports = []
        for _ in range(count):
            proc = await RelaydProcess.start_for(
                self, ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp", *redis], env={"AEP_TOKEN": TOKEN}
            )
            await proc.wait_for(rb"shared state in Redis")
            # Listening comes before the Redis pool is up (a POST then is a 503).
            await proc.wait_for(rb"connected to Redis at ")
            ports.append(proc.port("aep"))
            self.processes = [*getattr(self, "processes", []), proc]
        self.procs = ports
        return ports

    async def post(self, port: int, *events: dict) -> int:
        response = await treq.post(
            f"http://127.0.0.1:{port}/events",
            data=ndjson(*events),
            headers={**AUTH, "aep-version": "0.1", "content-type": "application/x-ndjson"},
            pool=self.pool,
        )
        await treq.content(response)
        return response.code

    async def ws(self, port: int, **hello: object) -> WSClient:
        client = await WSClient.connect(f"ws://127.0.0.1:{port}/socket", AUTH)
        self.addCleanup(client.close)
        reply = await client.hello(**hello)
        self.assertEqual(reply["type"], "hello")
        return client

    async def sse(self, port: int, query: str) -> SSEClient:
        client = await SSEClient.connect(f"http://127.0.0.1:{port}/stream{query}", AUTH)
        self.addCleanup(client.close)
        self.assertEqual(client.code, 200)
        return client

    async def roster_with(self, client: WSClient, count: int) -> list:
        """The roster once it has C{count} entries (claims reach Redis a moment after the event)."""
        for _ in range(100):
            client.send({"type": "roster", "id": "r"})
            reply = await client.recv()
            if len(reply["entries"]) == count:
                return reply["entries"]
            await deferLater(reactor, 0.02, lambda: None)  # polling another process's write
        self.fail(f"roster never had {count} entries: {reply}")


class ThreeInstances(Instances):
    shared = True

    async def test_ingest_on_a_reaches_sse_on_b_and_ws_on_c_then_resume_on_b(self) -> None:
        a, b, c = await self.start_cluster()
        consumer_b = await self.sse(b, '?filter={"session":"X"}')
        consumer_c = await self.ws(c, role="consumer")
        consumer_c.send({"type": "subscribe", "id": "c", "filter": {"session": "X"}})
        self.assertEqual(await consumer_c.recv(), {"type": "subscribed", "id": "c"})
        # The subscription on C is registered with C's bus before the event is posted on A.
        await consumer_c.roundtrip()
        self.assertEqual(await self.post(a, *[event("X", i, "progress.status") for i in range(3)]), 202)
        got_b = [(await consumer_b.next_event()).id for _ in range(3)]
        self.assertEqual(got_b, ["X:0:0", "X:0:1", "X:0:2"])
        got_c = [(await consumer_c.recv())["seq"] for _ in range(3)]
        self.assertEqual(got_c, [0, 1, 2])
        # Resume on B from a position: the history written through A is there.
        history = await SSEClient.connect(
            f"http://127.0.0.1:{b}/stream?live=0&from=" + json.dumps([{"session": "X", "epoch": 0, "seq": 0}]), AUTH
        )
        rest = await history.read_until_end()
        self.assertEqual([m.id for m in rest if m.id], ["X:0:1", "X:0:2"])
        self.assertEqual(rest[-1].comment, "replay-complete")
        # Last-Event-ID resume on C, and from=all on A, see the same history.
        everything = await SSEClient.connect(f"http://127.0.0.1:{a}/stream?live=0&from=all", AUTH)
        self.assertEqual(held_ids(await everything.read_until_end()), ["X:0:0", "X:0:1", "X:0:2"])

    async def test_command_from_c_reaches_the_emitter_on_a_and_two_claimants_are_ambiguous(self) -> None:
        a, b, c = await self.start_cluster()
        emitter = await self.ws(a, role="emitter", identity={"agent": "agent-a"},
                                capabilities={"control": {"accepts": ["control.pause"]}})
        emitter.send(event("S", 0, "session.started"))
        await emitter.roundtrip()  # the claim is registered before anyone routes to it
        sender = await self.ws(c, role="consumer", identity={"agent": "operator"})
        roster = await self.roster_with(sender, 1)
        self.assertEqual(roster, [{"session": "S", "agent": "agent-a", "control": {"accepts": ["control.pause"]}}])
        command = event("S", None, "control.pause", id="cmd-1", agent="operator")
        sender.send(command)
        self.assertEqual(await emitter.recv(), command)  # routed across instances, byte for byte
        unsupported = event("S", None, "control.resume", id="cmd-2", agent="operator")
        sender.send(unsupported)
        refusal = await sender.recv()
        self.assertEqual((refusal["code"], refusal["cause"]), ("unsupported", "cmd-2"))

        second = await self.ws(b, role="emitter", identity={"agent": "agent-b"})
        second.send(event("S", 1, "progress.status", source="aep://other/agent/b"))
        self.assertEqual(len(await self.roster_with(sender, 2)), 2)
        sender.send(event("S", None, "control.pause", id="cmd-3", agent="operator"))
        reply = await sender.recv()
        self.assertEqual((reply["code"], reply["cause"]), ("ambiguous", "cmd-3"))
        self.assertIn("2 connected emitters", reply["detail"])

        # The claimant on A goes away: its claim goes with it, and only B's remains.
        await emitter.close()
        self.assertEqual([e["agent"] for e in await self.roster_with(sender, 1)], ["agent-b"])
        sender.send(event("S", None, "control.pause", id="cmd-4", agent="operator"))
        self.assertEqual(await second.recv(), event("S", None, "control.pause", id="cmd-4", agent="operator"))


class ThreeInstancesOnCluster(OnCluster, ThreeInstances):
    pass


class RestartDuringTraffic(Instances):
    async def test_redis_restart_during_traffic(self) -> None:
        a, b = await self.start_cluster(2)
        self.assertEqual(await self.post(a, event("R", 0)), 202)
        self.redis.stop(save=True)
        # Redis away: ingest answers promptly with 503 naming the store, never hangs.
        started = reactor.seconds()
        response = await treq.post(
            f"http://127.0.0.1:{a}/events", data=ndjson(event("R", 1)),
            headers={**AUTH, "aep-version": "0.1", "content-type": "application/x-ndjson"}, pool=self.pool,
        )
        body = json.loads(await treq.content(response))
        self.assertEqual((response.code, body), (503, {"error": "store-unavailable", "store": "aep"}))
        self.assertLess(reactor.seconds() - started, 5)
        self.redis.restart()
        # relayd reconnects by itself; acknowledged data from before the restart is still there.
        deadline = reactor.seconds() + 20
        while reactor.seconds() < deadline:  # B reconnects with backoff on its own schedule
            code = await self.post(b, event("R", 2))
            if code == 202:
                break
            await deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(code, 202, self.processes[1].log.decode(errors="replace")[-4000:])
        deadline = reactor.seconds() + 20
        while reactor.seconds() < deadline:  # and so does A
            history = await SSEClient.connect(f"http://127.0.0.1:{a}/stream?live=0&from=all", AUTH)
            if history.code == 200:
                break
            self.assertEqual(json.loads(history.refusal), {"error": "store-unavailable", "store": "aep"})
            await deferLater(reactor, 0.05, lambda: None)
        self.assertEqual(held_ids(await history.read_until_end()), ["R:0:0", "R:0:2"])


class LiveReshard(Instances):
    """Issue 25 acceptance 2: C{redis-cli --cluster reshard} moves a busy session's slot to another
    master while two relayd processes ingest into it: MOVED and ASK are followed, no 500, and the
    replay holds every acknowledged event exactly once, in order."""

    timeout = 180
    # Its cluster has no replicas: acknowledged writes must not wait for one (on by default).
    redis_options = ("--redis-wait-replicas", "0")

    async def test_a_reshard_of_a_busy_sessions_slot(self) -> None:
        cluster = RedisCluster.start()
        self.addCleanup(cluster.cleanup)
        source, target = cluster.nodes[0], cluster.nodes[1]
        probe = await connected_redis(cluster.url)
        self.addCleanup(probe.close)
        owned = [slot for slot, owner in enumerate(probe._slots) if owner == ("127.0.0.1", source.port)]
        # The session of the source's lowest bucket slot: the reshard moves the source's slots from
        # its lowest up, ending with the busy session's.
        session = min((f"busy{n}" for n in range(2000)), key=lambda s: (
            key_slot(BUCKETS.tag_of(s.encode())) not in owned, key_slot(BUCKETS.tag_of(s.encode()))))  # fmt: skip
        slot = key_slot(BUCKETS.tag_of(session.encode()))
        self.assertIn(slot, owned)
        moving = slot - owned[0] + 1
        ids = {node.port: cluster.command(node, "CLUSTER", "MYID").strip() for node in (source, target)}
        self.redis_url = cluster.url
        a, b = await self.start_cluster(2)
        # A live subscriber on B, whose bucket's shard channel (relayd/storage/sharded.py) moves with the slot.
        live = await self.sse(b, "?filter=" + json.dumps({"session": session}))
        self.assertEqual(await self.post(a, event(session, 0)), 202)
        self.assertEqual((await live.next_event()).id, f"{session}:0:0")  # heard from A, on the slot's first master
        acknowledged, codes = [0], Counter([202])

        reshard = threads.deferToThread(
            subprocess.run,
            [cluster.cli, "--cluster", "reshard", f"127.0.0.1:{source.port}", "--cluster-from", ids[source.port],
             "--cluster-to", ids[target.port], "--cluster-slots", str(moving), "--cluster-yes"],
            capture_output=True, timeout=120,
        )  # fmt: skip
        seq = 1
        after = 0
        while after < 50 and seq < 5000:  # bounded traffic: during the reshard, then 50 more
            code = await self.post((a, b)[seq % 2], event(session, seq))
            codes[code] += 1
            if code == 202:
                acknowledged.append(seq)
            seq += 1
            if reshard.called:
                after += 1
        done = await reshard
        self.assertEqual(done.returncode, 0, done.stderr.decode(errors="replace")[-2000:])
        self.assertEqual(cluster.command(target, "CLUSTER", "COUNTKEYSINSLOT", str(slot)).strip() != "0", True)
        self.assertLessEqual(set(codes), {202, 503}, codes)  # an outage at worst, never a 500
        self.assertGreater(codes[202], 50, codes)
        history = await SSEClient.connect(
            f"http://127.0.0.1:{b}/stream?live=0&from=" + json.dumps([{"session": session, "epoch": 0, "seq": -1}]), AUTH
        )
        held = [int(i.rsplit(":", 1)[1]) for i in held_ids(await history.read_until_end())]
        self.assertEqual(held, sorted(set(held)))  # in order, none twice
        self.assertEqual([s for s in acknowledged if s not in held], [])  # every acknowledged one
        # Once the slot has moved, events posted on A still reach B's live subscriber (resubscribed
        # on the slot's new master).
        last = seq
        self.assertEqual(await self.post(a, event(session, last)), 202)
        while (await live.next_event()).id != f"{session}:0:{last}":
            pass
