"""The fence around Twisted's and autobahn's private state (relayd/web/twisted_internals.py).

For every shortcut: the feature is detected on the installed release, shown on real objects over real
loopback connections (a Twisted or autobahn release that moves the state fails here, loudly), and the
fallback taken when it is absent gives the same observable result (or, where there is no public
equivalent, the documented plainer one). Last, no module outside the fences touches a Twisted,
autobahn or txredisapi private attribute (txredisapi's fence is relayd/redis_internals.py, its
detections are in tests/test_redis_internals.py).
"""

from __future__ import annotations

import ast
import inspect
import io
import re
from pathlib import Path
from typing import Any

from autobahn.twisted.websocket import (
    WebSocketClientFactory,
    WebSocketClientProtocol,
    WebSocketServerFactory,
    WebSocketServerProtocol,
)
from twisted.application.service import MultiService
from twisted.internet import endpoints, reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory, Protocol
from twisted.internet.testing import StringTransport
from twisted.logger import (
    LogLevel,
    LogPublisher,
    globalLogPublisher,
    textFileLogObserver,
)
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

import relayd
from relayd import redis_internals as redis_fence
from relayd.web import twisted_internals as fence
from relayd.web.site import RelaySite
from relayd.web.streams.sse import http_chunk
from tests.support.cases import cases, expand
from tests.support.raw import RawClient

TIMEOUT = 5.0


# -- helpers: real loopback connections --------------------------------------------------------------


class _Server(Protocol):
    """Records its transport once connected."""

    made: Deferred[Any]

    def connectionMade(self) -> None:
        self.made.callback(self.transport)


