"""The fence's twisted.web entries: a request's and an HTTP channel's private (or undocumented)
state and hooks, and the dict surgery that shrinks an idle stream.

Every shortcut below is one function (or, for hooks Twisted only offers as private methods, one
method of L{ChannelHooks} or a class value of L{RequestHooks}). Each is detected once, at import, on
the installed classes (L{relayd.compat.detect.code_uses}: the names the shortcut relies on must
appear in the methods of Twisted that use them); when a release drops them the flag is off and the
shortcut takes the public path, slower or plainer but correct. tests/compat/test_web.py checks each
detection over real loopback connections and checks that each fallback gives the same observable
result (or, where no public API does the same, Twisted's own plainer behaviour); tests/compat/
test_fence.py fails any module outside relayd/compat/ that reaches in. setup.cfg bounds the Twisted
version so that a new release is admitted only once those tests pass on it.

What each shortcut saves is measured in docs/performance.md ("Twisted internals"). This module
imports nothing of relayd's but the rest of the fence.

(The reactor's exit signal and the twisted.logger entries at the end are waiting for their own
module, relayd/compat/logger.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Protocol

from twisted.internet import protocol
from twisted.protocols import basic
from twisted.python import components
from twisted.python.failure import Failure
from twisted.web import http, server
from twisted.web.http_headers import Headers

from relayd.compat.detect import code_uses
from relayd.compat.tcp import PLAIN_TCP, TCP_BUFFERS, hand_over

# -- twisted.web requests ----------------------------------------------------------------------------

REQUEST_DISCONNECTED = code_uses(http.Request.connectionLost, "_disconnected") and code_uses(
    http.Request.write, "_disconnected"
)
"""C{Request._disconnected} says the client went away before the response finished."""
REQUEST_BODY_DIRECT = REQUEST_DISCONNECTED and code_uses(http.Request.write, "chunked", "sentLength")
"""C{Request.write} frames a body by C{chunked} and counts it in C{sentLength} (the access log's
bytes), so body bytes can be framed by the caller and written to the transport directly."""


def send_body(request: Any, transport: Any, data: bytes, framed: bytes) -> None:
    """Send body bytes C{data} of C{request}, already C{framed} as the response needs (an HTTP chunk
    when C{request.chunked}), straight to C{transport} (the request's own), counted as
    C{request.write} counts them; through C{request.write(data)} when that cannot be done.

    The request's own write path (chunk framing, the HEAD and 204 checks) costs more than the frame
    itself on a fan-out of one small event per reactor turn (part of what took an SSE delivery to 100
    subscribers from 6.3 to 2.0 us, docs/performance.md). One call per delivery: the checks of
    L{write_now} are repeated inline.
    """
    if not REQUEST_BODY_DIRECT or transport is None or request._disconnected:
        request.write(data)
        return
    request.sentLength += len(data)
    if (
        TCP_BUFFERS
        and type(transport) in PLAIN_TCP
        and transport.connected
        and not transport.disconnecting
        and not transport._tempDataBuffer
        and transport.offset == len(transport.dataBuffer)
    ):
        try:
            sent = transport.socket.send(framed)
        except OSError:
            sent = 0
        if sent == len(framed):
            return
        framed = framed[sent:]
    transport.write(framed)


REQUEST_NOTIFICATIONS = (
    code_uses(http.Request.notifyFinish, "notifications", "append")
    and code_uses(http.Request.connectionLost, "notifications", "errback")
    and code_uses(getattr(http.Request, "_cleanup", None), "notifications", "callback")
)
"""C{notifyFinish} appends a Deferred to C{request.notifications}, which the request fires with
C{callback(None)} when it finishes and C{errback(reason)} when its connection is lost."""


class EndWatcher(Protocol):
    """What L{watch_end} calls: as a Deferred of C{notifyFinish} would be fired."""

    def callback(self, result: None) -> None:
        """The response finished."""

    def errback(self, reason: Failure) -> None:
        """The connection was lost before the response finished."""


def watch_end(request: Any, watcher: EndWatcher) -> None:
    """Have C{watcher} told how C{request} ends, as C{request.notifyFinish()} would tell it.

    An idle stream holds its watcher in the request's own list instead of a Deferred with its
    callbacks: 295 B less per held stream (docs/performance.md, "Memory per idle stream").
    """
    notifications = getattr(request, "notifications", None)
    if REQUEST_NOTIFICATIONS and type(notifications) is list:
        notifications.append(watcher)
        return
    request.notifyFinish().addCallbacks(watcher.callback, watcher.errback)


REQUEST_COMPONENTS = issubclass(server.Request, components.Componentized) and code_uses(
    components.Componentized.__init__, "_adapterCache"
)
"""A request is C{Componentized}: its C{__init__} gives it an adapter cache (an empty dict) that only
C{getComponent} and its kin read."""
REQUEST_SPENT_PRIVATE: tuple[str, ...] = ("_adapterCache",) if REQUEST_COMPONENTS else ()
"""Private request state that a streaming response never reads (L{slim_stream} drops it: 64 B)."""

REQUEST_WRITE_STATE = code_uses(http.Request.write, "startedWriting", "chunked", "sentLength")
"""C{Request.write} sets C{startedWriting} once the headers are out, frames the body by C{chunked}
and counts it in C{sentLength} (undocumented attributes)."""


def headers_written(request: Any) -> bool:
    """Whether C{request}'s response headers are on the wire (C{False} when that cannot be known:
    the caller then leaves the response to twisted.web)."""
    return REQUEST_WRITE_STATE and bool(request.startedWriting)


def body_framing(request: Any) -> tuple[bool, int]:
    """Whether C{request}'s response body is chunk-framed, and how many body bytes it has sent (for
    its access line); C{(False, 0)} when that cannot be known (nothing is then held, L{headers_written})."""
    if not REQUEST_WRITE_STATE:
        return False, 0
    return bool(getattr(request, "chunked", False)), int(getattr(request, "sentLength", 0))  # (a test double may lack them)


def set_body_sent(request: Any, sent: int) -> None:
    """Record C{sent} body bytes for C{request} (an answer written without its write path), as
    twisted.web's access log would count them."""
    request.sentLength = sent


