"""Redis behind Sentinel (relayd/storage/sentinel.py): the redis+sentinel:// URL, the follower finding
and following the master, and a failover as an outage that loses nothing acknowledged (issue 25).

Each test that needs servers starts its own master, two replicas and three sentinels
(tests/support/redis.py L{SentinelGroup}): a failover changes them for good."""

from __future__ import annotations

import io
import json
import sys
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults, succeed
from twisted.internet.task import deferLater
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.base.errors import OutcomeUnknown, StoreRefused, StoreUnavailable
from relayd.buzz.redis.state import RedisReceipts
from relayd.storage import sentinel
from relayd.storage.redis import Redis, parse_redis_url
from relayd.tap import Options, all_settings
from tests.storage.test_redis import until
from tests.support.aep import event, open_sse, start_relay
from tests.support.http import HttpClient
from tests.support.redis import RedisServer, SentinelGroup, command, connected_redis, free_port, role
from tests.support.wing import Wing


class SentinelURL(TestCase):
    def test_parsed(self) -> None:
        url = parse_redis_url("rediss+sentinel://u:data%40pw@s1:26380,s2,[::1]:26381/main/3?sentinel_password=sp")
        self.assertEqual(url.sentinels, (("s1", 26380), ("s2", 26379), ("::1", 26381)))
        self.assertEqual((url.master, url.db, url.tls), ("main", 3, True))
        self.assertEqual((url.username, url.password, url.sentinel_password), ("u", "data@pw", "sp"))
        self.assertEqual(url.secrets, ("data@pw", "sp"))
        self.assertEqual(str(url), "rediss+sentinel://s1:26380,s2:26379,[::1]:26381/main/3")  # no password
        self.assertEqual(parse_redis_url("redis+sentinel://s1/main").db, 0)

    def test_refused_with_what_to_write(self) -> None:
        for text, says in [
            ("redis+sentinel://s1:26379", "must name the master"),
            ("redis+sentinel://s1:26379/", "must name the master"),
            ("redis+sentinel://s1:x/main", "sentinel 's1:x' has an invalid port"),
            ("redis+sentinel://s1,,s2/main", "must name each sentinel as HOST:PORT"),
            ("redis+sentinel://s1/main/zero", "database must be a number"),
            ("redis+sentinel://s1/main/0/1", "more than a master and a database"),
            ("redis+sentinel://s1/main?password=x", "unknown query parameter 'password'"),
            ("sentinel://s1/main", "must be a redis://, rediss://, redis+cluster://HOST:PORT[,HOST:PORT...] or redis+sentinel://"),
        ]:
            with self.assertRaises(ValueError) as caught:
                parse_redis_url(text)
            self.assertIn(says, str(caught.exception), text)


