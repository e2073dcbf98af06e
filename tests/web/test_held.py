"""A held stream leaves twisted.web once its headers are sent (relayd/web/streams/held.py): over real loopback
connections, its request and channel are freed, its bytes, end, access line, backpressure, drain and
unsolicited input behave as documented, and a stream that cannot be held stays on twisted.web."""

from __future__ import annotations

import gc
import weakref
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relayd.base.clock import Timekeeper
from relayd.web.site import RelaySite
from relayd.web.streams import held as held_module
from relayd.web.streams.held import MAX_UNSOLICITED, HeldResponse
from relayd.web.streams.sse import SSEHub, SSEStream, http_chunk, sse_comment, sse_event
from tests.support.cases import cases, expand
from tests.support.raw import RawClient
from tests.web.test_site import _turns, next_access_line

HEADERS = [(b"content-type", b"text/event-stream")]
OPEN = b": open\n\n"
GET = b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"


class _Streams(Resource):
    isLeaf = True

    def __init__(self, hub: SSEHub) -> None:
        super().__init__()
        self.hub = hub
        self.held = True
        self.streams: list[SSEStream] = []
        self.requests: list[weakref.ref[Any]] = []
        self.ended: list[SSEStream] = []
        self.opened: Deferred[SSEStream] = Deferred()

    def render_GET(self, request: Any) -> Any:
        if request.path != b"/stream":
            request.setHeader(b"content-length", b"2")
            return b"ok"
        stream = SSEStream(request, self.hub, max_buffer=10**8)
        stream.on_close = lambda: self.ended.append(stream)
        self.requests.append(weakref.ref(request))
        stream.start(HEADERS, OPEN, held=self.held)
        self.streams.append(stream)
        opened, self.opened = self.opened, Deferred()
        opened.callback(stream)
        return NOT_DONE_YET


class HeldCase(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.hub = SSEHub(Timekeeper(reactor), 3600.0, sse_comment("ping"))
        self.addCleanup(self.hub.stop)
        self.resource = _Streams(self.hub)
        self.site = RelaySite(self.resource, relay="test")
        self.port = reactor.listenTCP(0, self.site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)

    async def connect(self) -> RawClient:
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port.getHost().port), client)
        self.addCleanup(lambda: client.transport.loseConnection() if client.transport.connected else None)
        return client

    async def open(self, request: bytes = GET) -> tuple[RawClient, SSEStream]:
        client = await self.connect()
        opened = self.resource.opened
        client.transport.write(request)
        stream = await opened
        await client.wait_for(http_chunk(OPEN))
        return client, stream


class LeavesTwistedWeb(HeldCase):
    async def test_request_and_channel_are_freed_at_once(self) -> None:
        # With the collector off only reference counting frees: a cycle left between the request
        # and its channel would keep both (and a frozen collector would keep them for hours).
        gc.disable()
        self.addCleanup(gc.enable)
        _, stream = await self.open()
        held = stream._held
        self.assertIsInstance(held, HeldResponse)
        self.assertIs(held.transport.protocol, held)  # type: ignore[union-attr]
        self.assertIsNone(stream.request)
        self.assertIsNone(self.resource.requests[0]())

    async def test_an_ended_held_stream_leaves_nothing_for_the_collector(self) -> None:
        # The collector policy freezes long-lived objects: a cycle left by a closed stream would
        # stay until the next full pass (docs/performance.md, "Collector policy").
        gc.disable()
        self.addCleanup(gc.enable)
        client, stream = await self.open()
        held = weakref.ref(stream._held)  # type: ignore[arg-type]
        transport = weakref.ref(stream._held.transport)  # type: ignore[union-attr]
        client.transport.loseConnection()
        await client.closed
        while not stream.closed:
            await _turns(1)
        self.resource.streams.clear()
        self.resource.ended.clear()
        del stream
        await _turns(2)  # the reactor lets go of the closed connection
        self.assertEqual((held(), transport()), (None, None))

    async def test_frames_go_out_chunk_framed(self) -> None:
        client, stream = await self.open()
        stream.write(sse_event(b"one", id=b"1"))
        stream.write(sse_event(b"two"))
        await client.wait_for(http_chunk(sse_event(b"one", id=b"1") + sse_event(b"two")))
        self.assertIn(b"transfer-encoding: chunked\r\n", client.received.lower())