class RequestHooks(server.Request):
    """A C{Request} whose per-request private settings are class values.

    Request.__init__ sets these on every request; as class values too, a streaming request's dict
    leaves those entries out (L{slim_stream}: an entry identical to the class value it shadows is
    dropped), and reading them answers the same object. A release that renames them only makes
    that dict an entry larger.
    """

    # relayd sites parse no form posts (RelaySite passes parsePOSTFormSubmission=False); the channel
    # passes the deprecated queued as len(requests), 0 unless pipelined.
    queued = 0
    _parsePOSTFormSubmission = False


CHANNEL_REQUESTS = code_uses(http.HTTPChannel.requestDone, "requests") and code_uses(
    http.HTTPChannel.allHeadersReceived, "requests"
)
"""An C{HTTPChannel} keeps the requests it is answering in its C{requests} list (undocumented)."""


def forget_request(channel: Any, request: Any) -> None:
    """Take C{request} out of C{channel}'s queue once the connection has left twisted.web: the two
    hold each other, and breaking that one cycle frees both at once (a frozen collector would not).
    Without the queue known, the collector frees them later."""
    requests = getattr(channel, "requests", None) if CHANNEL_REQUESTS else None
    if type(requests) is list and request in requests:
        requests.remove(request)


def current_request(channel: Any) -> Any:
    """The request whose headers C{channel} is reading or has just read (C{None} if unknown)."""
    requests = getattr(channel, "requests", None) if CHANNEL_REQUESTS else None
    return requests[-1] if requests else None


CHANNEL_PERSISTENCE = code_uses(http.HTTPChannel.requestDone, "persistent")
"""An C{HTTPChannel} closes the connection after a response once its C{persistent} is false."""


def close_after(request: Any) -> None:
    """Close C{request}'s connection once its response is sent (C{connection: close} is set by the
    caller). Without the flag known the connection stays open: the client is told, and may go."""
    channel = getattr(request, "channel", None)
    if CHANNEL_PERSISTENCE and channel is not None:
        channel.persistent = False


def keeps_alive(channel: Any) -> bool:
    """Whether C{channel} will read another request after the current one (C{False} if unknown)."""
    return CHANNEL_PERSISTENCE and bool(channel.persistent)


# -- an idle stream's dicts ------------------------------------------------------------------------
# Over a request's life Twisted gives its Request and HTTPChannel more instance attributes than
# CPython's shared-key dicts hold, so each ends up with a combined dict sized for growth (about 1.5 KB
# apiece). Thousands of SSE streams sit idle per process, each holding both. Once a stream's headers
# are on the wire, slim_stream rebuilds both dicts at their right size, without the entries that
# only repeat the class's own value and without what only reading the request needed (docs/
# performance.md, "Memory per idle stream"). Every removal keeps behaviour: an entry identical to the
# class attribute it shadows reads the same object once gone, and the few entries dropped outright
# are only read while a request is received or before its headers are written (a later use raises
# AttributeError: loud, never silent).

