"""The one place relayd reaches into Twisted's and autobahn's private state.

Every shortcut below is one function (or, for hooks Twisted only offers as private methods, one
method of L{ChannelHooks}). Each is detected once, at import, on the installed classes (the names
the shortcut relies on must appear in the methods of Twisted or autobahn that use them); when a
release drops them the flag is off and the shortcut takes the public path, slower or plainer but
correct. tests/web/test_twisted_internals.py checks each detection over real loopback
connections, checks that each fallback gives the same observable result (or, where no public API
does the same, Twisted's own plainer behaviour), and fails any module outside this one that
touches a Twisted or autobahn private attribute. setup.cfg bounds the
Twisted and autobahn versions so that a new release is admitted only once those tests pass on it.

What each shortcut saves is measured in docs/performance.md ("Twisted internals"). This module
imports no wing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from autobahn.twisted.websocket import WebSocketAdapterProtocol
from autobahn.websocket.protocol import WebSocketProtocol
from twisted.application import service
from twisted.application.internet import StreamServerEndpointService
from twisted.internet import abstract, defer, tcp
from twisted.internet.interfaces import IListeningPort, IStreamServerEndpoint
from twisted.protocols import basic
from twisted.python import components
from twisted.python.failure import Failure
from twisted.python.reflect import prefixedMethodNames
from twisted.web import http, server
from twisted.web import resource as _resource


def code_uses(function: Any, *names: str) -> bool:
    """Whether C{function}'s code refers to every one of C{names} (as attributes or globals)."""
    code = getattr(function, "__code__", None)
    return code is not None and set(names) <= set(code.co_names)


# -- TCP transports ----------------------------------------------------------------------------------

_DIRECT = (tcp.Server, tcp.Client)

TCP_BUFFERS = code_uses(abstract.FileDescriptor.doWrite, "_tempDataBuffer", "dataBuffer", "offset")
"""A FileDescriptor queues writes in C{_tempDataBuffer} and C{dataBuffer[offset:]}."""
HOLD_WRITES = TCP_BUFFERS and code_uses(abstract.FileDescriptor.write, "startWriting")
"""C{write} registers the socket for writability through C{startWriting}, which can be held."""


def nothing_queued(transport: Any) -> bool:
    """Whether C{transport} is a plain TCP connection, open, with no byte waiting in its buffers.

    C{False} whenever that cannot be known: the caller then goes through C{transport.write}.
    """
    return (
        TCP_BUFFERS
        and type(transport) in _DIRECT
        and transport.connected
        and not transport.disconnecting
        and not transport._tempDataBuffer
        and transport.offset == len(transport.dataBuffer)
    )


def write_now(transport: Any, data: bytes) -> None:
    """Send C{data} now if C{transport} is a plain TCP connection with nothing queued, else queue it.

    Twisted's C{transport.write} queues the bytes, registers the socket for writability, and sends
    them on the next reactor iteration, then unregisters it: three system calls per write. A stream
    that receives one small event per turn pays that for every subscriber; here an idle socket gets
    one C{send}, and only what the kernel did not take goes to C{transport.write}, so ordering and
    backpressure stay Twisted's. With the other fan-out changes an SSE delivery to 100 subscribers
    went from 6.3 to 2.0 us (docs/performance.md).
    """
    if (  # nothing_queued(), inline: this runs once per delivery of a fan-out
        TCP_BUFFERS
        and type(transport) in _DIRECT
        and transport.connected
        and not transport.disconnecting
        and not transport._tempDataBuffer
        and transport.offset == len(transport.dataBuffer)
    ):
        try:
            sent = transport.socket.send(data)
        except OSError:
            sent = 0  # would block, or an error Twisted's own write path will see and report
        if sent == len(data):
            return
        data = data[sent:]
    transport.write(data)


def _held() -> None:
    """Stands in for C{startWriting} while writes are held (see L{hold_writes})."""


def hold_writes(transport: Any) -> bool:
    """Until L{release_writes}, let bytes written to C{transport} queue without watching the socket.

    Twisted registers a socket for writability on its first queued write and unregisters it once
    the bytes are sent on the next reactor turn: two system calls around the one that sends. A
    response made while a read is handled (most HTTP answers) is then sent by L{release_writes} at
    the end of that read, with one system call. C{False} (nothing held) when the transport is not
    plain TCP or Twisted's write path is not the one this knows. Single-event POSTs went from
    275-330 to 144 us with this and the cached local address (docs/performance.md).
    """
    if (
        not HOLD_WRITES
        or type(transport) not in _DIRECT
        or not transport.connected
        # (Not "in transport.__dict__": asking for the dict makes one, 61 B per connection kept.)
        or transport.startWriting is _held
    ):
        return False
    transport.startWriting = _held
    return True


