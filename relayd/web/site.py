"""A C{Site} that caps bodies, times out slow headers, logs requests without query strings, and can
close what it served."""

from __future__ import annotations

import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.internet.interfaces import IAddress, IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web import resource as _resource
from twisted.web import server as _server
from twisted.web.http import RESPONSES, datetimeToString
from twisted.web.resource import IResource, Resource
from twisted.web.server import Site

from relayd import metrics
from relayd.clock import Timekeeper
from relayd.logging import ACCESS_NAMESPACE, SCRUBBED_MARK
from relayd.reactor import installed
from relayd.web.body import BodyLimit, EarlyAnswer, LimitedRequest
from relayd.web.simple_post import SimplePost, read_simple_post
from relayd.web.transport import hold_writes, release_writes
from relayd.web.twisted_internals import (
    ChannelHooks,
    allowed_methods,
    between_requests,
    channel_of,
    channel_protocol,
    held_line,
    request_line,
)

MAX_HEADER_BYTES = 16384
"""The request line and header block together (Twisted's C{totalHeadersSize}); C{431} beyond."""
MAX_HEADER_FIELDS = 500
"""Header fields in one request (Twisted's C{maxHeaders}); C{431} beyond."""
# Answers written by the channel itself, before (or instead of) any request reaching a resource.
_BAD_REQUEST = (400, b"Bad Request", b'{"error":"bad_request"}')
_HEADERS_TOO_LARGE = (
    431,
    b"Request Header Fields Too Large",
    b'{"error":"header_fields_too_large","max_bytes":%d,"max_fields":%d}' % (MAX_HEADER_BYTES, MAX_HEADER_FIELDS),
)
_REQUEST_TIMEOUT = (408, b"Request Timeout", b'{"error":"request_timeout"}')
_BARE_LINE_FEED = (
    400, b"Bad Request", b'{"error":"bad_request","reason":"every line of the request line and headers must end with CRLF"}'
)
# A Content-Length with more digits than this is larger than any body cap; Python's int() refuses
# over 4300 digits, which Twisted's parser does not expect (an unhandled ValueError, no answer).
_LENGTH_DIGITS = 18
# A read longer than this that holds a header block and more is parsed in two parts (RelayChannel._read).
_SPLIT_READS_OVER = 4096
DEFAULT_HEADER_TIMEOUT = 20.0
DEFAULT_MAX_CLIENT_CONNECTIONS = 256
HEALTH_RESERVE = 4
"""Connections a client may open beyond its cap that answer only the health check (503 otherwise)."""
DEFAULT_BODY_TIMEOUT = 60.0
DEFAULT_IDLE_TIMEOUT = 60.0
_MAX_SHARED_ADDRESSES = 64
# A module-level logger: a Logger class attribute would take the class's name as its namespace.
_access_log = Logger(namespace=ACCESS_NAMESPACE)
_log = Logger()