_MISSING = object()

# Public twisted.web Request attributes that only serve receiving the request, finding its resource
# or writing its headers: the body (the stream's handler read it before starting), the cookies it
# came with and those to send (written with the headers), what traversal left (postpath) and the
# path session cookies are scoped to (sitepath; relayd keeps no sessions), and what traversal
# consumed (prepath: 56 B; the class's None is read instead). With them gone a streaming request
# keeps about 20 entries, which fit a dict of the next size down.
_REQUEST_SPENT = ("content", "received_cookies", "cookies", "postpath", "sitepath", "prepath", *REQUEST_SPENT_PRIVATE)
# The methods and versions a held stream's request line has, one object each for every stream (a
# request's own copies from parsing its line are 77 B).
_REQUEST_LINE_WORDS = {word: word for word in (b"GET", b"POST", b"HTTP/1.1", b"HTTP/1.0")}
# What the access line at a stream's end reads of the request's headers (RelaySite.client_address).
_KEPT_REQUEST_HEADERS = (b"x-forwarded-for",)


class SentHeaders(Headers):
    """Headers that are already on the wire, or already read: empty, and what is set on them is
    dropped (as it was when each stream had a fresh C{Headers} of its own: nothing is sent after
    the headers). One instance, L{SENT}, serves every held stream."""

    __slots__ = ()

    def setRawHeaders(self, name: Any, values: Any) -> None:
        pass

    def addRawHeader(self, name: Any, value: Any) -> None:
        pass

    def removeHeader(self, name: Any) -> None:
        pass


SENT: Final = SentHeaders()