def release_writes(transport: Any) -> None:
    """Send what was queued since L{hold_writes}; whatever cannot go now is left to the reactor."""
    del transport.startWriting
    if not transport.connected or getattr(transport, "_aborting", False):
        return
    if transport.disconnecting:
        transport.startWriting()  # a close asked for meanwhile: the reactor flushes, then closes
        return
    if not transport._tempDataBuffer and transport.offset == len(transport.dataBuffer):
        return
    try:
        failed = transport.doWrite() is not None
    except Exception:
        failed = True
    if failed or transport._tempDataBuffer or transport.offset < len(transport.dataBuffer):
        transport.startWriting()  # the rest (or the error) is the reactor's to handle


TCP_PROTOCOL = (
    code_uses(tcp.Connection._dataReceived, "protocol", "dataReceived")
    and code_uses(tcp.Connection.readConnectionLost, "protocol")
    and code_uses(tcp.Connection.connectionLost, "protocol")
)
"""A TCP connection hands what it reads, and its loss, to whatever its C{protocol} attribute holds
when it happens (so another protocol can take the connection over)."""


def take_over(transport: Any, channel: Any, protocol: Any, producer: Any) -> bool:
    """Make C{protocol} the protocol of C{transport} in place of the site protocol around C{channel},
    and C{producer} (a push producer) its producer instead of C{channel}.

    C{False}, nothing changed, unless C{transport} is a plain TCP connection, open, that has not
    paused its producer (what it has queued is then within its buffer; more pauses C{producer}),
    whose protocol is C{channel}'s.
    """
    if (
        not TCP_PROTOCOL
        or type(transport) is not tcp.Server
        or not transport.connected
        or transport.disconnecting
        or transport.producerPaused
        or channel_of(getattr(transport, "protocol", None)) is not channel
    ):
        return False
    transport.unregisterProducer()
    transport.registerProducer(producer, True)
    transport.protocol = protocol
    transport.resumeProducing()  # (a channel handling a request may have stopped reading)
    return True


# -- twisted.web requests ----------------------------------------------------------------------------

REQUEST_DISCONNECTED = code_uses(http.Request.connectionLost, "_disconnected") and code_uses(
    http.Request.write, "_disconnected"
)
"""C{Request._disconnected} says the client went away before the response finished."""
REQUEST_BODY_DIRECT = REQUEST_DISCONNECTED and code_uses(http.Request.write, "chunked", "sentLength")
"""C{Request.write} frames a body by C{chunked} and counts it in C{sentLength} (the access log's
bytes), so body bytes can be framed by the caller and written to the transport directly."""


def request_gone(request: Any) -> bool:
    """Whether C{request}'s client disconnected before its response finished.

    It saves no time: 0.19 us against the public reading's 0.17 (the request lost its channel
    without finishing; bench/internals.py). The attribute is Twisted's own record where the reading
    infers it; the two differ only for a finished response whose connection dropped before Twisted
    cleaned it up (gone here, not there), which every caller also tests as C{request.finished}.
    """
    if REQUEST_DISCONNECTED:
        return bool(getattr(request, "_disconnected", False))
    return getattr(request, "channel", None) is None and not getattr(request, "finished", False)


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
        and type(transport) in _DIRECT
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
"""Private request state that a streaming response never reads (relayd.web.slim drops it: 64 B)."""


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


CHANNEL_HEADER_COUNTS = code_uses(http.HTTPChannel.lineReceived, "_receivedHeaderSize") and code_uses(
    http.HTTPChannel.headerReceived, "_receivedHeaderCount"
)
CHANNEL_PIPELINE = code_uses(http.HTTPChannel.requestDone, "_waitingForTransport", "_networkProducer")
CHANNEL_LENGTH_HOOK = hasattr(http.HTTPChannel, "_maybeChooseTransferDecoder")
CHANNEL_BAD_REQUEST_HOOK = hasattr(http.HTTPChannel, "_respondToBadRequestAndDisconnect")
GENERIC_CHANNEL = hasattr(http, "_GenericHTTPChannelProtocol")
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
    HTTP/2 after TLS ALPN (the channel itself, HTTP/1.1 only, if the wrapper is gone)."""
    if GENERIC_CHANNEL:
        return http._GenericHTTPChannelProtocol(channel)
    return channel


def channel_of(protocol: Any) -> Any:
    """The C{HTTPChannel} in a site's protocol (unwrapping L{channel_protocol})."""
    return getattr(protocol, "_channel", protocol)


ALLOWED_METHODS = hasattr(_resource, "_computeAllowedMethods")


