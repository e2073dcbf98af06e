"""relayd.storage.redis against a real redis-server: a failed handshake is retried, not given up; a Redis
holding another relayd keyspace version is refused."""

from __future__ import annotations

import socket
from typing import Callable

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.base.errors import OutcomeUnknown, StoreUnavailable
from relayd.compat import txredisapi as fence
from relayd.storage.redis import KEYSPACE_VERSION, Redis
from tests.support.cases import cases, expand
from tests.support.redis import RedisServer


def admin(port: int, commands: bytes) -> bytes:
    """Inline commands over a plain socket (a second client, not the one under test)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(commands + b"QUIT\r\n")
        return b"".join(iter(lambda: s.recv(65536), b"")).removesuffix(b"+OK\r\n")


def denied_auth(port: int) -> int:
    """Failed AUTH attempts so far (Redis groups them in one ACL LOG entry with a count)."""
    log = admin(port, b"AUTH old\r\nACL LOG\r\n").split(b"$5\r\ncount\r\n:")
    return int(log[1].split(b"\r\n")[0]) if len(log) > 1 else 0


async def until(
    test: TestCase, condition: Callable[[], object], what: str, within: float = 10.0, step: float = 0.02
) -> None:
    """Wait until C{condition()} holds, failing C{test} with C{what} after C{within} seconds. Polling is
    acceptable here: what is waited on is an external redis-server, or connections that the client makes,
    loses and remakes (with a backoff) by itself, with no event a test could wait on instead."""
    waited = 0.0
    while not condition():
        test.assertLess(waited, within, what)
        await deferLater(reactor, step, lambda: None)
        waited += step


class Reconnect(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)

    async def test_failed_handshake_is_retried_not_given_up(self) -> None:
        # A handshake that fails (here a wrong password; during a restart, a connection closed
        # mid-SELECT) must not stop the pool for good: once Redis accepts, the client serves again.
        port = self.server.port
        self.assertEqual(admin(port, b"CONFIG SET requirepass old\r\n"), b"+OK\r\n")
        redis = Redis(f"redis://:new@127.0.0.1:{port}/1", Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        refused = await self.assertFailure(redis.execute("probe", "PING"), StoreUnavailable)
        self.assertEqual(str(refused), "probe store unavailable: not connected")
        # Every slot of the pool has tried and been refused before the password is fixed.
        # Polling an external server's counter.
        await until(self, lambda: denied_auth(port) >= 4, "the client never tried to authenticate", step=0.05)

        self.assertEqual(admin(port, b"AUTH old\r\nCONFIG SET requirepass new\r\n"), b"+OK\r\n+OK\r\n")
        # Polling a reconnect that backs off by itself.
        await until(self, lambda: redis.connected, "the client did not reconnect", step=0.05)
        self.assertEqual(await redis.execute("probe", "SET", "k", "v"), fence.status("OK"))
        # SELECT ran: the key is in database 1 (beside the keyspace version), not 0.
        self.assertEqual(sorted(await redis.execute("probe", "KEYS", "*")), [b"k", b"relayd:schema"])


@expand
class CommandTimeout(TestCase):
    """A command written on a ready connection is timed once: its reply timer is the client's timeout
    (relayd/compat/txredisapi.py reply_timer_first), and Redis silent it fails as with both."""

    timeout = 30

    def setUp(self) -> None:
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)

    @cases(one_deadline=True, two=False)
    async def test_a_command_redis_does_not_answer(self, reply_timer_only: bool) -> None:
        if not reply_timer_only:
            self.patch(fence, "reply_timer_first", lambda protocol, clock, seconds: False)
        redis = Redis(self.server.url, Timekeeper(reactor), timeout=0.5)
        self.addCleanup(redis.close)
        await until(self, lambda: redis.connected, "the client did not connect")
        self.server.pause(self)
        answers = [redis.execute("probe", "GET", "k"), *redis.execute_many("probe", [("GET", "a"), ("GET", "b")])]
        waiting = [d for d in redis.clock._queues[0.5].entries if d.active()]
        self.assertEqual(len(waiting), 3 if reply_timer_only else 6)
        for answer in answers:
            failure = await self.assertFailure(answer, OutcomeUnknown)
            self.assertEqual(
                str(failure),
                "probe store unavailable: no answer from Redis (Not received Redis response in 0.5 seconds); "
                "the command may have run",
            )


class KeyspaceVersion(TestCase):
    """The version key (C{<prefix>schema}) is checked on every connection before it is used."""

    timeout = 30

    def setUp(self) -> None:
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)
        self.logged: list[dict] = []
        globalLogPublisher.addObserver(self.logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.logged.append)

    def get(self, key: bytes) -> bytes:
        return admin(self.server.port, b"GET " + key + b"\r\n")

    def client(self, prefix: str = "relayd:") -> Redis:
        redis = Redis(self.server.url, Timekeeper(reactor), timeout=1, prefix=prefix)
        self.addCleanup(redis.close)
        return redis

    async def test_fresh_redis_gets_this_version(self) -> None:
        self.assertEqual(self.get(b"relayd:schema"), b"$-1\r\n")
        redis = self.client()
        await until(self, lambda: redis.connected, "the client did not connect")
        mine = str(KEYSPACE_VERSION).encode()
        self.assertEqual(await redis.execute("probe", "GET", "relayd:schema"), mine)
        self.assertIsNone(redis.refusal)

    async def test_same_version_is_used(self) -> None:
        mine = str(KEYSPACE_VERSION).encode()
        admin(self.server.port, b"SET relayd:schema " + mine + b"\r\n")
        redis = self.client()
        await until(self, lambda: redis.connected, "the client did not connect")
        self.assertEqual(await redis.execute("probe", "SET", "k", "v"), fence.status("OK"))
        self.assertFalse(redis.refused.called)

    async def refused(self, stored: bytes, prefix: str = "relayd:") -> tuple[Redis, str]:
        admin(self.server.port, b"SET " + prefix.encode() + b"schema " + stored + b"\r\n")
        redis = self.client(prefix)
        reason = await redis.refused
        return redis, reason

    async def test_unversioned_keys_of_an_earlier_relayd_are_refused(self) -> None:
        # An earlier relayd kept no version key: its keys under the prefix are not an empty keyspace.
        admin(self.server.port, b"SET relayd:mcp:buffered 10\r\n")
        redis = self.client()
        reason = await redis.refused
        self.assertIn("holds keys of an earlier relayd without a keyspace version (key relayd:schema)", reason)
        self.assertEqual(self.get(b"relayd:schema"), b"$-1\r\n")  # nothing written over them

    async def test_earlier_keys_under_another_prefix_do_not_count(self) -> None:
        admin(self.server.port, b"SET other:aep:lru x\r\n")
        redis = self.client()
        await until(self, lambda: redis.connected, "the client did not connect")
        self.assertEqual(await redis.execute("probe", "GET", "relayd:schema"), str(KEYSPACE_VERSION).encode())

    async def test_newer_version_is_refused_with_the_reason(self) -> None:
        redis, reason = await self.refused(str(KEYSPACE_VERSION + 1).encode())
        self.assertEqual(
            reason,
            f"Redis at redis://127.0.0.1:{self.server.port}/0 holds relayd keyspace version {KEYSPACE_VERSION + 1} "
            f"(key relayd:schema), this relayd uses keyspace version {KEYSPACE_VERSION}: relayd versions that lay "
            "out their keys differently cannot share them. Stop the relayd processes of the other version and "
            "delete the keys under 'relayd:' (FLUSHDB if that database holds nothing else), or give this relayd "
            'another Redis database (redis://host:port/N) or --redis-prefix; see docs/deployment.md "Upgrades"',
        )
        # Nothing is run against it, and the version found is left as it was.
        self.assertFalse(redis.connected)
        failure = await self.assertFailure(redis.execute("probe", "SET", "k", "v"), StoreUnavailable)
        self.assertEqual(str(failure), "probe store unavailable: another relayd keyspace version")
        self.assertEqual(self.get(b"relayd:schema"), b"$1\r\n%d\r\n" % (KEYSPACE_VERSION + 1))
        self.assertEqual(self.get(b"k"), b"$-1\r\n")
        # One critical line, no traceback, no password.
        critical = [e for e in self.logged if e.get("log_level") is not None and e["log_level"].name == "critical"]
        self.assertEqual([formatEvent(e) for e in critical], [reason])
        self.assertFalse([e for e in self.logged if "log_failure" in e])

    async def test_older_version_is_refused(self) -> None:
        _, reason = await self.refused(str(KEYSPACE_VERSION - 1).encode())
        self.assertIn(f"holds relayd keyspace version {KEYSPACE_VERSION - 1} (key relayd:schema)", reason)

    async def test_a_key_of_another_type_is_refused(self) -> None:
        admin(self.server.port, b"HSET relayd:schema v 1\r\n")
        redis = self.client()
        reason = await redis.refused
        self.assertIn("holds a relayd:schema key that is not a version (key relayd:schema)", reason)

    async def test_refused_client_stops_reconnecting(self) -> None:
        redis, _ = await self.refused(b"999")

        def ours() -> int:  # connections from the client under test (the admin socket says QUIT at once)
            listing = admin(self.server.port, b"CLIENT LIST\r\n")
            return listing.count(b"cmd=") - listing.count(b"cmd=client")

        await until(self, lambda: ours() == 0, "the refused client kept connections open")
        self.assertTrue(redis._pool._factory.stopped)

    async def test_version_is_per_prefix(self) -> None:
        # Another deployment (prefix) with another version does not concern this one.
        admin(self.server.port, b"SET other:schema 999\r\n")
        redis = self.client("mine:")
        await until(self, lambda: redis.connected, "the client did not connect")
        self.assertEqual(self.get(b"mine:schema"), b"$1\r\n%d\r\n" % KEYSPACE_VERSION)
        _, reason = await self.refused(b"999", prefix="other:")
        self.assertIn("(key other:schema)", reason)
        self.assertIn("delete the keys under 'other:'", reason)

    async def test_password_never_in_the_reason(self) -> None:
        self.assertEqual(admin(self.server.port, b"CONFIG SET requirepass s3cret\r\n"), b"+OK\r\n")
        admin(self.server.port, b"AUTH s3cret\r\nSET relayd:schema 999\r\n")
        redis = Redis(f"redis://:s3cret@127.0.0.1:{self.server.port}/0", Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        reason = await redis.refused
        self.assertIn("holds relayd keyspace version 999", reason)
        self.assertNotIn("s3cret", reason)


class DeploymentBounds(TestCase):
    """The bounds a keyspace is kept by (C{<prefix>bounds}, beside the version) are the first
    instance's; a relayd with others is refused with both values named."""

    timeout = 30

    def setUp(self) -> None:
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)

    async def client(self, bounds: dict[str, float], prefix: str = "relayd:") -> Redis:
        redis = Redis(self.server.url, Timekeeper(reactor), timeout=1, prefix=prefix)
        self.addCleanup(redis.close)
        redis.hold_bounds(bounds)
        return redis

    async def test_first_instance_sets_them_and_same_values_share(self) -> None:
        first = await self.client({"aep-buffer": 100, "mcp-ttl-ms": 14_400_000.0})
        await until(self, lambda: first.connected, "the client did not connect")
        held = admin(self.server.port, b"HGETALL relayd:bounds\r\n")
        self.assertEqual(held, b"*4\r\n$10\r\naep-buffer\r\n$3\r\n100\r\n$10\r\nmcp-ttl-ms\r\n$8\r\n14400000\r\n")
        second = await self.client({"aep-buffer": 100, "mcp-ttl-ms": 14_400_000})
        await until(self, lambda: second.connected, "the same bounds were refused")
        self.assertIsNone(second.refusal)

    async def test_other_values_are_refused_naming_both(self) -> None:
        first = await self.client({"aep-buffer": 100, "aep-max-sessions": 5})
        await until(self, lambda: first.connected, "the client did not connect")
        other = await self.client({"aep-buffer": 101, "aep-max-sessions": 5})
        reason = await other.refused
        self.assertEqual(
            reason,
            f"--aep-buffer is 101 here and 100 on Redis (key relayd:bounds at redis://127.0.0.1:{self.server.port}/0): "
            "every relayd sharing these keys must use the same bounds, or each would trim the others' data by its "
            "own. Start this relayd with --aep-buffer 100; to change a bound, stop every relayd using this prefix, "
            'delete the key relayd:bounds, and start them with the new value (docs/deployment.md "Deployment-wide '
            'bounds")',
        )
        self.assertFalse(other.connected)
        # The first instance's values stay; the refused one wrote nothing.
        self.assertEqual(admin(self.server.port, b"HGET relayd:bounds aep-buffer\r\n"), b"$3\r\n100\r\n")

    async def test_a_bound_another_instance_does_not_keep_is_added(self) -> None:
        # An AEP-only instance first, then one with MCP too: the MCP bounds join, the AEP ones must match.
        first = await self.client({"aep-buffer": 100})
        await until(self, lambda: first.connected, "the client did not connect")
        both = await self.client({"aep-buffer": 100, "mcp-queue-frames": 1000})
        await until(self, lambda: both.connected, "a new bound was refused")
        self.assertEqual(admin(self.server.port, b"HGET relayd:bounds mcp-queue-frames\r\n"), b"$4\r\n1000\r\n")

    async def test_bounds_are_per_prefix(self) -> None:
        first = await self.client({"aep-buffer": 100}, prefix="one:")
        await until(self, lambda: first.connected, "the client did not connect")
        other = await self.client({"aep-buffer": 5}, prefix="two:")
        await until(self, lambda: other.connected, "another deployment's bounds were applied")