def _class_value(cls: type, name: str) -> Any:
    """The plain class attribute C{name} would fall back to, or L{_MISSING} (descriptors count as
    missing: they could answer differently from the instance entry)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            return _MISSING if hasattr(type(value), "__get__") else value
    return _MISSING


def compact(obj: Any, drop: tuple[str, ...] = ()) -> None:
    """Give C{obj} a right-sized instance dict: the entries named in C{drop} and those identical to
    the class attribute they shadow are left out (reading them answers the same object)."""
    cls = type(obj)
    kept = {}
    for name, value in vars(obj).items():
        if name in drop:
            continue
        if value is _class_value(cls, name):
            continue
        kept[name] = value
    obj.__dict__ = kept


def spent_headers(request: Any) -> None:
    """Once C{request}'s response headers are written: its response headers are L{SENT}, and of its
    request headers it keeps only what its access line will read (the parsed headers of an MCP GET
    stream are about 530 B, its response headers 104 B)."""
    request.responseHeaders = SENT
    headers = request.requestHeaders
    kept = {name: values for name in _KEPT_REQUEST_HEADERS if (values := headers.getRawHeaders(name))}
    request.requestHeaders = Headers(kept) if kept else SENT


def slim_stream(request: Any) -> None:
    """Compact C{request} and its channel once its response's headers are written and it only
    streams (L{relayd.web.streams.sse.SSEStream.start})."""
    if not headers_written(request):
        return  # the headers (and the cookies) are still to be written
    spent_headers(request)
    for name in ("method", "clientproto"):
        value = getattr(request, name, None)
        if isinstance(value, bytes):
            setattr(request, name, _REQUEST_LINE_WORDS.get(value, value))
    content = vars(request).get("content")
    if content is not None:
        content.close()  # what Twisted's connectionLost would do (an in-memory copy of the body)
    compact(request, _REQUEST_SPENT)
    channel = getattr(request, "channel", None)
    if channel is not None and hasattr(channel, "__dict__"):
        compact(channel)


CHANNEL_REQUEST_LINE = code_uses(http.HTTPChannel.lineReceived, "_command", "_path")
"""An C{HTTPChannel} keeps the request line it is reading in C{_command} and C{_path}."""


def request_line(channel: Any) -> tuple[bytes, bytes]:
    """The method and target of the request C{channel} is reading (its headers may not be in yet).

    C{(b"", b"")} if Twisted keeps them elsewhere: an early answer then names no path.
    """
    if CHANNEL_REQUEST_LINE:
        return getattr(channel, "_command", None) or b"", getattr(channel, "_path", None) or b""
    return b"", b""


CHANNEL_READ_AHEAD = code_uses(http.HTTPChannel.rawDataReceived, "_handlingRequest", "_dataBuffer") and code_uses(
    basic.LineReceiver.dataReceived, "_buffer"
)
"""An C{HTTPChannel} handling a request keeps what the client sends meanwhile (the next, pipelined
request) in C{_dataBuffer}, to parse once the response is done; what arrived in the same read as
the request is still in its C{LineReceiver} C{_buffer} while the request is rendered."""


def read_ahead(channel: Any) -> bool:
    """Whether C{channel} may hold bytes of a request after the one it is answering (C{True} when
    that cannot be known)."""
    return (
        not CHANNEL_READ_AHEAD or bool(channel._dataBuffer) or bool(channel._buffer) or len(channel.requests) != 1
    )


CHANNEL_BETWEEN_REQUESTS = CHANNEL_READ_AHEAD and code_uses(
    http.HTTPChannel.lineReceived, "requests", "persistent", "_receivedHeaderSize"
)
"""An C{HTTPChannel} between requests has no request in C{requests}, nothing in its buffers, and a
header count of zero; once it is not C{persistent} it reads nothing more."""


def between_requests(channel: Any) -> bool:
    """Whether C{channel} is reading nothing (no request begun, no bytes kept), so a whole request
    may be answered beside it; C{False} when that cannot be known."""
    return (
        CHANNEL_BETWEEN_REQUESTS
        and channel.line_mode
        and channel.persistent
        and not channel.requests
        and not channel._buffer
        and not channel._dataBuffer
        and not channel._receivedHeaderSize
    )


CHANNEL_LINE_STATE = code_uses(basic.LineReceiver.dataReceived, "line_mode", "paused")
"""A C{LineReceiver} reads lines while C{line_mode} and parses nothing while C{paused}."""
CHANNEL_LENGTH_STATE = code_uses(http.HTTPChannel.allHeadersReceived, "length")
"""An C{HTTPChannel} keeps the body length its headers announced in C{length} (0: no body)."""
CHANNEL_HEADER_COUNTS = code_uses(http.HTTPChannel.lineReceived, "_receivedHeaderSize") and code_uses(
    http.HTTPChannel.headerReceived, "_receivedHeaderCount"
)
CHANNEL_PIPELINE = code_uses(http.HTTPChannel.requestDone, "_waitingForTransport", "_networkProducer")
CHANNEL_LENGTH_HOOK = hasattr(http.HTTPChannel, "_maybeChooseTransferDecoder")
CHANNEL_BAD_REQUEST_HOOK = hasattr(http.HTTPChannel, "_respondToBadRequestAndDisconnect")
GENERIC_CHANNEL = hasattr(http, "_GenericHTTPChannelProtocol")
HTTP2 = GENERIC_CHANNEL and bool(getattr(http, "H2_ENABLED", False))
"""Whether twisted.web can switch a connection to HTTP/2 (the C{h2} package is installed): only then
is a connection worth Twisted's HTTP/1.1-or-2 wrapper, an object per connection and a forwarded call
per read and per attribute the site sets (L{channel_protocol})."""
CHANNEL_CONTINUE_HOOK = code_uses(http.HTTPChannel.allHeadersReceived, "_send100Continue")
CHUNK_SIZE_HOOK = (
    CHANNEL_LENGTH_HOOK
    and code_uses(http.HTTPChannel._maybeChooseTransferDecoder, "_ChunkedTransferDecoder", "_transferDecoder")
    and code_uses(http._ChunkedTransferDecoder.dataReceived, "state")
    and code_uses(http._ChunkedTransferDecoder._dataReceived_CHUNK_LENGTH, "length", "state")
    and code_uses(http._ChunkedTransferDecoder.__init__, "dataCallback", "finishCallback")
)
"""What each L{ChannelHooks} method and L{channel_protocol} rely on: C{HTTPChannel}'s header counts,
its pause state and network producer, its private hooks (the length headers, the bad request, the
C{100 Continue}), its chunked decoder's chunk-size state, and the HTTP/1.1-or-2 wrapper."""


class _AnnouncedChunks(http._ChunkedTransferDecoder):
    """Twisted's chunked decoder that tells C{announce} each chunk's size as soon as its size line
    is read (Twisted's own says nothing until the chunk's bytes arrive)."""

    def __init__(self, decoder: Any, announce: Callable[[int], None]) -> None:
        super().__init__(decoder.dataCallback, decoder.finishCallback)
        self.announce = announce

    def _dataReceived_CHUNK_LENGTH(self) -> bool:
        read = bool(super()._dataReceived_CHUNK_LENGTH())
        if read and self.state == "BODY":
            self.announce(self.length)
        return read


