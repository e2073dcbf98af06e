"""A WebSocket client that opens /socket and never says hello is closed once --aep-hello-timeout has
passed (error hello-timeout, close 1002), not held for ever; one that said hello in time is not."""

from __future__ import annotations

from twisted.internet.task import Clock as FakeTime
from twisted.trial.unittest import TestCase

from relayd.aep.core.relay import EventRelay
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.websocket import AEPSocket
from relayd.base.clock import Timekeeper
from tests.support.aep import serve_sockets, wait_until
from tests.support.ws import WSClient

HELLO_TIMEOUT = 10.0


class HelloTimeout(TestCase):
    async def connect(self) -> tuple[WSClient, AEPSocket]:
        """A client on a relay whose timers run on L{time} (the sockets on the real reactor)."""
        self.time = FakeTime()
        clock = Timekeeper(self.time)
        self.addCleanup(clock.shutdown)
        relay = EventRelay(MemoryEventLog(10, 10), token=None, buffer=10, max_from=10, seconds=self.time.seconds)
        sockets, url = serve_sockets(self, relay, clock, heartbeat=3600.0, hello_timeout=HELLO_TIMEOUT)
        client = await WSClient.connect(url)
        self.addCleanup(client.close)
        await wait_until(lambda: len(sockets.connections) == 1)
        (conn,) = sockets.connections
        return client, conn

    async def test_no_hello_is_closed_at_the_time_out(self) -> None:
        client, conn = await self.connect()
        self.time.advance(HELLO_TIMEOUT - 0.001)  # just before the limit: still open
        self.assertEqual(conn.state, conn.STATE_OPEN)
        self.assertFalse(client.closed.called)
        self.time.advance(0.001)  # at the limit
        frame = await client.recv()
        self.assertEqual((frame["type"], frame["code"]), ("error", "hello-timeout"))
        code, reason = await client.closed
        self.assertEqual((code, reason), (1002, "hello timeout"))

    async def test_a_hello_in_time_keeps_the_connection(self) -> None:
        client, conn = await self.connect()
        self.time.advance(HELLO_TIMEOUT - 0.001)
        client.send({"type": "hello", "versions": ["0.1"]})
        await wait_until(lambda: conn.hello_done)
        self.time.advance(0)  # the reply's flush turn
        self.assertEqual((await client.recv())["type"], "hello")
        self.time.advance(HELLO_TIMEOUT * 10)
        self.time.advance(0)
        self.assertEqual(conn.state, conn.STATE_OPEN)
        client.send({"type": "ping", "t": 1})
        await wait_until(lambda: conn._dirty or conn._queue)
        self.time.advance(0)
        self.assertEqual(await client.recv(), {"type": "pong", "t": 1})
