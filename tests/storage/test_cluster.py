"""relayd on a real Redis Cluster (relayd/storage/cluster.py): every store's operations routed by
slot, the keyspace version checked by slot, MOVED and ASK followed, and a cluster that moves for
ever or is down answered as an outage (StoreUnavailable: 503), never as a bug."""

from __future__ import annotations

import itertools
import os
import signal
from typing import Any

import txredisapi
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from relayd.base.errors import OutcomeUnknown, StoreUnavailable
from relayd.storage import cluster as cluster_module
from relayd.storage import redis as redis_module
from relayd.storage.buckets import BUCKETS, SLOTS, key_slot
from relayd.storage.cluster import ClusterRedis
from relayd.storage.heartbeat import PING_IDLE
from relayd.storage.redis import KEYSPACE_VERSION, RedisBus, parse_redis_url
from tests.storage.test_redis_scripts import Ids, every_operation
from tests.support.aep import event, start_relay
from tests.support.redis import RedisCluster, RedisServer, connected_redis, read_on_replica, shared_cluster

_prefixes = itertools.count()


def _prefix() -> str:
    return f"c{os.getpid()}-{next(_prefixes)}:"


async def _until(check: Any, timeout: float = 10.0) -> None:
    waited = 0.0
    while not check():
        if waited > timeout:
            raise AssertionError("timed out")
        await deferLater(reactor, 0.02, lambda: None)  # polling an external process's state
        waited += 0.02


