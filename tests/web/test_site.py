"""RelaySite plumbing: one access line per request without the query string, the client address from
X-Forwarded-For only when trusted, and the slowloris header deadline (timers on a task.Clock, sockets
real)."""

from __future__ import annotations

from typing import Any

import treq
from twisted.internet import reactor, task
from twisted.internet.address import IPv4Address, UNIXAddress
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.testing import EventLoggingObserver, StringTransport
from twisted.internet.threads import deferToThread
from twisted.logger import Logger, LogLevel, formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relayd.base.clock import Timekeeper
from relayd.compat import web as fence
from relayd.process.settings import HEALTH_RESERVE, SiteSettings
from relayd.web.answers import Answer
from relayd.web.request import BodyLimit
from relayd.web.site import RelaySite
from relayd.web.streams.sse import SSEHub, SSEStream
from tests.support.aep import AEPRelay, event, ndjson
from tests.support.raw import RawClient, connect_raw, exchange
from tests.support.sse import SSEClient
from tests.support.ws import WSClient

TIMEOUT = 5.0


class _Plain(Resource):
    isLeaf = True
    hub: SSEHub | None = None

    def render_GET(self, request: Any) -> Any:
        if request.path == b"/held":
            return NOT_DONE_YET  # like an SSE stream: open until the client goes
        if request.path == b"/sse" and self.hub is not None:
            SSEStream(request, self.hub).start([(b"content-type", b"text/event-stream")], b": open\n\n")
            return NOT_DONE_YET
        request.setHeader(b"content-type", b"text/plain")
        return b"hello"


def access_lines(observer: EventLoggingObserver) -> list[dict[str, Any]]:
    return [e for e in observer if e.get("log_namespace") == "relayd.access"]


def next_access_line(test: TestCase, path: str) -> Deferred[dict[str, Any]]:
    """Fires with the next access-log event for C{path}."""
    d: Deferred[dict[str, Any]] = Deferred()

    def observe(e: dict[str, Any]) -> None:
        if e.get("log_namespace") == "relayd.access" and e.get("path") == path and not d.called:
            globalLogPublisher.removeObserver(observe)
            d.callback(e)

    globalLogPublisher.addObserver(observe)
    test.addCleanup(globalLogPublisher.removeObserver, observe)
    return d.addTimeout(TIMEOUT, reactor)