class RelayChannel(ChannelHooks):
    """An C{HTTPChannel} whose refusals are complete answers a client can read.

    A request line and header block over L{MAX_HEADER_BYTES}, or over L{MAX_HEADER_FIELDS} fields,
    get C{431} (Twisted would drop the connection without a word, a line over C{MAX_LENGTH}, or
    answer C{400}): a client that bounds long query strings (the AEP SDK's C{from} budget) needs a
    4xx it can read. Every other malformed request gets C{400}; a slow one C{408}. Each has a JSON
    body, a length and C{connection: close}, and an access line.

    Pipelined requests are parsed one at a time while their answers can be sent: once the
    transport's buffer is full (the client reads nothing) the next one waits until it drains.
    """

    maxHeaders = MAX_HEADER_FIELDS
    totalHeadersSize = MAX_HEADER_BYTES
    length_digits = _LENGTH_DIGITS
    _header_call: IDelayedCall | None = None
    _host: Any = None
    # The site's clock and its header and body timeouts, read once per connection (a channel
    # outside a RelaySite has no clock, so no deadlines).
    _deadlines: tuple[Timekeeper, float | None, float | None] | None = None
    # The RelaySite, found once by connectionMade, through which getHost shares the local address.
    # Twisted builds requests (which ask getHost) only once connected; before that, or outside a
    # RelaySite, getHost answers the plain address.
    _relay_site: RelaySite | None = None
    client: str | None = None
    """The client this connection is counted for under the site's per-client cap (None: not counted)."""
    crowded = False
    """Whether the connection is one of its client's L{HEALTH_RESERVE}: it answers the health check only."""
    simple_waiting: list[bytes] | None = None
    """What the client sent while the answer to its plain POST is awaited (L{_answer_simple})."""
    reading = False
    """Whether a read is being parsed (what a request answered within it replays is parsed by it)."""
    unparsed = 0
    """Bytes of the read being handled that the parser has not been handed yet (what follows a
    header block, L{_read}): a stream must not take the connection over from under them."""

    def getHost(self) -> Any:
        # Twisted asks the socket (a system call) for every request; the local address of a
        # connection never changes, and is one of the few the site listens on (one object for all
        # its connections: 96 B less per held connection).
        host = self._host
        if host is None:
            host = super().getHost()
            site = self._relay_site
            if site is not None:
                host = site.shared_address(host)
            self._host = host
        return host

    def lineLengthExceeded(self, line: bytes) -> None:
        self._refuse(_HEADERS_TOO_LARGE)

    # Slowloris: Twisted's idle timeout restarts with every byte, so a client trickling a header
    # byte at a time would hold the connection forever. The request line and headers must all
    # arrive within the site's header_timeout of their first byte (or of the connection), and a
    # body within its body_timeout of the end of the headers (the slow-POST variant).

    def connectionMade(self) -> None:
        super().connectionMade()
        site = getattr(self, "site", None)
        if isinstance(site, RelaySite):
            self._relay_site = site
            self._deadlines = (site.clock, site.header_timeout, site.body_timeout)
            # (Behind trusted proxies the client is known from each request's headers: getResourceFor.
            # A UNIX socket's peers have no address to tell them apart: not counted.)
            if site.max_client_connections and not site.trust_forwarded_for and self.transport is not None:
                host = getattr(self.transport.getPeer(), "host", None)
                if host and not site.count_client(self, str(host)):
                    self._refuse(site.too_many_connections)
                    return
        self._start_header_clock()

    def dataReceived(self, data: bytes) -> None:
        if self._header_call is None and self.line_mode:
            self._start_header_clock()
        if self.reading:  # a request answered within the read replays what followed it
            self._read(data)
            return
        transport = self.transport
        held = hold_writes(transport)
        self.reading = True
        try:
            self._read(data)
            # A line the reader holds unsplit once a read is parsed holds no CRLF: a line feed there
            # is a bare one, after which the client waits for an answer that would come only with
            # the header timeout.
            if self.line_mode and not self.paused and b"\n" in held_line(self) and _open(self.transport):
                self._refuse(_BARE_LINE_FEED)
        finally:
            del self.reading
            if held:
                release_writes(transport)

    def _read(self, data: bytes) -> None:
        waiting = self.simple_waiting
        if waiting is not None:  # a plain POST's answer is awaited: what follows it waits for it
            waiting.append(data)
            return
        site = self._relay_site
        if site is not None and site.simple_posts and data.startswith(b"POST ") and between_requests(self):
            if self._answer_simple(site, data):
                return
        # Twisted's line reader copies what follows each line it splits off, so a POST whose
        # headers and body arrive in one read had its body copied once per header line (a 50 KB
        # NDJSON batch about ten times). The header block goes first, then the rest: the parser
        # sees the bytes as if they had come in two reads.
        if self.line_mode and len(data) > _SPLIT_READS_OVER:
            end = data.find(b"\r\n\r\n", 0, MAX_HEADER_BYTES + 4) + 4
            if 4 <= end < len(data):
                self.unparsed = len(data) - end
                try:
                    super().dataReceived(data[:end])
                finally:
                    del self.unparsed
                transport = self.transport
                if transport is None or getattr(transport, "disconnecting", False):
                    return  # answered and closing: nothing more is read (as within one read)
                data = data[end:]
        super().dataReceived(data)

    def _answer_simple(self, site: RelaySite, data: bytes) -> bool:
        """Answer the plain POST that C{data} is, if the wing whose path it names takes it
        (L{RelaySite.simple_posts}); C{False}, with nothing done, for twisted.web to read it. Its
        client is read as twisted.web's path reads it (L{RelaySite.client_of}); a wing whose store
        answers later answers with a C{Deferred}, and what the client sends meanwhile waits."""
        post = read_simple_post(
            data,
            site.simple_posts,
            max_header_bytes=self.totalHeadersSize,
            max_fields=self.maxHeaders,
            max_length_digits=self.length_digits,
        )
        if post is None:
            return False
        forwarded = post.headers.get(b"x-forwarded-for")
        peer = site.client_of(None if forwarded is None else [forwarded], self.getPeer())
        if site.max_client_connections and (self.crowded or (site.trust_forwarded_for and peer != self.client)):
            return False  # (twisted.web's path counts a proxied client anew, and answers the crowded 503)
        started = site.clock.monotonic()
        try:
            answer = site.simple_posts[post.path](post)
        except Exception:
            # twisted.web's path then answers it (with its 500 if the fault is there too).
            _log.failure("a simple POST handler failed; the request goes to twisted.web")
            return False
        if answer is None:
            return False
        self._stop_header_clock()
        self.resetTimeout()
        if isinstance(answer, Deferred):
            self.simple_waiting = []
            self.transport.pauseProducing()  # type: ignore[union-attr]
            answer.addCallback(self._write_simple, site, post, peer, started).addErrback(self._simple_failed)
            return True
        self._write_simple(answer, site, post, peer, started)
        return True

    def _write_simple(self, answer: EarlyAnswer, site: RelaySite, post: SimplePost, peer: str, started: float) -> None:
        """Write the answer to a plain POST as twisted.web writes the same answer: its status line,
        C{Connection: close} if it closes an HTTP/1.1 connection, Server and Date, the answer's
        headers with their names capitalised as it does, the length; then close the connection, or
        read what the client sent while the answer was awaited."""
        waiting, self.simple_waiting = self.simple_waiting, None
        transport = self.transport
        if transport is None or not getattr(transport, "connected", False):
            return  # (the client left while the store wrote)
        status, headers, body = answer
        head = [b"%s %d %s\r\n" % (post.version, status, RESPONSES.get(status, b"Unknown Status"))]
        if post.close and post.version == b"HTTP/1.1":
            head.append(b"Connection: close\r\n")
        head.append(b"Server: %s\r\nDate: %s\r\n" % (_server.version, datetimeToString()))
        head += [b"%s: %s\r\n" % (_capitalised(name), value) for name, value in headers]
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        transport.write(b"".join(head) + body)
        site.access(method=b"POST", path=post.path, status=status, sent=len(body), peer=peer, started=started)
        if post.close:
            transport.loseConnection()
        elif waiting is not None:
            transport.resumeProducing()  # type: ignore[attr-defined]
            if waiting:
                self.dataReceived(b"".join(waiting))

    def _simple_failed(self, failure: Failure) -> None:
        # (The wing answers every refusal of its own; this is a bug, and nothing can be answered.)
        _log.failure("a simple POST's answer failed; the connection is dropped", failure)
        self.simple_waiting = None
        if self.transport is not None:
            self.transport.abortConnection()  # type: ignore[attr-defined]

    def body_arrived(self) -> int:
        """Bytes of the read being handled that follow the header block just parsed (a body that
        came whole with its headers is among them)."""
        return len(held_line(self)) + self.unparsed

    def lineReceived(self, line: bytes) -> None:
        if b"\n" in line:
            self._refuse(_BARE_LINE_FEED)
            return
        super().lineReceived(line)

    def chunk_size(self, size: int) -> None:
        request = self.requests[-1] if self.requests else None
        if isinstance(request, LimitedRequest):
            request.chunk_announced(size)

    def send_continue(self) -> None:
        request = self.requests[-1] if self.requests else None
        if not getattr(request, "refused", False):  # answered early: the client must not send its body
            super().send_continue()

    def allHeadersReceived(self) -> None:
        self._stop_header_clock()
        deadlines = self._deadlines
        if self.length != 0 and deadlines is not None and deadlines[2]:  # a body follows (a length, or chunked)
            self._header_call = deadlines[0].deadline(deadlines[2], self._request_too_slow)
        super().allHeadersReceived()

    def allContentReceived(self) -> None:
        self._stop_header_clock()
        super().allContentReceived()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_header_clock()
        site = self._relay_site
        if self.client is not None and site is not None:
            site.client_left(self.client)
            del self.client
        super().connectionLost(reason)

    def _start_header_clock(self) -> None:
        """Answer 408 unless the request line and headers arrive within the site's header timeout."""
        deadlines = self._deadlines
        if deadlines is not None and deadlines[1]:
            self._header_call = deadlines[0].deadline(deadlines[1], self._request_too_slow)

    def _stop_header_clock(self) -> None:
        call, self._header_call = self._header_call, None
        if call is not None and call.active():
            call.cancel()

    def _request_too_slow(self) -> None:
        self._header_call = None
        self._refuse(_REQUEST_TIMEOUT)

    def _access_log(self, status: int, sent: int) -> None:
        site = getattr(self, "site", None)
        if isinstance(site, RelaySite) and self.transport is not None:
            peer = _host_of(self.transport.getPeer())
            method, path = request_line(self)
            site.access(method=method or b"-", path=_strip_query(path or b"-"), status=status, sent=sent, peer=peer)

    def headers_too_large(self) -> None:
        self._refuse(_HEADERS_TOO_LARGE)

    def length_header(self, header: bytes, data: bytes) -> bytes:
        if len(data) > _LENGTH_DIGITS and header.lower() == b"content-length" and data.isdigit():
            data = data.lstrip(b"0") or b"0"
            if len(data) > _LENGTH_DIGITS:
                data = b"9" * _LENGTH_DIGITS  # over every body cap: the site's BodyLimit answers
        return data

    def bad_request(self) -> None:
        # Twisted writes a bare status line (no length, no connection: close, no access line).
        self._refuse(_BAD_REQUEST)

    def _refuse(self, answer: tuple[int, bytes, bytes]) -> None:
        """Answer the request being read with C{answer} and close: nothing more is read."""
        status, reason, body = answer
        self._stop_header_clock()
        length = len(body)
        if request_line(self)[0] == b"HEAD":
            body = b""  # a HEAD answer announces the length of the body it does not send
        self._access_log(status, len(body))
        if self.transport is not None:
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, reason, length, body)
            )
        self.loseConnection()

    # Pipelining: Twisted parses the next request as soon as one is answered, all of one read in a
    # loop; a client that never reads could have any number of large answers rendered and buffered
    # from one small read. Once the transport asks us to pause, the rest waits for its resume.

    def requestDone(self, request: Any) -> None:
        if self.persistent and self.waiting_for_transport():
            self.paused = True  # LineReceiver: keep what is buffered, parse nothing more
            self.stop_reading()  # and read nothing more meanwhile
        super().requestDone(request)

    def resumeProducing(self) -> None:
        super().resumeProducing()
        if self.paused and not self.waiting_for_transport() and self.transport is not None:
            self.paused = False
            self.dataReceived(b"")  # parse the held requests now that answers can flow