def allowed_methods(found: Any) -> list[bytes]:
    """The methods a resource has a C{render_} method for, as Twisted lists them for a C{405}."""
    if ALLOWED_METHODS:
        return list(_resource._computeAllowedMethods(found))
    return [name.encode("ascii") for name in prefixedMethodNames(found.__class__, "render_")]


# -- listening ----------------------------------------------------------------------------------------

LISTEN_STATE = code_uses(StreamServerEndpointService.privilegedStartService, "_raiseSynchronously", "_waitingForPort")
"""C{StreamServerEndpointService} keeps its listen Deferred and can raise a bind error at start."""


class _StrictListener(StreamServerEndpointService):
    """The fallback listener: raises a bind error from C{privilegedStartService} (as strports
    does), through nothing but C{endpoint.listen}."""

    def __init__(self, endpoint: IStreamServerEndpoint, factory: Any) -> None:
        super().__init__(endpoint, factory)
        self.listening: defer.Deferred[IListeningPort] | None = None

    def privilegedStartService(self) -> None:
        service.Service.privilegedStartService(self)
        failed: list[Any] = []
        starting = True

        def now(failure: Any) -> Any:
            if starting:
                failed.append(failure)
                return None  # raised below
            return failure  # a later failure is for whoever waits on bound_port()

        self.listening = self.endpoint.listen(self.factory)
        self.listening.addErrback(now)
        starting = False
        if failed:
            failed[0].raiseException()

    def startService(self) -> None:
        service.Service.startService(self)
        if self.listening is None:
            self.privilegedStartService()

    def stopService(self) -> Any:
        listening: Any = self.listening
        self.listening = None
        self.running = False
        if listening is None:
            return defer.succeed(None)
        listening.cancel()
        return listening.addCallback(lambda port: port.stopListening()).addErrback(lambda f: None)


def listening_service(endpoint: IStreamServerEndpoint, factory: Any) -> StreamServerEndpointService:
    """A service listening on C{endpoint}; a port that cannot be bound fails startup, as strports does."""
    if not LISTEN_STATE:
        return _StrictListener(endpoint, factory)
    svc = StreamServerEndpointService(endpoint, factory)
    svc._raiseSynchronously = True
    return svc


def bound_port(svc: StreamServerEndpointService) -> defer.Deferred[IListeningPort]:
    """Fires with C{svc}'s port once it is bound (C{svc} from L{listening_service}, started)."""
    if isinstance(svc, _StrictListener):
        return svc.listening  # type: ignore[return-value]
    return svc._waitingForPort  # type: ignore[return-value]


# -- autobahn -----------------------------------------------------------------------------------------

WS_SEND_STATE = code_uses(WebSocketProtocol.sendPreparedMessage, "_perMessageCompress") and code_uses(
    WebSocketProtocol.sendData, "send_queue"
)
"""autobahn compresses per message when C{_perMessageCompress} is set and queues in C{send_queue}."""
WS_RECEIVE_STATE = code_uses(WebSocketProtocol.processData, "current_frame", "inside_message", "data", "_perMessageCompress")
"""autobahn's parser is between frames when it has no current frame, message or buffered data."""
WS_QUIET_RECEIVE = hasattr(WebSocketProtocol, "_dataReceived") and code_uses(
    WebSocketAdapterProtocol.dataReceived, "_dataReceived"
)
"""autobahn's C{dataReceived} formats a debug line, then parses in C{_dataReceived}."""


def ws_frames_direct(protocol: Any) -> bool:
    """Whether frames already framed for C{protocol} may be written to its transport directly.

    autobahn's per-message send path formats a debug log line per message; frames prepared once per
    event for every connection then cost a write each: a WebSocket delivery to 100 subscribers went
    from 15.4 to 3.2 us with the fan-out's other changes (docs/performance.md).
    """
    return WS_SEND_STATE and protocol._perMessageCompress is None and not protocol.send_queue


def ws_parser_idle(protocol: Any) -> bool:
    """Whether C{protocol}'s parser is between messages and uncompressed: complete plain frames at
    the head of a read may be handled without it (the broker host's relay client)."""
    return (
        WS_RECEIVE_STATE
        and protocol.current_frame is None
        and not protocol.inside_message
        and not protocol.data
        and protocol._perMessageCompress is None
    )


def ws_data_received(protocol: Any, data: bytes) -> None:
    """Hand C{data} to autobahn's parser without its per-read debug-log formatting (6-8 us per
    read, bench/internals.py)."""
    if WS_QUIET_RECEIVE:
        protocol._dataReceived(data)
    else:
        WebSocketAdapterProtocol.dataReceived(protocol, data)