class SentinelSettings(TestCase):
    """--redis with a Sentinel URL, and the wait options: one-line start-up errors, --check-config."""

    def options(self, *args: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        self.patch(sys, "stdout", out)
        self.patch(sys, "stderr", err)
        with self.assertRaises(SystemExit) as exit:
            Options(environ={}).parseOptions([*args, "--check-config"])
        return int(exit.exception.code or 0), out.getvalue(), err.getvalue()

    def test_a_bad_url_is_one_line(self) -> None:
        self.assertEqual(
            self.options("--redis", "redis+sentinel://s1:26379"),
            (2, "", "relayd: error: --redis: must name the master the sentinels monitor after the sentinels "
                    "(redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER[/DB])\n"),
        )  # fmt: skip
        code, _, err = self.options("--redis-wait-timeout-ms", "5000")
        self.assertEqual((code, err.count("\n")), (2, 1))
        self.assertIn("--redis-wait-timeout-ms: '5000' must be at most 1000 ms", err)

    def test_checked_and_both_passwords_are_secrets(self) -> None:
        url = "redis+sentinel://u:data-pw@s1:26379/main?sentinel_password=sentinel-pw"
        code, out, _ = self.options("--redis", url, "--redis-wait-replicas", "2")
        self.assertEqual(code, 0)
        self.assertIn("redis = [secret]", out)
        self.assertIn("redis-wait-replicas = 2", out)
        setting = next(s for s in all_settings() if s.name == "redis")
        assert setting.secret_part is not None
        self.assertEqual(setting.secret_part(url), ("data-pw", "sentinel-pw"))


async def sentinel_redis(test: TestCase, url: str, **kw: Any) -> Redis:
    """A client on C{url} whose whole pool is up (closed at cleanup)."""
    redis = Redis(url, Timekeeper(reactor), **kw)
    test.addCleanup(redis.close)
    factory = redis._pool._factory
    await until(test, lambda: factory.size == factory.poolsize, "the pool never connected", within=10)
    return redis


class Follower(TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.group = SentinelGroup.start()
        self.addCleanup(self.group.cleanup)

    async def test_finds_the_master_and_follows_a_failover(self) -> None:
        redis = await sentinel_redis(self, self.group.url)
        first = self.group.master_port()
        assert first is not None
        await redis.execute("probe", "SET", "k", "1")
        self.assertEqual(command(first, "GET", "k"), b"1")  # written on the master
        self.assertEqual(redis.wait_replicas, 1)  # on by default with Sentinel

        self.group.failover()
        await until(self, lambda: self.group.master_port() != first, "no failover", within=10)
        second = self.group.master_port()
        assert second is not None

        async def written() -> bool:
            try:
                await redis.execute("probe", "SET", "k", "2", durable=True)
            except StoreUnavailable:
                return False
            return True

        # The old master still answers as a master for seconds: relayd must have moved anyway.
        ok = False
        for _ in range(300):
            ok = await written()
            if ok:
                break
            await deferLater(reactor, 0.02, lambda: None)
        self.assertTrue(ok, "no write accepted after the failover")
        self.assertEqual(command(second, "GET", "k"), b"2")
        self.assertEqual({redis.follower.address_of(c) for c in redis._factory.pool}, {("127.0.0.1", second)})

    async def switched(self, redis: Redis, within: float) -> float:
        """SENTINEL FAILOVER; how long after the sentinels name the new master every pool
        connection of C{redis} goes there (no traffic: nothing but the follower moves them)."""
        first = self.group.master_port()
        self.group.failover()
        await until(self, lambda: self.group.master_port() != first, "no failover", within=10)
        named = reactor.seconds()
        new = ("127.0.0.1", self.group.master_port())
        follower = redis.follower
        assert follower is not None
        factory = redis._factory
        await until(
            self, lambda: follower.address == new and factory.size == factory.poolsize
            and {follower.address_of(c) for c in factory.pool} == {new},
            "the pool never moved to the new master", within=within,
        )  # fmt: skip
        return reactor.seconds() - named

    async def test_a_switch_is_followed_at_once(self) -> None:
        self.patch(sentinel, "RECHECK_INTERVAL", 3600.0)  # only +switch-master can tell it
        redis = await sentinel_redis(self, self.group.url)
        bus = redis.bus()
        heard: list[bytes] = []
        bus.subscribe(b"chan", heard.append)
        await bus.ready
        self.assertLess(await self.switched(redis, within=5), 1.5)
        # The pub/sub connection moved too (checked like the pool's: ROLE, then the address).
        follower = redis.follower
        assert follower is not None
        await until(self, lambda: bus.connection is not None and follower.address_of(bus.connection) == follower.address,
                    "the subscriber never moved", within=5)  # fmt: skip
        await until(self, lambda: bus.connection is not None and bus.connection.transport.connected, "", within=5)
        for _ in range(100):  # (its SUBSCRIBE may still be on its way)
            await redis.execute("probe", "PUBLISH", b"chan", b"after")
            if heard:
                break
            await deferLater(reactor, 0.02, lambda: None)
        self.assertEqual(heard[:1], [b"after"])

    async def test_a_missed_switch_is_found_by_asking(self) -> None:
        self.patch(sentinel, "SWITCH", b"+never-published")  # the event missed
        self.patch(sentinel, "FAILOVER_STARTS", b"+never-published-either")
        redis = await sentinel_redis(self, self.group.url)
        self.assertLess(await self.switched(redis, within=8), sentinel.RECHECK_INTERVAL + 1.5)

    async def test_wait_counts_fewer_replicas_as_an_outage(self) -> None:
        redis = await sentinel_redis(self, self.group.url, wait_replicas=3, wait_timeout_ms=50)
        failure = await self.assertFailure(redis.execute("probe", "SET", "k", "1", durable=True), OutcomeUnknown)
        self.assertRegex(str(failure), "confirmed by [012] of 3 replicas within 50 ms")
        await redis.execute("probe", "SET", "k", "2")  # not durable: no wait


class RoleCheck(TestCase):
    """A connection to a node that says it is not a master (ROLE, read as bytes) is never used."""

    timeout = 30

    async def test_a_replica_named_as_master_is_not_used(self) -> None:
        master = RedisServer.start()
        self.addCleanup(master.cleanup)
        replica = RedisServer.start("--replicaof", "127.0.0.1", str(master.port))
        self.addCleanup(replica.cleanup)
        named = [replica.port]  # what the (stand-in) sentinels answer

        def discover(follower: sentinel.SentinelFollower) -> Deferred[tuple[str, int]]:
            follower._found(("127.0.0.1", named[0]))
            return succeed(("127.0.0.1", named[0]))

        self.patch(sentinel.SentinelFollower, "discover", discover)
        self.patch(sentinel.SentinelFollower, "start", lambda follower: None)
        redis = Redis(f"redis+sentinel://127.0.0.1:{free_port()}/main/0", Timekeeper(reactor))
        self.addCleanup(redis.close)
        lines: list[str] = []
        observer = lambda e: lines.append(formatEvent(e))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        await until(self, lambda: any("is a slave, not the master" in line for line in lines), "no ROLE check")
        self.assertFalse(redis.connected)
        await self.assertFailure(redis.execute("probe", "SET", "k", "1"), StoreUnavailable)

        named[0] = master.port  # the sentinels now name the master
        await until(self, lambda: redis.connected, "never connected to the master")
        await redis.execute("probe", "SET", "k", "1")
        self.assertEqual(command(master.port, "GET", "k"), b"1")


class NoSentinel(TestCase):
    """No sentinel answers: every request is refused at once (never held), and the log says why once."""

    timeout = 30

    async def test_refused_at_once_and_logged_once(self) -> None:
        answers = [0]
        answered = sentinel.SentinelFollower._answered

        def counted(follower: sentinel.SentinelFollower, result: Any) -> None:
            answers[0] += 1
            answered(follower, result)

        self.patch(sentinel.SentinelFollower, "_answered", counted)
        lines: list[str] = []
        observer = lambda e: lines.append(formatEvent(e))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        redis = Redis(f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/main/0", Timekeeper(reactor))
        self.addCleanup(redis.close)
        failure = await self.assertFailure(redis.execute("probe", "SET", "k", "1", durable=True), StoreUnavailable)
        self.assertIn("not connected", str(failure))
        await until(self, lambda: answers[0] >= 6, "the sentinels were not asked again")
        unfound = [line for line in lines if "no sentinel named master 'main'" in line and "asking again" in line]
        self.assertEqual(len(unfound), 1, unfound)
        self.assertIn("Connection refused", unfound[0])


class Rediscovery(TestCase):
    """A refusal of a node that is not (or no longer) a master sends the follower to the sentinels."""

    timeout = 30

    async def test_readonly_asks_the_sentinels_again(self) -> None:
        server = RedisServer.start()
        self.addCleanup(server.cleanup)
        redis = await connected_redis(server.url)
        self.addCleanup(redis.close)
        asked: list[str] = []

        class Follower:
            failing_over = False

            def recheck(self) -> None:
                asked.append("recheck")

            def stop(self) -> Deferred[None]:
                return succeed(None)

        redis.follower = Follower()  # type: ignore[assignment]
        await redis.execute("probe", "SET", "k", "1")
        self.assertEqual(asked, [])
        command(server.port, "REPLICAOF", "127.0.0.1", str(free_port()))  # a master demoted
        failure = await self.assertFailure(redis.execute("probe", "SET", "k", "2"), StoreRefused)
        self.assertEqual((failure.code, asked), ("READONLY", ["recheck"]))
        command(server.port, "CONFIG", "SET", "maxmemory", "1")
        command(server.port, "REPLICAOF", "NO", "ONE")
        command(server.port, "CONFIG", "SET", "maxmemory-policy", "noeviction")
        failure = await self.assertFailure(redis.execute("probe", "SET", "k", "3"), StoreRefused)
        self.assertEqual((failure.code, asked), ("OOM", ["recheck"]))  # full, not demoted: nothing to ask


TOKEN = "t" * 32


class Failover(TestCase):
    """Acceptance 3 of issue 25: SENTINEL FAILOVER, then the new master killed, during bounded AEP
    traffic from a client that retries on 503: writes accepted again within 6 s of the kill, and
    every acknowledged event there afterwards."""

    timeout = 90

    def setUp(self) -> None:
        self.group = SentinelGroup.start()
        self.addCleanup(self.group.cleanup)

    async def test_aep_mcp_and_broker_lose_nothing_acknowledged(self) -> None:
        relay = await start_relay(self, redis=self.group.url, redis_prefix="failover:")
        mcp = await Wing.start("mcp", {"redis": self.group.url, "redis-prefix": "failover:",
                                       "mcp-reap-interval-ms": "0", "mcp-max-sessions-per-address": "0"})  # fmt: skip
        self.addCleanup(mcp.stop)
        page = HttpClient(self, mcp.url + mcp.settings["mcp-prefix"])
        acknowledged: list[int] = []
        accepted_at: list[float] = []  # when each was acknowledged (the reactor's clock)
        refused: list[int] = []
        registered: list[str] = []  # MCP sessions whose register answered ok
        settled: list[str] = []  # broker requests whose verdict was stored (the broker answers it then)
        redis = await sentinel_redis(self, self.group.url, prefix="failover:")
        receipts = RedisReceipts(redis, Timekeeper(reactor), lambda effects: succeed(None), prefix="failover:")
        self.addCleanup(receipts.close)
        await receipts.bus.ready
        going = [True]

        async def traffic() -> None:
            seq = 0
            while going[0]:
                seq += 1
                while going[0]:  # the same event until it is acknowledged (dedupe makes a retry safe)
                    try:
                        response, body = await relay.post(event("F", seq))
                    except Exception:  # no answer in time: retried
                        response, body = None, b""
                    if response is not None and response.code == 202:
                        acknowledged.append(seq)
                        accepted_at.append(reactor.seconds())
                        break
                    self.assertTrue(response is None or response.code == 503, (response and response.code, body))
                    refused.append(seq)
                    await deferLater(reactor, 0.02, lambda: None)  # a client's pause before its retry

        async def registers() -> None:
            n = 0
            while going[0]:
                n += 1
                session = f"fo{n:05d}"
                while going[0]:
                    try:
                        reply = await page.post("/register", json.dumps({"session": session, "token": TOKEN}).encode())
                    except Exception:  # no answer in time: retried
                        reply = None
                    if reply is not None and reply.code == 200:
                        registered.append(session)
                        break
                    self.assertTrue(reply is None or reply.code == 503, reply and (reply.code, reply.body))
                    await deferLater(reactor, 0.05, lambda: None)  # a client's pause before its retry
                await deferLater(reactor, 0.02, lambda: None)  # a register every few tens of ms

        async def verdicts() -> None:
            n = 0
            while going[0]:
                n += 1
                request, digest = f"req{n}", b"%032d" % n
                while going[0]:  # the broker's path: claim, then store the verdict it answers
                    try:
                        claim = await receipts.claim("agent", request, digest)
                        if claim.status != "done":
                            self.assertIn(claim.status, ("new", "resume"))
                            await receipts.complete("agent", request, digest, b"verdict %d" % n, [])
                        settled.append(request)
                        break
                    except StoreUnavailable:
                        await deferLater(reactor, 0.05, lambda: None)  # retried as the agent would
                await deferLater(reactor, 0.02, lambda: None)

        done = gatherResults([Deferred.fromCoroutine(loop()) for loop in (traffic, registers, verdicts)])
        try:
            await until(self, lambda: len(acknowledged) >= 20, "no traffic", within=10)
            first = self.group.master_port()
            self.group.failover()
            await until(self, lambda: self.group.master_port() != first, "no failover", within=10)
            second = self.group.master_port()
            assert first is not None and second is not None
            count = len(acknowledged)
            await until(self, lambda: len(acknowledged) > count + 20, "writes not accepted after the failover", within=10)
            # The sentinels demote the old master some 10 s after the promotion (nothing relayd
            # does changes that): until then the new master has one replica, and killing it would
            # leave the next master none to confirm writes.
            await until(self, lambda: role(first) == b"slave", "the old master was never demoted", within=20)

            # The new master killed: writes accepted again within 6 s.
            self.group.node(second).proc.kill()  # type: ignore[union-attr]
            killed = reactor.seconds()
            await until(self, lambda: accepted_at[-1] > killed + 0.1, "writes not accepted after the kill", within=10)
            first_after = next(t for t in accepted_at if t > killed + 0.1)  # (a write answered as it died)
            self.assertNotEqual(self.group.master_port(), second)
            self.assertLess(first_after - killed, 6.0)
            count = len(acknowledged)
            await until(self, lambda: len(acknowledged) > count + 20, "traffic stalled", within=10)
        finally:
            going[0] = False
            await done

        # Every acknowledged event is there, once, in order.
        history = await open_sse(self, relay, live="0", from_=[{"session": "F"}])
        stored = [m.json()["seq"] for m in await history.read_until_end() if m.comment is None]
        missing = sorted(set(acknowledged) - set(stored))
        self.assertEqual(missing, [], f"{len(missing)} acknowledged events lost of {len(acknowledged)}")
        self.assertEqual(stored, sorted(set(stored)))
        self.assertTrue(refused, "the failovers never refused a write: were they seen?")
        # Every MCP session whose register was answered ok is there (a poll of it is answered).
        lost = []
        for session in registered:
            for _ in range(100):  # (a 503 is retried: the client may be reconnecting still)
                reply = await page.get(f"/{session}/poll?token={TOKEN}&wait=0")
                if reply.code != 503:
                    break
                await deferLater(reactor, 0.05, lambda: None)
            if reply.code != 200:
                lost.append((session, reply.code))
        self.assertEqual(lost, [], f"{len(lost)} acknowledged registers lost of {len(registered)}")
        # Every verdict the broker would have answered is stored, as it was.
        gone = []
        for request in settled:
            for _ in range(100):
                try:
                    receipt = await receipts.receipt("agent", request)
                    break
                except StoreUnavailable:  # reconnecting still: retried
                    await deferLater(reactor, 0.05, lambda: None)
            if receipt is None or receipt.state != "done" or receipt.response != b"verdict " + request[3:].encode():
                gone.append((request, receipt))
        self.assertEqual(gone, [], f"{len(gone)} settled verdicts lost of {len(settled)}")
        self.assertTrue(registered and settled)
