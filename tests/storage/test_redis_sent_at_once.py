"""A pool connection's command leaves within the call (relayd/storage/redis.py _Protocol.send_command)."""

from __future__ import annotations

from twisted.internet import reactor
from twisted.internet.defer import gatherResults
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.compat import txredisapi as fence
from relayd.compat.tcp import nothing_queued
from relayd.storage.redis import Redis
from tests.support.redis import RedisServer


class SentAtOnce(TestCase):
    timeout = 30

    async def test_a_command_leaves_at_once_on_an_idle_connection(self) -> None:
        """What the shortcut saves: the command is sent within the call (relayd/compat/tcp.py
        write_now), not queued for the reactor's next turn with the socket watched for it; replies
        come back in order as before."""
        server = RedisServer.start()
        self.addCleanup(server.cleanup)
        redis = Redis(server.url, Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        waited = 0.0
        while (connection := fence.idle_connection(redis._factory)) is None:
            self.assertLess(waited, 10.0, "the client did not connect")
            await deferLater(reactor, 0.02, lambda: None)  # polling a connection being made
            waited += 0.02
        answers = [connection.execute_command(b"SET", b"k", b"v"), connection.execute_command(b"GET", b"k")]
        self.assertTrue(nothing_queued(connection.transport))
        self.assertEqual(await gatherResults(answers), [fence.status("OK"), b"v"])
        # Through the client too (what the AEP append takes).
        self.assertEqual(await redis.execute("probe", b"GET", b"k"), b"v")