class Ends(HeldCase):
    async def test_the_end_is_the_last_chunk_then_the_close_and_one_access_line(self) -> None:
        line = next_access_line(self, "/stream")
        client, stream = await self.open()
        stream.write(sse_event(b"x"))
        stream.close(b": bye\n\n")
        await client.closed
        self.assertTrue(client.received.endswith(http_chunk(sse_event(b"x") + b": bye\n\n") + b"0\r\n\r\n"))
        logged = await line
        body = len(OPEN) + len(sse_event(b"x")) + len(b": bye\n\n")
        self.assertEqual((logged["status"], logged["bytes"], logged["method"]), (200, body, "GET"))
        self.assertEqual(self.resource.ended, [stream])

    async def test_the_client_leaving_ends_the_stream_and_logs_once(self) -> None:
        line = next_access_line(self, "/stream")
        client, stream = await self.open()
        logged: list[dict[str, Any]] = []
        line.addCallback(logged.append)
        client.transport.loseConnection()
        await line
        self.assertEqual((logged[0]["status"], logged[0]["bytes"]), (200, len(OPEN)))
        self.assertTrue(stream.closed)
        self.assertEqual(self.resource.ended, [stream])
        self.assertFalse(stream.write(b"late"))

    async def test_the_access_line_names_the_forwarded_peer(self) -> None:
        self.site.trust_forwarded_for = 1
        line = next_access_line(self, "/stream")
        client, stream = await self.open(b"GET /stream HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.9\r\n\r\n")
        self.assertIsNotNone(stream._held)
        client.transport.loseConnection()
        self.assertEqual((await line)["peer"], "203.0.113.9")

    async def test_abort_drops_what_is_queued(self) -> None:
        client, stream = await self.open()
        client.transport.pauseProducing()  # reads nothing more: what follows stays queued
        stream.write(b"never sent\n\n")
        stream.abort()
        client.transport.resumeProducing()
        await client.closed
        self.assertNotIn(b"never sent", client.received)


class Backpressure(HeldCase):
    async def test_a_client_that_stops_reading_pauses_the_stream_until_it_reads(self) -> None:
        client, stream = await self.open()
        self.assertIs(stream._held.transport.producer, stream)  # type: ignore[union-attr]
        client.transport.pauseProducing()
        frame = b"data: " + b"x" * 65536 + b"\n\n"
        for _ in range(2000):  # far more than the socket buffers hold: the transport pauses us
            if stream.paused:
                break
            stream.write(frame)
            await _turns(1)
        self.assertTrue(stream.paused)
        client.transport.resumeProducing()
        while stream.paused:
            await _turns(1)
        self.assertFalse(stream.closed)


class Drain(HeldCase):
    async def test_a_held_connection_is_counted_and_closed_by_its_site(self) -> None:
        client, stream = await self.open()
        self.assertEqual(self.site.open_connections(), 1)
        self.site.close_connections()
        await client.closed
        self.assertTrue(stream.closed)
        self.assertEqual(self.site.open_connections(), 0)

    async def test_the_hub_drains_a_held_stream_with_its_final_words(self) -> None:
        client, _ = await self.open()
        self.hub.drain(b": shutdown\n\n")
        await client.closed
        self.assertTrue(client.received.endswith(http_chunk(b": shutdown\n\n") + b"0\r\n\r\n"))


class Unsolicited(HeldCase):
    async def test_bytes_up_to_the_bound_are_discarded_and_one_over_drops_the_connection(self) -> None:
        client, stream = await self.open()
        held = stream._held
        assert held is not None
        client.transport.write(b"z" * MAX_UNSOLICITED)
        while held.unsolicited < MAX_UNSOLICITED:
            await _turns(1)
        self.assertFalse(stream.closed)
        stream.write(b": still here\n\n")
        await client.wait_for(b": still here")
        client.transport.write(b"z")
        await client.closed
        self.assertTrue(stream.closed)


@expand
class StaysOnTwistedWeb(HeldCase):
    async def test_a_stream_not_held_keeps_its_connection_for_the_next_request(self) -> None:
        self.resource.held = False
        client, stream = await self.open()
        self.assertIsNone(stream._held)
        stream.close()
        await client.wait_for(b"0\r\n\r\n")
        client.transport.write(b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
        await client.wait_for(b"\r\n\r\nok")

    @cases(small=b"", over_the_split_read_bound=b"X-Pad: " + b"p" * 5000 + b"\r\n")
    async def test_a_pipelined_request_is_answered_after_the_stream(self, pad: bytes) -> None:
        # (A read over 4 KiB is handed to the parser header block first: what follows is unparsed
        # then, and must keep the stream on twisted.web as well.)
        client = await self.connect()
        opened = self.resource.opened
        client.transport.write(GET[:-2] + pad + b"\r\n" + b"GET /other HTTP/1.1\r\nHost: x\r\n\r\n")
        stream = await opened
        await client.wait_for(http_chunk(OPEN))
        self.assertIsNone(stream._held)  # the next request is in twisted.web's buffer: it stays
        stream.close()
        await client.wait_for(b"\r\n\r\nok")

    async def test_without_the_takeover_the_stream_works_through_twisted_web(self) -> None:
        self.patch(held_module, "take_over", lambda *args: False)
        client, stream = await self.open()
        self.assertIsNone(stream._held)
        self.assertIsNotNone(stream.request)
        stream.write(sse_event(b"x"))
        await client.wait_for(http_chunk(sse_event(b"x")))
        stream.close()
        await client.wait_for(b"0\r\n\r\n")
        self.assertFalse(client.closed.called)
