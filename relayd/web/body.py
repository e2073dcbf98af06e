"""Request bodies with a byte cap, and refusals decided from the headers, before any body byte is read.

At the end of a request's headers, if a body follows, the site's L{BodyLimit} is asked whether the
headers alone refuse it (the wing's C{check}: its auth wall, an unknown route or method, a media
type it does not take) or its declared size does (over C{max_bytes}, a C{Content-Length} or a
chunk size). A refusal is answered at once (the wing decides the status, headers and body) and the
connection closed (unless the body came whole with the headers: it is dropped and the connection
kept), so a client learns *why* instead of seeing a reset after uploading 16 MiB, and an
unauthenticated client cannot make relayd buffer bodies.
"""

from __future__ import annotations

from dataclasses import dataclass
from io import BytesIO
from typing import Callable

from twisted.web.http import RESPONSES, parse_qs
from twisted.web.server import Request

from relayd.web.target import origin_form
from relayd.web.twisted_internals import request_line

# (status, headers, body) of an early answer.
EarlyAnswer = tuple[int, list[tuple[bytes, bytes]], bytes]
_FRAMING = frozenset((b"connection", b"content-length"))
# twisted.web's reason phrases, but RFC 7231's for 413 (Twisted still says "Request Entity").
_REASONS = {**RESPONSES, 413: b"Payload Too Large"}


@dataclass(frozen=True)
class BodyLimit:
    """The largest body a site accepts, how it answers a larger one, and what it refuses from the
    headers alone.

    @ivar max_bytes: the cap.
    @ivar respond: the answer to a body over the cap.
    @ivar check: the answer to a request the headers already refuse, or C{None} to read its body;
        asked at the end of the headers of every request a body follows, before the size unless
        C{size_first} (the wing's reference checks the size first).
    """

    max_bytes: int
    respond: Callable[[Request], EarlyAnswer]
    check: Callable[[Request], EarlyAnswer | None] | None = None
    size_first: bool = False

    def refusal(self, request: Request, length: int | None) -> EarlyAnswer | None:
        """The early answer to C{request}, whose headers are in and whose body of C{length} bytes
        (C{None}: chunked) is still to come, or C{None} to read the body."""
        if self.size_first and length is not None and length > self.max_bytes:
            return self.respond(request)
        if self.check is not None:
            answer = self.check(request)
            if answer is not None:
                return answer
        if length is not None and length > self.max_bytes:
            return self.respond(request)
        return None


class LimitedRequest(Request):
    """A C{Request} that buffers its body in memory up to its site's L{BodyLimit}.

    Refused (L{BodyLimit.refusal}, a chunk that would take the body over the cap, or bytes over
    it) it writes the early answer straight to the transport, closes the connection (or drops a
    body that came whole with the headers) and never renders: the resource is not consulted for a
    body it could not have accepted.

    An absolute-form target (C{http://host/path}, RFC 9112 3.2.2) is served as its path, with its
    authority as the C{Host} (the received C{Host} is ignored, as the RFC requires).
    """

    _refused = False
    _skipped = False  # refused, its body (already read) dropped, the connection kept
    _received = 0
    content: BytesIO  # in memory, set by gotLength before any chunk (Request's own may be None)
    # Every response names its own type; an empty 202/404 must not claim to be text/html.
    defaultContentType = None

    @property
    def refused(self) -> bool:
        """Whether the request was answered early (its body is not read)."""
        return self._refused

    def _limit(self) -> BodyLimit | None:
        site = getattr(self.channel, "site", None)
        return getattr(site, "body_limit", None)

    def gotLength(self, length: int | None) -> None:
        limit = self._limit()
        if limit is not None and length != 0:  # a body follows
            self._read_target()
            answer = limit.refusal(self, length)
            if answer is not None:
                # A body that came with its headers (small pipelined POSTs) is skipped and the
                # connection kept; one still to come is not waited for: the connection closes.
                arrived = getattr(self.channel, "body_arrived", None)
                skipped = length is not None and arrived is not None and length <= arrived() and self.channel.persistent
                self._answer_early(answer, close=not skipped)
                return
        # The cap bounds the body, so it lives in memory rather than a temporary file.
        self.content = BytesIO()

    def chunk_announced(self, size: int) -> None:
        """A chunk of C{size} bytes follows: refused at once if it would take the body over the cap."""
        limit = self._limit()
        if not self._refused and limit is not None and self._received + size > limit.max_bytes:
            self._answer_early(limit.respond(self))

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._received += len(data)
        limit = self._limit()
        if limit is not None and self._received > limit.max_bytes:
            self._answer_early(limit.respond(self))
            return
        self.content.write(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if self._refused:
            if self._skipped:  # answered: the channel reads the next request
                self.finished = True
                self.channel.requestDone(self)
            return
        path, authority = origin_form(path)
        if authority is not None:
            self.requestHeaders.setRawHeaders(b"host", [authority])
        super().requestReceived(command, path, version)

    def _read_target(self) -> None:
        """Split the request line as requestReceived will, before the request is "received": the
        early answer sees the method, the path and the query (an C{access_token}) and the C{Host}
        exactly as a rendered request does."""
        self.method, target = request_line(self.channel)
        self.uri, authority = origin_form(target)
        if authority is not None:
            self.requestHeaders.setRawHeaders(b"host", [authority])
        self.path, _, query = self.uri.partition(b"?")
        self.args = parse_qs(query, 1) if query else {}

    def _answer_early(self, answer: EarlyAnswer, close: bool = True) -> None:
        """Write C{answer}; then close the connection, or drop the body (already read)."""
        self._refused = True
        self._skipped = not close
        self.content = BytesIO()
        status, headers, body = answer
        lines = [b"HTTP/1.1 %d %s" % (status, _REASONS.get(status, b"Unknown Status"))]
        # (The framing headers are this writer's: a Connection: close set on the request is not repeated.)
        lines.extend(name + b": " + value for name, value in headers if name.lower() not in _FRAMING)
        lines.append(b"content-length: %d" % len(body))
        if close:
            lines.append(b"connection: close")
        transport = self.channel.transport
        if self.method == b"HEAD":
            body = b""
        if transport is not None:
            transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            if close:
                transport.loseConnection()
        self.answered_early(status, len(body))

    def answered_early(self, status: int, sent: int) -> None:
        """Told once an early answer of C{status} with C{sent} body bytes is written (for the log)."""


def read_body(request: Request) -> bytes:
    """The whole request body (already bounded by the site's cap)."""
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    return content.read()
