"""The fence around txredisapi's private state (relayd/compat/txredisapi.py).

Each reliance is detected on the installed txredisapi (a release that moves the state fails here,
loudly: setup.cfg admits a new txredisapi only once these pass), shown on real objects, and its
fallback gives a working client. tests/compat/ fails any other module that
touches a txredisapi private attribute.
"""

from __future__ import annotations

import enum
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import txredisapi
from twisted.internet import reactor, task
from twisted.internet.defer import CancelledError, gatherResults
from twisted.internet.error import ConnectionDone
from twisted.internet.task import deferLater
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.compat import txredisapi as fence
from relayd.storage.redis import KEYSPACE_VERSION, Redis
from tests.support.cases import cases, expand
from tests.support.redis import RedisServer

REPO = Path(__file__).resolve().parents[2]

# Three bulk strings in one read, as a pub/sub message or an MGET answer arrives.
THREE = b"*3\r\n$1\r\nx\r\n$1\r\ny\r\n$1\r\nz\r\n"


class _Whole(fence.WholeReads, txredisapi.BaseRedisProtocol):
    """txredisapi's line reader (its parser without hiredis), as relayd's connections mix it."""


def connected(protocol: txredisapi.RedisProtocol) -> txredisapi.RedisProtocol:
    protocol.makeConnection(StringTransport())  # no password, no database: ready at once
    return protocol


class Detection(TestCase):
    def test_each_reliance_is_detected_on_the_installed_txredisapi(self) -> None:
        self.assertTrue(fence.READY_STATE, "txredisapi no longer keeps _ready/_waiting_for_connect")
        self.assertTrue(fence.SPLIT_READS, "txredisapi no longer splits a read across reactor turns")
        self.assertTrue(fence.OWN_REPLIES, "txredisapi no longer hands every reply to replyReceived")
        self.assertTrue(fence.ONE_PASS_COMMANDS, "txredisapi no longer builds commands in _build_command")
        self.assertTrue(fence.REPLY_TIMERS, "txredisapi no longer times replies with the protocol's callLater")
        self.assertTrue(fence.ONE_DEFERRED, "txredisapi's execute_command no longer answers from its replyQueue")
        self.assertTrue(fence.IDLE_CONNECTIONS, "txredisapi's pool no longer keeps its connections in connectionQueue")

    def test_hiredis_reads_the_replies(self) -> None:
        """setup.cfg requires hiredis; txredisapi then parses with it, and the fence knows."""
        self.assertIsNotNone(txredisapi.hiredis, "hiredis is not installed")
        self.assertIs(txredisapi.RedisProtocol, txredisapi.HiredisProtocol)
        self.assertTrue(fence.HIREDIS_REPLIES, "txredisapi no longer parses replies with hiredis's reader")
        self.assertEqual(fence.status("OK"), b"OK")

    def test_the_parser_in_use_is_the_one_detected(self) -> None:
        self.assertEqual(fence.HIREDIS_REPLIES, txredisapi.hiredis is not None)
        self.assertEqual(fence.status("OK"), b"OK" if txredisapi.hiredis is not None else "OK")

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
        protocol = connected(txredisapi.BaseRedisProtocol(charset=None, convertNumbers=False))
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


