"""A held stream's connection once it has left twisted.web (docs/performance.md, "Memory per idle
stream").

An SSE stream can stay open for days, and once its headers are on the wire it needs nothing of
twisted.web: its frames already go straight to the TCP transport, chunk-framed by the stream
(relayd.web.streams.sse). What twisted.web keeps for it all the same (the C{Request} and the C{HTTPChannel}
with their instance dicts, the HTTP/2-capable wrapper around the channel, the request's headers) is
about 1.5 KB per connection. A stream that is held open therefore leaves twisted.web: a
L{HeldResponse} becomes the transport's protocol and the stream its producer, and the request and
its channel are freed at once.

The held response sends the stream's bytes, writes the response's end, logs the request's access
line (when it ends, as for any other request) and is counted and closed on shutdown by its site like
any other connection. Its connection is not reused: once the stream ends the connection is closed
(HTTP/1.1 lets a server close after a complete response; a client opens another). Nothing the
client sends meanwhile is read as a request: up to L{MAX_UNSOLICITED} bytes are discarded, and the
connection is dropped past that.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.interfaces import IProtocol, IPushProducer
from twisted.python.failure import Failure
from twisted.web.server import Request
from zope.interface import implementer

from relayd.compat.tcp import write_now
from relayd.compat.web import body_framing, forget_request, headers_written, read_ahead, take_over
from relayd.web.request import RelayRequest
from relayd.web.site import RelaySite

MAX_UNSOLICITED = 65536
"""Bytes a client may send on a held stream's connection before it is dropped (what it sends there
is never read: a pipelined request would wait for an answer that cannot come)."""

_LAST_CHUNK = b"0\r\n\r\n"


@implementer(IProtocol)
class HeldResponse:
    """The protocol of a connection whose streaming response has left twisted.web."""

    # Thousands sit idle per process: slots, and the access line's fields rather than the request.
    __slots__ = (
        "transport", "chunked", "sent", "unsolicited", "site", "method", "path", "status", "peer", "started",
        "__weakref__",
    )

    def __init__(self, transport: Any, request: Request, site: RelaySite) -> None:
        self.transport = transport
        self.chunked, sent = body_framing(request)
        self.sent: int | None = sent  # body bytes, as the access line counts them; None once logged
        self.unsolicited = 0
        self.site = site
        self.method: bytes = request.method
        self.path: bytes = request.path
        self.status: int = request.code
        self.peer = site.client_address(request)
        self.started = request.received_at if isinstance(request, RelayRequest) else None

    def send(self, data: bytes, framed: bytes) -> None:
        """Send body bytes C{data}, already C{framed} as the response needs (an HTTP chunk if chunked)."""
        if self.sent is not None:
            self.sent += len(data)
            write_now(self.transport, framed)

    def finish(self) -> None:
        """End the response and close the connection once what is queued is sent."""
        if self.sent is None:
            return
        if self.chunked:
            write_now(self.transport, _LAST_CHUNK)
        self._access()
        self.transport.unregisterProducer()
        self.transport.loseConnection()

    def abort(self) -> None:
        """Drop the connection without sending what is queued."""
        self.transport.abortConnection()

    def _access(self) -> None:
        sent, self.sent = self.sent, None
        if sent is not None:
            self.site.access(
                method=self.method, path=self.path, status=self.status, sent=sent, peer=self.peer, started=self.started
            )

    # IProtocol (a TCP transport calls these on whatever its protocol is)

    def makeConnection(self, transport: Any) -> None:
        """Never called: the connection was made before this became its protocol."""

    def connectionMade(self) -> None:
        """Never called (see L{makeConnection})."""

    def dataReceived(self, data: bytes) -> None:
        self.unsolicited += len(data)
        if self.unsolicited > MAX_UNSOLICITED:
            self.transport.abortConnection()

    def connectionLost(self, reason: Failure) -> None:
        # The transport has told the stream already (it is the transport's producer).
        self._access()
        self.site.held_closed(self.peer)

    def logPrefix(self) -> str:
        return "HeldResponse"


def hold(request: Request, producer: IPushProducer) -> HeldResponse | None:
    """Take C{request}'s connection out of twisted.web once its response headers are written, with
    C{producer} (the stream) as its producer; C{None}, nothing changed, if it cannot be taken: not a
    plain TCP connection of a L{RelaySite}, its producer paused, or bytes after the request in what
    was read (a pipelined request, which twisted.web answers once this one ends)."""
    channel = getattr(request, "channel", None)
    site = getattr(channel, "site", None)
    if (
        channel is None
        or not isinstance(site, RelaySite)
        or not headers_written(request)
        or request.finished
        or read_ahead(channel)
        or getattr(channel, "unparsed", 0)
    ):
        return None
    held = HeldResponse(channel.transport, request, site)
    if not take_over(channel.transport, channel, held, producer):
        return None
    forget_request(channel, request)  # (nothing else holds either once the transport has a new protocol)
    site.track(held, channel)
    return held