class RelayRequest(LimitedRequest):
    """A request that writes one access-log line however it ends: finished, refused, upgraded to a
    WebSocket, or abandoned by the client (a consumer closing its SSE stream)."""

    _received_at: float | None = None  # on the site's clock.monotonic, once the request line is in
    _logged = False
    # What Request.__init__ sets on every relayd request (RelaySite parses no forms; the channel
    # passes the deprecated queued as len(requests), 0 unless pipelined), as class values too: a
    # streaming request's dict then leaves those entries out (relayd.web.slim), and reading them
    # answers the same object.
    queued = 0
    _parsePOSTFormSubmission = False

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
            if isinstance(site, RelaySite) and getattr(channel, "client", None) is not None:
                site.client_left(channel.client)
                channel.client = None

    def connectionLost(self, reason: Any) -> None:
        if self._received_at is not None and not self.finished:
            self._access(self.code)
        super().connectionLost(reason)

    def answered_early(self, status: int, sent: int) -> None:
        self.code = status
        self.sentLength = sent
        if self._received_at is None:
            self._received_at = _durations(self)()
        self._access(status)

    def _access(self, status: int) -> None:
        if self._logged:
            return
        self._logged = True
        site = getattr(getattr(self, "channel", None), "site", None)
        if isinstance(site, RelaySite):
            site.access(
                method=self.method if isinstance(self.method, bytes) else b"-",
                path=self.path if isinstance(self.path, bytes) else b"-",
                status=status,
                sent=self.sentLength,
                peer=site.client_address(self),
                started=self._received_at,
            )


