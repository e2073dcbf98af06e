"""An instance hears the other instances' events only while a local subscription needs them
(relayd/aep/redis/fanout.py): on a single Redis the classic channel is subscribed with the first
subscription and unsubscribed with the last, so an instance that only ingests reads nothing back;
and a subscription says it is subscribed only once Redis has answered that SUBSCRIBE."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, succeed
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase

from relayd.aep.core.event import Event, event_from
from relayd.aep.core.relay import EventRelay
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.redis.fanout import RedisFanout
from relayd.aep.redis.store import RedisEventLog
from relayd.base.clock import Timekeeper
from tests.support.aep import event, serve_sockets
from tests.support.redis import command, connected_redis, shared_redis
from tests.support.ws import WSClient

_prefixes = itertools.count()


def _event(session: str, seq: int) -> Event:
    return event_from(json.dumps(event(session, seq)).encode())


class ClassicChannelWhileNeeded(TestCase):
    timeout = 30

    def subscribers(self, channel: bytes) -> int:
        """How many connections Redis has subscribed to C{channel} (C{PUBSUB NUMSUB})."""
        return int(command(shared_redis().port, "PUBSUB", "NUMSUB", channel)[1])

    async def until_subscribers(self, channel: bytes, count: int) -> None:
        for _ in range(500):
            if self.subscribers(channel) == count:
                return
            await deferLater(reactor, 0.02, lambda: None)  # polling another connection's effect on Redis
        self.fail(f"{channel!r} never had {count} subscribers")

    async def test_subscribed_from_the_first_subscription_to_the_last(self) -> None:
        prefix = f"needs{os.getpid()}-{next(_prefixes)}:"
        channel = prefix.encode() + b"aep:fanout"
        a = await connected_redis(shared_redis().url, wait_replicas=0)
        self.addCleanup(a.close)
        b = await connected_redis(shared_redis().url, wait_replicas=0)
        self.addCleanup(b.close)
        log = RedisEventLog(a, 10, 640, prefix, publisher="A")
        got: list[Event] = []
        bus = b.bus()
        fanout = RedisFanout(b, bus, "B", got.extend, prefix)
        await bus.ready  # connected, and everything it was asked to hear is subscribed
        self.assertEqual(self.subscribers(channel), 0)  # no subscription here: nothing heard
        self.assertEqual(await log.append([_event("X", 0)], publish=True), [True])

        heard = fanout.need(("X",))
        assert heard is not None  # Redis has not answered the SUBSCRIBE yet
        await heard
        self.assertEqual(self.subscribers(channel), 1)
        self.assertIsNone(fanout.need(None))  # heard already (any subscription needs the one channel)
        self.assertEqual(fanout.needed, {channel: 2})
        self.assertEqual(await log.append([_event("X", 1)], publish=True), [True])
        while not got:
            await deferLater(reactor, 0.01, lambda: None)  # the other instance's event, delivered
        self.assertEqual([e.position for e in got], [(0, 1)])

        fanout.release(("X",))
        self.assertEqual(self.subscribers(channel), 1)  # still needed by the other subscription
        fanout.release(None)
        self.assertEqual(fanout.needed, {})
        await self.until_subscribers(channel, 0)

        again = fanout.need(("X",))  # subscribed again, and heard once Redis answers
        assert again is not None
        await again
        self.assertEqual(self.subscribers(channel), 1)


class Needs:
    """A fan-out whose need is answered by the test (no Redis)."""

    def __init__(self) -> None:
        self.heard: Deferred[None] = Deferred()
        self.asked: Deferred[None] = Deferred()  # fires the turn after the relay asked

    def publish(self, events: object) -> object:
        return succeed(None)

    def need(self, sessions: tuple[str, ...] | None) -> Deferred[None] | None:
        reactor.callLater(0, self.asked.callback, None)
        return self.heard

    def release(self, sessions: tuple[str, ...] | None) -> None:
        pass


class SubscribedOnceHeard(TestCase):
    timeout = 30

    async def test_a_websocket_subscription_is_confirmed_once_its_channels_are_heard(self) -> None:
        needs = Needs()
        relay = EventRelay(MemoryEventLog(10, 10), token=None, buffer=10, max_from=10, seconds=reactor.seconds,
                           fanout=lambda deliver: needs)  # type: ignore[arg-type]  # fmt: skip
        clock = Timekeeper(reactor)
        self.addCleanup(clock.shutdown)
        sockets, url = serve_sockets(self, relay, clock)
        client = await WSClient.connect(url)
        await client.hello(role="consumer")
        (conn,) = sockets.connections
        sent: list[Any] = []
        send_frame = conn.send_frame
        conn.send_frame = lambda frame, *rest: (sent.append(frame), send_frame(frame, *rest))[-1]  # type: ignore[method-assign]

        client.send({"type": "subscribe", "id": "s", "filter": {"session": "X"}})
        client.send({"type": "ping", "t": 1})
        await needs.asked  # the subscribe was handled (in an earlier turn)
        self.assertEqual(sent, [])  # not "subscribed" while another instance's event could be missed
        needs.heard.callback(None)
        self.assertEqual((await client.recv())["type"], "subscribed")
        self.assertEqual(await client.recv(), {"type": "pong", "t": 1})  # what followed, in order
