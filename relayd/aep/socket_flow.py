"""The flow of an AEP WebSocket connection: what it sends, paced, and what it reads, fairly.

Outbound, every message is queued and the factory flushes each connection written to once per
reactor turn (small messages coalesced, a burst of C{FLUSH_AT} handed over at once so that a client
that does not read pauses the connection and the backlog bounds apply); a replay is pulled a chunk
per turn through the one pacer (L{relayd.web.streams.pacing}). Inbound, a connection handles at
most C{MESSAGES_PER_TURN} messages before it gives way to the others, and what it sends while it is
busy (a replay being sent, the client not reading, a subscription waiting for its turn to start)
waits, unread, in order.

A subscription's start (its filter compiled, its place in the index, its replay begun) is a
newcomer's work, as a new connection's first request is: when thousands of connections subscribe
in one reactor turn, the site's admission (L{relayd.web.admission}, the one count of newcomers
started per turn, shared with the HTTP channel) starts its share and the rest L{wait_for_turn}:
each keeps what it was asked, is started in arrival order on a later turn (L{admitted}), and
handles nothing it sent after it meanwhile.

L{relayd.aep.websocket.AEPSocket} is the AEP protocol on top: the hello gate and the message handlers.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Protocol, cast

from autobahn.twisted.websocket import WebSocketServerProtocol
from twisted.internet.interfaces import IConsumer, IPushProducer
from twisted.logger import Logger
from zope.interface import implementer

from relayd.aep.core.backlog import HARD_BACKLOG
from relayd.aep.core.event import Event
from relayd.base.clock import Timekeeper
from relayd.compat.autobahn import ws_data_received, ws_frames_direct
from relayd.compat.tcp import pause_reading, resume_reading, write_now
from relayd.web.admission import Admission
from relayd.web.streams.pacing import Pacer

FLUSH_AT = 64 * 1024  # coalesce small messages per reactor turn, but never hold back a burst
# Messages one connection has handled before it gives way to the others for a reactor turn: one read
# can bring a thousand small requests (a `roster` costs about 20 us), and twenty such clients held
# every other connection for a second.
MESSAGES_PER_TURN = 100


class FlowFactory(Protocol):
    """What a connection's flow needs of its factory: one flush per turn for all, and the clock."""

    clock: Timekeeper

    def schedule(self, conn: SocketFlow) -> None: ...


@implementer(IPushProducer)
class _Backpressure:
    """The connection's push producer: the transport pauses it while the client does not read."""

    def __init__(self, conn: SocketFlow) -> None:
        self.conn = conn

    def pauseProducing(self) -> None:
        self.conn.paused = True

    def resumeProducing(self) -> None:
        self.conn.drained()

    def stopProducing(self) -> None:
        self.conn.paused = True


