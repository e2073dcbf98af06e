"""The fence's twisted.web entries (relayd/compat/web.py).

For every shortcut: the feature is detected on the installed release, shown on real objects over real
loopback connections (a Twisted release that moves the state fails here, loudly), and the fallback
taken when it is absent gives the same observable result (or, where there is no public equivalent,
the documented plainer one). (The reactor's exit signal and the twisted.logger entries at the end
wait for relayd/compat/logger.py.)
"""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import Protocol
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web import http
from twisted.web.http import HTTPChannel
from twisted.web.server import Site

from relayd.compat import tcp
from relayd.compat import web as fence
from relayd.compat.tcp import TCP_PROTOCOL
from relayd.process.settings import SiteSettings
from relayd.web.answers import Answer
from relayd.web.channel import RelayChannel
from relayd.web.routes import RoutedResource, RouteTable
from relayd.web.site import RelaySite
from relayd.web.streams.sse import http_chunk
from tests.compat.loopback import TIMEOUT, Held, LoopbackCase, Plain, Watcher, client_turn
from tests.support.cases import cases, expand

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
        self.assertTrue(TCP_PROTOCOL)
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
        held = Held()
        client = await self.connect(self.listen(RelaySite(held)))
        client.transport.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\nGET /next HTTP/1.1\r\n")
        request = await held.arrived.addTimeout(TIMEOUT, reactor)
        self.assertTrue(fence.read_ahead(request.channel))  # in the same read: still the line buffer's
        await client.wait_for(b"\r\n\r\n")
        self.assertTrue(fence.read_ahead(request.channel))  # now the channel's own buffer

    async def test_without_the_connection_state_nothing_is_taken_over(self) -> None:
        self.patch(tcp, "TCP_PROTOCOL", False)
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
        held = Held()
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
        site = RelaySite(Held())
        await self.connect(self.listen(site))
        while not list(site._protocols):
            await client_turn()
        self.assertFalse(fence.between_requests(fence.channel_of(next(iter(site._protocols)))))


# -- requests -------------------------------------------------------------------------------------------