class OnCluster(TestCase):
    timeout = 60

    async def connect(self, prefix: str = "relayd:") -> ClusterRedis:
        redis = await connected_redis(shared_cluster().url)
        self.addCleanup(redis.close)
        assert isinstance(redis, ClusterRedis)
        return redis

    async def test_every_operation_of_every_wing_runs_on_a_cluster(self) -> None:
        cluster = shared_cluster()
        redis = await self.connect()
        prefix = _prefix()
        await every_operation(redis, prefix, Ids(aep_sessions=("", "{x}", "}", "é")))
        masters = cluster.nodes[: cluster.masters]  # (their replicas hold copies)
        held = [cluster.command(node, "--scan", "--pattern", f"{prefix}*").split() for node in masters]
        self.assertTrue(all(held), held)  # the keys are spread over every master
        for node, keys in zip(masters, held, strict=True):
            for key in keys:
                owner = redis._slots[key_slot(key.encode())]
                self.assertEqual(owner, ("127.0.0.1", node.port), key)

    async def test_reads_of_many_slots_are_one_connection_per_master(self) -> None:
        redis = await self.connect()
        keys = [b"many:" + tag for tag in BUCKETS.tags]  # 64 buckets: every master holds some
        sent: list[int] = []
        execute_command = redis_module._Protocol.execute_command

        def recording(connection: object, *command: Any, **options: Any) -> Any:
            if command[0] == b"GET":
                sent.append(id(connection))
            return execute_command(connection, *command, **options)  # type: ignore[arg-type]

        self.patch(redis_module._Protocol, "execute_command", recording)
        self.assertEqual(await redis.get_many("test", keys), [None] * len(keys))
        self.assertEqual(len(sent), len(keys))
        self.assertEqual(len(set(sent)), len({redis._slots[key_slot(key)] for key in keys}))  # one write each

    async def test_the_keyspace_version_is_kept_on_its_slots_master(self) -> None:
        redis = await self.connect()
        self.assertEqual(await redis.execute("test", "GET", redis.version_key), str(KEYSPACE_VERSION).encode())

    async def test_keyspace_3_refuses_to_share(self) -> None:
        redis = await self.connect()
        prefix = _prefix()
        await redis.execute("test", "SET", f"{prefix}schema".encode(), b"3")
        other = ClusterRedis(shared_cluster().url, redis.clock, prefix=prefix)
        self.addCleanup(other.close)
        reason = await other.refused
        self.assertIn(f"holds relayd keyspace version 3 (key {prefix}schema), this relayd uses keyspace version 4", reason)
        with self.assertRaises(StoreUnavailable):
            await other.execute("test", "GET", b"x")

    async def test_a_stale_slot_map_follows_moved(self) -> None:
        redis = await self.connect()
        wrong = ("127.0.0.1", shared_cluster().nodes[0].port)
        redis._slots = [wrong] * SLOTS  # every slot believed on the first master
        moved: list[str] = []
        redirected = redis._redirected

        def recording(f: Any, *args: Any) -> Any:
            moved.append(str(f.value).split()[0])
            return redirected(f, *args)

        self.patch(redis, "_redirected", recording)
        await every_operation(redis, _prefix(), Ids())  # MOVED answered by the other two, followed
        self.assertIn("MOVED", moved)
        await _until(lambda: redis._refreshing is None and redis._later is None)
        await redis.refresh()
        self.assertGreater(len(set(redis._slots)), 1)  # the map was read again

    async def test_a_moved_storm_is_store_unavailable(self) -> None:
        redis = await self.connect()
        key = b"storm:x"
        owner = redis._slots[key_slot(key)]
        elsewhere = next(("127.0.0.1", node.port) for node in shared_cluster().nodes if ("127.0.0.1", node.port) != owner)

        class Stuck(list[Any]):
            """A map that never learns: every MOVED sends the command back to the wrong master."""

            def __setitem__(self, index: Any, value: Any) -> None:
                pass

        redis._slots = Stuck([elsewhere] * SLOTS)
        self.patch(redis, "refresh", lambda: None)
        with self.assertRaises(StoreUnavailable) as raised:
            await redis.execute("test", "SET", key, b"1")
        self.assertIn("slots keep moving", str(raised.exception))

    async def test_ask_during_a_migration_is_followed(self) -> None:
        cluster = RedisCluster.start()
        self.addCleanup(cluster.cleanup)
        redis = await connected_redis(cluster.url)
        self.addCleanup(redis.close)
        key = b"asked:{m}"
        slot = key_slot(key)
        owner = redis._slots[slot]
        source = next(node for node in cluster.nodes if node.port == owner[1])
        target = next(node for node in cluster.nodes if node.port != owner[1])
        ids = {node.port: cluster.command(node, "CLUSTER", "MYID").strip() for node in (source, target)}
        cluster.command(target, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", ids[source.port])
        cluster.command(source, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", ids[target.port])
        asked: list[Any] = []
        execute_asking = cluster_module._Node.execute_asking

        def recording(node: Any, store: str, *command: Any, **options: Any) -> Any:
            asked.append((node.url.port, command[0]))
            return execute_asking(node, store, *command, **options)

        self.patch(cluster_module._Node, "execute_asking", recording)
        # An acknowledged write asked of the target WAITs there too: this cluster has no replicas,
        # so none confirms it (relayd's default on a cluster is to wait for one).
        failure = await self.assertFailure(redis.execute("test", "SET", key, b"unconfirmed", durable=True), OutcomeUnknown)
        self.assertIn("confirmed by 0 of 1 replicas", str(failure))
        # A key of the slot the source does not hold: it answers ASK, and the client asks the target.
        await redis.execute("test", "SET", key, b"moved-in")
        self.assertEqual(asked, [(target.port, "SET"), (target.port, "SET")])
        self.assertEqual(redis._slots[slot], owner)  # an ASK is not a MOVED: the map is unchanged
        for node in cluster.nodes:
            cluster.command(node, "CLUSTER", "SETSLOT", str(slot), "NODE", ids[target.port])
        self.assertEqual(await redis.execute("test", "GET", key), b"moved-in")  # MOVED now, followed
        self.assertEqual(redis._slots[slot], ("127.0.0.1", target.port))


class ClusterDown(TestCase):
    timeout = 60

    async def test_a_master_gone_then_the_cluster_down_is_store_unavailable(self) -> None:
        cluster = RedisCluster.start()
        self.addCleanup(cluster.cleanup)
        redis = await connected_redis(cluster.url)
        self.addCleanup(redis.close)
        assert isinstance(redis, ClusterRedis)
        dead = cluster.nodes[2]
        keys = {port: next(b"k%d" % n for n in itertools.count() if redis._slots[key_slot(b"k%d" % n)][1] == port)
                for port in (node.port for node in cluster.nodes)}  # fmt: skip
        assert dead.proc is not None
        os.kill(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait(10)
        with self.assertRaises(StoreUnavailable):
            await redis.execute("test", "GET", keys[dead.port])
        # After the node timeout the others say CLUSTERDOWN: an outage too (not a ResponseError).
        await _until(lambda: "cluster_state:fail" in cluster.command(cluster.nodes[0], "CLUSTER", "INFO"))
        try:
            await redis.execute("test", "GET", keys[cluster.nodes[0].port])
        except StoreUnavailable as e:
            self.assertIn("CLUSTERDOWN", str(e))
        except txredisapi.ResponseError as e:  # pragma: no cover - what this test is here to catch
            self.fail(f"a Redis error escaped as a bug: {e}")
        else:
            self.fail("a down cluster answered")


class ClusterURLs(TestCase):
    def test_a_cluster_url_names_its_seeds_and_database_0(self) -> None:
        url = parse_redis_url("rediss+cluster://u:p%40ss@127.0.0.1:7001,[::1]:7002,host")
        self.assertEqual(url.seeds, (("127.0.0.1", 7001), ("::1", 7002), ("host", 6379)))
        self.assertEqual((url.db, url.username, url.password, url.tls, url.cluster), (0, "u", "p@ss", True, True))
        self.assertEqual(str(url), "rediss+cluster://127.0.0.1:7001,[::1]:7002,host:6379")  # no password
        self.assertFalse(parse_redis_url("redis://h:1/2").cluster)

    def test_a_bad_cluster_url_says_what_to_write(self) -> None:
        for text, reason in [
            ("redis+cluster://h:1/3", "database 0 only"),
            ("redis+cluster://h:x", "invalid port"),
            ("redis+cluster://", "must name each seed node"),
        ]:
            with self.assertRaisesRegex(ValueError, reason):
                parse_redis_url(text)

    def test_the_layout_is_chosen_by_the_url(self) -> None:
        from relayd.base.clock import Timekeeper
        from relayd.storage.cluster import redis_client
        from relayd.storage.redis import Redis

        clock = Timekeeper(reactor)
        single = redis_client("redis://127.0.0.1:1/0", clock)
        self.addCleanup(single.close)
        several = redis_client("redis+cluster://127.0.0.1:1,127.0.0.1:2", clock)
        self.addCleanup(several.close)
        self.assertIs(type(single), Redis)
        self.assertIs(type(several), ClusterRedis)


class MasterFailover(TestCase):
    """Issue 25 acceptance 4: a master killed (6 nodes: 3 masters with a replica each), its slots'
    traffic goes to the promoted replica by itself, answered StoreUnavailable meanwhile."""

    timeout = 90

    async def test_a_killed_master_is_rerouted_to_its_promoted_replica(self) -> None:
        cluster = RedisCluster.start(3, replicas=1)
        self.addCleanup(cluster.cleanup)
        redis = await connected_redis(cluster.url)
        self.addCleanup(redis.close)
        assert isinstance(redis, ClusterRedis)
        dead = cluster.nodes[1]  # a master (BusOnAnyNode kills the first seed)
        self.assertEqual(redis._slots.count(("127.0.0.1", dead.port)) > 0, True)
        tag = next(t for t in (b"{%d}" % n for n in itertools.count()) if redis._slots[key_slot(t)][1] == dead.port)
        await redis.execute("test", "SET", tag + b"before", b"1")
        dead_id = cluster.command(dead, "CLUSTER", "MYID").strip()
        await _until(lambda: bool(cluster.command(dead, "CLUSTER", "REPLICAS", dead_id).strip()))  # the replica known
        replica_line = cluster.command(dead, "CLUSTER", "REPLICAS", dead_id)
        replica_port = int(replica_line.split()[1].split("@")[0].rsplit(":", 1)[1])
        replica = next(node for node in cluster.nodes if node.port == replica_port)
        await _until(lambda: cluster.command(replica, "DBSIZE").strip() == "1")  # replicated
        assert dead.proc is not None
        os.kill(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait(10)
        killed = reactor.seconds()
        outages = 0
        promoted = None  # when the replica said it is a master (Redis's failover)
        replica_until = 0.0  # when it last said it is still a replica
        while True:
            try:
                await redis.execute("test", "SET", tag + b"after", b"2")
                break
            except StoreUnavailable:
                outages += 1
                if promoted is None:
                    if cluster.command(replica, "ROLE").startswith("master"):
                        promoted = reactor.seconds() - killed
                    else:
                        replica_until = reactor.seconds() - killed
                self.assertLess(reactor.seconds() - killed, 20, "never re-routed")
                await deferLater(reactor, 0.05, lambda: None)  # a client retrying
        rerouted = reactor.seconds() - killed
        self.assertGreater(outages, 0)
        self.assertEqual(redis._slots[key_slot(tag)], ("127.0.0.1", replica.port))
        self.assertEqual(await redis.execute("test", "GET", tag + b"before"), b"1")
        # Re-routed within a second of Redis's failover (the node timeout, then its election): of
        # the promotion a retry saw, or, when the retry after it was already re-routed, of the
        # last moment the replica was not promoted yet (the promotion came later).
        failover = promoted if promoted is not None else replica_until
        self.assertLess(rerouted, failover + 1, (promoted, replica_until, rerouted))
        self.assertLess(rerouted, RedisCluster.NODE_TIMEOUT + 4, (promoted, rerouted))


class BusOnAnyNode(TestCase):
    """The buses' pub/sub and keyless PUBLISH on a cluster use any reachable node, every instance the
    same one (a PUBLISH counts only its own node's subscribers: the MCP bus's "instance gone"), and
    move on when that node dies, and back when it returns (6 nodes: each master with a replica)."""

    timeout = 120

    async def test_the_first_seed_killed_then_back_the_bus_follows(self) -> None:
        cluster = RedisCluster.start(3, replicas=1)
        self.addCleanup(cluster.cleanup)
        first = cluster.nodes[0]  # the first seed, a master
        here = await connected_redis(cluster.url)  # two instances
        self.addCleanup(here.close)
        there = await connected_redis(cluster.url)
        self.addCleanup(there.close)
        assert isinstance(here, ClusterRedis) and isinstance(there, ClusterRedis)
        heard: list[bytes] = []
        bus = RedisBus(here)  # (made as the MCP bus makes its own, not by here.bus())
        self.addCleanup(bus.close)
        bus.subscribe(b"ch", heard.append)
        await bus.ready

        async def delivered(message: bytes) -> int:
            """Publish from the other instance until its PUBLISH is answered; the receivers it counted."""
            waited = 0.0
            while True:
                try:
                    receivers = int(await there.execute("test", "PUBLISH", b"ch", message))
                    if receivers:
                        break
                except StoreUnavailable:
                    pass  # its node is gone: a client retrying
                self.assertLess(waited, 20, f"{message!r} never reached a subscriber")
                await deferLater(reactor, 0.05, lambda: None)  # a client retrying
                waited += 0.05
            await _until(lambda: message in heard)
            return receivers

        self.assertEqual(await delivered(b"before"), 1)
        self.assertEqual(here.bus_node(bus.connection), ("127.0.0.1", first.port))
        assert first.proc is not None
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(10)
        # Both instances move to the next seed: the message arrives and its PUBLISH counts the subscriber.
        self.assertEqual(await delivered(b"after"), 1)
        self.assertEqual(here.bus_node(bus.connection), ("127.0.0.1", cluster.nodes[1].port))
        first._spawn()  # back (a replica now): both instances go back to the first seed
        await _until(lambda: here.bus_node(bus.connection) == ("127.0.0.1", first.port))
        await _until(lambda: there._keyless_address() == ("127.0.0.1", first.port))
        self.assertEqual(await delivered(b"back"), 1)


class BusClosedWhileConnecting(TestCase):
    async def test_no_other_node_is_tried(self) -> None:
        """Cancelled, the bus's connection attempt stops. A HostnameEndpoint cancelled while it
        resolves the name fails with DNSLookupError, which the walk over the nodes once took for a
        node that cannot be reached: it connected to the next one behind the bus's stopped
        ClientService (automat's NoTransition logged when that connection went)."""
        here = await connected_redis(shared_cluster().url)
        self.addCleanup(here.close)
        bus = RedisBus(here)
        await bus.close()  # before its connection is made
        self.assertFalse(bus.connected)


class BusAfterAHungNode(TestCase):
    """A node that hangs (SIGSTOP) still accepts connections: the buses move to the next node within
    the heartbeat's bound and are heard there, and go back once it answers (3 masters)."""

    timeout = 120

    async def test_the_bus_is_heard_on_another_node_while_the_first_seed_hangs(self) -> None:
        cluster = RedisCluster.start(3)
        self.addCleanup(cluster.cleanup)
        first, second = cluster.nodes[0], cluster.nodes[1]
        here = await connected_redis(cluster.url, timeout=5, wait_replicas=0)
        self.addCleanup(here.close)
        there = await connected_redis(cluster.url, timeout=5, wait_replicas=0)
        self.addCleanup(there.close)
        assert isinstance(here, ClusterRedis) and isinstance(there, ClusterRedis)
        here.timeout = there.timeout = 1.0  # (the buses' heartbeat and the commands' wait)
        for node in [*here._nodes.values(), *there._nodes.values()]:
            node.timeout = 1.0
        heard: list[bytes] = []
        bus = RedisBus(here)
        self.addCleanup(bus.close)
        bus.subscribe(b"ch", heard.append)
        theirs = RedisBus(there)  # every instance has a bus (MCP's, the commands'): it finds the node silent too
        self.addCleanup(theirs.close)
        theirs.subscribe(b"other", lambda message: None)
        await bus.ready
        await theirs.ready

        async def delivered(message: bytes, within: float) -> int:
            """Publish from the other instance until a subscriber counts it; the receivers it counted."""
            waited, started = 0.0, reactor.seconds()
            while True:
                try:
                    receivers = int(await there.execute("test", "PUBLISH", b"ch", message))
                    if receivers:
                        break
                except (StoreUnavailable, OutcomeUnknown):
                    pass  # its node hangs: a client retrying
                self.assertLess(reactor.seconds() - started, within, f"{message!r} never reached a subscriber")
                await deferLater(reactor, 0.05, lambda: None)  # a client retrying
                waited += 0.05
            await _until(lambda: message in heard)
            return receivers

        self.assertEqual(await delivered(b"before", 10), 1)
        self.assertEqual(here.bus_node(bus.connection), ("127.0.0.1", first.port))
        logged: list[str] = []
        observer = lambda event: logged.append(formatEvent(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        assert first.proc is not None
        os.kill(first.proc.pid, signal.SIGSTOP)
        self.addCleanup(os.kill, first.proc.pid, signal.SIGCONT)
        # Within the heartbeat's bound (the idle look twice, the timeout), the reconnection's backoff
        # and a margin for a loaded machine: heard again, on the next seed, counted by the PUBLISH.
        self.assertEqual(await delivered(b"while hung", 2 * PING_IDLE + 1 + 2 + 3), 1)
        self.assertEqual(here.bus_node(bus.connection), ("127.0.0.1", second.port))
        moved = f"Redis Cluster node 127.0.0.1:{first.port} does not answer; pub/sub moves to 127.0.0.1:{second.port}"
        self.assertEqual(len([line for line in logged if line.startswith(moved)]), 2)  # once per instance
        os.kill(first.proc.pid, signal.SIGCONT)
        await _until(lambda: here.bus_node(bus.connection) == ("127.0.0.1", first.port), timeout=20)
        await _until(lambda: there._keyless_address() == ("127.0.0.1", first.port), timeout=20)
        self.assertEqual(await delivered(b"back", 10), 1)
        self.assertIn(f"Redis Cluster node 127.0.0.1:{first.port} answers again; pub/sub may use it again", logged)


def _replica_of(cluster: RedisCluster, master_port: int) -> RedisServer:
    """The replica of the master on C{master_port} (C{CLUSTER REPLICAS}, asked of that master)."""
    master = next(node for node in cluster.nodes if node.port == master_port)
    master_id = cluster.command(master, "CLUSTER", "MYID").strip()
    line = cluster.command(master, "CLUSTER", "REPLICAS", master_id)
    port = int(line.split()[1].split("@")[0].rsplit(":", 1)[1])
    return next(node for node in cluster.nodes if node.port == port)


class WaitOnCluster(TestCase):
    """An acknowledged write on a Redis Cluster is answered only once C{WAIT 1} counted a replica of
    its master (on by default with redis+cluster://, as with Sentinel); with that replica stopped,
    the write falls short: AEP answers 503, not 202 (6 nodes: each master with a replica)."""

    timeout = 90

    async def test_a_write_waits_for_its_masters_replica(self) -> None:
        cluster = RedisCluster.start(3, replicas=1)
        self.addCleanup(cluster.cleanup)
        redis = await connected_redis(cluster.url)
        self.addCleanup(redis.close)
        assert isinstance(redis, ClusterRedis)
        self.assertEqual(redis.wait_replicas, 1)  # the default with redis+cluster://
        key = b"{waited}k"
        master = redis._slots[key_slot(key)]
        assert master is not None
        replica = _replica_of(cluster, master[1])
        await redis.execute("test", "SET", key, b"1", durable=True)
        self.assertEqual(read_on_replica(replica.port, key), b"1")  # on the replica when answered

        relay = await start_relay(self, redis=cluster.url, redis_prefix="wait:")
        session = "waited"
        master = redis._slots[key_slot(BUCKETS.tag_of(session.encode()))]
        assert master is not None
        stopped = _replica_of(cluster, master[1])
        response, _ = await relay.post(event(session, 0))
        self.assertEqual(response.code, 202)
        assert stopped.proc is not None
        os.kill(stopped.proc.pid, signal.SIGSTOP)  # the replica no longer acknowledges
        resumed = False

        def resume() -> None:
            if not resumed and stopped.proc is not None:
                os.kill(stopped.proc.pid, signal.SIGCONT)

        self.addCleanup(resume)
        response, body = await relay.post(event(session, 1))
        self.assertEqual(response.code, 503, body)
        self.assertIn(b"outcome-unknown", body)
        with self.assertRaises(OutcomeUnknown) as raised:
            await redis.execute("test", "SET", b"{waited}k", b"2", durable=True)
        self.assertIn("confirmed by 0 of 1 replicas", str(raised.exception))
        await redis.execute("test", "SET", b"{waited}k", b"3")  # not acknowledged: no wait
        resume()
        resumed = True
        response, _ = await relay.post(event(session, 1))  # the client's retry
        self.assertEqual(response.code, 202)