class _Heard:
    """Records every complete reply a parser hands over."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.replies: list[Any] = []

    def replyReceived(self, reply: Any) -> None:
        self.replies.append(reply)


class _HeardByLines(_Heard, _Whole):
    pass


# Every kind of reply relayd's connections get (charset None, no number conversion): bulk strings
# (empty, binary with line breaks, long), nil, integers, statuses, errors (a code word, a bare
# message, nested in an array as EXEC and a script's table give them), nested and empty arrays, nil
# arrays, pub/sub messages and confirmations (classic, pattern, shard), a sentinel's answer.
_REPLIES = (
    b"$1\r\nx\r\n$0\r\n\r\n$5\r\na\r\n$1\r\n$-1\r\n$100000\r\n" + b"y" * 100_000 + b"\r\n"
    b":0\r\n:-1\r\n:9223372036854775807\r\n+OK\r\n+PONG\r\n+QUEUED\r\n+1\r\n"
    b"-ERR unknown command 'X'\r\n-WRONGTYPE Operation against a key holding the wrong kind of value\r\n"
    b"-NOSCRIPT No matching script. Please use EVAL.\r\n-MOVED 3999 127.0.0.1:6381\r\n-LEASE lapsed\r\n"
    b"*2\r\n$4\r\n1101\r\n:3\r\n*3\r\n$2\r\n10\r\n:64\r\n$3\r\nvic\r\n*0\r\n*-1\r\n"
    b"*3\r\n*2\r\n:1\r\n*1\r\n$1\r\nz\r\n*0\r\n$-1\r\n*2\r\n:1\r\n-ERR x\r\n"
    b"*3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$5\r\n12345\r\n*4\r\n$8\r\npmessage\r\n$1\r\n*\r\n$1\r\nc\r\n$2\r\nhi\r\n"
    b"*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n*3\r\n$8\r\nsmessage\r\n$1\r\nc\r\n$0\r\n\r\n"
    b"*2\r\n$4\r\npong\r\n$0\r\n\r\n*2\r\n$9\r\n127.0.0.1\r\n$4\r\n6379\r\n"
)


def _as_hiredis_gives(reply: Any) -> Any:
    """A reply of txredisapi's line reader as hiredis gives it: a status as bytes (fence.HIREDIS_REPLIES)."""
    if isinstance(reply, str):
        return reply.encode()
    if isinstance(reply, list):
        return [_as_hiredis_gives(item) for item in reply]
    return reply


def _comparable(reply: Any) -> Any:
    if isinstance(reply, Exception):
        return (type(reply), reply.args)
    if isinstance(reply, list):
        return [_comparable(item) for item in reply]
    return reply


@expand
class Parsers(TestCase):
    """hiredis's reader (txredisapi's parser once hiredis is installed) hands relayd the replies its
    line reader does, a status as bytes aside (fence.HIREDIS_REPLIES)."""

    def setUp(self) -> None:
        if txredisapi.hiredis is None:
            self.skipTest("hiredis is not installed (the line reader alone)")

    @cases(whole=len(_REPLIES), split=7, byte_by_byte=1)
    def test_every_kind_of_reply_is_the_same(self, step: int) -> None:
        lines = connected(_HeardByLines(charset=None, convertNumbers=False))
        hiredis = connected(type("Heard", (_Heard, txredisapi.HiredisProtocol), {})(charset=None, convertNumbers=False))
        for at in range(0, len(_REPLIES), step):
            lines.dataReceived(_REPLIES[at : at + step])
            hiredis.dataReceived(_REPLIES[at : at + step])
        self.assertEqual(len(lines.replies), 29)
        self.assertEqual(_comparable(hiredis.replies), _comparable(_as_hiredis_gives(lines.replies)))

    def test_relayds_connections_read_with_the_parser_in_use(self) -> None:
        from relayd.storage.redis import _Protocol, _Subscriber
        from relayd.storage.sentinel import _OneShot, _Watcher
        from relayd.storage.sharded import _ShardSubscriber

        for kind in (_Protocol, _Subscriber, _OneShot, _Watcher, _ShardSubscriber):
            self.assertTrue(issubclass(kind, txredisapi.HiredisProtocol), kind)


class WithoutHiredis(TestCase):
    """relayd without hiredis: txredisapi's line reader, and the fence's reliances detected on it."""

    timeout = 600

    def test_the_fence_and_the_clients_work_with_the_line_reader(self) -> None:
        # This module and the subscribers' heartbeat (the PONG status) against real redis-servers, in
        # a process where hiredis cannot be imported.
        run = "import sys; sys.modules['hiredis'] = None; import pytest; sys.exit(pytest.main(sys.argv[1:]))"
        argv = [sys.executable, "-c", run, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                "tests/compat/test_txredisapi.py", "tests/storage/test_redis_heartbeat.py",
                "-k", "not WithoutHiredis and not hiredis_reads_the_replies"]  # fmt: skip
        done = subprocess.run(argv, cwd=REPO, env=dict(os.environ), capture_output=True, text=True, timeout=540)
        self.assertEqual(done.returncode, 0, done.stdout[-4000:] + done.stderr[-2000:])
        self.assertIn(" passed", done.stdout)
        self.assertIn(" skipped", done.stdout)  # (Parsers: nothing to compare without hiredis)


class _OnePass(fence.OnePassCommands, txredisapi.RedisProtocol):
    encoded = 0

    def _encode_value(self, arg: Any) -> bytes:
        self.encoded += 1
        return super()._encode_value(arg)  # type: ignore[no-any-return]


class _Color(enum.IntEnum):
    RED = 1


