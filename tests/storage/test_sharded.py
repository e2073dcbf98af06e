"""The AEP fan-out over sharded pub/sub on a real Redis Cluster (relayd/storage/sharded.py,
relayd/aep/redis/fanout.py): the append script publishes each batch on its bucket's shard channel
(C{SPUBLISH}, in the slot of its keys), an instance subscribes (C{SSUBSCRIBE}, on the bucket's master)
only to the buckets its local subscriptions need, and follows a slot that moves to another master."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from twisted.internet import reactor, task
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from relayd.aep.core.event import Event, event_from
from relayd.aep.redis.fanout import RedisFanout
from relayd.aep.redis.store import RedisEventLog
from relayd.base.clock import Timekeeper
from relayd.base.errors import StoreUnavailable
from relayd.storage import sharded
from relayd.storage.buckets import BUCKETS, key_slot
from relayd.storage.cluster import ClusterRedis
from relayd.storage.heard import HEARD_WAIT
from relayd.storage.sharded import ShardedBus
from tests.support.aep import event
from tests.support.redis import RedisCluster, RedisServer, connected_redis, shared_cluster

_prefixes = itertools.count()


def _prefix() -> str:
    return f"sp{os.getpid()}-{next(_prefixes)}:"


async def _until(check: Any, timeout: float = 10.0) -> None:
    waited = 0.0
    while not check():
        if waited > timeout:
            raise AssertionError("timed out")
        await deferLater(reactor, 0.02, lambda: None)  # polling another connection's effect on Redis
        waited += 0.02


def _event(session: str, seq: int) -> Event:
    return event_from(json.dumps(event(session, seq)).encode())


def _channel(prefix: str, session: str) -> bytes:
    return prefix.encode() + b"aep:" + BUCKETS.tag_of(session.encode()) + b":fanout"


def _shard_channels(cluster: RedisCluster, prefix: str) -> dict[str, int]:
    """Every shard channel under C{prefix} some client subscribes to, over every master, with its
    subscribers (C{PUBSUB SHARDCHANNELS}, C{PUBSUB SHARDNUMSUB})."""
    found: dict[str, int] = {}
    for node in cluster.nodes[: cluster.masters]:
        for channel in cluster.command(node, "PUBSUB", "SHARDCHANNELS", f"{prefix}*").split():
            count = cluster.command(node, "PUBSUB", "SHARDNUMSUB", channel).split()[1]
            found[channel] = found.get(channel, 0) + int(count)
    return found


class Instances:
    """Two instances' clients on one cluster: A publishes (its log's appends), B listens (its fan-out)."""

    async def instances(
        self, case: TestCase, url: str, prefix: str, sharded: bool = True
    ) -> tuple[RedisEventLog, RedisFanout, list[Event]]:
        a = await connected_redis(url, wait_replicas=0)
        case.addCleanup(a.close)
        b = await connected_redis(url, wait_replicas=0)
        case.addCleanup(b.close)
        assert isinstance(b, ClusterRedis) and b.sharded_pubsub is sharded
        got: list[Event] = []
        log = RedisEventLog(a, 10, 640, prefix, publisher="A")
        fanout = RedisFanout(b, b.bus(), "B", got.extend, prefix)
        return log, fanout, got


class SharedCluster(Instances, TestCase):
    timeout = 60

    async def test_a_batch_reaches_the_other_instance_on_its_buckets_shard_channel(self) -> None:
        prefix = _prefix()
        log, fanout, got = await self.instances(self, shared_cluster().url, prefix)
        channel = _channel(prefix, "X")
        cluster = shared_cluster()
        heard = fanout.need(("X",))
        assert heard is not None
        await heard  # fires once Redis has answered the SSUBSCRIBE: subscribed now
        self.assertEqual(_shard_channels(cluster, prefix), {channel.decode(): 1})
        self.assertIsNone(fanout.need(("X",)))  # heard already
        fanout.release(("X",))
        self.assertEqual(await log.append([_event("X", 0), _event("X", 1)], publish=True), [True, True])
        await _until(lambda: len(got) == 2)
        self.assertEqual([e.position for e in got], [(0, 0), (0, 1)])
        # Published with SPUBLISH on the bucket's master, not PUBLISH: no classic channel is used.
        owner = fanout._bus.channels[channel]
        self.assertEqual(owner, log.redis.owner_of(key_slot(channel)))  # type: ignore[attr-defined]
        for node in cluster.nodes[: cluster.masters]:
            self.assertEqual(cluster.command(node, "PUBSUB", "CHANNELS", f"{prefix}*").split(), [])

    async def test_an_instance_subscribes_to_the_buckets_its_subscriptions_need(self) -> None:
        prefix = _prefix()
        cluster = shared_cluster()
        _, fanout, _ = await self.instances(self, cluster.url, prefix)
        tag = BUCKETS.tag_of
        x = "X"
        x2 = next(s for s in (f"x{n}" for n in range(5000)) if tag(s.encode()) == tag(b"X"))  # X's bucket
        y = next(s for s in (f"y{n}" for n in range(5000)) if tag(s.encode()) != tag(b"X"))  # another
        fanout.need((x,))
        fanout.need((x, y))
        fanout.need((x2,))
        wanted = {_channel(prefix, x).decode(): 1, _channel(prefix, y).decode(): 1}
        await _until(lambda: _shard_channels(cluster, prefix) == wanted)
        self.assertEqual(fanout.needed, {_channel(prefix, x): 3, _channel(prefix, y): 1})
        fanout.need(None)  # a subscription that pins no session: every bucket
        await _until(lambda: len(_shard_channels(cluster, prefix)) == BUCKETS.count)
        self.assertEqual(set(_shard_channels(cluster, prefix).values()), {1})  # one subscriber connection each
        fanout.release(None)
        await _until(lambda: _shard_channels(cluster, prefix) == wanted)
        fanout.release((x, y))
        await _until(lambda: _shard_channels(cluster, prefix) == {_channel(prefix, x).decode(): 1})
        fanout.release((x,))
        self.assertEqual(fanout.needed, {_channel(prefix, x): 1})  # x2 still needs it
        fanout.release((x2,))
        await _until(lambda: _shard_channels(cluster, prefix) == {})
        self.assertEqual(fanout.needed, {})

    async def test_publish_sends_each_bucket_its_own_events(self) -> None:
        """RedisFanout.publish (a batch the append did not publish: one with commands) on a cluster:
        one SPUBLISH per bucket, heard only where that bucket is needed."""
        prefix = _prefix()
        _, fanout, got = await self.instances(self, shared_cluster().url, prefix)
        a_side = RedisFanout(fanout.redis, fanout.redis.bus(), "A", lambda events: None, prefix)
        y = next(s for s in (f"y{n}" for n in range(5000)) if BUCKETS.tag_of(s.encode()) != BUCKETS.tag_of(b"X"))
        heard = fanout.need(("X",))
        assert heard is not None
        await heard
        await a_side.publish([_event("X", 0), _event(y, 0), _event("X", 1)])
        await _until(lambda: len(got) == 2)
        self.assertEqual([(e.session, e.position) for e in got], [("X", (0, 0)), ("X", (0, 1))])
        self.assertEqual(list(fanout._bus.channels), [_channel(prefix, "X")])  # y's bucket is not heard here

    async def test_without_relayds_own_replies_the_fanout_stays_classic_and_works(self) -> None:
        """The fence's fallback (relayd/compat/txredisapi.py OWN_REPLIES off): one classic channel."""
        self.patch(ClusterRedis, "sharded_pubsub", False)
        prefix = _prefix()
        log, fanout, got = await self.instances(self, shared_cluster().url, prefix, sharded=False)
        heard = fanout.need(("X",))
        self.assertEqual(fanout.needed, {prefix.encode() + b"aep:fanout": 1})  # the one classic channel
        await heard
        self.assertEqual(await log.append([_event("X", 0)], publish=True), [True])
        await _until(lambda: len(got) == 1)


