"""A subscriber connection whose Redis node stops answering is dropped within seconds (relayd/storage/heartbeat.py
L{Heartbeat}): the schedule on a test clock with a fake transport, then a real redis-server SIGSTOPped."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace
from typing import Any

import txredisapi
from twisted.internet import reactor
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock, deferLater
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.compat import txredisapi as fence
from relayd.storage.heartbeat import PING_IDLE
from relayd.storage.redis import Redis, _Subscriber
from relayd.storage.sentinel import SentinelFollower, _Watcher
from relayd.storage.sharded import _ShardSubscriber
from tests.storage.test_redis import until
from tests.support.cases import cases, expand
from tests.support.redis import RedisServer, SentinelGroup

PING = b"*1\r\n$4\r\nPING\r\n"
PONG = b"*2\r\n$4\r\npong\r\n$0\r\n\r\n"


def message(channel: bytes, body: bytes) -> bytes:
    return b"*3\r\n$7\r\nmessage\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(channel), channel, len(body), body)


class FakeBus:
    """What a L{_Subscriber} asks of its bus, recording what it hears."""

    def __init__(self, clock: Clock, timeout: float) -> None:
        self.redis = SimpleNamespace(clock=Timekeeper(clock), timeout=timeout, subscriber_silent=lambda conn: None)
        self.heard: list[tuple[bytes, bytes]] = []
        self.lost = False

    def _subscribed(self, protocol: _Subscriber) -> None:
        protocol.subscribe([b"c"])

    def _lost(self, protocol: _Subscriber) -> None:
        self.lost = True

    def _message(self, channel: bytes, body: bytes) -> None:
        self.heard.append((channel, body))


def connected(kind: type[Any], **owner: Any) -> tuple[Any, StringTransport]:
    """A subscriber protocol of C{kind} whose owner (its bus, or its shard link) is C{owner},
    connected to a transport that records what it writes."""
    protocol = type(kind.__name__, (kind,), owner)(charset=None, convertNumbers=False)
    protocol.factory = SimpleNamespace()
    transport = StringTransport()
    protocol.makeConnection(transport)
    return protocol, transport


class Schedule(TestCase):
    """The PING schedule on a C{task.Clock}, against a transport that records what is written."""

    timeout_ = 2.0

    def connect(self) -> tuple[Clock, FakeBus, _Subscriber, StringTransport]:
        clock = Clock()
        bus = FakeBus(clock, self.timeout_)

        protocol, transport = connected(_Subscriber, bus=bus)
        self.assertIn(b"SUBSCRIBE", transport.value())
        protocol.dataReceived(b"*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n")
        transport.clear()
        clock.advance(PING_IDLE)  # the first look: the SUBSCRIBE's answer was heard since
        self.assertEqual(transport.value(), b"")
        return clock, bus, protocol, transport

    def test_idle_connection_pings_and_a_silent_node_is_dropped(self) -> None:
        logged: list[str] = []
        observer = lambda event: logged.append(formatEvent(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        clock, bus, protocol, transport = self.connect()
        clock.advance(PING_IDLE - 0.1)
        self.assertEqual(transport.value(), b"")
        clock.advance(0.1)
        self.assertEqual(transport.value(), PING)
        clock.advance(self.timeout_ - 0.1)
        self.assertFalse(transport.disconnecting)
        clock.advance(0.1)
        self.assertTrue(transport.disconnected, "a node that did not answer the PING was kept")
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertTrue(bus.lost)
        self.assertEqual(len([line for line in logged if "did not answer a subscriber's PING" in line]), 1)
        self.assertEqual(clock.getDelayedCalls(), [])  # nothing left behind the connection

    def test_answered_ping_keeps_the_connection_and_pings_again(self) -> None:
        clock, bus, protocol, transport = self.connect()
        clock.advance(PING_IDLE)
        for _ in range(3):
            self.assertEqual(transport.value(), PING)
            transport.clear()
            clock.advance(self.timeout_ / 2)
            protocol.dataReceived(PONG)
            clock.advance(PING_IDLE - 0.01)  # the next look is PING_IDLE after the answer
            self.assertEqual(transport.value(), b"")
            self.assertFalse(transport.disconnecting)
            clock.advance(0.01)
        # The pong is the heartbeat's: nothing is queued for a command that never asked.
        self.assertEqual(protocol.replyQueue.pending, [])
        self.assertEqual(bus.heard, [])

    def test_message_between_ping_and_pong_is_delivered(self) -> None:
        clock, bus, protocol, transport = self.connect()
        clock.advance(PING_IDLE)
        self.assertEqual(transport.value(), PING)
        protocol.dataReceived(message(b"c", b"hello") + PONG[:9])  # a read may split the pong too
        protocol.dataReceived(PONG[9:] + message(b"c", b"again"))
        self.assertEqual(bus.heard, [(b"c", b"hello"), (b"c", b"again")])
        self.assertEqual(protocol.replyQueue.pending, [])
        clock.advance(self.timeout_ * 2)
        self.assertFalse(transport.disconnecting)

    def test_busy_connection_sends_no_ping(self) -> None:
        clock, bus, protocol, transport = self.connect()
        for i in range(10):
            clock.advance(PING_IDLE / 2)
            protocol.dataReceived(message(b"c", b"%d" % i))
        self.assertEqual(transport.value(), b"")
        self.assertEqual(len(bus.heard), 10)

    def test_without_the_fence_no_ping_is_sent(self) -> None:
        # A txredisapi whose parser no longer hands replies to replyReceived: the answer could not
        # be taken, so no PING is sent and the connection is as TCP keeps it.
        self.patch(fence, "PONGS", False)
        clock, bus, protocol, transport = self.connect()
        clock.advance(PING_IDLE * 5)
        self.assertEqual(transport.value(), b"")
        self.assertFalse(transport.disconnecting)
        protocol.dataReceived(message(b"c", b"hello"))
        self.assertEqual(bus.heard, [(b"c", b"hello")])


class HungNode(TestCase):
    """A real redis-server stopped (SIGSTOP): its TCP connections stay up, it answers nothing."""

    timeout = 30

    async def test_bus_drops_a_hung_node_within_the_bound(self) -> None:
        server = RedisServer.start()
        self.addCleanup(server.cleanup)
        redis = Redis(server.url, Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        heard: list[bytes] = []
        bus = redis.bus()
        bus.subscribe(b"c", heard.append)
        await bus.ready
        first = bus.connection
        assert server.proc is not None
        pid = server.proc.pid
        logged: list[str] = []
        observer = lambda event: logged.append(formatEvent(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        os.kill(pid, signal.SIGSTOP)
        self.addCleanup(os.kill, pid, signal.SIGCONT)
        # Polling a connection the client drops by itself, on the real clock: at most twice the idle
        # look plus the timeout, and a margin for a loaded machine.
        await until(self, lambda: bus.connection is not first, "the bus kept a node that answers nothing",
                    within=2 * PING_IDLE + 1 + 2)  # fmt: skip
        self.assertTrue(any(f"127.0.0.1:{server.port} did not answer" in line for line in logged), logged)
        os.kill(pid, signal.SIGCONT)
        # Back: the bus resubscribes and hears again (published until heard: the SUBSCRIBE of the
        # new connection may not be answered yet).
        await until(self, lambda: redis.connected and bus.connection is not None, "the client did not reconnect")
        for _ in range(50):
            await bus.publish("probe", b"c", b"back")
            await deferLater(reactor, 0.1, lambda: None)  # polling a message published through Redis
            if heard:
                break
        self.assertEqual(set(heard), {b"back"})


class FakeLink:
    """What a L{_ShardSubscriber} asks of its link (relayd/storage/sharded.py), recording the replies."""

    def __init__(self, clock: Clock, timeout: float) -> None:
        self.bus = SimpleNamespace(cluster=SimpleNamespace(clock=Timekeeper(clock), timeout=timeout))
        self.answers: list[Any] = []
        self.up = False

    def came_up(self, protocol: Any) -> None:
        self.up = True

    def went_down(self, protocol: Any) -> None:
        self.up = False

    def answer(self, reply: Any) -> None:
        self.answers.append(reply)


class ShardSchedule(TestCase):
    """A Redis Cluster master's shard subscriber: its pongs are the heartbeat's, not the link's
    replies, and a master that stops answering takes the link down (its channels then move)."""

    def test_pong_is_not_a_reply_and_a_silent_master_goes_down(self) -> None:
        clock = Clock()
        link = FakeLink(clock, 2.0)

        protocol, transport = connected(_ShardSubscriber, link=link)
        self.assertTrue(link.up)
        clock.advance(PING_IDLE)
        self.assertEqual(transport.value(), PING)
        transport.clear()
        smessage = b"*3\r\n$8\r\nsmessage\r\n$1\r\nc\r\n$2\r\nhi\r\n"
        protocol.dataReceived(smessage + PONG)
        self.assertEqual(link.answers, [[b"smessage", b"c", b"hi"]])
        clock.advance(PING_IDLE)  # (the pong came after the message answered: heard since this look)
        self.assertEqual(transport.value(), b"")
        clock.advance(PING_IDLE)
        self.assertEqual(transport.value(), PING)
        clock.advance(2.0)
        self.assertTrue(transport.disconnected)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertFalse(link.up)
        self.assertEqual(clock.getDelayedCalls(), [])


class HungHandshake(TestCase):
    """A reconnection to a node that hangs waits in its handshake (AUTH) no longer than the timeout."""

    timeout = 30

    async def test_reconnection_to_a_hung_node_is_dropped_in_its_handshake(self) -> None:
        server = RedisServer.start("--requirepass", "pw")
        self.addCleanup(server.cleanup)
        redis = Redis(f"redis://:pw@127.0.0.1:{server.port}/0", Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        bus = redis.bus()
        bus.subscribe(b"c", lambda message: None)
        await bus.ready
        assert server.proc is not None
        pid = server.proc.pid
        logged: list[str] = []
        observer = lambda event: logged.append(formatEvent(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        os.kill(pid, signal.SIGSTOP)
        self.addCleanup(os.kill, pid, signal.SIGCONT)
        made: list[object] = []
        self.patch(
            bus._factory,
            "buildProtocol",
            lambda addr, build=bus._factory.buildProtocol: made.append(addr) or build(addr),
        )
        # Polling what the client does by itself on the real clock: the PING unanswered (at most
        # twice the idle look plus the timeout), then the next connection's AUTH unanswered and a
        # third connection made (each the reconnection's backoff plus the timeout), with a margin
        # for a loaded machine.
        await until(self, lambda: any("did not answer a subscriber's PING" in line for line in logged),
                    "the bus kept a node that answers nothing", within=2 * PING_IDLE + 1 + 2)  # fmt: skip
        await until(self, lambda: len(made) >= 2, "a reconnection waited in its handshake", within=2 * (0.5 + 1) + 2)


class SentinelWatcherSchedule(TestCase):
    """A sentinel's watcher (relayd/storage/sentinel.py) has the same heartbeat: a silent sentinel
    is dropped, said once however often its watcher is made again, and said again when it answers."""

    def test_a_silent_sentinel_is_dropped_and_logged_once(self) -> None:
        logged: list[str] = []
        observer = lambda event: logged.append(formatEvent(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        clock = Clock()
        follower = SentinelFollower([("s1", 26379)], "main", Timekeeper(clock), timeout=1.0)

        def watcher() -> tuple[Any, StringTransport]:
            protocol = type("Watcher", (_Watcher,), {"follower": follower})(charset=None, convertNumbers=False)
            protocol.factory = SimpleNamespace(relayd_sentinel=("s1", 26379))
            transport = StringTransport()
            protocol.makeConnection(transport)
            self.assertIn(b"SUBSCRIBE", transport.value())
            transport.clear()
            return protocol, transport

        for attempt in range(3):  # the first connection, then two reconnections to the same silent sentinel
            protocol, transport = watcher()
            clock.advance(PING_IDLE)  # (nothing heard since it subscribed: the first look pings)
            self.assertEqual(transport.value(), PING, attempt)
            clock.advance(1.0 - 0.01)
            self.assertFalse(transport.disconnecting)
            clock.advance(0.01)
            self.assertTrue(transport.disconnected, f"a sentinel that did not answer was kept ({attempt})")
            protocol.connectionLost(Failure(ConnectionDone()))
            self.assertEqual(clock.getDelayedCalls(), [])
        silent = [line for line in logged if "did not answer" in line]
        self.assertEqual(silent, ["Sentinel s1:26379 did not answer a PING within 1.0 s; reconnecting its watcher"])
        self.assertEqual([line for line in logged if "subscribe interrupted" in line], [])

        protocol, transport = watcher()  # it answers again: said, and its events are heard
        subscribed = b"*3\r\n$9\r\nsubscribe\r\n$14\r\n+switch-master\r\n:1\r\n"
        protocol.dataReceived(subscribed)
        self.assertIn("Sentinel s1:26379 answers again", logged)
        protocol.dataReceived(message(b"+switch-master", b"main 10.0.0.1 6379 10.0.0.2 6379"))
        self.assertEqual(follower.address, ("10.0.0.2", 6379))
        clock.advance(PING_IDLE)  # (heard since the last look: no PING)
        self.assertEqual(transport.value(), b"")
        clock.advance(PING_IDLE)
        self.assertEqual(transport.value(), PING)
        protocol.dataReceived(PONG)
        clock.advance(1.0)
        self.assertFalse(transport.disconnecting)
        protocol.connectionLost(Failure(ConnectionDone()))


@expand
class SentinelWatcherAuth(TestCase):
    """A watcher of a sentinel with a password runs relayd's AUTH: one refused, unanswered or cut by
    a lost connection drops that connection only, and its factory connects again (txredisapi's own
    handshake stops the factory: that sentinel would never be watched again)."""

    def setUp(self) -> None:
        self.clock = Clock()
        self.follower = SentinelFollower([("s1", 26379)], "main", Timekeeper(self.clock), timeout=1.0, password="pw")
        self.factory = txredisapi.SubscriberFactory(isLazy=True)
        self.factory.continueTrying = True
        self.factory.relayd_sentinel = ("s1", 26379)

    def watcher(self) -> tuple[Any, StringTransport]:
        protocol = type("Watcher", (_Watcher,), {"follower": self.follower})(
            charset=None, convertNumbers=False, password="pw"
        )
        protocol.factory = self.factory
        transport = StringTransport()
        protocol.makeConnection(transport)
        self.assertEqual(transport.value(), b"*2\r\n$4\r\nAUTH\r\n$2\r\npw\r\n")
        transport.clear()
        return protocol, transport

    def test_answered_it_watches(self) -> None:
        protocol, transport = self.watcher()
        protocol.dataReceived(b"+OK\r\n")
        self.assertIn(b"SUBSCRIBE", transport.value())
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.clock.getDelayedCalls(), [])

    @cases(lost=True, refused=False)
    def test_a_failed_auth_drops_the_connection_not_the_watcher(self, lost: bool) -> None:
        protocol, transport = self.watcher()
        if lost:  # (the sentinel restarted mid-AUTH)
            protocol.connectionLost(Failure(ConnectionDone()))
        else:
            protocol.dataReceived(b"-WRONGPASS invalid username-password pair\r\n")
            self.assertTrue(transport.disconnected)
            protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(transport.value(), b"")  # (nothing subscribed)
        self.assertTrue(self.factory.continueTrying, "the watcher's factory stopped reconnecting")
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_an_unanswered_auth_is_dropped_within_the_timeout(self) -> None:
        protocol, transport = self.watcher()
        self.clock.advance(0.99)
        self.assertFalse(transport.disconnected)
        self.clock.advance(0.01)
        self.assertTrue(transport.disconnected)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertTrue(self.factory.continueTrying)
        self.assertEqual(self.clock.getDelayedCalls(), [])

    def test_without_the_reliance_txredisapi_authenticates(self) -> None:
        self.patch(fence, "READY_STATE", False)
        protocol, transport = self.watcher()
        protocol.dataReceived(b"+OK\r\n")
        self.assertIn(b"SUBSCRIBE", transport.value())
        protocol.connectionLost(Failure(ConnectionDone()))


class HungSentinel(TestCase):
    """A real sentinel stopped (SIGSTOP): its watcher is dropped and made again, said once, and
    said again once the sentinel answers."""

    timeout = 60

    async def test_watcher_drops_a_hung_sentinel_and_hears_it_again(self) -> None:
        group = SentinelGroup.start()
        self.addCleanup(group.cleanup)
        redis = Redis(group.url, Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        await until(self, lambda: redis.connected, "the client never connected")
        follower = redis.follower
        assert follower is not None
        port, proc, _ = group.sentinels[0]
        made: list[object] = []
        factory = follower._watchers[0]
        self.patch(factory, "buildProtocol", lambda addr, build=factory.buildProtocol: made.append(addr) or build(addr))
        logged: list[str] = []
        observer = lambda event: logged.append(formatEvent(event))  # noqa: E731
        globalLogPublisher.addObserver(observer)
        self.addCleanup(globalLogPublisher.removeObserver, observer)
        os.kill(proc.pid, signal.SIGSTOP)
        self.addCleanup(os.kill, proc.pid, signal.SIGCONT)
        # Polling what the follower does by itself on the real clock: the PING unanswered (at most
        # twice the idle look plus the timeout), then the watcher made again; a margin for a loaded machine.
        said = f"Sentinel 127.0.0.1:{port} did not answer a PING within 1 s; reconnecting its watcher"
        await until(self, lambda: said in logged, "the watcher kept a sentinel that answers nothing",
                    within=2 * PING_IDLE + 1 + 2)  # fmt: skip
        await until(self, lambda: len(made) >= 2, "the watcher was not made again", within=2 * (PING_IDLE + 1 + 2) + 2)
        self.assertEqual(logged.count(said), 1)  # once, however often it is made again
        os.kill(proc.pid, signal.SIGCONT)
        await until(self, lambda: f"Sentinel 127.0.0.1:{port} answers again" in logged, "never heard again",
                    within=2 * PING_IDLE + 1 + 2 + 2)  # fmt: skip