class AccessLog(TestCase):
    timeout = 30

    def setUp(self) -> None:
        self.log = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.site = RelaySite(_Plain())
        self.site.relay = "test"
        self.port = reactor.listenTCP(0, self.site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)
        self.url = f"http://127.0.0.1:{self.port.getHost().port}"
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(self.pool.closeCachedConnections)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> Any:
        d = treq.get(self.url + path, headers=headers or {}, pool=self.pool)
        d.addTimeout(TIMEOUT, reactor)
        response = await d
        await treq.content(response)
        return response

    async def test_one_line_per_request_without_the_query(self) -> None:
        await self.get("/hello?access_token=s3cret&x=1")
        (line,) = access_lines(self.log)
        self.assertEqual(
            {k: line[k] for k in ("relay", "peer", "method", "path", "status", "bytes")},
            {"relay": "test", "peer": "127.0.0.1", "method": "GET", "path": "/hello", "status": 200, "bytes": 5},
        )
        self.assertIsInstance(line["duration_ms"], float)
        self.assertNotIn("s3cret", repr(line))

    async def test_forwarded_for_only_when_trusted(self) -> None:
        xff = {"X-Forwarded-For": "198.51.100.1, 203.0.113.9"}
        await self.get("/a", xff)
        self.site.trust_forwarded_for = 1
        await self.get("/b", xff)
        self.site.trust_forwarded_for = 2
        await self.get("/c", xff)
        self.site.trust_forwarded_for = 5  # fewer entries than proxies: the leftmost
        await self.get("/d", xff)
        peers = [line["peer"] for line in access_lines(self.log)]
        self.assertEqual(peers, ["127.0.0.1", "203.0.113.9", "198.51.100.1", "198.51.100.1"])

    async def test_a_request_the_client_abandons_is_logged_when_it_goes(self) -> None:
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port.getHost().port), client)
        client.transport.write(b"GET /held?token=abc HTTP/1.1\r\nHost: x\r\n\r\n")
        # the open request has no line yet; the line comes when the client leaves
        line = next_access_line(self, "/held")
        await _turns(3)
        self.assertEqual(access_lines(self.log), [])  # open: no line yet
        client.transport.loseConnection()
        self.assertEqual((await line)["status"], 200)

    async def test_a_held_stream_is_logged_with_its_forwarded_peer_when_it_ends(self) -> None:
        """A started stream keeps of its request headers what its access line reads (X-Forwarded-For)."""
        resource = self.site.resource
        resource.hub = SSEHub(Timekeeper(reactor), 3600, b": ping\n\n")
        self.addCleanup(resource.hub.stop)
        self.site.trust_forwarded_for = 1
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port.getHost().port), client)
        client.transport.write(b"GET /sse HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 203.0.113.9\r\n\r\n")
        await client.wait_for(b": open")
        (stream,) = resource.hub.streams
        self.assertEqual(stream.request.requestHeaders.getRawHeaders(b"x-forwarded-for"), [b"203.0.113.9"])
        self.assertIsNone(stream.request.requestHeaders.getRawHeaders(b"host"))  # read, and dropped
        line = next_access_line(self, "/sse")
        client.transport.loseConnection()
        self.assertEqual({k: (await line)[k] for k in ("peer", "status")}, {"peer": "203.0.113.9", "status": 200})

    async def test_access_log_can_be_turned_off(self) -> None:
        self.site.access_log = False
        await self.get("/hello")
        self.assertEqual(access_lines(self.log), [])


class AccessLogOnTheAEPRelay(TestCase):
    """Refusals written below the resource (413 early, 431) and WebSocket upgrades get lines too."""

    timeout = 30

    async def setUp(self) -> None:  # type: ignore[override]
        self.log = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.relay = await AEPRelay.start(aep_max_body=200)
        self.addCleanup(self.relay.stop)

    async def test_early_413_431_and_101(self) -> None:
        body = ndjson(*[event("S", i, data={"pad": "x" * 50}) for i in range(5)])
        r, _ = await self.relay.request(
            "POST", "/events", body, {"aep-version": "0.1", "content-type": "application/x-ndjson"}
        )
        self.assertEqual(r.code, 413)
        port = int(self.relay.url.rsplit(":", 1)[1])
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)
        client.transport.write(b"GET /stream?access_token=" + b"a" * 20000 + b" HTTP/1.1\r\n")
        await client.closed
        self.assertIn(b" 431 ", client.received)
        ws = await WSClient.connect(self.relay.ws_url + "?access_token=zzz")
        await ws.close()
        lines = [(line["method"], line["path"], line["status"]) for line in access_lines(self.log)]
        self.assertEqual(lines, [("POST", "/events", 413), ("-", "-", 431), ("GET", "/socket", 101)])
        self.assertNotIn("access_token", repr(access_lines(self.log)))

    async def test_sse_stream_line_when_the_consumer_leaves(self) -> None:
        stream = await SSEClient.connect(self.relay.url + "/stream?access_token=abc")
        await self.relay.post(event("S", 0))
        await stream.next_event()
        line = next_access_line(self, "/stream")
        await disconnect(stream)
        self.assertEqual(((await line)["status"], (await line)["bytes"] > 0), (200, True))


class AccessDurationOnTheClock(TestCase):
    """A request's duration is measured on the site's clock, which a test fixes (from time 0 on)."""

    timeout = 30

    async def test_the_duration_is_the_clock_s(self) -> None:
        fake = task.Clock()
        site = RelaySite(_Plain(), clock=Timekeeper(fake))
        port = reactor.listenTCP(0, site, interface="127.0.0.1")
        self.addCleanup(port.stopListening)
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), client)
        line = next_access_line(self, "/held")
        client.transport.write(b"GET /held HTTP/1.1\r\nHost: x\r\n\r\n")
        while not list(site._protocols) or not fence.channel_of(next(iter(site._protocols))).requests:
            await _turns(1)
        fake.advance(1.5)
        client.transport.loseConnection()
        self.assertEqual((await line)["duration_ms"], 1500.0)