class JSONError(Resource):
    """A site-level error in JSON: what Twisted's HTML error pages and its C{501} for an unknown
    method become (every relayd answer is JSON; a 5xx would say relayd failed)."""

    isLeaf = True

    def __init__(
        self, status: int, error: str, allow: bytes | None = None, body: bytes | None = None, close: bool = False
    ) -> None:
        super().__init__()
        self.status = status
        self.body = body if body is not None else b'{"error":"%s"}' % error.encode("ascii")
        self.allow = allow
        self.close = close

    def render(self, request: Any) -> bytes:
        request.setResponseCode(self.status)
        if self.close:
            request.setHeader(b"connection", b"close")
            request.channel.persistent = False  # (twisted.web then closes once it is sent)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"%d" % len(self.body))
        if self.allow is not None:
            request.setHeader(b"allow", self.allow)
        return b"" if request.method == b"HEAD" else self.body


_NOT_FOUND = JSONError(404, "not_found")
# Twisted's error-page resources (NoResource from a traversal that found nothing, ...): public
# aliases of its private classes.
_TWISTED_ERROR_PAGES = (_resource.ErrorPage, _resource.NoResource, _resource.ForbiddenResource)
_ERROR_NAMES = {403: "forbidden", 404: "not_found"}
_METHOD_ORDER = {b"GET": 0, b"HEAD": 1, b"POST": 2, b"PUT": 3, b"PATCH": 4, b"DELETE": 5}


