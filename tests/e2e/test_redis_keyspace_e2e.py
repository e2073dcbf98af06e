"""A real ``twistd -n relayd`` refuses a Redis that holds another relayd keyspace version: one clear
line (no traceback), nothing written to Redis, and a non-zero exit status; with its own version it runs."""

from __future__ import annotations

import socket

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from relayd.redis import KEYSPACE_VERSION
from tests.support.redis import RedisServer
from tests.support.twistd import RelaydProcess


def command(port: int, line: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(line + b"\r\nQUIT\r\n")
        return b"".join(iter(lambda: s.recv(65536), b"")).removesuffix(b"+OK\r\n")


class KeyspaceRefusal(TestCase):
    timeout = 60

    def setUp(self) -> None:
        self.redis = RedisServer.start()
        self.addCleanup(self.redis.cleanup)

    async def start(self) -> RelaydProcess:
        proc = await RelaydProcess.start(
            ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp", "--redis", self.redis.url],
            env={"AEP_TOKEN": "t"},
        )
        self.addCleanup(proc.kill)
        return proc

    async def test_another_version_stops_relayd_with_status_1(self) -> None:
        command(self.redis.port, b"SET relayd:schema %d" % (KEYSPACE_VERSION + 1))
        proc = await self.start()
        exited = proc.exited
        exited.addTimeout(20, reactor)
        status = await exited
        log = proc.log.decode(errors="replace")
        self.assertEqual(status, 1, log)
        # The URL is logged as given unless it is the --redis value itself (a secret: it may hold a password).
        self.assertRegex(
            log,
            r"\[relayd\.redis\.Redis#critical\] Redis at (\[scrubbed\]|redis://\S+) holds relayd keyspace version "
            rf"{KEYSPACE_VERSION + 1} \(key relayd:schema\), this relayd uses keyspace version {KEYSPACE_VERSION}: ",
        )
        self.assertIn("[relayd.tap.RelaydService#critical] relayd stops (exit status 1)", log)
        self.assertNotIn("Traceback", log)
        self.assertEqual(command(self.redis.port, b"DBSIZE"), b":1\r\n")  # nothing but the version key
        self.assertEqual(command(self.redis.port, b"GET relayd:schema"), b"$1\r\n%d\r\n" % (KEYSPACE_VERSION + 1))

    async def test_own_version_runs_and_exits_0(self) -> None:
        proc = await self.start()
        await proc.wait_for(rb"shared state in Redis")
        deadline = reactor.seconds() + 15
        while command(self.redis.port, b"GET relayd:schema") == b"$-1\r\n":
            self.assertLess(reactor.seconds(), deadline, "relayd never wrote its keyspace version")
            from twisted.internet.task import deferLater

            await deferLater(reactor, 0.05, lambda: None)  # polling another process's connection
        self.assertEqual(command(self.redis.port, b"GET relayd:schema"), b"$1\r\n%d\r\n" % KEYSPACE_VERSION)
        self.assertEqual(await proc.terminate(), 0)