class PlainAnswerDate(TestCase):
    """The answer to a plain POST is dated on the site's clock, to the second it is written in
    (formatted once per second: the first answer of each second formats it)."""

    timeout = 30

    async def test_the_date_is_the_clock_s_second_either_side_of_a_boundary(self) -> None:
        fake = task.Clock()
        tick = 1 / 1024  # (steps a float adds exactly: the boundaries are where they look)
        fake.advance(1_700_000_000 - tick)  # 2023-11-14T22:13:19.999 UTC
        site = RelaySite(_Plain(), clock=Timekeeper(fake))
        site.simple_posts[b"/events"] = lambda post: Answer(202, b"{}")
        client = await connect_raw(self, site)
        dates = []
        # Then a millisecond on (.000), to that second's end (.998, .999) and over it (a keep-alive connection).
        for step in (0, tick, 1 - 2 * tick, tick, tick):
            fake.advance(step)
            client.received = b""
            client.transport.write(b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            await client.wait_for(b"\r\n\r\n{}")
            [date] = [line for line in client.received.split(b"\r\n") if line.startswith(b"Date: ")]
            dates.append(date)
        self.assertEqual(
            dates,
            [b"Date: Tue, 14 Nov 2023 22:13:%d GMT" % second for second in (19, 20, 20, 20, 21)],
        )


class HeaderDeadline(TestCase):
    """Slowloris: header bytes trickling in do not extend the deadline (Twisted's idle timer would)."""

    timeout = 30

    def setUp(self) -> None:
        self.clock = task.Clock()
        self.site = RelaySite(_Plain(), reactor=self.clock)
        self.site.header_timeout = 20.0
        self.log = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.port = reactor.listenTCP(0, self.site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)

    async def connect(self) -> tuple[RawClient, Any]:
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port.getHost().port), client)
        while not list(self.site._protocols):
            await _turns(1)
        (protocol,) = list(self.site._protocols)
        self.addCleanup(self.close, client)
        return client, fence.channel_of(protocol)

    async def close(self, client: RawClient) -> None:
        client.transport.loseConnection()
        await client.closed.addTimeout(TIMEOUT, reactor)

    def timers(self) -> list[Any]:
        """The site's connections' pending timers (not its factory's once-a-second log date)."""
        return [c for c in self.clock.getDelayedCalls() if getattr(c.func, "__name__", "") != "_updateLogDateTime"]

    async def send(self, client: RawClient, channel: Any, data: bytes) -> None:
        """Write C{data} and wait until the server's channel has read it."""
        arrived: Deferred[None] = Deferred()
        original = channel.dataReceived

        def received(chunk: bytes) -> None:
            channel.dataReceived = original
            original(chunk)
            arrived.callback(None)

        channel.dataReceived = received
        client.transport.write(data)
        await arrived.addTimeout(TIMEOUT, reactor)

    async def test_trickled_headers_get_408_at_the_deadline(self) -> None:
        client, channel = await self.connect()
        await self.send(client, channel, b"GET /hello HTTP/1.1\r\n")
        for _ in range(4):
            self.clock.advance(4.9)  # each byte would reset an idle timer
            await self.send(client, channel, b"X")
        self.assertFalse(client.closed.called)
        self.clock.advance(1)
        await client.closed
        self.assertTrue(client.received.startswith(b"HTTP/1.1 408 "))
        self.assertEqual([e["status"] for e in access_lines(self.log)], [408])

    async def test_a_trickled_body_gets_408_at_the_body_deadline(self) -> None:
        self.site.body_timeout = 30.0
        client, channel = await self.connect()
        await self.send(client, channel, b"POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        self.clock.advance(19.9)  # the header clock has stopped: headers were in time
        for _ in range(2):
            await self.send(client, channel, b"x")
            self.clock.advance(5)
        self.assertFalse(client.closed.called)
        self.clock.advance(0.2)
        await client.closed
        self.assertTrue(client.received.startswith(b"HTTP/1.1 408 "))
        (line,) = access_lines(self.log)
        self.assertEqual((line["method"], line["path"], line["status"]), ("POST", "/hello", 408))

    async def test_a_silent_connection_gets_408_too(self) -> None:
        client, _ = await self.connect()
        self.clock.advance(20)
        await client.closed
        self.assertTrue(client.received.startswith(b"HTTP/1.1 408 "))

    async def test_a_request_in_time_then_keepalive_restarts_the_deadline(self) -> None:
        client, channel = await self.connect()
        self.clock.advance(19)
        await self.send(client, channel, b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        await client.wait_for(b"hello")
        self.clock.advance(19)  # idle keep-alive: the header clock is not running
        self.assertFalse(client.closed.called)
        await self.send(client, channel, b"GET /hello HTTP/1.1\r\n")
        self.clock.advance(19.5)
        self.assertFalse(client.closed.called)
        self.clock.advance(1)
        await client.closed
        self.assertIn(b"HTTP/1.1 408 ", client.received)

    async def test_a_connection_holds_one_timer_until_its_request_is_in(self) -> None:
        # The header clock fires before Twisted's idle timeout could: the idle timer waits until a
        # request is in, so a connection closed after one answer arms and cancels one timer, not two.
        client, channel = await self.connect()
        [header_clock] = self.timers()
        self.assertEqual(header_clock.getTime(), 20.0)
        await self.send(client, channel, b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        await client.wait_for(b"hello")
        [idle] = self.timers()  # keep-alive: now Twisted's idle timer, alone
        self.assertEqual(idle.getTime(), self.site.timeOut)

    async def test_an_idle_timeout_shorter_than_the_header_clock_runs_from_the_connection(self) -> None:
        self.site.timeOut = 5
        client, _ = await self.connect()
        self.assertEqual(sorted(c.getTime() for c in self.timers()), [5, 20.0])
        self.clock.advance(5.1)
        await client.closed.addTimeout(TIMEOUT, reactor)
        self.assertEqual(client.received, b"")  # Twisted's idle close, as ever: no 408

    async def test_a_body_without_a_deadline_waits_at_most_the_idle_timeout(self) -> None:
        self.site.body_timeout = None
        client, channel = await self.connect()
        await self.send(client, channel, b"POST /hello HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        self.clock.advance(self.site.timeOut - 1)
        self.assertFalse(client.closed.called)
        self.clock.advance(2)
        await client.closed.addTimeout(TIMEOUT, reactor)

    async def test_a_plain_post_answered_within_its_read_arms_no_header_clock(self) -> None:
        self.site.simple_posts[b"/events"] = lambda post: Answer(202, b"{}")
        request = b"POST /events HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n%s\r\n{}"
        armed: list[float] = []
        deadline = self.site.clock.deadline
        self.site.clock.deadline = lambda delay, *a: (armed.append(delay), deadline(delay, *a))[1]  # type: ignore[method-assign]
        client, channel = await self.connect()
        await self.send(client, channel, request % b"")
        await client.wait_for(b"{}")
        client.received = b""
        await self.send(client, channel, request % b"")
        await client.wait_for(b"{}")
        self.assertEqual(armed, [20.0])  # the connection's: none for a request answered within its read
        [idle] = self.timers()  # keep-alive: the idle timer only
        self.assertEqual(idle.getTime(), self.site.timeOut)
        self.clock.advance(10)
        await self.send(client, channel, b"POST /events HTTP/1.1\r\n")  # a head begun: its clock starts now
        self.clock.advance(19.9)
        self.assertFalse(client.closed.called)
        self.clock.advance(0.2)
        await client.closed.addTimeout(TIMEOUT, reactor)
        self.assertIn(b"HTTP/1.1 408 ", client.received)
        other, channel = await self.connect_another()
        await self.send(other, channel, request % b"Connection: close\r\n")
        await other.closed.addTimeout(TIMEOUT, reactor)
        self.assertIn(b"HTTP/1.1 202 Accepted", other.received)
        self.assertEqual(self.timers(), [])  # its one timer cancelled, none armed after

    async def connect_another(self) -> tuple[RawClient, Any]:
        known = set(self.site._protocols)
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port.getHost().port), client)
        while not set(self.site._protocols) - known:
            await _turns(1)
        (protocol,) = set(self.site._protocols) - known
        self.addCleanup(self.close, client)
        return client, fence.channel_of(protocol)

    async def test_an_idle_keepalive_connection_is_closed_at_the_idle_timeout(self) -> None:
        """Twisted's idle timeout runs on the site's clock (one scheduler shared by every connection)."""
        client, channel = await self.connect()
        await self.send(client, channel, b"GET /hello HTTP/1.1\r\nHost: x\r\n\r\n")
        await client.wait_for(b"hello")
        self.clock.advance(self.site.timeOut - 1)
        self.assertFalse(client.closed.called)
        self.clock.advance(2)
        await client.closed.addTimeout(TIMEOUT, reactor)
        self.assertEqual(client.received.count(b"HTTP/1.1 "), 1)  # closed, not answered


async def disconnect(stream: SSEClient) -> None:
    """Drop an SSE client's connection (the consumer goes away) and wait for its end."""
    response = stream.response
    transport = getattr(getattr(response, "original", response), "_transport", None)
    if transport is not None and not stream.ended.called:
        transport.stopProducing()
    await stream.ended


async def _turns(n: int) -> None:
    """Let the reactor run C{n} iterations (I/O already in flight is processed)."""
    for _ in range(n):
        d: Deferred[None] = Deferred()
        reactor.callLater(0, d.callback, None)
        await d


class AccessEventAsTwistedBuildsIt(TestCase):
    """The access line's event has the keys C{Logger.emit} gives an info event (the site builds it
    without emit's level check), its time the site's clock's."""

    def test_the_event_is_an_info_event_at_the_clocks_time(self) -> None:
        log = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        fake = task.Clock()
        fake.advance(1764460800.25)
        site = RelaySite(_Plain(), clock=Timekeeper(fake), relay="test")
        for _ in range(2):  # (the second from the loggable text kept)
            site.access(method=b"POST", path=b"/events?x=1", status=202, sent=11, peer="192.0.2.1", started=fake.seconds())
        first, second = access_lines(log)
        self.assertEqual(first["access_line"], second["access_line"])
        self.assertIs(first["log_level"], LogLevel.info)
        self.assertEqual(first["log_namespace"], "relayd.access")
        self.assertEqual(first["log_format"], "{access_line}")
        self.assertIsNone(first["log_source"])
        self.assertIsInstance(first["log_logger"], Logger)
        self.assertEqual(first["log_time"], 1764460800.25)
        self.assertEqual(formatEvent(first), 'test 192.0.2.1 "POST /events" 202 11')
        self.assertEqual((first["method"], first["path"], first["status"], first["bytes"], first["duration_ms"]),
                         ("POST", "/events", 202, 11, 0.0))


class AccessLineEscaping(TestCase):
    """No byte a client chooses can break an access line or forge another (a raw DEL or a quote in
    the path)."""

    def setUp(self) -> None:
        self.log = EventLoggingObserver.createWithCleanup(self, globalLogPublisher)
        self.site = RelaySite(_Plain())
        self.site.relay = "test"
        self.port = reactor.listenTCP(0, self.site, interface="127.0.0.1")
        self.addCleanup(self.port.stopListening)

    async def test_unsafe_bytes_are_percent_encoded(self) -> None:
        port = self.port.getHost().port
        for target, logged in (
            (b"/a\x7fb", "/a%7Fb"),
            (b'/q"uote', "/q%22uote"),
            (b"/plain/%0A", "/plain/%0A"),
        ):
            await deferToThread(exchange, port, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            self.assertEqual(access_lines(self.log)[-1]["path"], logged)
            self.assertNotIn("\n", access_lines(self.log)[-1]["access_line"])


class _Bodies(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    def render_POST(self, request: Any) -> bytes:
        self.bodies.append(request.content.read())
        return b"ok"


class HeadersThenBody(TestCase):
    """A read holding a header block and more is parsed in two parts (RelayChannel._read): Twisted's
    line reader would copy the body once per header line."""

    def setUp(self) -> None:
        self.resource = _Bodies()
        self.site = RelaySite(
            self.resource, body_limit=BodyLimit(100_000, lambda request: Answer(413, b"too large")), reactor=task.Clock()
        )
        self.transport = StringTransport()
        self.protocol = self.site.buildProtocol(self.transport.getPeer())
        self.protocol.makeConnection(self.transport)
        self.reads: list[bytes] = []
        original = fence.ChannelHooks.dataReceived

        def recorded(channel: Any, data: bytes) -> None:
            self.reads.append(data)
            original(channel, data)

        self.patch(fence.ChannelHooks, "dataReceived", recorded)

    @staticmethod
    def post(body: bytes) -> bytes:
        return b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    def test_the_header_block_goes_to_the_parser_alone_then_the_body(self) -> None:
        body = b"x" * 5000
        self.protocol.dataReceived(self.post(body) + self.post(b"second"))
        self.assertEqual(self.reads[:2], [self.post(body)[: -len(body)], body + self.post(b"second")])
        self.assertEqual(self.resource.bodies, [body, b"second"])

    def test_a_read_at_the_bound_is_parsed_whole(self) -> None:
        head = len(self.post(b"")) - 1  # the headers without the length's digits (one digit: "0")
        data = self.post(b"x" * (4096 - head - 4))  # a four-digit length
        self.assertEqual(len(data), 4096)
        self.protocol.dataReceived(data)
        self.assertEqual(self.reads[0], data)
        self.assertEqual(len(self.resource.bodies[0]), 4096 - head - 4)

    def test_nothing_after_a_refusal_of_the_headers_is_read(self) -> None:
        refused = b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n"
        self.protocol.dataReceived(refused + b"x" * 5000 + self.post(b"next"))
        self.assertEqual(self.reads, [refused])
        self.assertTrue(self.transport.value().startswith(b"HTTP/1.1 413"))
        self.assertEqual(self.resource.bodies, [])


class ClientCap(TestCase):
    """The per-client connection cap as connections arrive (tests/hostile/test_framing.py attacks a
    real relayd with it)."""

    def _connect(self, site: RelaySite, peer: Any) -> StringTransport:
        transport = StringTransport(peerAddress=peer)
        site.buildProtocol(peer).makeConnection(transport)
        return transport

    def test_the_cap_and_its_reserve_then_refused_at_once(self) -> None:
        site = RelaySite(_Plain(), settings=SiteSettings(max_client_connections=2), reactor=task.Clock())
        peers = [IPv4Address("TCP", "192.0.2.1", 40000 + i) for i in range(2 + HEALTH_RESERVE + 1)]
        answers = [self._connect(site, peer).value() for peer in peers]
        self.assertEqual(answers[:-1], [b""] * (2 + HEALTH_RESERVE))  # counted, nothing said yet
        self.assertTrue(answers[-1].startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answers[-1])
        self.assertEqual(self._connect(site, IPv4Address("TCP", "192.0.2.2", 40000)).value(), b"")  # another client

    def test_unix_socket_peers_are_not_counted(self) -> None:
        # Their peers have no address to tell them apart (a local proxy's): one cap for all would be wrong.
        site = RelaySite(_Plain(), settings=SiteSettings(max_client_connections=1), reactor=task.Clock())
        self.assertEqual([self._connect(site, UNIXAddress(None)).value() for _ in range(10)], [b""] * 10)