def _json_answer(found: Any, method: bytes) -> IResource | None:
    """The JSON error that replaces Twisted's own answer to C{method} on C{found}, if any."""
    if isinstance(found, _TWISTED_ERROR_PAGES):
        code = getattr(found, "code", 404)
        return _NOT_FOUND if code == 404 else JSONError(code, _ERROR_NAMES.get(code, "error"))
    if type(found).render is not Resource.render:
        return None  # the resource dispatches methods itself
    if _renders(found, method.decode("ascii", "replace")):
        return None
    allowed: set[bytes] = {m for m in allowed_methods(found) if _renders(found, m.decode("ascii"))}
    if not allowed:
        return _NOT_FOUND  # an inner node of the tree (/v1): nothing is served there
    if b"GET" in allowed:
        allowed.add(b"HEAD")
    ordered: list[bytes] = sorted(allowed, key=_method_rank)
    return JSONError(405, "method_not_allowed", allow=b", ".join(ordered))


def _method_rank(method: bytes) -> tuple[int, bytes]:
    return _METHOD_ORDER.get(method, 9), method


def _renders(found: Any, method: str) -> bool:
    """Whether C{found} answers C{method}: Resource's own C{render_HEAD} is C{render_GET}'s."""
    if method == "HEAD" and getattr(type(found), "render_HEAD", None) is Resource.render_HEAD:
        method = "GET"
    return getattr(found, "render_" + method, None) is not None


def _relay_channel(site: Site) -> Any:
    return channel_protocol(RelayChannel())


