"""The HTTP channel of every relayd site: complete refusals, deadlines against slow clients, bounded
headers and lengths, pipelining that waits for the client to read, split reads, and the plain POST
answered beside twisted.web."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import CancelledError, Deferred
from twisted.internet.interfaces import IDelayedCall
from twisted.internet.protocol import connectionDone
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.base.clock import Timekeeper
from relayd.compat.tcp import hold_writes, pause_reading, peer_host, release_writes, resume_reading
from relayd.compat.web import (
    ChannelHooks,
    between_requests,
    current_request,
    held_line,
    keeps_alive,
    request_line,
)
from relayd.web.answers import Answer, RenderedAnswer, http_date, json_answer, raw_response
from relayd.web.request import ChannelSite, LimitedRequest, host_of
from relayd.web.simple_post import HeldAnswer, SimplePost, read_simple_post

MAX_HEADER_BYTES = 16384
"""The request line and header block together (Twisted's C{totalHeadersSize}); C{431} beyond."""
MAX_HEADER_FIELDS = 500
"""Header fields in one request (Twisted's C{maxHeaders}); C{431} beyond."""
# Answers written by the channel itself, before (or instead of) any request reaching a resource.
_BAD_REQUEST = json_answer(400, b'{"error":"bad_request"}')
_HEADERS_TOO_LARGE = json_answer(
    431, b'{"error":"header_fields_too_large","max_bytes":%d,"max_fields":%d}' % (MAX_HEADER_BYTES, MAX_HEADER_FIELDS)
)
_REQUEST_TIMEOUT = json_answer(408, b'{"error":"request_timeout"}')
_BARE_LINE_FEED = json_answer(
    400, b'{"error":"bad_request","reason":"every line of the request line and headers must end with CRLF"}'
)
# A Content-Length with more digits than this is larger than any body cap; Python's int() refuses
# over 4300 digits, which Twisted's parser does not expect (an unhandled ValueError, no answer).
_LENGTH_DIGITS = 18
# The longest request target L{_health_check} reads for a health path (with its query).
MAX_HEALTH_PATH = 256
# What a connection may send while the answer to its plain POST is awaited before it is read no
# more (twisted.web reads on up to the same while it handles a request: HTTPChannel.rawDataReceived).
_WAITING_READ_MAX = 16384
# A read longer than this that holds a header block and more is parsed in two parts (RelayChannel._read).
_SPLIT_READS_OVER = 4096
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
    _relay_site: ChannelSite | None = None
    peer_host: str | None = None
    """The host of the connection's peer, once a plain POST read it (L{_peer_host})."""
    client: str | None = None
    """The client this connection is counted for under the site's per-client cap (None: not counted)."""
    crowded = False
    """Whether the connection is one of its client's L{relayd.process.settings.HEALTH_RESERVE}: it answers the health check only."""
    simple_waiting: bytearray | None = None
    """What the client sent while the answer to its plain POST is awaited (L{_answer_simple})."""
    simple_answer: Deferred[Answer] | HeldAnswer | None = None
    """The answer to its plain POST that is awaited: cancelled if the client leaves first."""
    simple_held: tuple[ChannelSite, SimplePost, str, float] | None = None
    """The plain POST whose L{HeldAnswer} is awaited, its client and start (for L{_held_answered})."""
    reading = False
    """Whether a read is being parsed (what a request answered within it replays is parsed by it)."""
    unparsed = 0
    """Bytes of the read being handled that the parser has not been handed yet (what follows a
    header block, L{_read}): a stream must not take the connection over from under them."""
    newcomer = True
    """Whether no request of this connection has been started yet (L{relayd.web.admission})."""
    kept: list[bytes] | None = None
    """What the connection sent while it waits for its turn to start (L{relayd.web.admission})."""

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

    def _peer_host(self) -> str:
        """The host of the connection's peer (read once: it never changes, a PROXY header's included,
        which is read before anything reaches the channel)."""
        host = self.peer_host
        if host is None:
            host = self.peer_host = host_of(self.getPeer())
        return host

    def lineLengthExceeded(self, line: bytes) -> None:
        self._refuse(_HEADERS_TOO_LARGE)

    # Slowloris: Twisted's idle timeout restarts with every byte, so a client trickling a header
    # byte at a time would hold the connection forever. The request line and headers must all
    # arrive within the site's header_timeout of their first byte (or of the connection), and a
    # body within its body_timeout of the end of the headers (the slow-POST variant).

    def connectionMade(self) -> None:
        site = getattr(self, "site", None)
        if not isinstance(site, ChannelSite):
            site = None
        else:
            self._relay_site = site
            self._deadlines = (site.clock, site.header_timeout, site.body_timeout)
        if self._covers_idle(1):
            # Twisted arms its idle timeout here; the header clock armed below fires first, so the
            # idle timer waits until a request is in (L{_idle}): one timer per connection, not two,
            # and none to cancel when the connection closes after one answer.
            idle, self.timeOut = self.timeOut, None
            super().connectionMade()
            self.timeOut = idle
        else:
            super().connectionMade()
        if site is not None:
            # (Behind trusted proxies the client is known from each request's headers: getResourceFor.
            # A UNIX socket's peers have no address to tell them apart: not counted.)
            if site.max_client_connections and not site.trust_forwarded_for and self.transport is not None:
                host = peer_host(self.transport)
                if host and not site.count_client(self, str(host)):
                    self._refuse(site.too_many_connections)
                    return
        self._start_header_clock()

    def dataReceived(self, data: bytes) -> None:
        if self.newcomer and self._waits(data):
            return
        if self.reading:  # a request answered within the read replays what followed it
            self._read(data)
            return
        transport = self.transport
        held = hold_writes(transport)
        self.reading = True
        try:
            # A line the reader holds unsplit once a read is parsed holds no CRLF: a line feed there
            # is a bare one, after which the client waits for an answer that would come only with
            # the header timeout. (A read that was one plain POST left the reader as it found it,
            # holding nothing: L{between_requests}. Not asked then.)
            # (find: docs/architecture.md, hot paths)
            if not self._read(data):
                bare = self.reading_head() and not self.parsing_paused() and held_line(self).find(b"\n") >= 0
                if bare and _open(self.transport):
                    self._refuse(_BARE_LINE_FEED)
        finally:
            del self.reading
            if held:
                release_writes(transport)

    def _waits(self, data: bytes) -> bool:
        """Whether C{data}, what a connection not yet started read, waits for its turn (it is kept)."""
        kept = self.kept
        if kept is None:
            site = self._relay_site
            if site is None or site.admission.starts_now() or _health_check(data, site.health_paths):
                self.newcomer = False
                return False
            # Its socket stays registered (two system calls fewer per waiting connection): a client
            # that sent its request has nothing more to send until it is answered.
            kept = self.kept = []
            site.admission.wait(self)
        kept.append(data)
        if sum(map(len, kept)) > MAX_HEADER_BYTES:
            pause_reading(self.transport)  # it sends more meanwhile: the rest waits in the kernel
        return True

    def admitted(self) -> bool:
        """Start on what was kept while the connection waited for its turn (L{relayd.web.admission});
        C{False} if it closed meanwhile."""
        kept, self.kept = self.kept, None
        if kept is None or not _open(self.transport):
            return False
        self.newcomer = False
        resume_reading(self.transport)
        try:
            self.dataReceived(b"".join(kept))
        except Exception:
            # (As Twisted drops a connection whose protocol fails on a read; here the read is the
            # admission's turn, which must go on to the next connection.)
            _log.failure("reading a connection's first request failed; the connection is dropped")
            self.transport.abortConnection()  # type: ignore[union-attr]
        return True

    def _read(self, data: bytes) -> bool:
        """Read C{data}; C{True} when it was one plain POST, taken whole (nothing else was read)."""
        waiting = self.simple_waiting
        if waiting is None:
            site = self._relay_site
            # (a site whose wings answer no plain POST declines each at its request line: no
            # SimplePosts.__bool__ asked per read)
            if site is not None and data.startswith(b"POST ") and between_requests(self):
                if self._answer_simple(site, data):
                    return True  # (answered within this read: a header clock started for it could never fire)
        if self._header_call is None and self.reading_head():
            self._start_header_clock()  # the head's first byte
        if waiting is not None:  # a plain POST's answer is awaited: what follows it waits for it
            waiting += data  # (one buffer: its length is known at once however many reads came)
            if len(waiting) > _WAITING_READ_MAX:
                pause_reading(self.transport)  # (the rest waits in the kernel until the answer is written)
            return False
        # Twisted's line reader copies what follows each line it splits off, so a POST whose
        # headers and body arrive in one read had its body copied once per header line (a 50 KB
        # NDJSON batch about ten times). The header block goes first, then the rest: the parser
        # sees the bytes as if they had come in two reads.
        if self.reading_head() and len(data) > _SPLIT_READS_OVER:
            end = data.find(b"\r\n\r\n", 0, MAX_HEADER_BYTES + 4) + 4
            if 4 <= end < len(data):
                self.unparsed = len(data) - end
                try:
                    super().dataReceived(data[:end])
                finally:
                    del self.unparsed
                transport = self.transport
                if transport is None or getattr(transport, "disconnecting", False):
                    return False  # answered and closing: nothing more is read (as within one read)
                data = data[end:]
        super().dataReceived(data)
        return False

    def _answer_simple(self, site: ChannelSite, data: bytes) -> bool:
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
        client = self.client
        if not site.trust_forwarded_for:
            # (the peer's host, read when the connection was counted or its first plain POST came: no
            # address built again)
            peer = client if client is not None else (self.peer_host or self._peer_host())
        else:
            forwarded = post.headers.get(b"x-forwarded-for")
            peer = site.client_of(None if forwarded is None else [forwarded], self.getPeer())
        if site.max_client_connections:
            if site.trust_forwarded_for:
                if not site.count_forwarded(self, peer):
                    return False  # (at its cap: twisted.web's path counts it and answers the crowded 503)
            elif self.crowded:
                return False  # (twisted.web's path answers the crowded 503)
        started = site.clock.monotonic()
        post.channel = self
        try:
            answer = None if post.handler is None else post.handler(post)
        except Exception:
            # twisted.web's path then answers it (with its 500 if the fault is there too).
            _log.failure("a simple POST handler failed; the request goes to twisted.web")
            return False
        if answer is None:
            return False
        if self._header_call is not None:  # (none running for most: no call to stop nothing)
            self._stop_header_clock()
        if isinstance(answer, Answer):  # (asked first: isinstance against Deferred, an ABC, is slow for anything else)
            if not post.close:
                self.setTimeout(self.timeOut)  # (L{_idle}; an answer written now to a connection that then closes needs no idle timer)
            self._write_simple(answer, site, post, peer, started)
            return True
        answer_to = getattr(answer, "answer_to", None)  # (a HeldAnswer; a Deferred has none)
        if answer_to is None:
            # No idle timeout while the answer is awaited (a held POST waits for the page up to its
            # request timeout), as twisted.web runs none while it handles a request: the idle timer
            # stays armed (no cancel and new timer per held POST) but does nothing if it fires
            # meanwhile (L{timeoutConnection}), and is restarted once the answer is written.
            # The connection is still read meanwhile (what comes waits, up to _WAITING_READ_MAX): a
            # client that closes it is seen at once, and its held request forgotten (connectionLost).
            self.simple_waiting = bytearray()
            self.simple_answer = answer
            answer.addCallback(self._write_simple, site, post, peer, started).addErrback(self._simple_failed)
            return True
        # A HeldAnswer: the same, told directly (no Deferred).
        self.simple_waiting = bytearray()
        self.simple_answer = answer
        self.simple_held = (site, post, peer, started)
        answer_to(self._held_answered)
        return True

    def _write_simple(
        self, answer: Answer, site: ChannelSite, post: SimplePost, peer: str, started: float
    ) -> None:
        """Write the answer to a plain POST as twisted.web writes the same answer (its version, Server
        and Date, its header capitals, C{Connection: close} when it closes an HTTP/1.1 connection);
        then close the connection, or read what the client sent while the answer was awaited."""
        waiting, self.simple_waiting = self.simple_waiting, None
        self.simple_answer = None
        if waiting is not None and not post.close:
            self.setTimeout(self.timeOut)  # (L{_idle}: answered later, the idle timeout counts from the answer, as twisted.web's)
        transport = self.transport
        if transport is None or not getattr(transport, "connected", False):
            return  # (the client left while the store wrote)
        # An answer that waited for the store (Redis) is written outside a read of this connection:
        # held as a read's are, it is sent at once (and the connection closed at once) as within one.
        held = hold_writes(transport)
        try:
            transport.write(
                raw_response(
                    answer.status, answer.headers, answer.body, close=post.close and post.version == b"HTTP/1.1",
                    date=http_date(site.clock.seconds()), capitalised=True, version=post.version,
                    dated_after=answer.early if isinstance(answer, RenderedAnswer) else 0,
                )
            )
            path = post.path
            if path.find(b"?") >= 0:  # (a path claimed by prefix may carry a query: twisted.web logs its path)
                path = path.partition(b"?")[0]
            site.access(method=b"POST", path=path, status=answer.status, sent=len(answer.body), peer=peer, started=started)
            if post.close:
                transport.loseConnection()
            elif waiting:
                if len(waiting) > _WAITING_READ_MAX:
                    resume_reading(transport)  # (paused by L{_read})
                self.dataReceived(bytes(waiting))
        finally:
            if held:
                release_writes(transport)

    def _held_answered(self, answer: Answer) -> None:
        held, self.simple_held = self.simple_held, None
        if held is None:
            return
        try:
            self._write_simple(answer, *held)
        except Exception:
            # (Called by whoever finished the request, the page's POST: the fault stays here, as a
            # Deferred's callback would keep it.)
            self._simple_failed(Failure())

    def _simple_failed(self, failure: Failure) -> None:
        self.simple_answer = None
        if failure.check(CancelledError):
            return  # (the client left: L{connectionLost})
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
        if line.find(b"\n") >= 0:
            self._refuse(_BARE_LINE_FEED)
            return
        super().lineReceived(line)

    def chunk_size(self, size: int) -> None:
        request = current_request(self)
        if isinstance(request, LimitedRequest):
            request.chunk_announced(size)

    def send_continue(self) -> None:
        request = current_request(self)
        if not getattr(request, "refused", False):  # answered early: the client must not send its body
            super().send_continue()

    def allHeadersReceived(self) -> None:
        self._stop_header_clock()
        deadlines = self._deadlines
        if self.body_follows():  # a body follows (a length, or chunked)
            if deadlines is not None and deadlines[2]:
                self._header_call = deadlines[0].deadline(deadlines[2], self._request_too_slow)
            if not self._covers_idle(2):
                self._idle()  # (Twisted's idle timeout then runs while the body comes)
        super().allHeadersReceived()

    def allContentReceived(self) -> None:
        self._stop_header_clock()
        super().allContentReceived()

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._stop_header_clock()
        answer, self.simple_answer = self.simple_answer, None
        self.simple_held = None
        if answer is not None:
            answer.cancel()  # (the wing is told, as twisted.web tells a request whose client left)
        if self.kept is not None:
            self.kept = None  # (no longer waiting for its turn: L{admitted} passes it over)
        site = self._relay_site
        if self.client is not None and site is not None:
            site.client_left(self.client)
            del self.client
        super().connectionLost(reason)

    def timeoutConnection(self) -> None:
        if self.simple_answer is not None:
            return  # (idle while the answer to its plain POST is awaited: not idle; L{_write_simple} re-arms)
        super().timeoutConnection()

    def _covers_idle(self, which: int) -> bool:
        """Whether the site's header (C{which} 1) or body (2) deadline fires before Twisted's idle
        timeout could: no idle timer is needed while it runs."""
        deadlines = self._deadlines
        limit = deadlines[which] if deadlines is not None else None
        idle = self.timeOut
        return bool(limit) and (idle is None or limit <= idle)  # type: ignore[operator]

    def _idle(self) -> None:
        """Arm (or restart) Twisted's idle timeout, for a connection that waits for the client."""
        self.setTimeout(self.timeOut)

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
        if isinstance(site, ChannelSite) and self.transport is not None:
            peer = host_of(self.transport.getPeer())
            method, path = request_line(self)
            site.access(method=method or b"-", path=path or b"-", status=status, sent=sent, peer=peer)

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

    def _refuse(self, answer: Answer) -> None:
        """Answer the request being read with C{answer} and close: nothing more is read."""
        self._stop_header_clock()
        head = request_line(self)[0] == b"HEAD"  # the length of the body it does not send
        self._access_log(answer.status, 0 if head else len(answer.body))
        if self.transport is not None:
            self.transport.write(raw_response(answer.status, answer.headers, answer.body, close=True, head=head))
        self.loseConnection()

    # Pipelining: Twisted parses the next request as soon as one is answered, all of one read in a
    # loop; a client that never reads could have any number of large answers rendered and buffered
    # from one small read. Once the transport asks us to pause, the rest waits for its resume.

    def requestDone(self, request: Any) -> None:
        if keeps_alive(self) and self.waiting_for_transport():
            self.pause_parsing()  # keep what is buffered, parse nothing more
            self.stop_reading()  # and read nothing more meanwhile
        super().requestDone(request)

    def resumeProducing(self) -> None:
        super().resumeProducing()
        if self.parsing_paused() and not self.waiting_for_transport() and self.transport is not None:
            self.resume_parsing()
            self.dataReceived(b"")  # parse the held requests now that answers can flow


def _health_check(data: bytes, paths: frozenset[bytes]) -> bool:
    """Whether C{data}, a connection's first bytes, asks for one of the site's health C{paths} (it
    then starts at once, however many connections wait: a probe is answered during a storm)."""
    if not paths:
        return False
    space = data.find(b" ", 0, 8)
    end = data.find(b" ", space + 1, space + 2 + MAX_HEALTH_PATH)
    if space < 0 or end < 0:
        return False
    return data[space + 1 : end].partition(b"?")[0] in paths


def _open(transport: Any) -> bool:
    """Whether C{transport} is there and not closing (nothing was answered that closes it)."""
    return transport is not None and not getattr(transport, "disconnecting", False)
