"""relayd's request: its body capped, refusals decided from its headers before any body byte is read,
and one access line however it ends.

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
from typing import Any, Callable

from twisted.internet.interfaces import IAddress
from twisted.web.http import parse_qs
from twisted.web.resource import IResource
from twisted.web.server import Request, Site

from relayd.base.clock import Timekeeper
from relayd.compat.web import RequestHooks, body_framing, keeps_alive, request_line, set_body_sent
from relayd.web.admission import Admission
from relayd.web.answers import Answer, raw_response
from relayd.web.simple_post import SimplePosts
from relayd.web.target import origin_form


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
    respond: Callable[[Request], Answer]
    check: Callable[[Request], Answer | None] | None = None
    size_first: bool = False

    def too_large(self, request: Request) -> Answer:
        """The answer to C{request}'s body over the cap."""
        return self.respond(request)

    def refusal(self, request: Request, length: int | None) -> Answer | None:
        """The early answer to C{request}, whose headers are in and whose body of C{length} bytes
        (C{None}: chunked) is still to come, or C{None} to read the body."""
        if self.size_first and length is not None and length > self.max_bytes:
            return self.too_large(request)
        if self.check is not None:
            answer = self.check(request)
            if answer is not None:
                return answer
        if length is not None and length > self.max_bytes:
            return self.too_large(request)
        return None


class LimitedRequest(RequestHooks):
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
                skipped = length is not None and arrived is not None and length <= arrived() and keeps_alive(self.channel)
                self._answer_early(answer, close=not skipped)
                return
        # The cap bounds the body, so it lives in memory rather than a temporary file.
        self.content = BytesIO()

    def chunk_announced(self, size: int) -> None:
        """A chunk of C{size} bytes follows: refused at once if it would take the body over the cap."""
        limit = self._limit()
        if not self._refused and limit is not None and self._received + size > limit.max_bytes:
            self._answer_early(limit.too_large(self))

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._received += len(data)
        limit = self._limit()
        if limit is not None and self._received > limit.max_bytes:
            self._answer_early(limit.too_large(self))
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

    def _answer_early(self, answer: Answer, close: bool = True) -> None:
        """Write C{answer}; then close the connection, or drop the body (already read)."""
        self._refused = True
        self._skipped = not close
        self.content = BytesIO()
        status, body = answer.status, answer.body
        # (A Connection: close set on the request is the writer's to say, not repeated.)
        head = self.method == b"HEAD"
        transport = self.channel.transport
        if transport is not None:
            transport.write(raw_response(status, answer.headers, body, close=close, head=head))
            if close:
                transport.loseConnection()
        if head:
            body = b""
        self.answered_early(status, len(body))

    def answered_early(self, status: int, sent: int) -> None:
        """Told once an early answer of C{status} with C{sent} body bytes is written (for the log)."""


class ChannelSite(Site):
    """The site as its channels and requests see it (L{relayd.web.site.RelaySite} is the one
    implementation): its clock and deadlines, its per-client count and its access line."""

    clock: Timekeeper
    relay: str | None
    header_timeout: float | None
    body_timeout: float | None
    trust_forwarded_for: int
    max_client_connections: int
    too_many_connections: Answer
    body_limit: BodyLimit | None
    simple_posts: SimplePosts
    """Paths (and prefixes) whose plain POSTs the wing answers itself, beside twisted.web (relayd.web.simple_post)."""
    admission: Admission
    """How many new connections start per reactor turn (relayd.web.admission)."""
    health_paths: frozenset[bytes]
    """The health check's paths: answered to a crowded client, and never queued (relayd.web.admission)."""

    def shared_address(self, address: IAddress) -> IAddress:
        """One object for each local address the site's connections arrive on."""
        raise NotImplementedError

    def count_client(self, channel: Any, client: str) -> bool:
        """Count C{channel} for C{client}; C{False} when C{client} holds more than its cap."""
        raise NotImplementedError

    def count_forwarded(self, channel: Any, client: str) -> bool:
        """Count C{channel} for C{client}, its plain POST's forwarded client; C{False}, nothing
        changed, when C{client} is at its cap."""
        raise NotImplementedError

    def client_left(self, client: str) -> None:
        """One connection counted for C{client} closed."""
        raise NotImplementedError

    def client_address(self, request: Any) -> str:
        """The client's address of C{request}."""
        raise NotImplementedError

    def client_of(self, forwarded: list[bytes] | None, peer: Any) -> str:
        """The client's address from C{X-Forwarded-For} values and the (PROXY) peer."""
        raise NotImplementedError

    def access(
        self, *, method: bytes, path: bytes, status: int, sent: int, peer: str, started: float | None = None
    ) -> None:
        """Count one answered request and log its line."""
        raise NotImplementedError


class RelayRequest(LimitedRequest):
    """A request that writes one access-log line however it ends: finished, refused, upgraded to a
    WebSocket, or abandoned by the client (a consumer closing its SSE stream)."""

    _received_at: float | None = None  # on the site's clock.monotonic, once the request line is in
    _logged = False

    @property
    def received_at(self) -> float | None:
        """When the request line was in, on the site's clock (for the access line's duration)."""
        return self._received_at

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        self._received_at = _durations(self)()
        super().requestReceived(command, path, version)

    def render(self, resrc: IResource) -> None:
        super().render(resrc)
        channel = getattr(self, "channel", None)  # gone once the response has finished
        if channel is not None and channel.transport is None and not self.finished:
            self._access(101)  # a WebSocket upgrade took the connection over; no finish() will come
            # Nothing tells the site when a WebSocket ends: it leaves the per-client count now.
            site = getattr(channel, "site", None)
            if isinstance(site, ChannelSite) and getattr(channel, "client", None) is not None:
                site.client_left(channel.client)
                channel.client = None

    def connectionLost(self, reason: Any) -> None:
        if self._received_at is not None and not self.finished:
            self._access(self.code)
        super().connectionLost(reason)

    def answered_early(self, status: int, sent: int) -> None:
        self.code = status
        set_body_sent(self, sent)
        if self._received_at is None:
            self._received_at = _durations(self)()
        self._access(status)

    def _access(self, status: int) -> None:
        if self._logged:
            return
        self._logged = True
        site = getattr(getattr(self, "channel", None), "site", None)
        if isinstance(site, ChannelSite):
            site.access(
                method=self.method if isinstance(self.method, bytes) else b"-",
                path=self.path if isinstance(self.path, bytes) else b"-",
                status=status,
                sent=body_framing(self)[1],
                peer=site.client_address(self),
                started=self._received_at,
            )


def _durations(request: Any) -> Callable[[], float]:
    """The clock C{request}'s duration is measured on: its site's (outside a relayd site, which is the
    one to log it, there is nothing to measure)."""
    site = getattr(getattr(request, "channel", None), "site", None)
    return site.clock.monotonic if isinstance(site, ChannelSite) else _unmeasured


def _unmeasured() -> float:
    return 0.0


def read_body(request: Request) -> bytes:
    """The whole request body (already bounded by the site's cap)."""
    content = request.content
    if content is None:
        return b""
    content.seek(0)
    return content.read()


def host_of(address: Any) -> str:
    """The host of a peer C{address} for an access line (C{unix} for a UNIX socket's)."""
    host = getattr(address, "host", None)
    if host:
        return str(host)
    name = getattr(address, "name", None)  # a UNIX socket peer
    return "unix" if name is not None or address is None else str(address)