class ConnectionLog(TestCase):
    """An operator (and a test waiting for a relayd subprocess) reads when Redis can be reached."""

    timeout = 30

    def setUp(self) -> None:
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)
        self.lines: list[str] = []

        def observe(event: dict) -> None:  # type: ignore[type-arg]
            if event.get("log_namespace") == "relayd.storage.redis.Redis":
                self.lines.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    async def test_first_connection_and_last_loss_are_logged_once(self) -> None:
        url = f"redis://:secret-pass@127.0.0.1:{self.server.port}/0"
        admin(self.server.port, b"CONFIG SET requirepass secret-pass\r\n")
        redis = Redis(url, Timekeeper(reactor), timeout=1, poolsize=3)
        self.addCleanup(redis.close)
        await until(self, lambda: redis._factory.size == 3, "the pool did not fill")
        connected = f"connected to Redis at redis://127.0.0.1:{self.server.port}/0 (keyspace version {KEYSPACE_VERSION})"
        self.assertEqual(self.lines, [connected])  # once for the pool, not per connection; no password
        self.server.stop(save=False)
        await until(self, lambda: len(self.lines) > 1, "the loss was not logged")
        self.assertEqual(self.lines[1:], [f"lost every connection to Redis at redis://127.0.0.1:{self.server.port}/0; reconnecting"])

    async def test_closing_is_not_a_loss(self) -> None:
        redis = Redis(self.server.url, Timekeeper(reactor), timeout=1)
        await until(self, lambda: redis.connected, "the client did not connect")
        await redis.close()
        self.assertEqual(len(self.lines), 1, self.lines)