@expand
class Requests(LoopbackCase):
    def test_request_state_is_detected(self) -> None:
        self.assertTrue(fence.REQUEST_DISCONNECTED)
        self.assertTrue(fence.REQUEST_BODY_DIRECT)
        self.assertTrue(fence.REQUEST_WRITE_STATE)

    def test_request_end_and_component_state_are_detected(self) -> None:
        self.assertTrue(fence.REQUEST_NOTIFICATIONS)
        self.assertEqual(fence.REQUEST_SPENT_PRIVATE, ("_adapterCache",))

    @cases(detected=True, fallback=False)
    async def test_a_watcher_is_told_of_a_client_gone(self, detected: bool) -> None:
        self.patch(fence, "REQUEST_NOTIFICATIONS", detected)
        request, client = await self.held_request()
        watcher = Watcher()
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
        watcher = Watcher()
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
                     "CHANNEL_REQUEST_LINE", "GENERIC_CHANNEL", "CHANNEL_CONTINUE_HOOK", "CHUNK_SIZE_HOOK",
                     "CHANNEL_LINE_STATE", "CHANNEL_LENGTH_STATE", "CHANNEL_REQUESTS", "CHANNEL_PERSISTENCE"):
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
        site = RelaySite(Plain())
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
    async def test_a_connection_made_on_plain_tcp(self, detected: bool) -> None:
        # Nagle off, the idle timeout armed, the channel the transport's streaming producer: the
        # same whether Twisted's connectionMade (zope's checks, a stand-in producer) runs or not.
        self.assertTrue(fence.CHANNEL_CONNECTION_MADE)
        self.patch(fence, "CHANNEL_CONNECTION_MADE", detected)
        transport, _ = await self.tcp_pair()
        clock = Clock()
        channel = fence.ChannelHooks()
        channel.timeOut = 30
        channel.callLater = clock.callLater  # type: ignore[method-assign]
        channel.makeConnection(transport)
        self.assertTrue(transport.getTcpNoDelay())
        self.assertIs(channel._networkProducer, transport)
        self.assertEqual((transport.producer, transport.streamingProducer), (channel, True))
        self.assertEqual([call.getTime() for call in clock.getDelayedCalls()], [30])
        transport.unregisterProducer()

    @cases(detected=True, fallback=False)
    async def test_a_connection_made_without_an_idle_timeout_arms_none(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_CONNECTION_MADE", detected)
        transport, _ = await self.tcp_pair()
        clock = Clock()
        channel = fence.ChannelHooks()
        channel.timeOut = None
        channel.callLater = clock.callLater  # type: ignore[method-assign]
        channel.makeConnection(transport)
        self.assertEqual(clock.getDelayedCalls(), [])
        self.assertIs(channel.transport.producer, channel)
        transport.unregisterProducer()

    def test_a_connection_made_on_another_transport_is_twisteds(self) -> None:
        channel = fence.ChannelHooks()
        channel.timeOut = None
        transport = StringTransport()
        channel.makeConnection(transport)
        self.assertEqual((transport.producer, transport.streaming), (channel, True))

    @cases(detected=True, fallback=False)
    def test_a_site_builds_its_channel_as_twisted_does(self, detected: bool) -> None:
        # The three buildProtocols' settings given at once: the same channel state either way.
        self.assertTrue(fence.SITE_BUILDS_CHANNEL)
        self.patch(fence, "SITE_BUILDS_CHANNEL", detected)
        self.patch(fence, "HTTP2", False)
        clock = Clock()
        site = RelaySite(Plain(), reactor=clock, settings=SiteSettings(idle_timeout=42))
        twisteds = Site.buildProtocol(site, None)
        self.assertIs(fence.built_channel(site, fence.ChannelHooks()) is None, not detected)
        channel = site.buildProtocol(None)
        self.assertIsInstance(channel, RelayChannel)
        for name in ("factory", "timeOut", "requestFactory", "site"):
            self.assertIs(getattr(channel, name), getattr(twisteds, name), name)
        self.assertEqual((channel.timeOut, channel.requestFactory), (42, site.requestFactory))
        self.assertEqual(channel.callLater, clock.callLater)  # the idle timeout on the site's clock
        self.assertEqual(sorted(vars(channel)), sorted(vars(twisteds)))

    def test_the_wrapper_only_where_http2_is_spoken(self) -> None:
        # Twisted's HTTP/1.1-or-2 wrapper costs an object per connection and a forwarded call per
        # read; without the h2 package it would only ever speak HTTP/1.1, as the channel does.
        self.assertEqual(fence.HTTP2, fence.GENERIC_CHANNEL and bool(http.H2_ENABLED))
        channel = fence.ChannelHooks()
        protocol = fence.channel_protocol(channel)
        self.assertEqual(protocol is channel, not fence.HTTP2)
        self.assertIs(fence.channel_of(protocol), channel)

    @cases(detected=True, fallback=False)
    async def test_a_site_answers_the_same_through_either_channel_protocol(self, detected: bool) -> None:
        self.patch(fence, "HTTP2", detected)
        table = RouteTable()
        table.add("/", {"GET": lambda request: Answer(200, b"hello"), "POST": lambda request: Answer(200)})
        site = RelaySite(RoutedResource(table))
        client = await self.connect(self.listen(site))
        client.transport.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\nDELETE / HTTP/1.1\r\nhost: x\r\n\r\n")
        await client.wait_for(b"method_not_allowed")
        [protocol] = list(site._protocols)
        self.assertEqual(protocol is fence.channel_of(protocol), not detected)
        self.assertIn(b"\r\n\r\nhello", client.received)
        self.assertIn(b"allow: get, head, post\r\n", client.received.lower())


# -- the request's write state, the channel's queue and persistence ------------------------------------


@expand
class RequestState(LoopbackCase):
    """What a held stream reads of its request (relayd.web.streams.held) and what ends a connection."""

    def test_the_state_is_detected(self) -> None:
        self.assertTrue(fence.REQUEST_WRITE_STATE)
        self.assertTrue(fence.CHANNEL_REQUESTS)
        self.assertTrue(fence.CHANNEL_PERSISTENCE)

    @cases(detected=True, fallback=False)
    async def test_the_write_state_of_a_streaming_response(self, detected: bool) -> None:
        self.patch(fence, "REQUEST_WRITE_STATE", detected)
        request, _ = await self.held_request()
        request.write(b"abc")
        if detected:
            self.assertEqual((request.startedWriting, request.chunked, request.sentLength), (1, 1, 3))
        # Without it nothing is held (headers_written says no), so the framing is never asked for.
        self.assertEqual(fence.headers_written(request), detected)
        self.assertEqual(fence.body_framing(request), (True, 3) if detected else (False, 0))
        fence.set_body_sent(request, 7)
        self.assertEqual(request.sentLength, 7)
        request.finish()

    @cases(detected=True, fallback=False)
    async def test_a_request_forgotten_by_its_channel(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_REQUESTS", detected)
        request, _ = await self.held_request()
        channel = request.channel
        self.assertEqual(channel.requests, [request])
        self.assertIs(fence.current_request(channel), request if detected else None)
        fence.forget_request(channel, request)
        self.assertEqual(channel.requests, [] if detected else [request])  # else the collector frees them
        fence.forget_request(channel, request)  # (twice: nothing more)

    @cases(detected=True, fallback=False)
    async def test_close_after_the_response(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_PERSISTENCE", detected)
        request, client = await self.held_request()
        self.assertEqual(fence.keeps_alive(request.channel), detected)
        fence.close_after(request)
        self.assertFalse(fence.keeps_alive(request.channel))
        request.finish()
        if detected:
            await client.closed.addTimeout(TIMEOUT, reactor)  # closed once the response is sent
        else:
            self.assertTrue(client.transport.connected)  # Twisted's own: the connection is kept

    def test_request_hooks_hold_what_every_request_is_given(self) -> None:
        """The class values are what Request.__init__ sets on a relayd request: a release that
        changes them (or their names) fails here, and the slim stream's dict keeps those entries."""
        site = RelaySite(Plain())
        channel = fence.channel_of(site.buildProtocol(None))
        channel.makeConnection(StringTransport())
        request = site.requestFactory(channel)
        self.assertIsInstance(request, fence.RequestHooks)
        for name in ("queued", "_parsePOSTFormSubmission"):
            self.assertIn(name, vars(request))
            self.assertEqual(vars(request)[name], getattr(fence.RequestHooks, name), name)
        channel.connectionLost(None)


@expand
class LineState(TestCase):
    """The channel's line reader and length state (relayd.web.channel's split reads, pipelining and
    body deadline)."""

    def test_the_state_is_detected(self) -> None:
        self.assertTrue(fence.CHANNEL_LINE_STATE)
        self.assertTrue(fence.CHANNEL_LENGTH_STATE)

    @cases(detected=True, fallback=False)
    def test_reading_the_head_and_pausing_the_parser(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_LINE_STATE", detected)
        channel, _ = _fed(b"POST / HTTP/1.1\r\nhost: x\r\n")
        self.assertEqual(channel.reading_head(), detected)
        channel.dataReceived(b"content-length: 3\r\n\r\n")
        self.assertFalse(channel.reading_head())  # the body: raw mode
        channel.pause_parsing()
        self.assertEqual(channel.parsing_paused(), detected)
        self.assertEqual(channel.paused, detected)
        channel.resume_parsing()
        self.assertFalse(channel.parsing_paused())
        channel.connectionLost(None)

    @cases(detected=True, fallback=False)
    def test_whether_a_body_follows(self, detected: bool) -> None:
        self.patch(fence, "CHANNEL_LENGTH_STATE", detected)
        follows: list[bool] = []
        original = HTTPChannel.allHeadersReceived
        self.patch(_Recording, "allHeadersReceived", lambda self: (follows.append(self.body_follows()), original(self)))
        for data in (b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", b"POST / HTTP/1.1\r\ncontent-length: 3\r\n\r\n",
                     b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n"):  # fmt: skip
            _fed(data)[0].connectionLost(None)
        # Without the state known a body is assumed (the body deadline then always runs).
        self.assertEqual(follows, [False, True, True] if detected else [True, True, True])