# Every kind of argument a caller could pass, and the edges of each: empty, line breaks, a length of
# several digits, negative and long numbers, non-ASCII text.
_ARGUMENTS: list[Any] = [
    "EVALSHA", b"", b"\r\n$3\r\n", b"x" * 100_000, 0, -1, 10**300, "", "caf\u00e9 \U0001f600", True, False,
    1.5, float("inf"), bytearray(b"ab"), _Color.RED, None,
]


@expand
class Commands(TestCase):
    """Commands built in one pass are byte for byte txredisapi's."""

    @cases(bytes_out=None, text="utf-8", latin="latin-1/replace")
    def test_every_kind_of_argument_as_txredisapi_writes_it(self, charset: str | None) -> None:
        name, _, errors = (charset or "").partition("/")
        name, errors = name or None, errors or "strict"
        ours = _OnePass(charset=name, errors=errors)
        theirs = txredisapi.RedisProtocol(charset=name, errors=errors)
        for arg in _ARGUMENTS:
            self.assertEqual(ours._build_command(arg), theirs._build_command(arg), repr(arg))
        self.assertEqual(ours._build_command(*_ARGUMENTS), theirs._build_command(*_ARGUMENTS))
        self.assertEqual(ours._build_command(), theirs._build_command())

    @cases(bytes_out=None, text="utf-8", ascii="ascii")
    def test_what_txredisapi_refuses_is_refused_the_same(self, charset: Any) -> None:
        for arg in ["\ud800", "caf\u00e9", 10**5000]:
            try:
                txredisapi.RedisProtocol(charset=charset)._build_command(arg)
            except Exception as e:
                with self.assertRaises(type(e)):
                    _OnePass(charset=charset)._build_command(arg)
            else:
                self.assertEqual(
                    _OnePass(charset=charset)._build_command(arg),
                    txredisapi.RedisProtocol(charset=charset)._build_command(arg),
                )

    def test_bytes_numbers_and_text_go_through_no_per_argument_call(self) -> None:
        """What the shortcut saves: txredisapi calls _encode_value twice per argument."""
        protocol = _OnePass(charset=None)
        protocol._build_command("EVALSHA", b"sha", 2, b"key", "value")
        self.assertEqual(protocol.encoded, 0)
        self.patch(fence, "ONE_PASS_COMMANDS", False)
        fallback = _OnePass(charset=None)
        self.assertEqual(fallback._build_command("EVALSHA", b"sha", 2, b"key", "value"),
                         protocol._build_command("EVALSHA", b"sha", 2, b"key", "value"))  # fmt: skip
        self.assertEqual(fallback.encoded, 11)

    @cases(one_pass=True, fallback=False)
    def test_framed_arguments_are_written_as_the_arguments_themselves(self, detected: bool) -> None:
        self.patch(fence, "ONE_PASS_COMMANDS", detected)
        keys = [b"k", b"", b"\r\n$3\r\n", b"x" * 1000]
        framed = fence.Framed(keys)
        ours, theirs = _OnePass(charset=None), txredisapi.RedisProtocol(charset=None)
        for args in [(framed,), ("EVALSHA", b"sha", 5, b"first", framed, 7, "value"), (framed, framed)]:
            self.assertEqual(ours._build_command(*args), theirs._build_command(*fence.unframed(args)), repr(args))
        self.assertEqual(fence.unframed(["EVALSHA", framed, 1]), ["EVALSHA", *keys, 1])
        self.assertEqual(ours._build_command(fence.Framed([])), theirs._build_command())
        with self.assertRaises(TypeError):
            fence.Framed([b"k", "text"])

    def test_relayds_pool_connections_build_in_one_pass(self) -> None:
        from relayd.storage.redis import _Protocol

        self.assertTrue(issubclass(_Protocol, fence.OnePassCommands))


class _OneDeferred(fence.OneDeferredCommands, fence.WholeReads, txredisapi.RedisProtocol):
    pass


