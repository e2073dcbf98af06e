"""One WebSocket connection handles at most MESSAGES_PER_TURN of what it sent before the others get
the reactor (relayd.aep.websocket): a read of a thousand small requests no longer holds every other
connection for the whole batch. Order is kept: the rest waits, then is handled in the next turns."""

from __future__ import annotations

import json

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from relayd.aep.core.relay import EventRelay
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.socket_flow import MESSAGES_PER_TURN
from relayd.base.clock import Timekeeper
from tests.support.aep import serve_sockets
from tests.support.ws import WSClient


class GivingWay(TestCase):
    timeout = 30

    async def test_a_burst_of_requests_is_handled_a_turn_at_a_time_in_order(self) -> None:
        relay = EventRelay(MemoryEventLog(10, 10), token=None, buffer=10, max_from=10, seconds=reactor.seconds)
        clock = Timekeeper(reactor)
        self.addCleanup(clock.shutdown)
        sockets, url = serve_sockets(self, relay, clock)
        client = await WSClient.connect(url)
        await client.hello(role="consumer")
        (conn,) = sockets.connections
        turns: list[int] = []  # how many messages the connection had handled each time it gave way
        give_way = conn._give_way
        conn._give_way = lambda: (turns.append(conn._handled), give_way())[-1]

        count = 3 * MESSAGES_PER_TURN + 50
        for n in range(count):
            client.send({"type": "ping", "t": n})
        pongs = [json.loads(await client.recv_raw()) for _ in range(count)]
        self.assertEqual([p["t"] for p in pongs], list(range(count)))  # every one, in order
        self.assertTrue(turns)  # it gave way at least once
        self.assertEqual(set(turns), {MESSAGES_PER_TURN + 1})  # never more than its share in one turn