def held_line(channel: Any) -> bytes:
    """What C{channel}'s line reader holds of a line it has not split off yet (C{b""} if unknown)."""
    return channel._buffer if CHANNEL_READ_AHEAD else b""


CHANNEL_CONNECTION_MADE = code_uses(
    http.HTTPChannel.connectionMade, "setTcpNoDelay", "setTimeout", "timeOut", "_networkProducer", "registerProducer"
)
"""C{HTTPChannel.connectionMade} disables Nagle on a TCP transport, arms its idle timeout, and
registers itself as the streaming producer of its C{_networkProducer}: the transport, when it is a
push producer."""


class ChannelHooks(http.HTTPChannel):
    """An C{HTTPChannel} whose private state and hooks have public names for a subclass.

    Twisted answers a request over its limits with a bare status line (or drops it), lets a
    Content-Length of any size reach C{int()}, and parses pipelined requests however full the
    transport is; changing that needs its private hooks. When one is gone its fallback is Twisted's
    own behaviour (a plainer answer, or none), never an error.
    """

    # A framing header value longer than this is handed to length_header (a subclass may lower it).
    length_digits = 18

    def header_bytes(self) -> int:
        """Bytes of request line and headers read so far (0 if unknown: Twisted's own cap applies)."""
        return int(self._receivedHeaderSize) if CHANNEL_HEADER_COUNTS else 0

    def header_fields(self) -> int:
        """Header fields read so far (0 if unknown: Twisted's own cap applies)."""
        return int(self._receivedHeaderCount) if CHANNEL_HEADER_COUNTS else 0

    def headers_too_large(self) -> None:
        """The request line and headers went over C{totalHeadersSize} bytes or C{maxHeaders}
        fields (a subclass answers; Twisted's own caps apply when the counts are not known)."""

    # The two limit checks run on every header line: inline here (the counts read directly, no
    # call per line), where Twisted's own checks would drop the connection or answer a bare 400.
    def lineReceived(self, line: bytes) -> None:
        if CHANNEL_HEADER_COUNTS and self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self.headers_too_large()
            return
        super().lineReceived(line)

    def headerReceived(self, line: bytes) -> bool:
        if CHANNEL_HEADER_COUNTS and self._receivedHeaderCount >= self.maxHeaders:
            self.headers_too_large()  # Twisted answers the field over its count with 400
            return False
        return bool(super().headerReceived(line))

    def reading_head(self) -> bool:
        """Whether the channel reads a request line or header lines (not a body), so a read may be
        split at the end of the header block (C{False} if unknown: read as it comes)."""
        return CHANNEL_LINE_STATE and bool(self.line_mode)

    def parsing_paused(self) -> bool:
        """Whether the line reader keeps what it has without parsing it (L{pause_parsing})."""
        return CHANNEL_LINE_STATE and bool(self.paused)

    def pause_parsing(self) -> None:
        """Parse nothing more of what is buffered until L{resume_parsing} (nothing if unknown: the
        reader parses as Twisted does)."""
        if CHANNEL_LINE_STATE:
            self.paused = True

    def resume_parsing(self) -> None:
        """Undo L{pause_parsing}."""
        if CHANNEL_LINE_STATE:
            self.paused = False

    def body_follows(self) -> bool:
        """Whether a body follows the headers just read (a length, or chunked; C{True} if unknown)."""
        return not CHANNEL_LENGTH_STATE or self.length != 0

    def waiting_for_transport(self) -> bool:
        """Whether the transport asked this channel to pause (its buffer is full)."""
        return bool(self._waitingForTransport) if CHANNEL_PIPELINE else False

    def stop_reading(self) -> None:
        """Read nothing more from the socket until the transport resumes this channel."""
        if CHANNEL_PIPELINE:
            self._networkProducer.pauseProducing()

    def length_header(self, header: bytes, data: bytes) -> bytes:
        """The value Twisted parses for the framing header C{header} whose value C{data} is longer
        than L{length_digits} (a subclass may bound it; shorter values go to Twisted as they are)."""
        return data

    def bad_request(self) -> None:
        """Answer a malformed request (Twisted's bare C{400} unless a subclass says otherwise)."""
        super()._respondToBadRequestAndDisconnect()

    def chunk_size(self, size: int) -> None:
        """A chunk of C{size} bytes (> 0) of the request body follows (a subclass may refuse it now;
        not called when Twisted's decoder is not the one this knows)."""

    def send_continue(self) -> None:
        """Send C{100 Continue} for a request whose headers asked for it (a subclass may not)."""
        super()._send100Continue()

    def connectionMade(self) -> None:
        transport = self.transport
        if CHANNEL_CONNECTION_MADE and type(transport) in PLAIN_TCP:
            # Twisted asks zope whether the transport is TCP, and adapts it to a push producer with
            # a stand-in made per connection in case it is not: a plain TCP transport is both.
            transport.setTcpNoDelay(True)  # type: ignore[union-attr]
            if self.timeOut is not None:
                self.setTimeout(self.timeOut)
            self._networkProducer = transport  # type: ignore[assignment]
            transport.registerProducer(self, True)  # type: ignore[union-attr]
            return
        super().connectionMade()

    def _maybeChooseTransferDecoder(self, header: bytes, data: bytes) -> bool:
        # Called for every header field: only a long value, or "chunked", costs a call.
        if CHANNEL_LENGTH_HOOK and len(data) > self.length_digits:
            data = self.length_header(header, data)
        chosen = bool(super()._maybeChooseTransferDecoder(header, data))
        if chosen and CHUNK_SIZE_HOOK and len(data) == 7 and type(self._transferDecoder) is http._ChunkedTransferDecoder:
            self._transferDecoder = _AnnouncedChunks(self._transferDecoder, self.chunk_size)
        return chosen

    def _send100Continue(self) -> None:
        self.send_continue()

    def _respondToBadRequestAndDisconnect(self) -> None:
        if CHANNEL_BAD_REQUEST_HOOK:
            self.bad_request()
        else:
            super()._respondToBadRequestAndDisconnect()