@expand
class OneDeferred(TestCase):
    """A pool connection's command answered by the reply queue's own Deferred, as txredisapi answers it."""

    def setUp(self) -> None:
        self.fake = task.Clock()

    def protocol(self, timeout: float | None = 2) -> txredisapi.RedisProtocol:
        protocol = connected(_OneDeferred(charset=None, convertNumbers=False, replyTimeout=timeout))
        fence.time_replies_with(protocol, Timekeeper(self.fake))
        return protocol

    def test_the_answer_is_the_queues_deferred(self) -> None:
        """What the shortcut saves: txredisapi's own second Deferred, its three callbacks and closures."""
        protocol = self.protocol()
        answer = protocol.execute_command("GET", "k")
        self.assertIs(protocol.replyQueue.waiting[-1], answer)
        self.patch(fence, "ONE_DEFERRED", False)
        self.assertIsNot(protocol.execute_command("GET", "k"), protocol.replyQueue.waiting[-1])

    @cases(detected=True, fallback=False)
    def test_replies_errors_timeouts_and_cancels_as_txredisapi(self, detected: bool) -> None:
        self.patch(fence, "ONE_DEFERRED", detected)
        protocol = self.protocol()
        self.assertEqual(protocol.transport.value(), b"")
        answers = [protocol.execute_command("GET", "k") for _ in range(5)]
        self.assertEqual(protocol.transport.value(), b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n" * 5)
        answers[2].cancel()  # (relayd's own timeout): its reply, when it comes, is nobody's
        protocol.dataReceived(b"$1\r\nx\r\n-WRONGTYPE no\r\n$1\r\ny\r\n")
        self.assertEqual(self.successResultOf(answers[0]), b"x")
        self.assertEqual(str(self.failureResultOf(answers[1], txredisapi.ResponseError).value), "WRONGTYPE no")
        self.failureResultOf(answers[2], CancelledError)
        self.assertEqual(len(self.fake.getDelayedCalls()), 1)  # (the deadline of the two still waiting)
        self.fake.advance(2)
        for answer in answers[3:]:
            failure = self.failureResultOf(answer, txredisapi.TimeoutError)
            self.assertEqual(str(failure.value), "Not received Redis response in 2 seconds")
        self.assertTrue(protocol.transport.disconnecting)  # the connection dropped
        self.assertEqual(self.fake.getDelayedCalls(), [])

    @cases(detected=True, fallback=False)
    def test_a_reply_cancels_its_timer_and_a_lost_connection_fails_the_rest(self, detected: bool) -> None:
        self.patch(fence, "ONE_DEFERRED", detected)
        protocol = self.protocol()
        answers = [protocol.execute_command("GET", "k") for _ in range(2)]
        protocol.dataReceived(b":1\r\n")
        self.fake.advance(1)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual(self.successResultOf(answers[0]), 1)
        self.failureResultOf(answers[1], txredisapi.ConnectionError)
        self.assertEqual(self.fake.getDelayedCalls(), [])
        with self.assertRaises(txredisapi.ConnectionError):
            protocol.execute_command("GET", "k")  # (raised at once, as txredisapi raises it)

    @cases(detected=True, fallback=False)
    def test_without_a_reply_timeout_none_is_set(self, detected: bool) -> None:
        self.patch(fence, "ONE_DEFERRED", detected)
        protocol = self.protocol(timeout=None)
        answers = [protocol.execute_command("GET", "k"), protocol.execute_command("GET", "k")]
        self.assertEqual(self.fake.getDelayedCalls(), [])
        protocol.dataReceived(b"-ERR no\r\n$0\r\n\r\n")
        self.assertEqual(str(self.failureResultOf(answers[0], txredisapi.ResponseError).value), "ERR no")
        self.assertEqual(self.successResultOf(answers[1]), b"")

    def test_keywords_pipelines_and_transactions_are_txredisapis(self) -> None:
        protocol = self.protocol()
        unbounded = protocol.execute_command("BLPOP", "k", 0, apply_timeout=False)
        self.assertIsNot(unbounded, protocol.replyQueue.waiting[-1])
        self.assertEqual(self.fake.getDelayedCalls(), [])
        protocol.pipelining = True
        self.assertIsNot(protocol.execute_command("GET", "k"), protocol.replyQueue.waiting[-1])

    def test_relayds_pool_connections_take_one_deferred(self) -> None:
        from relayd.storage.redis import _Protocol

        self.assertTrue(issubclass(_Protocol, fence.OneDeferredCommands))


class ReplyTimers(TestCase):
    """Reply timers set on relayd's deadlines: one reactor call for every pending reply."""

    def setUp(self) -> None:
        self.fake = task.Clock()
        self.clock = Timekeeper(self.fake)

    def pending(self, protocol: txredisapi.RedisProtocol) -> list[Any]:
        return [protocol.execute_command("GET", "k") for _ in range(10)]

    def test_txredisapi_alone_sets_a_reactor_call_per_command(self) -> None:
        """What the shortcut saves."""
        protocol = connected(txredisapi.RedisProtocol(charset=None, replyTimeout=2))
        protocol.callLater = self.fake.callLater
        answers = self.pending(protocol)
        self.assertEqual(len(self.fake.getDelayedCalls()), 10)
        protocol.connectionLost(Failure(ConnectionDone()))
        for answer in answers:
            self.failureResultOf(answer, txredisapi.ConnectionError)

    def test_replies_are_timed_as_txredisapi_times_them_with_one_reactor_call(self) -> None:
        protocol = connected(txredisapi.RedisProtocol(charset=None, replyTimeout=2))
        fence.time_replies_with(protocol, self.clock)
        answers = self.pending(protocol)
        self.assertEqual(len(self.fake.getDelayedCalls()), 1)
        protocol.dataReceived(b"$1\r\nx\r\n")
        self.assertEqual(self.successResultOf(answers[0]), b"x")
        self.fake.advance(1.999)
        self.assertNoResult(answers[1])
        self.fake.advance(0.001)
        for answer in answers[1:]:
            self.failureResultOf(answer, txredisapi.TimeoutError)
        self.assertTrue(protocol.transport.disconnecting)  # txredisapi drops the connection, as without
        self.assertEqual(self.fake.getDelayedCalls(), [])

    def test_answered_or_lost_every_timer_goes(self) -> None:
        protocol = connected(_Whole(charset=None, replyTimeout=2))
        fence.time_replies_with(protocol, self.clock)
        answers = self.pending(protocol)
        protocol.dataReceived(b"$1\r\nx\r\n" * 5)
        protocol.connectionLost(Failure(ConnectionDone()))
        self.assertEqual([self.successResultOf(a) for a in answers[:5]], [b"x"] * 5)
        for answer in answers[5:]:
            self.failureResultOf(answer, txredisapi.ConnectionError)
        self.assertEqual(self.fake.getDelayedCalls(), [])

    def test_a_reply_timer_on_the_clock_is_a_timeout_of_its_length(self) -> None:
        protocol = connected(txredisapi.RedisProtocol(charset=None, replyTimeout=2))
        self.assertFalse(fence.reply_timer_first(protocol, self.clock, 2))  # (on the reactor: no order)
        fence.time_replies_with(protocol, self.clock)
        self.assertTrue(fence.reply_timer_first(protocol, self.clock, 2))
        self.assertFalse(fence.reply_timer_first(protocol, self.clock, 3))
        self.assertFalse(fence.reply_timer_first(protocol, Timekeeper(task.Clock()), 2))
        self.patch(fence, "REPLY_TIMERS", False)
        self.assertFalse(fence.reply_timer_first(protocol, self.clock, 2))

    def test_relayds_pool_connections_time_replies_on_its_clock(self) -> None:
        from relayd.storage.redis import _Protocol

        protocol = _Protocol(charset=None, replyTimeout=2)
        protocol.factory = type("Factory", (), {"relayd_client": type("Client", (), {"clock": self.clock})()})()
        protocol.factory.relayd_follower = None
        protocol.makeConnection(StringTransport())
        self.assertEqual(protocol.callLater, self.clock.deadline)
        protocol.connectionLost(Failure(ConnectionDone()))


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
        self.assertEqual(self.successResultOf(answer), fence.status("PONG"))
        protocol.own_replies = True
        protocol.dataReceived(
            b"*3\r\n$10\r\nssubscribe\r\n$1\r\nc\r\n:1\r\n"
            b"*3\r\n$8\r\nsmessage\r\n$1\r\nc\r\n$2\r\nhi\r\n"
            b"-MOVED 5 127.0.0.1:7000\r\n"
        )
        self.assertEqual(protocol.replies[:2], [[b"ssubscribe", b"c", 1], [b"smessage", b"c", b"hi"]])
        self.assertIsInstance(protocol.replies[2], txredisapi.ResponseError)
        self.assertEqual(str(protocol.replies[2]), "MOVED 5 127.0.0.1:7000")


class _Hears(fence.HearsReplies, fence.WholeReads, txredisapi.SubscriberProtocol):
    times_heard = 0

    def heard(self) -> None:
        self.times_heard += 1


class HearsReplies(TestCase):
    """A subscriber's PONG (its heartbeat writes the PING itself) is taken, whichever parser reads it."""

    def test_the_pong_status_and_the_subscribed_pong_go_no_further(self) -> None:
        protocol = connected(_Hears(charset=None, convertNumbers=False))
        protocol.dataReceived(b"+PONG\r\n")  # subscribed to nothing yet: the status
        subscribed = protocol.execute_command("SUBSCRIBE", b"c")
        protocol.dataReceived(b"*3\r\n$9\r\nsubscribe\r\n$1\r\nc\r\n:1\r\n*2\r\n$4\r\npong\r\n$0\r\n\r\n")
        self.assertEqual(self.successResultOf(subscribed), [b"subscribe", b"c", 1])  # not the PONG
        self.assertEqual(protocol.times_heard, 3)
        self.assertEqual(protocol.replyQueue.pending, [])


@expand
class Handshake(TestCase):
    """relayd's handshake (READY_STATE) and txredisapi's (the fallback) against a real redis-server."""

    timeout = 30

    def setUp(self) -> None:
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)

    async def until_connected(self, redis: Redis) -> None:
        waited = 0.0
        # (and checked: with txredisapi's handshake, the fallback, the pool hands a connection out
        # before relayd's keyspace check on it has written the version key)
        while not (redis.connected and redis._usable_connections):
            self.assertLess(waited, 10.0, "the client did not connect")
            await deferLater(reactor, 0.02, lambda: None)  # polling a connection being made
            waited += 0.02

    @cases(detected=True, fallback=False)
    async def test_a_connection_is_checked_and_serves(self, detected: bool) -> None:
        self.patch(fence, "READY_STATE", detected)
        redis = Redis(f"redis://127.0.0.1:{self.server.port}/2", Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        await self.until_connected(redis)
        self.assertEqual(await redis.execute("probe", "SET", "k", "v"), fence.status("OK"))
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


class _Pool:
    """What idle_connection reads of a txredisapi pool: its connection queue."""

    def __init__(self, *connections: Any) -> None:
        self.connectionQueue = txredisapi.PeekableQueue()
        for connection in connections:
            self.connectionQueue.put(connection)


class IdleConnections(TestCase):
    def test_a_connection_handed_out_is_picked_a_lost_one_never(self) -> None:
        up = connected(txredisapi.RedisProtocol(charset=None))
        lost = connected(txredisapi.RedisProtocol(charset=None))
        lost.connectionLost(Failure(ConnectionDone()))
        self.assertIs(fence.idle_connection(_Pool(up)), up)
        self.assertIsNone(fence.idle_connection(_Pool(lost)))
        self.assertIsNone(fence.idle_connection(_Pool()))
        picks = {fence.idle_connection(_Pool(up, lost)) for _ in range(50)}
        self.assertEqual(picks, {up, None})  # (at random, as txredisapi picks; the lost one never)

    def test_without_the_reliance_the_pool_is_asked(self) -> None:
        self.patch(fence, "IDLE_CONNECTIONS", False)
        self.assertIsNone(fence.idle_connection(_Pool(connected(txredisapi.RedisProtocol(charset=None)))))

    async def test_a_command_on_a_ready_pool_asks_no_connection_of_it(self) -> None:
        """What the shortcut saves: txredisapi's getConnection, a generator and its Deferreds, per command."""
        server = RedisServer.start()
        self.addCleanup(server.cleanup)
        redis = Redis(server.url, Timekeeper(reactor), timeout=1)
        self.addCleanup(redis.close)
        waited = 0.0
        while not redis.connected:
            self.assertLess(waited, 10.0, "the client did not connect")
            await deferLater(reactor, 0.02, lambda: None)  # polling a connection being made
            waited += 0.02
        factory = redis._factory
        asked: list[bool] = []
        original = factory.getConnection
        self.patch(factory, "getConnection", lambda peek=False: asked.append(peek) or original(peek))
        self.assertEqual(await redis.execute("probe", "SET", "k", "v"), fence.status("OK"))
        self.assertEqual(await redis.execute("probe", "GET", "k"), b"v")
        self.assertEqual(await gatherResults(redis.execute_many("probe", [("GET", "k"), ("GET", "k")])), [b"v", b"v"])
        self.assertEqual(asked, [])
        self.patch(fence, "IDLE_CONNECTIONS", False)
        self.assertEqual(await redis.execute("probe", "GET", "k"), b"v")
        self.assertEqual(asked, [True])  # (the pool's own way: a command through its handler)