class SocketFlow(WebSocketServerProtocol):
    """A WebSocket connection's paced sending and fair reading (the module's docstring)."""

    _log = Logger()  # autobahn owns self.log
    factory: FlowFactory

    def __init__(self) -> None:
        super().__init__()
        self.paused = False  # the transport paused us: the client is not reading what it was sent
        self._queue: list[tuple[Any, Any, Event | None]] = []  # (message, subscription, event)
        self._queued_bytes = 0
        self._dirty = False
        # Messages received while the connection was busy (a replay being read or sent, or the
        # client not reading), handled in order once it is not; the socket is not read meanwhile.
        self._held_messages: deque[tuple[bytes, bool]] | None = None
        self._replaying = False  # from a subscribe until its replay is all queued
        self._replay = Pacer(self._wake)  # the replay being sent, a chunk per turn as the client reads
        self._reading = True
        self._handling = False
        # Messages handled since this connection last gave way to the others; past MESSAGES_PER_TURN
        # its turn is over, and the rest of what it sent waits for the next.
        self._handled = 0
        self._open = False
        self._not_text = False  # a text message was not UTF-8: nothing after it is read
        # The work (a subscription's start) the site's admission starts on a later turn (wait_for_turn).
        self._awaiting_turn: Callable[[], None] | None = None

    def start_flow(self) -> None:
        """The connection is open: the client's reading paces what is sent (L{_Backpressure})."""
        try:
            # Under WebSocketResource the HTTP channel is still the transport's producer.
            consumer = cast(IConsumer, self.transport)
            consumer.unregisterProducer()
            consumer.registerProducer(_Backpressure(self), True)
        except Exception:
            self._log.failure("could not register the WebSocket producer")
        self._open = True

    def stop_flow(self) -> None:
        """The connection closed: nothing more is sent, read or held."""
        self._open = False
        self._queue = []
        self._queued_bytes = 0
        self._replay.stop()
        self._held_messages = None
        self._awaiting_turn = None  # (the admission passes it over: L{admitted})

    def _on_message(self, payload: bytes, isBinary: bool) -> None:
        raise NotImplementedError

    def _backpressure_close(self) -> None:
        """Cut the connection off: past the hard bound while the client does not read."""
        raise NotImplementedError

    def close_with(self, code: int, reason: str) -> None:
        """Start the closing handshake with a protocol-level code (1001, 1002, 1003, 1007, 1013).

        autobahn's C{sendClose} admits only 1000 and 3000-4999 (application codes); AEP names
        protocol codes, which the frame-level call sends as they are. What is queued (an error
        frame explaining the close) goes first, even to a client that is not reading; nothing is
        sent after the Close frame (L{_enqueue} checks the state), and the socket is read again for
        the client's answer to it.
        """
        self._replay.stop()
        self._write_queue(force=True)
        self.sendCloseFrame(code=code, reasonUtf8=reason.encode("utf-8"), isReply=False)
        self._held_messages = None
        self._awaiting_turn = None  # (nothing it asked is answered after the Close frame)
        self._start_reading()

    def _enqueue(self, message: Any, sub: Any, event: Event | None) -> None:
        """Queue a prepared message; the factory flushes every dirty connection once per turn.

        Every message counts: past the hard bound, while the client is not reading, the
        connection is cut off (L{_backpressure_close}).
        """
        if not self._open or self.state != self.STATE_OPEN:
            return  # nothing may follow a Close frame (RFC 6455 §5.5.1)
        self._queue.append((message, sub, event))
        self._queued_bytes += len(message.payloadHybi)
        if self.paused:
            if self._queued_bytes > HARD_BACKLOG:
                self._backpressure_close()
            return
        if self._queued_bytes >= FLUSH_AT:
            # A burst goes to the transport now, so a client that does not read pauses this
            # connection (and the backlog bounds apply) instead of the burst piling up here.
            self._write_queue()
        elif not self._dirty:
            self._schedule()

    def _schedule(self) -> None:
        self._dirty = True
        self.factory.schedule(self)

    def flush_queue(self) -> None:
        """Queue the next chunk of a replay being sent, then write what is queued (the factory
        calls this once per reactor turn for every connection written to)."""
        self._dirty = False
        if self.paused or not self._open:
            return
        replay = self._replay
        if replay.source is None:  # the usual turn of a live subscriber: nothing to pull
            self._write_queue()
            return
        if self._queued_bytes < FLUSH_AT:
            replay.pull(self._is_open)  # (it may end, and a held subscribe start another)
        self._write_queue()
        if replay.ready and not self.paused and self._open:
            self._wake()  # its next chunk on the next turn, unless the client lags

    def _wake(self) -> None:
        if self._open and not self._dirty:
            self._schedule()

    def _is_open(self) -> bool:
        return self._open

    def _write_queue(self, force: bool = False) -> None:
        """Hand what is queued to the transport, about C{FLUSH_AT} bytes per write, until the
        transport pauses this connection (unless C{force}d: the last words before a Close)."""
        queue = self._queue
        if not queue or (self.paused and not force):
            return
        if self.state != self.STATE_OPEN:
            self._queue = []
            self._queued_bytes = 0
            return
        direct = ws_frames_direct(self)
        start, count = 0, len(queue)
        while start < count and (force or not self.paused):
            if start == 0 and self._queued_bytes <= FLUSH_AT:
                end, size = count, self._queued_bytes  # the usual case: one write of everything
            else:
                end, size = start, 0
                while end < count and size < FLUSH_AT:
                    size += len(queue[end][0].payloadHybi)
                    end += 1
            batch = queue[start:end]
            start = end
            self._queued_bytes -= size
            for _, sub, event in batch:
                if sub is not None and event is not None and event.sequenced:
                    sub.delivered[event.session] = event.position
            if direct:
                # The frames are already framed (prepared once per event for every connection):
                # bypass autobahn's per-message path, which formats a debug log line per send.
                write_now(self.transport, b"".join(message.payloadHybi for message, _, _ in batch))
            else:
                for message, _, _ in batch:
                    self.sendPreparedMessage(message)
        del queue[:start]

    def drained(self) -> None:
        """The client read what was sent: send on, then handle what it sent meanwhile."""
        self.paused = False
        self.flush_queue()
        self._handle_held()

    def dataReceived(self, data: bytes) -> None:
        # autobahn's own formats a debug line per read (its function's and the peer's names, in
        # colour) before it parses: a third of a small message's read, and in a storm of subscribes
        # every connection's read comes in one reactor turn.
        ws_data_received(self, data)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        if self.failedByMe or self._not_text or not self._open:
            return  # after a message that broke the protocol (not UTF-8), or the connection was cut off
        if self.state != self.STATE_OPEN:
            self._handle(payload, isBinary)  # closing: never stop reading (the answer to our Close comes next)
            return
        if self._held_messages is None and not self._busy():
            self._handled += 1
            if self._handled <= MESSAGES_PER_TURN:
                self._handle(payload, isBinary)
                return
            self._give_way()
        # A replay is being read or sent, the client does not read what it was sent, or it had its
        # turn: what it sends now is handled after that, in order, and its socket is not read
        # meanwhile (TCP backpressure), so what waits here is at most what one read brought.
        if self._held_messages is None:
            self._held_messages = deque()
        self._held_messages.append((payload, isBinary))
        self._stop_reading()

    def _busy(self) -> bool:
        return (
            self._replaying or self.paused or self._handled > MESSAGES_PER_TURN or self._awaiting_turn is not None
        )

    def wait_for_turn(self, admission: Admission, start: Callable[[], None]) -> None:
        """C{start} (a newcomer's work: a subscription's) on the turn C{admission} gives it, in
        arrival order; what the client sends meanwhile waits behind it (the socket is read on until
        it sends more: a client that subscribed usually waits for the answer)."""
        self._awaiting_turn = start
        admission.wait(self)

    def admitted(self) -> bool:
        """The admission's turn for the work that waited (L{wait_for_turn}): do it, then what the
        client sent meanwhile; C{False} if the connection closed (it counts for nothing)."""
        start, self._awaiting_turn = self._awaiting_turn, None
        if start is None or not self._open:
            return False
        try:
            start()
        except Exception:
            # (As L{_handle}: a handler bug costs one message; the admission's turn goes on.)
            self._log.failure("AEP WebSocket message handling failed")
        self._handle_held()
        return True

    def _give_way(self) -> None:
        """This connection had its share of the reactor turn (L{_handled} is past the bound): go on
        with it in the next one."""
        self.factory.clock.call_later(0, self._next_turn)

    def _next_turn(self) -> None:
        self._handled = 0
        self._handle_held()

    def _handle_held(self) -> None:
        """Handle the messages that waited, until the connection is busy again; then read on."""
        if self._handling:
            return  # (a held message being handled ended a replay: the loop below goes on)
        self._handling = True
        try:
            held = self._held_messages
            while held and self._open and not self._busy():
                self._handled += 1
                if self._handled > MESSAGES_PER_TURN:
                    self._give_way()
                    break
                payload, isBinary = held.popleft()
                self._handle(payload, isBinary)
        finally:
            self._handling = False
        if self._open and not self._busy() and not self._held_messages:
            self._held_messages = None
            self._start_reading()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            pause_reading(self.transport)

    def _start_reading(self) -> None:
        if not self._reading:
            self._reading = True
            resume_reading(self.transport)

    def replay_sent(self) -> None:
        """A subscription's replay and what it held are all queued: handle the messages that waited."""
        self._replaying = False
        self._handle_held()

    def _handle(self, payload: bytes, isBinary: bool) -> None:
        try:
            self._on_message(payload, isBinary)
        except Exception:
            # A handler bug must cost one message, never the process or the connection.
            self._log.failure("AEP WebSocket message handling failed")