def channel_protocol(channel: http.HTTPChannel) -> Any:
    """What a site's C{protocol} returns for C{channel}: Twisted's wrapper that can switch to
    HTTP/2 after TLS ALPN where twisted.web speaks HTTP/2 (L{HTTP2}); else the channel itself,
    HTTP/1.1, which is all the wrapper would speak."""
    if HTTP2:
        return _GENERIC_PROTOCOL(channel)
    return channel


# (Looked up once: twisted.web.http is a deprecation proxy, which builds an object per lookup.)
_GENERIC_PROTOCOL: Any = getattr(http, "_GenericHTTPChannelProtocol", None)


SITE_BUILDS_CHANNEL = (
    code_uses(server.Site.buildProtocol, "requestFactory", "site")
    and code_uses(http.HTTPFactory.buildProtocol, "callLater", "timeOut")
    and code_uses(protocol.Factory.buildProtocol, "protocol", "factory")
)
"""A C{Site}'s C{buildProtocol} is C{Factory}'s (the protocol made, given its C{factory}) and
C{HTTPFactory}'s (its C{callLater} and C{timeOut}), and gives the channel the site's
C{requestFactory} and the C{site} itself."""


def built_channel(site: Any, channel: http.HTTPChannel) -> Any:
    """What C{site.buildProtocol} returns for a C{channel} its C{protocol} made: the settings of
    the three C{buildProtocol}s it goes through given in one call, once per connection, but for the
    scheduler of its idle timeout, which the caller gives it (relayd's clock); C{None} when they are
    not known (or Twisted's HTTP/1.1-or-2 wrapper is needed, L{channel_protocol}): the caller then
    calls C{buildProtocol}."""
    if not SITE_BUILDS_CHANNEL or HTTP2:
        return None
    channel.factory = site
    channel.timeOut = site.timeOut
    channel.requestFactory = site.requestFactory
    channel.site = site  # type: ignore[attr-defined]
    return channel


def channel_of(protocol: Any) -> Any:
    """The C{HTTPChannel} in a site's protocol (unwrapping L{channel_protocol})."""
    return getattr(protocol, "_channel", protocol)


def take_over(transport: Any, channel: Any, protocol: Any, producer: Any) -> bool:
    """Make C{protocol} the protocol of C{transport} in place of the site protocol around C{channel},
    and C{producer} (a push producer) its producer instead of C{channel} (L{tcp.hand_over}: C{False},
    nothing changed, unless that transport can be handed over and its protocol is C{channel}'s)."""
    if channel_of(getattr(transport, "protocol", None)) is not channel:
        return False
    return hand_over(transport, protocol, producer)