class _Held(Resource):
    """Leaves every GET open and hands the request to the test."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.arrived: Deferred[Any] = Deferred()

    def render_GET(self, request: Any) -> Any:
        request.setHeader(b"content-type", b"text/event-stream")
        request.write(b"")  # status line and headers now, as an SSE stream sends them
        self.arrived.callback(request)
        return NOT_DONE_YET


class _Plain(Resource):
    isLeaf = True

    def render_GET(self, request: Any) -> bytes:
        return b"hello"

    def render_POST(self, request: Any) -> bytes:
        return b"posted"


class LoopbackCase(TestCase):
    def listen(self, factory: Any) -> int:
        port = reactor.listenTCP(0, factory, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        return int(port.getHost().port)

    async def connect(self, port: int) -> RawClient:
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)

        def close() -> Any:
            if client.transport.connected:
                client.transport.loseConnection()
                return client.closed
            return None

        self.addCleanup(close)
        return client

    async def tcp_pair(self) -> tuple[Any, RawClient]:
        """A real server transport and the client reading it."""
        made: Deferred[Any] = Deferred()
        port = self.listen(Factory.forProtocol(type("S", (_Server,), {"made": made})))
        client = await self.connect(port)
        return await made.addTimeout(TIMEOUT, reactor), client

    async def held_request(self) -> tuple[Any, RawClient]:
        """A real twisted.web request left open (chunked, HTTP/1.1), and its client."""
        held = _Held()
        client = await self.connect(self.listen(RelaySite(held)))
        client.transport.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        request = await held.arrived.addTimeout(TIMEOUT, reactor)
        await client.wait_for(b"\r\n\r\n")
        return request, client


class _Watcher:
    """What watch_end tells: C{ended} fires with C{None} (finished) or the Failure (connection lost),
    in a list (a Failure as a Deferred's result would be its error)."""

    def __init__(self) -> None:
        self.ended: Deferred[list[Failure | None]] = Deferred()
        self.calls = 0

    def callback(self, result: None) -> None:
        self.calls += 1
        self.ended.callback([None])

    def errback(self, reason: Failure) -> None:
        self.calls += 1
        self.ended.callback([reason])


# -- TCP transports ------------------------------------------------------------------------------------


class Transports(LoopbackCase):
    async def test_tcp_buffers_are_detected_on_a_real_connection(self) -> None:
        self.assertTrue(fence.TCP_BUFFERS)
        self.assertTrue(fence.HOLD_WRITES)
        transport, _ = await self.tcp_pair()
        self.assertIsInstance(transport._tempDataBuffer, list)
        self.assertIsInstance(transport.dataBuffer, bytes)
        self.assertIsInstance(transport.offset, int)
        self.assertTrue(fence.nothing_queued(transport))
        transport.write(b"queued")  # waits for the next reactor turn
        self.assertFalse(fence.nothing_queued(transport))

    async def test_write_now_sends_within_the_call(self) -> None:
        transport, client = await self.tcp_pair()
        fence.write_now(transport, b"now")
        self.assertNotIn(transport, reactor.getWriters())  # sent, not queued for writability
        await client.wait_for(b"now")

    async def test_write_now_fallback_delivers_the_same_bytes(self) -> None:
        self.patch(fence, "TCP_BUFFERS", False)
        transport, client = await self.tcp_pair()
        self.assertFalse(fence.nothing_queued(transport))
        fence.write_now(transport, b"one ")
        fence.write_now(transport, b"two")
        await client.wait_for(b"one two")
        self.assertEqual(client.received, b"one two")

    async def test_held_writes_leave_the_socket_unwatched(self) -> None:
        transport, client = await self.tcp_pair()
        self.assertTrue(fence.hold_writes(transport))
        self.assertIn("startWriting", transport.__dict__)  # held: Twisted's write path calls this stand-in
        transport.write(b"held")
        self.assertNotIn(transport, reactor.getWriters())
        fence.release_writes(transport)
        self.assertNotIn("startWriting", transport.__dict__)
        await client.wait_for(b"held")

    async def test_hold_writes_fallback_holds_nothing_and_delivers_the_same_bytes(self) -> None:
        self.patch(fence, "HOLD_WRITES", False)
        transport, client = await self.tcp_pair()
        self.assertFalse(fence.hold_writes(transport))
        transport.write(b"held")
        await client.wait_for(b"held")
        self.assertEqual(client.received, b"held")


# -- taking a connection over from twisted.web ----------------------------------------------------------


class _Taker(Protocol):
    def __init__(self) -> None:
        self.received = b""
        self.lost: Deferred[None] = Deferred()

    def dataReceived(self, data: bytes) -> None:
        self.received += data

    def connectionLost(self, reason: Any = None) -> None:
        self.lost.callback(None)


class _Producer:
    stopped = False

    def pauseProducing(self) -> None:
        pass

    def resumeProducing(self) -> None:
        pass

    def stopProducing(self) -> None:
        self.stopped = True


@expand
class TakingOver(LoopbackCase):
    def test_connection_protocol_and_read_ahead_state_are_detected(self) -> None:
        self.assertTrue(fence.TCP_PROTOCOL)
        self.assertTrue(fence.CHANNEL_READ_AHEAD)

    async def test_the_new_protocol_reads_and_sees_the_end_and_the_producer_is_stopped(self) -> None:
        request, client = await self.held_request()
        channel, transport = request.channel, request.channel.transport
        self.assertFalse(fence.read_ahead(channel))
        taker, producer = _Taker(), _Producer()
        self.assertTrue(fence.take_over(transport, channel, taker, producer))
        self.assertIs(transport.producer, producer)
        client.transport.write(b"after")
        while not taker.received:
            await client_turn()
        self.assertEqual(taker.received, b"after")
        client.transport.loseConnection()
        await taker.lost.addTimeout(TIMEOUT, reactor)
        self.assertTrue(producer.stopped)

    async def test_pipelined_bytes_are_read_ahead(self) -> None:
        held = _Held()
        client = await self.connect(self.listen(RelaySite(held)))
        client.transport.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\nGET /next HTTP/1.1\r\n")
        request = await held.arrived.addTimeout(TIMEOUT, reactor)
        self.assertTrue(fence.read_ahead(request.channel))  # in the same read: still the line buffer's
        await client.wait_for(b"\r\n\r\n")
        self.assertTrue(fence.read_ahead(request.channel))  # now the channel's own buffer

    async def test_without_the_connection_state_nothing_is_taken_over(self) -> None:
        self.patch(fence, "TCP_PROTOCOL", False)
        request, _ = await self.held_request()
        channel, transport = request.channel, request.channel.transport
        self.assertFalse(fence.take_over(transport, channel, _Taker(), _Producer()))
        self.assertIs(fence.channel_of(transport.protocol), channel)
        self.assertIs(transport.producer, channel)

    async def test_without_the_read_ahead_state_a_request_may_follow(self) -> None:
        self.patch(fence, "CHANNEL_READ_AHEAD", False)
        request, _ = await self.held_request()
        self.assertTrue(fence.read_ahead(request.channel))


class BetweenRequests(LoopbackCase):
    """L{fence.between_requests}: what lets a plain POST be answered beside twisted.web (relayd.web.simple_post)."""

    def test_the_state_is_detected(self) -> None:
        self.assertTrue(fence.CHANNEL_BETWEEN_REQUESTS)

    async def test_a_channel_is_between_requests_until_one_begins_and_again_once_it_is_answered(self) -> None:
        held = _Held()
        site = RelaySite(held)
        client = await self.connect(self.listen(site))
        while not list(site._protocols):
            await client_turn()
        channel = fence.channel_of(next(iter(site._protocols)))
        self.assertTrue(fence.between_requests(channel))
        client.transport.write(b"GET /stream HTTP/1.1\r\n")  # begun: its headers are still to come
        while not channel._receivedHeaderSize:
            await client_turn()
        self.assertFalse(fence.between_requests(channel))
        client.transport.write(b"host: x\r\n\r\n")
        request = await held.arrived.addTimeout(TIMEOUT, reactor)
        self.assertFalse(fence.between_requests(channel))  # being answered
        request.write(b"done")
        request.finish()
        self.assertTrue(fence.between_requests(channel))

    async def test_without_the_state_no_channel_is_between_requests(self) -> None:
        self.patch(fence, "CHANNEL_BETWEEN_REQUESTS", False)
        site = RelaySite(_Held())
        await self.connect(self.listen(site))
        while not list(site._protocols):
            await client_turn()
        self.assertFalse(fence.between_requests(fence.channel_of(next(iter(site._protocols)))))


async def client_turn() -> None:
    d: Deferred[None] = Deferred()
    reactor.callLater(0, d.callback, None)
    await d


# -- requests -------------------------------------------------------------------------------------------


@expand
class Requests(LoopbackCase):
    def test_request_state_is_detected(self) -> None:
        self.assertTrue(fence.REQUEST_DISCONNECTED)
        self.assertTrue(fence.REQUEST_BODY_DIRECT)

    @cases(detected=True, fallback=False)
    async def test_a_client_gone_is_seen(self, detected: bool) -> None:
        self.patch(fence, "REQUEST_DISCONNECTED", detected)
        request, client = await self.held_request()
        if detected:
            self.assertIs(request._disconnected, False)
        self.assertFalse(fence.request_gone(request))
        lost = request.notifyFinish()
        client.transport.loseConnection()
        await self.assertFailure(lost.addTimeout(TIMEOUT, reactor), Exception)
        if detected:
            self.assertIs(request._disconnected, True)
        self.assertTrue(fence.request_gone(request))

    @cases(detected=True, fallback=False)
    async def test_a_finished_request_is_not_gone(self, detected: bool) -> None:
        self.patch(fence, "REQUEST_DISCONNECTED", detected)
        request, _ = await self.held_request()
        request.finish()
        self.assertFalse(fence.request_gone(request))

    def test_request_end_and_component_state_are_detected(self) -> None:
        self.assertTrue(fence.REQUEST_NOTIFICATIONS)
        self.assertEqual(fence.REQUEST_SPENT_PRIVATE, ("_adapterCache",))

    @cases(detected=True, fallback=False)
    async def test_a_watcher_is_told_of_a_client_gone(self, detected: bool) -> None:
        self.patch(fence, "REQUEST_NOTIFICATIONS", detected)
        request, client = await self.held_request()
        watcher = _Watcher()
        fence.watch_end(request, watcher)
        if detected:
            self.assertEqual(request.notifications, [watcher])  # no Deferred of its own
        client.transport.loseConnection()
        (reason,) = await watcher.ended.addTimeout(TIMEOUT, reactor)
        self.assertIsInstance(reason, Failure)
        self.assertEqual(watcher.calls, 1)

    @cases(detected=True, fallback=False)
    async def test_a_watcher_is_told_of_a_finish(self, detected: bool) -> None:
        self.patch(fence, "REQUEST_NOTIFICATIONS", detected)
        request, _ = await self.held_request()
        watcher = _Watcher()
        fence.watch_end(request, watcher)
        request.finish()
        self.assertEqual(await watcher.ended.addTimeout(TIMEOUT, reactor), [None])
        self.assertEqual(watcher.calls, 1)

    @cases(detected=True, fallback=False)
    async def test_a_direct_body_is_what_request_write_sends(self, detected: bool) -> None:
        """The bytes on the wire and the access log's count are the same either way."""
        self.patch(fence, "REQUEST_BODY_DIRECT", detected)
        request, client = await self.held_request()
        self.assertEqual(request.chunked, 1)
        before = len(client.received)
        transport = request.channel.transport
        through_write: list[bytes] = []
        self.patch(request, "write", lambda data: through_write.append(data) or type(request).write(request, data))
        for data in (b"data: one\n\n", b"data: two\n\n"):
            fence.send_body(request, transport, data, http_chunk(data))
        self.assertEqual(len(through_write), 0 if detected else 2)  # the fallback is request.write
        await client.wait_for(b"two\n\n\r\n")
        self.assertEqual(client.received[before:], b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n")
        self.assertEqual(request.sentLength, 22)
        request.finish()

    @cases(detected=True, fallback=False)
    def test_the_request_line_being_read(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_REQUEST_LINE", detected)
        channel = HTTPChannel()
        channel.makeConnection(StringTransport())
        channel.dataReceived(b"POST /p?q=1 HTTP/1.1\r\nhost: x\r\n")  # headers not finished
        if detected:
            self.assertEqual((channel._command, channel._path), (b"POST", b"/p?q=1"))
            self.assertEqual(fence.request_line(channel), (b"POST", b"/p?q=1"))
        else:
            self.assertEqual(fence.request_line(channel), (b"", b""))  # an early answer names no path
        channel.connectionLost(None)


# -- the channel's hooks --------------------------------------------------------------------------------


class _Recording(fence.ChannelHooks):
    def __init__(self) -> None:
        super().__init__()
        self.lengths: list[tuple[bytes, bytes]] = []
        self.bad = 0
        self.too_large = 0
        self.chunks: list[int] = []
        self.continues = 0
        self.continue_refused = False

    def chunk_size(self, size: int) -> None:
        self.chunks.append(size)

    def send_continue(self) -> None:
        self.continues += 1
        if not self.continue_refused:
            super().send_continue()

    def length_header(self, header: bytes, data: bytes) -> bytes:
        self.lengths.append((header.lower(), data))
        return data

    def headers_too_large(self) -> None:
        self.too_large += 1
        self.transport.loseConnection()

    def bad_request(self) -> None:
        self.bad += 1
        super().bad_request()


def _fed(data: bytes) -> tuple[_Recording, StringTransport]:
    channel = _Recording()
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(data)
    return channel, transport


@expand
class Channels(LoopbackCase):
    def test_channel_state_and_hooks_are_detected(self) -> None:
        for flag in ("CHANNEL_HEADER_COUNTS", "CHANNEL_PIPELINE", "CHANNEL_LENGTH_HOOK", "CHANNEL_BAD_REQUEST_HOOK",
                     "CHANNEL_REQUEST_LINE", "GENERIC_CHANNEL", "ALLOWED_METHODS", "CHANNEL_CONTINUE_HOOK",
                     "CHUNK_SIZE_HOOK"):
            self.assertTrue(getattr(fence, flag), flag)

    def test_header_counts(self) -> None:
        channel, _ = _fed(b"GET / HTTP/1.1\r\nhost: x\r\naccept: y\r\n")
        self.assertEqual(channel.header_fields(), channel._receivedHeaderCount)
        self.assertGreater(channel.header_fields(), 0)
        self.assertEqual(channel.header_bytes(), channel._receivedHeaderSize)
        self.assertGreater(channel.header_bytes(), 0)

    def test_header_counts_fallback(self) -> None:
        self.patch(fence, "CHANNEL_HEADER_COUNTS", False)
        channel, _ = _fed(b"GET / HTTP/1.1\r\nhost: x\r\n")
        self.assertEqual((channel.header_bytes(), channel.header_fields()), (0, 0))  # Twisted's caps apply

    @cases(detected=True, fallback=False)
    def test_length_hook(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_LENGTH_HOOK", detected)
        long = b"0" * 14 + b"12345"  # 19 characters: one over length_digits
        channel, _ = _fed(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: " + long + b"\r\n\r\n")
        self.assertEqual(channel.lengths, [(b"content-length", long)] if detected else [])
        self.assertEqual(channel.length, 12345)  # Twisted parsed the length either way

    def test_length_hook_skips_short_values(self) -> None:
        # Exactly length_digits characters: Twisted reads it as it is, without a call per header.
        channel, _ = _fed(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: " + b"0" * 17 + b"5\r\n\r\n")
        self.assertEqual((channel.lengths, channel.length), ([], 5))

    @cases(detected=True, fallback=False)
    def test_header_limits_hook(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_HEADER_COUNTS", detected)
        fields = b"".join(b"x-%d: y\r\n" % i for i in range(_Recording.maxHeaders + 1))
        channel, transport = _fed(b"GET / HTTP/1.1\r\n" + fields + b"\r\n")
        self.assertEqual(channel.too_large, 1 if detected else 0)
        if not detected:
            self.assertTrue(transport.value().startswith(b"HTTP/1.1 400"))  # Twisted's own cap
        within = b"".join(b"x-%d: y\r\n" % i for i in range(_Recording.maxHeaders - 1))
        channel, _ = _fed(b"GET / HTTP/1.1\r\n" + within + b"\r\n")
        self.assertEqual(channel.too_large, 0)

    def test_header_bytes_limit_hook(self) -> None:
        # Lines each within the line length, more bytes in all than totalHeadersSize.
        lines = b"".join(b"x-%d: %s\r\n" % (i, b"y" * 1000) for i in range(_Recording.totalHeadersSize // 1000 + 1))
        channel, _ = _fed(b"GET / HTTP/1.1\r\n" + lines + b"\r\n")
        self.assertEqual(channel.too_large, 1)

    @cases(detected=True, fallback=False)
    def test_bad_request_hook(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_BAD_REQUEST_HOOK", detected)
        channel, transport = _fed(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")
        self.assertEqual(channel.bad, 1 if detected else 0)
        self.assertTrue(transport.value().startswith(b"HTTP/1.1 400"))  # Twisted's own answer either way

    @cases(detected=True, fallback=False)
    def test_chunk_size_hook(self, detected: bool) -> None:
        self.patch(fence, "CHUNK_SIZE_HOOK", detected)
        channel, _ = _fed(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n" + b"f" * 40 + b"\r\n")
        self.assertEqual(channel.chunks, [3, int(b"f" * 40, 16)] if detected else [])
        # What the request is handed is Twisted's decoding either way (the last chunk not sent yet).
        channel, _ = _fed(b"POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n3;ext=1\r\nabc\r\n2\r\nde\r\n")
        content = channel.requests[-1].content
        content.seek(0)
        self.assertEqual(content.read(), b"abcde")

    def test_continue_hook(self) -> None:
        head = b"POST / HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n"
        channel, transport = _fed(head)
        self.assertEqual((channel.continues, transport.value()), (1, b"HTTP/1.1 100 Continue\r\n\r\n"))
        channel = _Recording()
        channel.continue_refused = True
        transport = StringTransport()
        channel.makeConnection(transport)
        channel.dataReceived(head)
        self.assertEqual((channel.continues, transport.value()), (1, b""))

    @cases(detected=True, fallback=False)
    def test_held_line(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_READ_AHEAD", detected)
        channel, _ = _fed(b"GET / HTTP/1.1\r\nhost: x\r\nunfinis")
        self.assertEqual(fence.held_line(channel), b"unfinis" if detected else b"")

    async def test_pipeline_state_on_a_real_connection(self) -> None:
        site = RelaySite(_Plain())
        client = await self.connect(self.listen(site))
        client.transport.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        await client.wait_for(b"hello")
        [protocol] = list(site._protocols)
        channel = fence.channel_of(protocol)
        self.assertIsInstance(channel, fence.ChannelHooks)
        self.assertIsNotNone(channel._networkProducer)
        self.assertIs(channel.waiting_for_transport(), False)
        channel.pauseProducing()  # what a full transport does
        self.assertIs(channel.waiting_for_transport(), True)
        channel.resumeProducing()
        self.patch(fence, "CHANNEL_PIPELINE", False)
        channel.pauseProducing()
        self.assertIs(channel.waiting_for_transport(), False)  # pipelined requests are then not held back
        channel.resumeProducing()

    @cases(detected=True, fallback=False)
    async def test_a_site_answers_the_same_through_either_channel_protocol(self, detected: bool) -> None:
        self.patch(fence, "GENERIC_CHANNEL", detected)
        site = RelaySite(_Plain())
        client = await self.connect(self.listen(site))
        client.transport.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\nDELETE / HTTP/1.1\r\nhost: x\r\n\r\n")
        await client.wait_for(b"method_not_allowed")
        [protocol] = list(site._protocols)
        self.assertEqual(protocol is fence.channel_of(protocol), not detected)
        self.assertIn(b"\r\n\r\nhello", client.received)
        self.assertIn(b"allow: get, head, post\r\n", client.received.lower())

    @cases(detected=True, fallback=False)
    def test_allowed_methods(self, detected: bool) -> None:
        self.patch(fence, "ALLOWED_METHODS", detected)
        self.assertEqual(sorted(fence.allowed_methods(_Plain())), [b"GET", b"HEAD", b"POST"])


# -- listening --------------------------------------------------------------------------------------------


@expand
class Listening(TestCase):
    def test_listen_state_is_detected(self) -> None:
        self.assertTrue(fence.LISTEN_STATE)

    @cases(detected=True, fallback=False)
    async def test_a_bound_port_and_a_port_in_use(self, detected: bool) -> None:
        self.patch(fence, "LISTEN_STATE", detected)
        parent = MultiService()
        svc = fence.listening_service(endpoints.serverFromString(reactor, "tcp:0:interface=127.0.0.1"), Factory())
        svc.setServiceParent(parent)
        parent.startService()
        port = await fence.bound_port(svc)
        if detected:
            self.assertIs(svc._raiseSynchronously, False)  # Twisted resets it once started
        number = port.getHost().port
        taken = fence.listening_service(
            endpoints.serverFromString(reactor, f"tcp:{number}:interface=127.0.0.1"), Factory()
        )
        self.assertRaises(CannotListenError, taken.startService)  # at start, not in a log line
        await parent.stopService()
        self.assertFalse(port.connected)


# -- the reactor ------------------------------------------------------------------------------------------


@expand
class ExitSignal(TestCase):
    def test_exit_signal_is_detected_on_the_running_reactor(self) -> None:
        self.assertTrue(fence.EXIT_SIGNAL)
        self.assertTrue(hasattr(reactor, "_exitSignal"))

    @cases(detected=True, fallback=False)
    def test_forget(self, detected: bool) -> None:
        self.patch(fence, "EXIT_SIGNAL", detected)
        self.patch(reactor, "_exitSignal", 15)
        fence.forget_exit_signal(reactor)
        # Without the attribute twistd's exit status stays the signal's (documented, no error).
        self.assertEqual(reactor._exitSignal, None if detected else 15)


# -- twisted.logger ----------------------------------------------------------------------------------------


@expand
class Logging(TestCase):
    def test_logger_state_is_detected(self) -> None:
        self.assertTrue(fence.PUBLISHER_LIST)
        self.assertTrue(fence.TEXT_FORMATTER)
        self.assertIsInstance(globalLogPublisher._observers, list)

    @cases(detected=True, fallback=False)
    def test_observe_first(self, detected: bool) -> None:
        self.patch(fence, "PUBLISHER_LIST", detected)
        seen: list[str] = []
        publisher = LogPublisher(lambda e: seen.append("theirs"))
        fence.observe_first(publisher, lambda e: seen.append("ours"))
        publisher({"log_format": "x"})
        # The fallback can only append: the scrubber then runs after observers added before it.
        self.assertEqual(seen, ["ours", "theirs"] if detected else ["theirs", "ours"])

    @cases(detected=True, fallback=False)
    def test_wrapped_text_formatters_write_the_same_bytes(self, detected: bool) -> None:
        self.patch(fence, "TEXT_FORMATTER", detected)
        out = io.StringIO()
        observer = textFileLogObserver(out)
        publisher = LogPublisher(observer)
        wrapped: list[Any] = []

        def wrap(format_event: Any) -> Any:
            wrapped.append(format_event)
            return lambda event: format_event(event)

        fence.wrap_text_formatters(publisher, wrap)
        event = {"log_format": "hello {who}", "who": "you", "log_time": 1.0, "log_namespace": "n",
                 "log_level": LogLevel.info}
        publisher(dict(event))
        self.assertEqual(len(wrapped), 1 if detected else 0)
        plain = io.StringIO()
        textFileLogObserver(plain)(dict(event))
        self.assertEqual(out.getvalue(), plain.getvalue())


# -- autobahn ------------------------------------------------------------------------------------------------


class _WSServer(WebSocketServerProtocol):
    def onOpen(self) -> None:
        self.factory.opened.callback(self)


class _WSClient(WebSocketClientProtocol):
    def dataReceived(self, data: bytes) -> None:
        fence.ws_data_received(self, data)

    def onOpen(self) -> None:
        self.factory.opened.callback(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.factory.messages.append(payload)
        if payload == b"last":
            self.factory.done.callback(None)


@expand
class WebSockets(LoopbackCase):
    async def pair(self) -> tuple[Any, Any]:
        server_factory = WebSocketServerFactory()
        server_factory.protocol = _WSServer
        server_factory.opened = Deferred()
        port = self.listen(server_factory)
        client_factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/")
        client_factory.protocol = _WSClient
        client_factory.opened, client_factory.messages, client_factory.done = Deferred(), [], Deferred()
        await endpoints.TCP4ClientEndpoint(reactor, "127.0.0.1", port).connect(client_factory)
        server = await server_factory.opened.addTimeout(TIMEOUT, reactor)
        client = await client_factory.opened.addTimeout(TIMEOUT, reactor)
        self.addCleanup(lambda: client.transport.loseConnection())
        return server, client

    def test_autobahn_state_is_detected(self) -> None:
        self.assertTrue(fence.WS_SEND_STATE)
        self.assertTrue(fence.WS_RECEIVE_STATE)
        self.assertTrue(fence.WS_QUIET_RECEIVE)

    async def test_open_connections_show_the_state(self) -> None:
        server, client = await self.pair()
        self.assertIsNone(server._perMessageCompress)
        self.assertEqual(len(server.send_queue), 0)
        self.assertTrue(fence.ws_frames_direct(server))
        self.assertTrue(fence.ws_parser_idle(client))
        self.assertTrue(fence.ws_parser_idle(server))

    @cases(detected=True, fallback=False)
    async def test_frames_arrive_the_same_either_way(self, detected: bool) -> None:
        for flag in ("WS_SEND_STATE", "WS_RECEIVE_STATE", "WS_QUIET_RECEIVE"):
            self.patch(fence, flag, detected)
        server, client = await self.pair()
        self.assertEqual(fence.ws_frames_direct(server), detected)
        self.assertEqual(fence.ws_parser_idle(client), detected)
        for text in (b"first", b"last"):
            message = server.factory.prepareMessage(text)
            if fence.ws_frames_direct(server):
                fence.write_now(server.transport, message.payloadHybi)
            else:
                server.sendPreparedMessage(message)
        await client.factory.done.addTimeout(TIMEOUT, reactor)
        self.assertEqual(client.factory.messages, [b"first", b"last"])


# -- nothing outside the fence touches a private attribute -----------------------------------------------

_PACKAGE = Path(relayd.__file__).parent
_FENCE = Path(fence.__file__).resolve()
_FENCES = {_FENCE, Path(redis_fence.__file__).resolve()}
_THIRD_PARTY = ("twisted", "autobahn", "txredisapi")

# Our own objects whose private names happen to be spelled like one of Twisted's or autobahn's. Each
# entry: (module under relayd/, attribute) -> why it is ours.
_OURS = {
    ("aep/core/index.py", "_scan"): "the subscription index's own scan",
    ("aep/websocket.py", "_open"): "AEPSocket's own state",
    ("mcp/http.py", "_log"): "the MCP resource's own Logger",
    ("redis.py", "_message"): "the Redis bus's own handler",
}


def _third_party_private_names() -> frozenset[str]:
    """Every single-underscore name Twisted's, autobahn's and txredisapi's modules define or assign."""
    import autobahn
    import txredisapi

    import twisted

    names: set[str] = set()
    pattern = re.compile(r"(?:self\.|def |class |^\s+)(_[A-Za-z][A-Za-z0-9_]*)\b", re.MULTILINE)
    for package in (twisted, autobahn, txredisapi):
        root = Path(package.__file__).parent
        # txredisapi is one module, not a package
        files = root.rglob("*.py") if Path(package.__file__).name == "__init__.py" else [Path(package.__file__)]
        for path in files:
            if "test" in path.relative_to(root).parts[:-1] or path.name.startswith("test_"):
                continue
            names.update(m for m in pattern.findall(path.read_text(errors="replace")) if not m.endswith("__"))
    return frozenset(names)


def _third_party_bases(tree: ast.Module, module: Any) -> dict[str, list[type]]:
    """The third-party classes among the bases of each class in C{module}, and of a mixin (a class
    of C{module} that other classes of it combine with a third-party class) those of the classes using it."""
    classes = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            cls = getattr(module, node.name, None)
            if inspect.isclass(cls):
                classes[node.name] = cls
    found: dict[str, list[type]] = {}
    for name, cls in classes.items():
        users = [other for other in classes.values() if cls in other.__mro__]
        found[name] = [
            b
            for user in users
            for b in user.__mro__
            if (getattr(b, "__module__", "") or "").split(".")[0] in _THIRD_PARTY
        ]
    return found


def private_uses(source: str, relative: str, module: Any, private: frozenset[str]) -> list[str]:
    """Where C{source} (relayd/C{relative}, imported as C{module}) touches a private name of Twisted
    or autobahn (other than our own)."""
    tree = ast.parse(source)
    bases = _third_party_bases(tree, module)
    uses: list[str] = []

    def flag(node: ast.AST, name: str) -> None:
        if name in private and (relative, name) not in _OURS:
            uses.append(f"{relative}:{getattr(node, 'lineno', 0)}: {name}")

    def inherited(cls: str, name: str) -> bool:
        return any(name in vars(b) or _assigns(b, name) for b in bases.get(cls, ()))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            own = own or (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super")
            if not own:
                flag(node, node.attr)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
            if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                name = node.args[1].value
                if name.startswith("_") and not name.startswith("__"):
                    flag(node, name)
        elif isinstance(node, (ast.ImportFrom,)) and node.module and node.module.split(".")[0] in _THIRD_PARTY:
            for alias in node.names:
                if alias.name.startswith("_") or any(p.startswith("_") for p in node.module.split(".")):
                    uses.append(f"{relative}:{node.lineno}: from {node.module} import {alias.name}")
    # In a subclass of a Twisted or autobahn class: its own private state and private methods.
    for cls_node in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls_node):
            name = None
            if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id == "self")
                or (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super")
            ):
                name = node.attr
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = node.name
            if name and name.startswith("_") and not name.startswith("__") and inherited(cls_node.name, name):
                uses.append(f"{relative}:{node.lineno}: {cls_node.name} uses inherited {name}")
    return uses


def _assigns(cls: type, name: str) -> bool:
    """Whether C{cls}'s own methods assign or read C{self.<name>}."""
    for value in vars(cls).values():
        code = getattr(value, "__code__", None)
        if code is not None and name in code.co_names:
            return True
    return False


def _modules() -> list[tuple[Path, Any]]:
    import importlib

    found = []
    for path in sorted(_PACKAGE.rglob("*.py")):
        if path.resolve() in _FENCES:
            continue
        dotted = ".".join(("relayd", *path.relative_to(_PACKAGE).with_suffix("").parts))
        found.append((path, importlib.import_module(dotted.removesuffix(".__init__"))))
    return found


class Fence(TestCase):
    def test_no_private_use_outside_the_fence(self) -> None:
        private = _third_party_private_names()
        uses = [
            use
            for path, module in _modules()
            for use in private_uses(path.read_text(), path.relative_to(_PACKAGE).as_posix(), module, private)
        ]
        self.assertEqual(uses, [], "move these into relayd/web/twisted_internals.py or relayd/redis_internals.py")

    def test_the_scan_sees_a_private_use(self) -> None:
        """A module reaching into a transport, a request, or an inherited private hook is caught."""
        private = _third_party_private_names()
        sample = (
            "from twisted.web.http import HTTPChannel\n"
            "from twisted.web.http import _GenericHTTPChannelProtocol\n"
            "def f(transport, request):\n"
            "    return transport._tempDataBuffer, getattr(request, '_disconnected', False)\n"
            "class C(HTTPChannel):\n"
            "    _mine = 0\n"
            "    def _respondToBadRequestAndDisconnect(self):\n"
            "        return self._networkProducer, self._mine\n"
        )
        namespace: dict[str, Any] = {}
        exec(compile(sample, "sample.py", "exec"), namespace)
        uses = private_uses(sample, "web/sample.py", type("M", (), namespace), private)
        self.assertEqual(
            sorted(u.split(": ", 1)[1] for u in uses),
            ["C uses inherited _networkProducer", "C uses inherited _respondToBadRequestAndDisconnect",
             "_disconnected", "_tempDataBuffer",
             "from twisted.web.http import _GenericHTTPChannelProtocol"],
        )

    def test_the_scan_sees_a_txredisapi_private_use(self) -> None:
        """A pool's private factory, a private helper, and txredisapi's readiness state set in a mixin."""
        private = _third_party_private_names()
        sample = (
            "import txredisapi\n"
            "def pool(host):\n"
            "    p = txredisapi.lazyConnectionPool(host)\n"
            "    return p._factory, txredisapi._makeEndpoint(host, 6379)\n"
            "class Ready:\n"
            "    def connectionMade(self):\n"
            "        self._ready = True\n"
            "class P(Ready, txredisapi.RedisProtocol):\n"
            "    pass\n"
        )
        namespace: dict[str, Any] = {}
        exec(compile(sample, "sample.py", "exec"), namespace)
        uses = private_uses(sample, "sample.py", type("M", (), namespace), private)
        self.assertEqual(sorted(u.split(": ", 1)[1] for u in uses), ["Ready uses inherited _ready", "_factory", "_makeEndpoint"])

    def test_the_fences_import_no_wing(self) -> None:
        # The Twisted fence imports nothing of relayd's; txredisapi's only the Twisted fence's detection.
        allowed = {_FENCE: set(), Path(redis_fence.__file__).resolve(): {"relayd.web.twisted_internals"}}
        for path, may in allowed.items():
            tree = ast.parse(path.read_text())
            imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            self.assertEqual({m for m in imported if m.startswith("relayd")}, may, path.name)
