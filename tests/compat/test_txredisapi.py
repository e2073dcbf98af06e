"""The fence around txredisapi's private state (relayd/compat/txredisapi.py).

Each reliance is detected on the installed txredisapi (a release that moves the state fails here,
loudly: setup.cfg admits a new txredisapi only once these pass), shown on real objects, and its
fallback gives a working client. tests/compat/ fails any other module that
touches a txredisapi private attribute.
"""

from __future__ import annotations

from typing import Any

import txredisapi
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.compat import txredisapi as fence
from relayd.storage.redis import KEYSPACE_VERSION, Redis
from tests.support.cases import cases, expand
from tests.support.redis import RedisServer

# Three bulk strings in one read, as a pub/sub message or an MGET answer arrives.
THREE = b"*3\r\n$1\r\nx\r\n$1\r\ny\r\n$1\r\nz\r\n"


class _Whole(fence.WholeReads, txredisapi.RedisProtocol):
    pass


def connected(protocol: txredisapi.RedisProtocol) -> txredisapi.RedisProtocol:
    protocol.makeConnection(StringTransport())  # no password, no database: ready at once
    return protocol


class Detection(TestCase):
    def test_each_reliance_is_detected_on_the_installed_txredisapi(self) -> None:
        self.assertTrue(fence.READY_STATE, "txredisapi no longer keeps _ready/_waiting_for_connect")
        self.assertTrue(fence.SPLIT_READS, "txredisapi no longer splits a read across reactor turns")
        self.assertTrue(fence.OWN_REPLIES, "txredisapi no longer hands every reply to replyReceived")

    def test_mark_ready_fires_whoever_waits_for_the_connection(self) -> None:
        protocol = txredisapi.RedisProtocol()  # its handshake not yet run
        waiting = protocol.whenConnected()
        self.assertFalse(waiting.called)
        fence.mark_ready(protocol)
        self.assertIs(self.successResultOf(waiting), protocol)
        self.assertIs(self.successResultOf(protocol.whenConnected()), protocol)  # and from now on at once
        self.assertEqual(protocol.connected, 1)


@expand
class Replies(TestCase):
    def test_txredisapi_alone_takes_more_turns(self) -> None:
        """What the shortcut saves: without it a three-string answer is not complete within the read."""
        protocol = connected(txredisapi.RedisProtocol(charset=None, convertNumbers=False))
        answer = protocol.execute_command("MGET", "a", "b", "c")
        protocol.dataReceived(THREE)
        self.assertFalse(answer.called)
        return answer.addCallback(self.assertEqual, [b"x", b"y", b"z"])

    def test_a_whole_read_is_parsed_within_the_call(self) -> None:
        protocol = connected(_Whole(charset=None, convertNumbers=False))
        answer = protocol.execute_command("MGET", "a", "b", "c")
        protocol.dataReceived(THREE)
        self.assertEqual(self.successResultOf(answer), [b"x", b"y", b"z"])

    @cases(detected=True, fallback=False)
    async def test_the_answer_is_the_same_either_way(self, detected: bool) -> None:
        self.patch(fence, "SPLIT_READS", detected)
        protocol = connected(_Whole(charset=None, convertNumbers=False))
        answers = [protocol.execute_command("MGET", "a", "b", "c") for _ in range(2)]
        protocol.dataReceived(THREE + THREE[:9])  # the second answer arrives in two reads
        protocol.dataReceived(THREE[9:])
        for answer in answers:
            self.assertEqual(await answer, [b"x", b"y", b"z"])


class _Own(fence.OwnReplies, fence.WholeReads, txredisapi.SubscriberProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: list[Any] = []

    def own_reply(self, reply: Any) -> None:
        self.replies.append(reply)


class OwnReplies(TestCase):
    """Sharded pub/sub's replies, which txredisapi's SubscriberProtocol does not know, taken from its parser."""

    def test_once_taken_every_reply_is_relayds_pushes_and_errors_too(self) -> None:
        protocol = connected(_Own(charset=None, convertNumbers=False))
        answer = protocol.execute_command("PING")
        protocol.dataReceived(b"+PONG\r\n")  # before: txredisapi's own answer to its command
        self.assertEqual(self.successResultOf(answer), "PONG")
        protocol.own_replies = True
        protocol.dataReceived(
            b"*3\r\n$10\r\nssubscribe\r\n$1\r\nc\r\n:1\r\n"
            b"*3\r\n$8\r\nsmessage\r\n$1\r\nc\r\n$2\r\nhi\r\n"
            b"-MOVED 5 127.0.0.1:7000\r\n"
        )
        self.assertEqual(protocol.replies[:2], [[b"ssubscribe", b"c", 1], [b"smessage", b"c", b"hi"]])
        self.assertIsInstance(protocol.replies[2], txredisapi.ResponseError)
        self.assertEqual(str(protocol.replies[2]), "MOVED 5 127.0.0.1:7000")


@expand
class Handshake(TestCase):
    """relayd's handshake (READY_STATE) and txredisapi's (the fallback) against a real redis-server."""

    timeout = 30

    def setUp(self) -> None:
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)

    async def until_connected(self, redis: Redis) -> None:
        waited = 0.0
        while not redis.connected:
            self.assertLess(waited, 10.0, "the client did not connect")
            await deferLater(reactor, 0.02, lambda: None)  # polling a connection being made
            waited += 0.02

    @cases(detected=True, fallback=False)
    async def test_a_connection_is_checked_and_serves(self, detected: bool) -> None:
        self.patch(fence, "READY_STATE", detected)
        redis = Redis(f"redis://127.0.0.1:{self.server.port}/2", Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        await self.until_connected(redis)
        self.assertEqual(await redis.execute("probe", "SET", "k", "v"), "OK")
        # SELECT ran (database 2) and the keyspace version was written beside the key.
        found: Any = await redis.execute("probe", "KEYS", "*")
        self.assertEqual(sorted(found), [b"k", b"relayd:schema"])
        self.assertEqual(await redis.execute("probe", "GET", "relayd:schema"), str(KEYSPACE_VERSION).encode())

    @cases(detected=True, fallback=False)
    async def test_a_bus_subscribes_and_hears(self, detected: bool) -> None:
        self.patch(fence, "READY_STATE", detected)
        redis = Redis(self.server.url, Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        heard: list[bytes] = []
        bus = redis.bus()
        bus.subscribe(b"c", heard.append)
        await bus.ready
        await self.until_connected(redis)
        await bus.publish("probe", b"c", b"hello")
        waited = 0.0
        while not heard:
            self.assertLess(waited, 5.0, "nothing heard")
            await deferLater(reactor, 0.02, lambda: None)  # polling a message published through Redis
            waited += 0.02
        self.assertEqual(heard, [b"hello"])
