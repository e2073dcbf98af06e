"""relayd.redis against a real redis-server: a failed handshake is retried, not given up."""

from __future__ import annotations

import socket

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from relayd.clock import Clock
from relayd.redis import Redis, StoreUnavailable
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


class Reconnect(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)

    async def until_connected(self, redis: Redis, within: float = 10.0) -> None:
        waited = 0.0
        while not redis.connected:
            self.assertLess(waited, within, "the client did not reconnect")
            await deferLater(reactor, 0.05, lambda: None)  # polling a reconnect that backs off by itself
            waited += 0.05

    async def test_failed_handshake_is_retried_not_given_up(self) -> None:
        # A handshake that fails (here a wrong password; during a restart, a connection closed
        # mid-SELECT) must not stop the pool for good: once Redis accepts, the client serves again.
        port = self.server.port
        self.assertEqual(admin(port, b"CONFIG SET requirepass old\r\n"), b"+OK\r\n")
        redis = Redis(f"redis://:new@127.0.0.1:{port}/1", Clock(reactor), timeout=1)
        self.addCleanup(redis.close)
        refused = await self.assertFailure(redis.execute("probe", "PING"), StoreUnavailable)
        self.assertEqual(str(refused), "probe store unavailable: not connected")
        # Every slot of the pool has tried and been refused before the password is fixed.
        waited = 0.0
        while denied_auth(port) < 4:
            self.assertLess(waited, 10, "the client never tried to authenticate")
            await deferLater(reactor, 0.05, lambda: None)  # polling an external server's counter
            waited += 0.05

        self.assertEqual(admin(port, b"AUTH old\r\nCONFIG SET requirepass new\r\n"), b"+OK\r\n+OK\r\n")
        await self.until_connected(redis)
        self.assertEqual(await redis.execute("probe", "SET", "k", "v"), "OK")
        # SELECT ran: the key is in database 1, not 0.
        self.assertEqual(await redis.execute("probe", "DBSIZE"), 1)
