"""Server-Sent Events: immediate headers, framing, one shared heartbeat, coalesced writes, backpressure.

Writes to a stream are queued and flushed once per reactor turn for all streams together, so a burst
of events costs one C{write} per subscriber instead of one per event. Each stream is the push producer
of its response: while the client does not read, the transport pauses it and its queue grows up to
C{max_buffer} bytes; past that the stream is aborted (the client reconnects and resumes). What lagging
clients hold together is bounded too (the hub's C{max_lagging}): thousands of streams each just under
their own bound would otherwise add up to gigabytes.

What a stream sends from a large source (a replay) is pulled from it with L{SSEStream.produce}, a
chunk per reactor turn and only while the transport is not paused: a client that does not read costs
one chunk, not the whole source.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import Request
from zope.interface import implementer

from relayd.base.clock import NextTurn, Timekeeper
from relayd.compat.tcp import no_delay
from relayd.compat.web import body_framing, send_body, slim_stream, watch_end
from relayd.web.streams.held import HeldResponse, hold
from relayd.web.streams.pacing import Pacer, Source

DEFAULT_MAX_BUFFER = 8 * 1024 * 1024
DEFAULT_MAX_LAGGING = 256 * 1024 * 1024  # every lagging stream of one hub (one wing) together
BEAT_SLICE = 1000  # streams one reactor turn sends the heartbeat to (about 10-25 ms of sends)


def sse_event(data: bytes, event: bytes | None = None, id: bytes | None = None) -> bytes:
    """One SSE event: C{event:}, C{data:} and C{id:} lines (in that order) and a blank line.

    C{data} must hold no line break; callers serialise compactly when it might.
    """
    parts = []
    if event is not None:
        parts.append(b"event: " + event + b"\n")
    parts.append(b"data: " + data + b"\n")
    if id is not None:
        parts.append(b"id: " + id + b"\n")
    parts.append(b"\n")
    return b"".join(parts)


def http_chunk(data: bytes) -> bytes:
    """C{data} as one HTTP/1.1 chunk (what a chunked response carries on the wire)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def sse_comment(text: str | bytes) -> bytes:
    """An SSE comment line followed by a blank line."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return b": " + text + b"\n\n"


@implementer(IPushProducer)
class SSEStream:
    """One open C{text/event-stream} response."""

    # Thousands of these sit idle per process: no per-instance __dict__.
    __slots__ = (
        "request", "hub", "max_buffer", "on_close", "closed", "paused", "discarded",
        "_pending", "_pending_bytes", "_lagging", "_dirty", "_transport", "_chunked", "_encoded", "_pacer",
        "_held",
    )

    _log = Logger()

    def __init__(
        self,
        request: Request,
        hub: SSEHub,
        *,
        max_buffer: int = DEFAULT_MAX_BUFFER,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.request: Request | None = request  # None once the stream has left twisted.web (start)
        self.hub = hub
        self.max_buffer = max_buffer
        self.on_close = on_close
        self.closed = False
        self.paused = False
        self.discarded = 0
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._lagging = 0  # of the pending bytes, those queued while paused (counted in the hub's total)
        self._encoded: bytes | None = None
        self._dirty = False
        self._transport: Any = None
        self._chunked = False
        self._pacer: Pacer | None = None  # a source's, while it has more (L{produce})
        self._held: HeldResponse | None = None

    @property
    def backlog(self) -> int:
        """Bytes queued because the client is not reading (0 while the transport accepts writes).

        Writes made while the transport accepts data are handed over at the end of the reactor
        turn whatever their size (a large replay is not a slow client); only what piles up while
        the transport has paused this producer counts against the bounds.
        """
        return self._pending_bytes if self.paused else 0

    def start(self, headers: Iterable[tuple[bytes, bytes]], preamble: bytes = b"", *, held: bool = False) -> None:
        """Send C{200} and the headers now (a live-only subscriber sees them at once).

        A C{held} stream is one that stays open until one side ends it (a subscription, not the
        answer to one request): its connection leaves twisted.web once the headers are sent and is
        closed when the stream ends (relayd.web.streams.held).
        """
        request = self.request
        assert request is not None, "a stream starts once"
        request.setResponseCode(200)
        for name, value in headers:
            request.responseHeaders.setRawHeaders(name, [value])
        request.registerProducer(self, True)
        request.write(preamble)  # writes the status line and headers even when the preamble is empty
        # The query has been read and the headers are on the wire: a stream can stay open for days,
        # so what it no longer reads goes (the headers and more: slim_stream below).
        request.args = {}
        # Frames go straight to the TCP transport (chunk-framed here): the request's write path
        # costs more than the frame itself on a fan-out of one small event per reactor turn.
        self._transport = getattr(request.channel, "transport", None)
        self._chunked = body_framing(request)[0]
        no_delay(self._transport)
        self.hub.add(self)
        if held:
            self._held = hold(request, self)
            if self._held is not None:
                self.request = None
                return
        watch_end(request, self)
        slim_stream(request)

    def write(self, chunk: bytes, encoded: bytes | None = None) -> bool:
        """Queue pre-framed bytes; C{False} if the stream is closed or just overflowed.

        C{encoded} is C{chunk} already in HTTP chunked form (L{http_chunk}), made once for every
        subscriber of a fan-out: a stream that sends just that one frame sends it as it is.
        """
        if self.closed:
            return False
        pending = self._pending
        self._encoded = encoded if not pending else None
        pending.append(chunk)
        self._pending_bytes += len(chunk)
        if self.paused:
            hub = self.hub
            self._lagging += len(chunk)
            hub.lagging += len(chunk)
            if self._pending_bytes > self.max_buffer or hub.lagging > hub.max_lagging:
                self._overflow()
                return False
        if not self._dirty and not self.paused:
            self._dirty = True
            hub = self.hub  # (SSEHub.schedule, inline: this runs once per delivery of a fan-out)
            hub._dirty.append(self)
            if hub._flush_turn.scheduled is None:
                hub._flush_turn.request()
        return True

    def produce(self, source: Source) -> None:
        """Pull what to send from C{source} as the client reads (L{Pacer}): a chunk per reactor turn
        while the transport is not paused (and again when it drains), never while the client lags.

        The first chunk is pulled now rather than on the next turn: a stream starts while its
        request's read is handled, when the response headers are still queued on the transport
        (relayd.compat.tcp.hold_writes), so headers and the first chunk of a replay leave in one
        C{send} instead of two (docs/performance.md, "Issue 24: the subscriber storm in slices")."""
        self._pacer = Pacer(self._schedule, source)
        self.flush()

    def _schedule(self) -> None:
        if not self._dirty and not self.closed:
            self._dirty = True
            self.hub.schedule(self)

    def flush(self) -> None:
        """Hand everything queued to the transport (called by the hub once per reactor turn)."""
        self._dirty = False
        if self.closed or self.paused:
            return
        pacer = self._pacer
        if pacer is not None:
            if pacer.pull(self._open):
                self._schedule()  # its next chunk on the next turn, unless the transport pauses us
            elif pacer.source is None and self._pacer is pacer:
                self._pacer = None  # (done: an idle stream holds no pacer)
            if self.closed:
                return
        pending = self._pending
        if not pending:
            return
        if len(pending) == 1:  # (a fan-out of one event per turn: its chunk was made once for all)
            data = pending[0]
            encoded = self._encoded
        else:
            data = b"".join(pending)
            encoded = None
        pending.clear()  # (the list is kept: nothing allocated per delivery)
        self._pending_bytes = 0
        if self._lagging:
            self._release_lagging()
        self._encoded = None
        framed = (encoded if encoded is not None else http_chunk(data)) if self._chunked else data
        held = self._held
        if held is not None:
            held.send(data, framed)
        else:
            send_body(self.request, self._transport, data, framed)

    def _open(self) -> bool:
        return not self.closed

    def close(self, final: bytes = b"") -> None:
        """Send what is queued plus C{final}, then end the response."""
        if self.closed:
            return
        if final:
            self._pending.append(final)
        self.paused = False
        self.flush()
        self._end()
        request = self.request
        if self._held is not None:
            self._held.finish()
        elif request is not None:
            try:
                request.unregisterProducer()
                request.finish()
            except RuntimeError:
                pass  # the connection went away meanwhile

    def abort(self) -> None:
        """Drop the connection without sending what is queued."""
        if self.closed:
            return
        self._end()
        if self._held is not None:
            self._held.abort()
            return
        transport = getattr(getattr(self.request, "channel", None), "transport", None)
        if transport is not None:
            transport.abortConnection()

    def _overflow(self) -> None:
        self.discarded = len(self._pending)  # frames dropped with the stream, for the wing's metrics
        self._log.debug("SSE subscriber overflowed its {max} byte buffer (or the hub's {total}); aborting",
                        max=self.max_buffer, total=self.hub.max_lagging)
        self.abort()

    def _release_lagging(self) -> None:
        if self._lagging:
            self.hub.lagging -= self._lagging
            self._lagging = 0

    def _end(self) -> None:
        self.closed = True
        self._pending = []
        self._pending_bytes = 0
        self._release_lagging()
        self._pacer = None
        self.hub.discard(self)
        callback, self.on_close = self.on_close, None
        if callback is not None:
            callback()

    # How the request ends, told as its notifyFinish Deferred would be (watch_end): a Deferred per
    # stream would hold its callbacks as well.

    def callback(self, result: None) -> None:
        """The response finished."""
        self._finished()

    def errback(self, reason: Failure) -> None:
        """The client went away before the response finished."""
        self._finished()

    def _finished(self) -> None:
        if self.closed:
            return
        try:
            self._end()
        except Exception:
            # Called from within Twisted's finish or connectionLost, as a Deferred's callback would
            # be, and as contained: the request's other notifications still fire.
            self._log.failure("ending an SSE stream failed")

    # IPushProducer

    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False
        if self._pending or self._pacer is not None:
            self._schedule()

    def stopProducing(self) -> None:
        # Called from within the transport's connectionLost once the stream is held: contained there
        # too, as the rest of that cleanup (closing the socket) must still run.
        self._finished()


class SSEHub:
    """The open streams of one wing: one shared heartbeat, one flush per reactor turn, drain."""

    def __init__(
        self, clock: Timekeeper, heartbeat_interval: float, heartbeat: bytes, *, max_lagging: int = DEFAULT_MAX_LAGGING
    ) -> None:
        self.clock = clock
        self.max_lagging = max_lagging
        self.lagging = 0  # bytes queued for clients that do not read, every stream together
        self.heartbeat = heartbeat
        self.heartbeat_interval = heartbeat_interval
        self.streams: set[SSEStream] = set()
        self._dirty: list[SSEStream] = []
        self._flush_turn = NextTurn(clock, self.flush)
        self._beating: list[SSEStream] = []  # the streams of the heartbeat round in progress
        self._beat_next = 0  # where in _beating the next slice starts
        self._beat_turn = NextTurn(clock, self._beat_slice)
        self._loop = clock.looping_call(heartbeat_interval, self.beat)

    def add(self, stream: SSEStream) -> None:
        self.streams.add(stream)

    def discard(self, stream: SSEStream) -> None:
        self.streams.discard(stream)

    def schedule(self, stream: SSEStream) -> None:
        """Flush C{stream} at the end of this reactor turn, together with every other dirty stream.

        (L{SSEStream.write} does this inline: it runs once per delivery of a fan-out.)"""
        self._dirty.append(stream)
        if self._flush_turn.scheduled is None:  # (the hot path: no call once it is)
            self._flush_turn.request()

    def flush(self) -> None:
        """Flush every stream written to since the last flush."""
        dirty, self._dirty = self._dirty, []
        for stream in dirty:
            stream.flush()

    def beat(self) -> None:
        """Send the heartbeat to every open stream, L{BEAT_SLICE} streams per reactor turn.

        One turn for every stream held the reactor for half a second at 20,000 streams (each
        write is a send); in slices, requests and deliveries run between them.
        """
        if self._beating:
            return  # the previous round is still going (a very large hub): it covers this one
        self._beating = list(self.streams)
        self._beat_next = 0
        self._beat_slice()

    def _beat_slice(self) -> None:
        start = self._beat_next
        end = self._beat_next = start + BEAT_SLICE
        for stream in self._beating[start:end]:
            stream.write(self.heartbeat)  # a stream closed since the round began refuses it
        if end < len(self._beating):
            self._beat_turn.request()
        else:
            self._beating = []

    def drain(self, final: bytes) -> None:
        """End every open stream with C{final} (for shutdown)."""
        for stream in list(self.streams):
            stream.close(final)

    def stop(self) -> None:
        """Stop the heartbeat."""
        self.clock.stop_loop(self._loop)
        self._beat_turn.cancel()
        self._beating = []
