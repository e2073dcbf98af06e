"""The fence's twisted.internet entries: a TCP transport's write buffers and its protocol, and the
public transport helpers beside them (Nagle, reading paused under TLS).

Twisted's C{transport.write} queues the bytes, registers the socket for writability, and sends them
on the next reactor iteration, then unregisters it: three system calls per write. When nothing is
queued on the transport, L{write_now} sends at once (one system call) and hands only what the kernel
did not take to C{transport.write}, so ordering and backpressure stay Twisted's. What each shortcut
saves is measured in docs/performance.md ("Twisted internals").
"""

from __future__ import annotations

import _socket
import socket
from typing import Any

from twisted.internet import abstract, error, main, tcp
from twisted.python.failure import Failure

from relayd.compat.detect import code_uses

PLAIN_TCP = (tcp.Server, tcp.Client)
"""The transports whose buffers the shortcuts know (not TLS, not UNIX sockets)."""

TCP_BUFFERS = code_uses(abstract.FileDescriptor.doWrite, "_tempDataBuffer", "dataBuffer", "offset")
"""A FileDescriptor queues writes in C{_tempDataBuffer} and C{dataBuffer[offset:]}."""
HOLD_WRITES = TCP_BUFFERS and code_uses(abstract.FileDescriptor.write, "startWriting")
"""C{write} registers the socket for writability through C{startWriting}, which can be held."""
CLOSE_NOW = HOLD_WRITES and code_uses(abstract.FileDescriptor.doWrite, "disconnecting", "_postLoseConnection")
"""C{doWrite} answers C{CONNECTION_DONE} once a connection asked to close has sent everything (what
the reactor then closes, L{release_writes} can close at once)."""
SEND_AT_ONCE = (
    HOLD_WRITES
    and code_uses(abstract.FileDescriptor.doWrite, "_tempDataLen", "producer", "producerPaused", "_writeDisconnecting")
    and code_uses(tcp.Connection.writeSomeData, "socket", "SEND_LIMIT")
)
"""C{doWrite}'s bookkeeping is what L{release_writes} can do itself for an answer sent whole: its
buffers, its producer (resumed only when paused) and a half-close asked for meanwhile."""
CLOSE_AT_ONCE = SEND_AT_ONCE and all(
    cls._postLoseConnection is abstract.FileDescriptor._postLoseConnection for cls in PLAIN_TCP
)
"""A plain TCP connection asked to close is done once its buffers are sent (its C{_postLoseConnection}
is C{FileDescriptor}'s, C{CONNECTION_DONE}): L{release_writes} can send a closing answer and close
without C{doWrite}."""
# One Failure for every connection closed here, as the reactor shares one (its _disconnectSelectable).
_CLOSED = Failure(main.CONNECTION_DONE)