class BusSubscribeInterrupted(TestCase):
    def test_connection_lost_while_subscribing_is_one_line_not_a_traceback(self) -> None:
        # A bus whose connection goes while it subscribes (Redis restarting, relayd stopping after
        # a keyspace refusal) subscribes again on the next connection: no failure is logged.
        import txredisapi
        from twisted.python.failure import Failure

        from relayd.storage.redis import RedisBus

        logged: list[dict] = []
        globalLogPublisher.addObserver(logged.append)
        self.addCleanup(globalLogPublisher.removeObserver, logged.append)
        bus = RedisBus.__new__(RedisBus)  # no connection needed: only the errback is under test
        bus._subscribe_failed(Failure(txredisapi.ConnectionError("Lost connection")))
        self.assertEqual([formatEvent(e) for e in logged], [
            "Redis subscribe interrupted (Lost connection); resubscribing on reconnect"
        ])  # fmt: skip
        self.assertFalse([e for e in logged if "log_failure" in e])
        bus._subscribe_failed(Failure(ValueError("a bug")))
        self.assertEqual(len([e for e in logged if "log_failure" in e]), 1)  # anything else keeps its traceback
        self.flushLoggedErrors(ValueError)


class BusHeard(TestCase):
    async def test_only_the_answer_to_the_latest_subscribe_makes_a_channel_heard(self) -> None:
        """Subscribed, unsubscribed and subscribed again before Redis answers: the first SUBSCRIBE's
        answer comes while the channel is not subscribed yet again (its UNSUBSCRIBE is still to be
        answered), so only the last SUBSCRIBE's answer makes it heard."""
        from twisted.internet.defer import Deferred

        from tests.support.redis import connected_redis, shared_redis

        redis = await connected_redis(shared_redis().url)
        self.addCleanup(redis.close)
        bus = redis.bus()
        await bus.ready  # (fires inside the connection's connectionMade: the round trip lets it return)
        await redis.execute("test", "PING")
        answers: list[Deferred[object]] = []

        class Subscriber:  # the bus's connection, its answers given by the test
            def subscribe(self, channels: list[bytes]) -> Deferred[object]:
                answers.append(Deferred())
                return answers[-1]

            def unsubscribe(self, channels: list[bytes]) -> Deferred[object]:
                return Deferred()

        real, bus._protocol = bus._protocol, Subscriber()  # type: ignore[assignment]
        self.addCleanup(setattr, bus, "_protocol", real)
        bus.subscribe(b"c", lambda message: None)
        bus.unsubscribe(b"c")
        bus.subscribe(b"c", lambda message: None)
        heard = bus.heard({b"c"})
        assert heard is not None
        answers[0].callback([b"subscribe", b"c", 1])
        self.assertNoResult(heard)
        answers[1].callback([b"subscribe", b"c", 1])
        self.successResultOf(heard)
