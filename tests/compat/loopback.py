"""Real loopback connections for the fence's tests: a server transport and its client, a twisted.web
request left open."""

from __future__ import annotations

from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Factory, Protocol
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET

from relayd.web.site import RelaySite
from tests.support.raw import RawClient

TIMEOUT = 5.0

class Server(Protocol):
    """Records its transport once connected."""

    made: Deferred[Any]

    def connectionMade(self) -> None:
        self.made.callback(self.transport)


class Held(Resource):
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


class Plain(Resource):
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
        port = self.listen(Factory.forProtocol(type("S", (Server,), {"made": made})))
        client = await self.connect(port)
        return await made.addTimeout(TIMEOUT, reactor), client

    async def held_request(self) -> tuple[Any, RawClient]:
        """A real twisted.web request left open (chunked, HTTP/1.1), and its client."""
        held = Held()
        client = await self.connect(self.listen(RelaySite(held)))
        client.transport.write(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        request = await held.arrived.addTimeout(TIMEOUT, reactor)
        await client.wait_for(b"\r\n\r\n")
        return request, client


class Watcher:
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



async def client_turn() -> None:
    """One reactor turn."""
    d: Deferred[None] = Deferred()
    reactor.callLater(0, d.callback, None)
    await d
