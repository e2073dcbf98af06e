"""TLS to the sentinels (C{rediss+sentinel://}): real sentinels that listen on TLS only, asked and
heard over TLS with the URL's CA; plain sentinels beside TLS data nodes with C{sentinel_tls=no};
and a sentinel whose certificate names another host, refused with the reason."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.storage import sentinel
from relayd.storage.redis import Redis
from tests.storage.test_redis import until
from tests.storage.test_redis_sentinel import sentinel_redis
from tests.storage.test_redis_tls import TLSServer, temporary_directory
from tests.support.redis import SentinelGroup, SentinelTLS, command
from tests.support.tls import make_pki


def group_tls(case: TestCase, sentinels_on_tls: bool) -> SentinelTLS:
    directory = temporary_directory(case)
    pki = make_pki(directory)
    ca = directory / "ca.pem"
    ca.write_bytes(pki.ca_pem)
    return SentinelTLS(Path(pki.cert), Path(pki.key), ca, sentinels_on_tls)


class SentinelsOnTLS(TestCase):
    timeout = 60

    async def written_and_read(self, group: SentinelGroup, redis: Redis) -> None:
        await redis.execute("probe", "SET", "k", "1", durable=True)
        master = group.master_port()
        assert master is not None
        self.assertEqual(command(group.node(master).port, "GET", "k"), b"1")  # (the node's plain port)
        self.assertEqual(await redis.execute("probe", "GET", "k"), b"1")

    async def test_sentinels_on_tls_only_are_asked_and_heard_over_tls(self) -> None:
        # Only +switch-master, heard on a watcher's TLS connection, can move the pool.
        self.patch(sentinel, "RECHECK_INTERVAL", 3600.0)
        group = SentinelGroup.start(tls=group_tls(self, sentinels_on_tls=True))
        self.addCleanup(group.cleanup)
        self.assertTrue(group.url.startswith("rediss+sentinel://localhost:"))
        redis = await sentinel_redis(self, group.url)
        await self.written_and_read(group, redis)
        first = group.master_port()
        group.failover()
        await until(self, lambda: group.master_port() != first, "no failover", within=10)
        new = ("127.0.0.1", group.master_port())
        follower, factory = redis.follower, redis._factory
        assert follower is not None
        await until(
            self, lambda: follower.address == new and factory.size == factory.poolsize
            and {follower.address_of(c) for c in factory.pool} == {new},
            "the pool never moved to the new master", within=5,
        )  # fmt: skip

    async def test_plain_sentinels_with_sentinel_tls_no(self) -> None:
        group = SentinelGroup.start(tls=group_tls(self, sentinels_on_tls=False))
        self.addCleanup(group.cleanup)
        self.assertIn("sentinel_tls=no", group.url)
        redis = await sentinel_redis(self, group.url)
        self.assertFalse(redis.url.sentinel_tls)
        await self.written_and_read(group, redis)


class SentinelCertificate(TestCase):
    timeout = 30

    async def test_a_sentinel_certificate_for_another_name_is_refused_and_logged(self) -> None:
        # A TLS port whose certificate names redis.example (and 127.0.0.1), asked as localhost:
        # refused in the TLS handshake, before any question.
        server = TLSServer(self, hostname="redis.example")
        logged: list[str] = []

        def observe(event: dict[str, Any]) -> None:
            logged.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)
        redis = Redis(f"rediss+sentinel://localhost:{server.tls_port}/main?tls_ca={server.ca}", Timekeeper(reactor))
        self.addCleanup(redis.close)
        assert redis.follower is not None
        watcher = redis.follower._watchers[0]
        made: list[object] = []
        self.patch(watcher, "buildProtocol", lambda addr, build=watcher.buildProtocol: made.append(addr) or build(addr))
        await until(self, lambda: any("no sentinel named master" in line for line in logged), "nothing logged")
        line = next(line for line in logged if "no sentinel named master" in line)
        self.assertIn(f"localhost:{server.tls_port}: TLS: the certificate does not name the host", line)
        self.assertFalse(redis.connected)
        # The watcher, refused the same way at every attempt, says nothing more (that line said why).
        await until(self, lambda: len(made) >= 2, "the watcher did not try again")
        self.assertEqual([line for line in logged if "subscribe interrupted" in line], [])
