"""A real ``twistd -n relayd`` refuses a Redis that holds another relayd keyspace version: one clear
line (no traceback), nothing written to Redis, and a non-zero exit status; with its own version it runs."""

from __future__ import annotations

import socket

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from relayd.storage.redis import KEYSPACE_VERSION
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
        # The URL as docs/deployment.md promises it (redis://HOST:PORT/DB): only a password is scrubbed.
        self.assertRegex(
            log,
            rf"\[relayd\.storage\.redis\.Redis#critical\] Redis at redis://127\.0\.0\.1:{self.redis.port}/0 holds relayd keyspace version "
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


class BoundsRefusal(TestCase):
    """A second relayd on the same keys with another --aep-buffer (or MCP bound) stops at start with
    one line naming both values, and leaves the running one's data alone."""

    timeout = 60

    def setUp(self) -> None:
        self.redis = RedisServer.start()
        self.addCleanup(self.redis.cleanup)

    async def start(self, *options: str, wait_for: tuple[str, ...] = ("aep",)) -> RelaydProcess:
        proc = await RelaydProcess.start(["--redis", self.redis.url, *options], env={"AEP_TOKEN": "t"}, wait_for=wait_for)
        self.addCleanup(proc.kill)
        return proc

    async def refused(self, proc: RelaydProcess) -> str:
        exited = proc.exited
        exited.addTimeout(20, reactor)
        status = await exited
        log = proc.log.decode(errors="replace")
        self.assertEqual(status, 1, log)
        self.assertIn("[relayd.tap.RelaydService#critical] relayd stops (exit status 1)", log)
        self.assertNotIn("Traceback", log)
        return log

    async def test_another_aep_buffer_stops_the_second_relayd(self) -> None:
        aep = ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp"]
        first = await self.start(*aep, "--aep-buffer", "100")
        await first.wait_for(rb"connected to Redis")
        second = await self.start(*aep, "--aep-buffer", "1000", "--aep-max-sessions", "500")
        log = await self.refused(second)
        self.assertIn(
            f"[relayd.storage.redis.Redis#critical] --aep-buffer is 1000 here and 100 on Redis (key relayd:bounds at "
            f"redis://127.0.0.1:{self.redis.port}/0): ",
            log,
        )
        self.assertIn("Start this relayd with --aep-buffer 100;", log)
        self.assertNotIn("aep-max-sessions is", log)  # the same on both (the default is 500 too... as given)
        self.assertEqual(command(self.redis.port, b"HGET relayd:bounds aep-buffer"), b"$3\r\n100\r\n")
        self.assertIsNone(first.status)  # the first runs on
        self.assertEqual(await first.terminate(), 0)

    async def test_another_mcp_queue_bound_stops_the_second_relayd(self) -> None:
        mcp = ["--no-aep", "--mcp-listen", "tcp:0:interface=127.0.0.1"]
        first = await self.start(*mcp, wait_for=("mcp",))
        await first.wait_for(rb"connected to Redis")
        second = await self.start(*mcp, "--mcp-queue-frames", "999", wait_for=("mcp",))
        log = await self.refused(second)
        self.assertIn("--mcp-queue-frames is 999 here and 1000 on Redis (key relayd:bounds at ", log)
        self.assertEqual(await first.terminate(), 0)


class ConnectionLine(TestCase):
    """The Redis URL is logged as redis://HOST:PORT/DB (docs/deployment.md), with or without a
    password; the password itself never appears."""

    timeout = 60

    def setUp(self) -> None:
        self.redis = RedisServer.start()
        self.addCleanup(self.redis.cleanup)

    async def connected_line(self, url: str) -> str:
        proc = await RelaydProcess.start_for(
            self, ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp", "--redis", url], env={"AEP_TOKEN": "t"}
        )
        line = await proc.wait_for(rb"connected to Redis at \S+")
        self.assertEqual(await proc.terminate(), 0)
        self.assertNotIn(b"s3cret-pass", proc.log)
        return line.group(0).decode()

    async def test_without_a_password(self) -> None:
        line = await self.connected_line(self.redis.url)
        self.assertEqual(line, f"connected to Redis at redis://127.0.0.1:{self.redis.port}/0")

    async def test_with_a_password(self) -> None:
        command(self.redis.port, b"CONFIG SET requirepass s3cret-pass")
        line = await self.connected_line(f"redis://:s3cret-pass@127.0.0.1:{self.redis.port}/0")
        self.assertEqual(line, f"connected to Redis at redis://127.0.0.1:{self.redis.port}/0")