@dataclass(frozen=True)
class SiteSettings:
    """The process-wide settings every wing's site is built with (relayd/settings.py's table).

    @ivar trust_forwarded_for: how many reverse proxies' C{X-Forwarded-For} entries to believe (0:
        none; the peer is the connection's, or the PROXY-protocol source on a C{haproxy:} listener).
    @ivar header_timeout: seconds a request line and its headers may take (C{408} after).
    @ivar body_timeout: seconds a request body may take once the headers are in (C{408} after).
    @ivar idle_timeout: seconds a connection may sit idle (Twisted's C{timeOut}).
    @ivar access_log: whether to log a line per request.
    @ivar max_client_connections: open connections one client (its address, or its forwarded
        address behind trusted proxies) may hold on one wing's listeners (0: no cap); beyond it,
        L{HEALTH_RESERVE} more answer only the health check, and the rest are refused with C{503}.
    """

    trust_forwarded_for: int = 0
    header_timeout: float | None = DEFAULT_HEADER_TIMEOUT
    body_timeout: float | None = DEFAULT_BODY_TIMEOUT
    idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT
    access_log: bool = True
    max_client_connections: int = DEFAULT_MAX_CLIENT_CONNECTIONS


DEFAULT_SITE_SETTINGS = SiteSettings()