def nothing_queued(transport: Any) -> bool:
    """Whether C{transport} is a plain TCP connection, open, with no byte waiting in its buffers.

    C{False} whenever that cannot be known: the caller then goes through C{transport.write}.
    """
    return (
        TCP_BUFFERS
        and type(transport) in PLAIN_TCP
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
        and type(transport) in PLAIN_TCP
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
        or type(transport) not in PLAIN_TCP
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
        # A close asked for meanwhile (an answer that closes its connection). Twisted would register
        # the socket for writing, send on the next reactor turn, unregister it and close: when
        # everything goes now, the connection closes now as the reactor would have closed it (two
        # epoll calls and a reactor turn fewer per connection that closes after one answer).
        if CLOSE_NOW:
            if CLOSE_AT_ONCE and transport.offset == len(transport.dataBuffer) and _close_sent(transport):
                return
            try:
                why = transport.doWrite()
            except Exception:
                why = None  # (Twisted's own write path will see it again and report it)
            if isinstance(why, error.ConnectionDone):
                # (The reactor would remove the socket from its reader and writer sets first;
                # connectionLost does that itself, FileDescriptor.connectionLost's stopReading
                # and stopWriting.)
                transport.connectionLost(_CLOSED)
                return
            if not transport.connected:
                return
        transport.startWriting()  # the rest is the reactor's to flush, then close
        return
    queued = transport._tempDataBuffer
    if transport.offset == len(transport.dataBuffer):  # (nothing older left to send)
        if not queued:
            return
        if SEND_AT_ONCE and _send_held(transport, queued):
            return
    try:
        failed = transport.doWrite() is not None
    except Exception:
        failed = True
    if failed or transport._tempDataBuffer or transport.offset < len(transport.dataBuffer):
        transport.startWriting()  # the rest (or the error) is the reactor's to handle


def _close_sent(transport: Any) -> bool:
    """Send what was queued while writes were held by a connection asked to close, with one
    C{send}, and close it once all of it went (as the reactor closes it when C{doWrite} answers
    C{CONNECTION_DONE}, without the calls around: C{doWrite}'s join and bookkeeping, a writability
    watch removed that was never set, the reactor's own removal of the socket, which
    C{connectionLost} does again); the rest, if the kernel took only part, is the reactor's to send,
    then close. C{False}, nothing changed, as L{_send_held}: C{doWrite} then does it all."""
    if _more_for_doWrite(transport):
        return False  # (doWrite resumes the producer, or half-closes, rather than close)
    queued = transport._tempDataBuffer
    if queued:
        sent = _send_once(transport, queued)
        if sent is None:
            return False
        if transport.offset < len(transport.dataBuffer):
            transport.startWriting()  # the rest is the reactor's to send, then close
            return True
    transport.connectionLost(_CLOSED)
    return True


def _send_held(transport: Any, queued: list[bytes]) -> bool:
    """Send what was queued while writes were held with one C{send}; C{True} when that is done: all
    of it went (the usual answer, a few hundred bytes: Twisted's C{doWrite} would join the same list,
    send it through three more calls and unwatch a socket that was never watched), or the rest is
    queued and the socket watched, as C{doWrite} leaves it. C{False}, nothing changed, when the send
    failed or C{doWrite} has more to do than clear the buffers (a producer to resume, a half-close):
    C{doWrite} then does it all."""
    if _more_for_doWrite(transport) or _send_once(transport, queued) is None:
        return False
    if transport.offset == len(transport.dataBuffer):
        transport.stopWriting()  # (watched only if it was before writes were held)
    else:
        transport.startWriting()  # the rest is the reactor's to send
    return True


def _more_for_doWrite(transport: Any) -> bool:
    """Whether C{doWrite} has more to do once the buffers are sent: a paused (or pulling) producer
    to resume, a half-close asked for."""
    producer = transport.producer
    return (producer is not None and (transport.producerPaused or not transport.streamingProducer)) or bool(
        transport._writeDisconnecting
    )


def _send_once(transport: Any, queued: list[bytes]) -> int | None:
    """Send C{queued} (the transport's queue, its buffer empty) with one C{send}: how much went, the
    queue then empty and the buffer what did not go, as C{doWrite} leaves them; C{None}, nothing
    changed, when it is over C{doWrite}'s send limit or the send failed."""
    data = queued[0] if len(queued) == 1 else b"".join(queued)
    if len(data) > transport.SEND_LIMIT:
        return None
    try:
        sent: int = transport.socket.send(data)
    except OSError:
        return None  # (would block, or an error doWrite's own send sees again and reports)
    transport._tempDataBuffer, transport._tempDataLen = [], 0
    transport.dataBuffer, transport.offset = (b"", 0) if sent == len(data) else (data, sent)
    return sent


TCP_PROTOCOL = (
    code_uses(tcp.Connection._dataReceived, "protocol", "dataReceived")
    and code_uses(tcp.Connection.readConnectionLost, "protocol")
    and code_uses(tcp.Connection.connectionLost, "protocol")
)
"""A TCP connection hands what it reads, and its loss, to whatever its C{protocol} attribute holds
when it happens (so another protocol can take the connection over)."""


def hand_over(transport: Any, protocol: Any, producer: Any) -> bool:
    """Make C{protocol} the protocol of C{transport}, and C{producer} (a push producer) its producer.

    C{False}, nothing changed, unless C{transport} is a plain TCP server connection, open, that has
    not paused its producer (what it has queued is then within its buffer; more pauses C{producer}).
    The caller checks that the transport's protocol is the one it means to replace.
    """
    if (
        not TCP_PROTOCOL
        or type(transport) is not tcp.Server
        or not transport.connected
        or transport.disconnecting
        or transport.producerPaused
    ):
        return False
    transport.unregisterProducer()
    transport.registerProducer(producer, True)
    transport.protocol = protocol
    transport.resumeProducing()  # (a channel handling a request may have stopped reading)
    return True


SERVER_PEER_HOST = code_uses(tcp.Server.__init__, "client", "hostname") and code_uses(tcp.Server.getPeer, "client")
"""A TCP server connection keeps its peer's host in C{hostname} (C{client[0]}), from which
C{getPeer} builds its address."""


def peer_host(transport: Any) -> Any:
    """The host of C{transport}'s peer (C{getPeer().host}; C{None} when its address has none: a
    UNIX socket's). A plain TCP server connection's is read without its address built (an attrs
    object, validated, per call)."""
    if SERVER_PEER_HOST and type(transport) is tcp.Server:
        return transport.hostname
    return getattr(transport.getPeer(), "host", None)


_SOCKET_FAMILY = _socket.socket.__dict__["family"].__get__  # (the number, not socket.family's enum)
_SOCKET_TYPE = _socket.socket.__dict__["type"].__get__

QUICK_ACCEPT = code_uses(getattr(tcp, "_accept", None), "accept") and code_uses(
    socket.socket.accept, "_accept", "family", "type", "proto", "getdefaulttimeout", "gettimeout", "setblocking"
)
"""A TCP port accepts through its listening socket's C{accept}, which is Python's: the connection's
socket made with the listening one's family, type and protocol."""


class _QuickAccept(socket.socket):
    """A listening socket whose C{accept} is Python's, given its family and type as the numbers
    they are: Python's converts both to enums for each connection (two of its properties, four
    calls into the enum module), which the new socket's constructor turns back into numbers."""

    __slots__ = ()

    def accept(self) -> tuple[socket.socket, Any]:
        fd, addr = self._accept()  # type: ignore[attr-defined]
        sock = socket.socket(_SOCKET_FAMILY(self), _SOCKET_TYPE(self), self.proto, fileno=fd)
        if socket.getdefaulttimeout() is None and self.gettimeout():
            sock.setblocking(True)  # (as Python's: issue 7995)
        return sock, addr


def quick_accept(port: Any) -> bool:
    """Have C{port}, a listening TCP port, accept its connections through L{_QuickAccept};
    C{False}, nothing changed, when it is not a plain TCP port on a Python socket (or its accept
    is not the one this knows)."""
    if not QUICK_ACCEPT or type(port) is not tcp.Port or type(getattr(port, "socket", None)) is not socket.socket:
        return False
    port.socket.__class__ = _QuickAccept
    return True


def no_delay(transport: Any) -> None:
    """Disable Nagle's algorithm: a stream's small writes must not wait for the previous ACK."""
    try:
        transport.setTcpNoDelay(True)
    except (AttributeError, OSError):
        pass  # not TCP (a UNIX socket, a test transport)


def _descriptor(transport: Any) -> Any:
    """The socket's own transport under C{transport} (through TLS), or C{None}."""
    for _ in range(4):
        if isinstance(transport, abstract.FileDescriptor):
            return transport
        transport = getattr(transport, "transport", None)
    return None


def pause_reading(transport: Any) -> None:
    """Stop reading from C{transport}'s socket (also under TLS): the peer's sends back up in TCP.

    For a protocol that must not take more requests while it cannot send their answers.
    """
    descriptor = _descriptor(transport)
    if descriptor is not None:
        descriptor.pauseProducing()


def resume_reading(transport: Any) -> None:
    """Read from C{transport}'s socket again (undoes L{pause_reading}; nothing once it is closing)."""
    descriptor = _descriptor(transport)
    if descriptor is not None:
        descriptor.resumeProducing()