class Reshard(Instances, TestCase):
    timeout = 120

    async def test_a_moved_slot_is_resubscribed_on_its_new_master(self) -> None:
        cluster = RedisCluster.start()
        self.addCleanup(cluster.cleanup)
        prefix = _prefix()
        log, fanout, got = await self.instances(self, cluster.url, prefix)
        fanout.need(("X",))
        channel = _channel(prefix, "X")
        await _until(lambda: channel in fanout._bus.channels)
        self.assertEqual(await log.append([_event("X", 0)], publish=True), [True])
        await _until(lambda: len(got) == 1)
        # Nothing else reads the map again now (no channel waits for its master): what moves the
        # channel is Redis's word that its slot left (and a test that fails without it).
        await _until(lambda: fanout._bus._retry is None)
        slot = key_slot(channel)
        source_port = fanout._bus.channels[channel][1]
        source = next(node for node in cluster.nodes if node.port == source_port)
        target = next(node for node in cluster.nodes if node.port != source_port)
        ids = {node.port: cluster.command(node, "CLUSTER", "MYID").strip() for node in (source, target)}
        # The slot's keys move first (as redis-cli --cluster reshard moves them), then the slot.
        cluster.command(target, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source.port])
        cluster.command(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[target.port])
        keys = cluster.command(source, "CLUSTER", "GETKEYSINSLOT", str(slot), "100").split()
        self.assertTrue(keys)
        cluster.command(source, "MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *keys)
        for node in (target, source, *cluster.nodes):
            cluster.command(node, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[target.port])
        # The source tells the subscriber the channel left it; it is subscribed on the target.
        await _until(lambda: fanout._bus.channels.get(channel) == ("127.0.0.1", target.port))
        await _until(lambda: _shard_channels(cluster, prefix) == {channel.decode(): 1})
        self.assertEqual(cluster.command(target, "PUBSUB", "SHARDNUMSUB", channel.decode()).split()[1], "1")
        self.assertEqual(await log.append([_event("X", 1)], publish=True), [True])  # (A follows MOVED)
        await _until(lambda: len(got) == 2)
        self.assertEqual([e.position for e in got], [(0, 0), (0, 1)])


class MasterLost(Instances, TestCase):
    timeout = 120

    async def test_a_killed_master_is_replaced_and_its_channels_resubscribed(self) -> None:
        cluster = RedisCluster.start(3, replicas=1)
        self.addCleanup(cluster.cleanup)
        prefix = _prefix()
        log, fanout, got = await self.instances(self, cluster.url, prefix)
        fanout.need(("X",))
        channel = _channel(prefix, "X")
        await _until(lambda: channel in fanout._bus.channels)
        lost = fanout._bus.channels[channel]
        victim: RedisServer = next(node for node in cluster.nodes if node.port == lost[1])
        victim.stop(save=False)
        # Once the cluster has promoted the victim's replica, the channel is subscribed there.
        await _until(lambda: fanout._bus.channels.get(channel, lost) != lost, timeout=30)

        async def delivered() -> bool:
            before = len(got)
            try:
                await log.append([_event("X", 100 + before)], publish=True)
            except StoreUnavailable:
                await deferLater(reactor, 0.05, lambda: None)  # a client retrying
                return False  # the slot's new master not yet reached by A
            try:
                await _until(lambda: len(got) > before, timeout=1)
            except AssertionError:
                return False
            return True

        for _ in range(100):
            if await delivered():
                break
        else:
            self.fail("no delivery after the failover")


class _FakeCluster:
    """What a L{ShardedBus} asks of its cluster, on a test clock: one slot map, every slot on C{owner}."""

    def __init__(self, owner: Any) -> None:
        self.clock = Timekeeper(task.Clock())
        self.owner = owner
        self.refreshed = 0
        self.listeners: list[Any] = []

    def owner_of(self, slot: int) -> Any:
        return self.owner

    def masters(self) -> set[Any]:
        return {self.owner}

    def on_map(self, listener: Any) -> None:
        self.listeners.append(listener)

    def refresh(self) -> None:
        self.refreshed += 1

    def moved(self, slot: int, where: str, answered_by: Any) -> None:
        host, _, port = where.rpartition(":")
        self.owner = (host, int(port))


class _FakeLink:
    """A link whose connection is up, recording what it is sent (no Redis)."""

    def __init__(self, bus: ShardedBus, address: Any) -> None:
        self.bus, self.address, self.ready = bus, address, True
        self.sent: list[tuple[bytes, bytes]] = []
        self.pending: Any = None

    def send(self, command: bytes, channel: bytes) -> None:
        self.sent.append((command, channel))

    def close(self) -> Deferred[None]:
        self.ready = False
        return succeed(None)


class Refusals(TestCase):
    """A refused SSUBSCRIBE: MOVED goes to the master it names at once; any other refusal is asked
    again only after the map is read again (never in a loop), and a replay waits at most HEARD_WAIT."""

    def bus(self) -> tuple[ShardedBus, _FakeCluster, dict[Any, _FakeLink]]:
        links: dict[Any, _FakeLink] = {}

        def link(bus: ShardedBus, address: Any) -> _FakeLink:
            links[address] = _FakeLink(bus, address)
            return links[address]

        self.patch(sharded, "_ShardLink", link)
        cluster = _FakeCluster(("a", 1))
        return ShardedBus(cluster), cluster, links  # type: ignore[arg-type]

    def test_moved_goes_to_the_named_master_other_refusals_wait_for_the_map(self) -> None:
        bus, cluster, links = self.bus()
        bus.subscribe(b"c", lambda message: None)
        self.assertEqual(links[("a", 1)].sent, [(b"SSUBSCRIBE", b"c")])
        bus._refused(links[("a", 1)], b"SSUBSCRIBE", b"c", "MOVED 7 b:2")  # type: ignore[arg-type]
        self.assertEqual(links[("b", 2)].sent, [(b"SSUBSCRIBE", b"c")])
        self.assertEqual(bus.channels, {b"c": ("b", 2)})
        bus._refused(links[("b", 2)], b"SSUBSCRIBE", b"c", "CLUSTERDOWN The cluster is down")  # type: ignore[arg-type]
        self.assertEqual(bus.channels, {})
        self.assertEqual(links[("b", 2)].sent, [(b"SSUBSCRIBE", b"c")])  # not asked again at once
        self.assertEqual(cluster.refreshed, 1)
        cluster.clock.reactor.advance(sharded.REPLACE_EVERY)  # type: ignore[attr-defined]
        self.assertEqual(links[("b", 2)].sent, [(b"SSUBSCRIBE", b"c")] * 2)
        bus.close()

    def test_heard_once_answered_or_after_the_wait(self) -> None:
        bus, cluster, links = self.bus()
        bus.subscribe(b"c", lambda message: None)
        bus.subscribe(b"d", lambda message: None)
        heard = bus.heard({b"c", b"d"})
        assert heard is not None
        bus._confirm(links[("a", 1)], b"c")  # type: ignore[arg-type]
        self.assertNoResult(heard)
        bus._confirm(links[("a", 1)], b"d")  # type: ignore[arg-type]
        self.successResultOf(heard)
        self.assertIsNone(bus.heard({b"c"}))
        bus.subscribe(b"e", lambda message: None)
        late = bus.heard({b"e"})  # its master never answers
        assert late is not None
        cluster.clock.reactor.advance(HEARD_WAIT)  # type: ignore[attr-defined]
        self.successResultOf(late)
        bus.close()