class RelaySite(Site):
    """The site of one wing's listener.

    It tracks its connections (weakly: a WebSocket upgrade hands the transport to autobahn, which
    then owns it) so that shutdown can close long-lived HTTP responses that C{stopListening} leaves
    open. It never writes the twisted.web access log, whose lines would carry query-string tokens
    (C{access_token}); it logs its own line per request instead (L{access}): method, path without
    the query, status, bytes, peer.

    Everything it is configured with is given at construction: C{relay}, the name in access-log
    lines and metrics, and C{settings} (L{SiteSettings}), whose values become the attributes
    below (C{idle_timeout} is Twisted's C{timeOut}).

    @ivar relay: the relay named in access-log lines and metrics.
    @ivar trust_forwarded_for: see L{SiteSettings}.
    @ivar header_timeout: see L{SiteSettings}.
    @ivar body_timeout: see L{SiteSettings}.
    @ivar access_log: see L{SiteSettings}.
    """

    requestFactory = RelayRequest
    protocol = _relay_channel
    _log = Logger()
    noisy = False  # no "Starting factory" lines per listener

    def __init__(
        self,
        resource: IResource,
        *,
        body_limit: BodyLimit | None = None,
        settings: SiteSettings = DEFAULT_SITE_SETTINGS,
        relay: str | None = None,
        clock: Timekeeper | None = None,
        health_paths: frozenset[bytes] = frozenset(),
        **kw: Any,
    ) -> None:
        # relayd takes no HTML form posts; Twisted's form parsing runs every POST's content type
        # through the email package, about a third of a small POST's CPU.
        kw.setdefault("parsePOSTFormSubmission", False)
        # Its timers (deadlines, Twisted's idle timeout) and durations run on the clock: the wing's,
        # or one on the reactor handed in (a test's task.Clock) or the installed one.
        if clock is None:
            reactor = kw.get("reactor")
            clock = Timekeeper(reactor if reactor is not None else installed())
        kw["reactor"] = clock.reactor
        self.clock = clock
        super().__init__(resource, **kw)
        self.body_limit = body_limit
        self.relay: str | None = relay
        self.settings = settings
        self.trust_forwarded_for: int = settings.trust_forwarded_for
        self.header_timeout: float | None = settings.header_timeout
        self.body_timeout: float | None = settings.body_timeout
        self.timeOut = settings.idle_timeout
        self.access_log: bool = settings.access_log
        self.max_client_connections: int = settings.max_client_connections
        self.health_paths = health_paths
        self.too_many_connections = (
            503,
            b"Service Unavailable",
            b'{"error":"too_many_connections","max_per_client":%d}' % self.max_client_connections,
        )
        self._crowded = JSONError(503, "", body=self.too_many_connections[2], close=True)
        self._clients: dict[str, int] = {}  # open connections per client, under the cap
        self._protocols: weakref.WeakSet[Any] = weakref.WeakSet()
        # Paths whose plain POSTs the wing answers itself, beside twisted.web (relayd.web.simple_post):
        # the handler answers, or declines with None before it has done anything.
        self.simple_posts: dict[bytes, Callable[[SimplePost], EarlyAnswer | Deferred[EarlyAnswer] | None]] = {}
        self._request_counters: dict[tuple[str, int], Any] = {}  # labelled children, looked up once
        self._addresses: dict[Any, Any] = {}

    def shared_address(self, address: Any) -> Any:
        """One object for each local address the site's connections arrive on (at most
        L{_MAX_SHARED_ADDRESSES}: a PROXY-protocol listener's are the proxy's to choose)."""
        try:
            shared = self._addresses.get(address)
        except TypeError:
            return address  # unhashable: not shared
        if shared is not None:
            return shared
        if len(self._addresses) < _MAX_SHARED_ADDRESSES:
            self._addresses[address] = address
        return address

    def buildProtocol(self, addr: IAddress | None) -> Any:
        protocol = super().buildProtocol(addr)
        self.clock.give_timeouts(protocol)
        self._protocols.add(protocol)
        return protocol

    def track(self, protocol: Any, channel: Any = None) -> None:
        """Count C{protocol} among this site's connections (for drain) though the site did not build
        it: a held stream's, once it has left twisted.web (relayd.web.streams.held) from C{channel}, whose
        place under the per-client cap it takes (L{held_closed} when it ends)."""
        self._protocols.add(protocol)
        if channel is not None and getattr(channel, "client", None) is not None:
            channel.client = None  # (its client is the held stream's peer: the same address)

    def held_closed(self, peer: str) -> None:
        """A held stream of C{peer} ended: its connection leaves the per-client count."""
        if self.max_client_connections:
            self.client_left(peer)

    def getResourceFor(self, request: Any) -> IResource:
        """The addressed resource, or a L{JSONError} where Twisted would answer in HTML (a path
        nothing serves) or with C{501} (a method the resource has no C{render_} for), or C{503}
        when the client holds more connections than L{max_client_connections}."""
        if self.max_client_connections:
            crowded = self._crowded_request(request)
            if crowded is not None:
                return crowded
        found = super().getResourceFor(request)
        return _json_answer(found, request.method) or found

    def _crowded_request(self, request: Any) -> IResource | None:
        channel = getattr(request, "channel", None)
        if not isinstance(channel, RelayChannel):
            return None
        if self.trust_forwarded_for:
            # The client is the request's: a proxy's connection counts for its latest client.
            client = self.client_address(request)
            if client != channel.client:
                if channel.client is not None:
                    self.client_left(channel.client)
                    del channel.client
                if not self.count_client(channel, client):
                    return self._crowded
        if channel.crowded and request.path not in self.health_paths:
            metrics.http_connections_refused.labels(relay=self.relay or "http").inc()
            return self._crowded
        return None

    def count_client(self, channel: RelayChannel, client: str) -> bool:
        """Count C{channel} for C{client}; C{False} (then not counted) when C{client} already holds
        its cap and its L{HEALTH_RESERVE}. Within the reserve the channel is marked C{crowded}."""
        count = self._clients.get(client, 0) + 1
        if count > self.max_client_connections + HEALTH_RESERVE:
            metrics.http_connections_refused.labels(relay=self.relay or "http").inc()
            return False
        self._clients[client] = count
        channel.client = client
        channel.crowded = count > self.max_client_connections
        return True

    def client_left(self, client: str) -> None:
        """One connection counted for C{client} closed (or left HTTP: a WebSocket)."""
        count = self._clients.get(client, 0) - 1
        if count > 0:
            self._clients[client] = count
        else:
            self._clients.pop(client, None)

    def log(self, request: Any) -> None:
        """Called by twisted.web when a response finishes: relayd's access line, not Twisted's."""
        access = getattr(request, "_access", None)
        if access is not None:
            access(request.code)

    def client_address(self, request: Any) -> str:
        """The client's address: the trusted C{X-Forwarded-For} entry, else the (PROXY) peer."""
        return self.client_of(request.requestHeaders.getRawHeaders(b"x-forwarded-for"), request.getClientAddress())

    def client_of(self, forwarded: list[bytes] | None, peer: Any) -> str:
        """The client's address from the C{X-Forwarded-For} values of its request and the address
        of the (PROXY) C{peer}: the one reading of every way a request comes in."""
        hops = self.trust_forwarded_for
        if hops:
            values = forwarded or []
            addresses = [a.strip() for value in values for a in value.split(b",") if a.strip()]
            if addresses:
                # Each trusted proxy appended the address it saw; the entry the outermost trusted
                # proxy appended is the client as far as anyone trustworthy knows (autobahn's rule).
                return addresses[-hops:][0].decode("ascii", "replace")[:64]
        return _host_of(peer)

    def access(
        self, *, method: bytes, path: bytes, status: int, sent: int, peer: str, started: float | None = None
    ) -> None:
        """Count one answered request and log its line (never the query string)."""
        relay = self.relay or "http"
        counter = self._request_counters.get((relay, status))
        if counter is None:
            counter = metrics.http_requests.labels(relay=relay, code=str(status))
            self._request_counters[(relay, status)] = counter
        counter.inc()
        if not self.access_log:
            return
        duration = round((self.clock.monotonic() - started) * 1000, 1) if started is not None else None
        verb = _loggable(method)
        where = _loggable(_strip_query(path))
        _access_log.info(
            # Rendered here once: twisted.logger's own formatting of five fields cost a third of
            # the line's price, and one line is written per request.
            "{access_line}",
            access_line=f'{relay} {peer} "{verb} {where}" {status} {sent}',
            relay=relay,
            peer=peer,
            method=verb,
            path=where,
            status=status,
            bytes=sent,
            duration_ms=duration,
            # Safe by construction (no query string, no headers): the scrubber need not render it.
            **{SCRUBBED_MARK: True},
        )

    def open_connections(self) -> int:
        """How many HTTP connections this site still serves."""
        return sum(1 for p in list(self._protocols) if _connected(p))

    def close_connections(self, abort: bool = False) -> None:
        """Close every connection (politely, or C{abort} without flushing)."""
        for protocol in list(self._protocols):
            transport = _transport(protocol)
            if transport is None or not _connected(protocol):
                continue
            if abort:
                transport.abortConnection()
            else:
                transport.loseConnection()


