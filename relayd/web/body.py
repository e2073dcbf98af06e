"""Request bodies with a byte cap that is enforced while the upload is still arriving.

A body over the cap is answered at once (the wing decides the status, headers and body) and the
connection is closed, so the client learns *why* instead of seeing a reset after uploading 16 MiB.
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO
from typing import Callable

from twisted.web.http import parse_qs
from twisted.web.server import Request

from relayd.web.twisted_internals import request_line

# (status, headers, body) of the early answer to an oversize body.
EarlyAnswer = tuple[int, list[tuple[bytes, bytes]], bytes]

_REASONS = {400: b"Bad Request", 413: b"Payload Too Large", 431: b"Request Header Fields Too Large"}


@dataclass(frozen=True)
class BodyLimit:
    """The largest body a site accepts, and how it answers a larger one."""

    max_bytes: int
    respond: Callable[[Request], EarlyAnswer]


class LimitedRequest(Request):
    """A C{Request} that buffers its body in memory up to its site's L{BodyLimit}.

    Over the cap it writes the early answer straight to the transport, closes the connection and
    never renders: the resource is not consulted for a body it could not have accepted.
    """

    _refused = False
    _received = 0
    content: BytesIO  # in memory, set by gotLength before any chunk (Request's own may be None)
    # Every response names its own type; an empty 202/404 must not claim to be text/html.
    defaultContentType = None

    def _limit(self) -> BodyLimit | None:
        site = getattr(self.channel, "site", None)
        return getattr(site, "body_limit", None)

    def gotLength(self, length: int | None) -> None:
        limit = self._limit()
        if limit is not None and length is not None and length > limit.max_bytes:
            self._refuse(limit)
            return
        # The cap bounds the body, so it lives in memory rather than a temporary file.
        self.content = BytesIO()

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._received += len(data)
        limit = self._limit()
        if limit is not None and self._received > limit.max_bytes:
            self._refuse(limit)
            return
        self.content.write(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self._refused:
            return
        super().requestReceived(command, path, version)

    def _refuse(self, limit: BodyLimit) -> None:
        self._refused = True
        self.content = BytesIO()
        channel = self.channel
        # The request line is known to the channel even though the request has not been "received":
        # split it as requestReceived would, so the early answer sees the path and the query (an
        # C{access_token}) exactly as a rendered request does.
        self.method, self.uri = request_line(channel)
        self.path, _, query = self.uri.partition(b"?")
        self.args = parse_qs(query, 1) if query else {}
        status, headers, body = limit.respond(self)
        lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Error"))]
        lines.extend(name + b": " + value for name, value in headers)
        lines.append(b"content-length: %d" % len(body))
        lines.append(b"connection: close")
        transport = channel.transport
        if transport is not None:
            transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            transport.loseConnection()


def read_body(request: Request) -> bytes:
    """The whole request body (already bounded by the site's cap)."""
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    return content.read()