def _transport(protocol: Any) -> Any:
    # Site protocols wrap the HTTPChannel (which holds the transport) in a generic proxy.
    return getattr(channel_of(protocol), "transport", None)


def _connected(protocol: Any) -> bool:
    transport = _transport(protocol)
    return transport is not None and bool(getattr(transport, "connected", False))


def _open(transport: Any) -> bool:
    """Whether C{transport} is there and not closing (nothing was answered that closes it)."""
    return transport is not None and not getattr(transport, "disconnecting", False)


def _durations(request: Any) -> Callable[[], float]:
    """The clock C{request}'s duration is measured on: its site's (outside a RelaySite, which is the
    one to log it, there is nothing to measure)."""
    site = getattr(getattr(request, "channel", None), "site", None)
    return site.clock.monotonic if isinstance(site, RelaySite) else _unmeasured


def _unmeasured() -> float:
    return 0.0


def _strip_query(path: bytes) -> bytes:
    return path.split(b"?", 1)[0]


# Bytes a client could use to break or forge an access line: controls (Twisted lets DEL through in a
# path), spaces and the line's own quote.
_UNLOGGABLE = re.compile(rb'[\x00-\x20\x7f"]')


def _loggable(value: bytes) -> str:
    """C{value} for an access line: unsafe bytes percent-encoded, the rest as UTF-8 (U+FFFD if not)."""
    if _UNLOGGABLE.search(value):
        value = _UNLOGGABLE.sub(lambda m: b"%%%02X" % m.group()[0], value)
    return value.decode("utf-8", "replace")  # (Twisted refuses non-ASCII request targets)


def _capitalised(name: bytes) -> bytes:
    """A header name as twisted.web writes it (C{content-type} -> C{Content-Type})."""
    return b"-".join(part.capitalize() for part in name.split(b"-"))


def _host_of(address: Any) -> str:
    host = getattr(address, "host", None)
    if host:
        return str(host)
    name = getattr(address, "name", None)  # a UNIX socket peer
    return "unix" if name is not None or address is None else str(address)
