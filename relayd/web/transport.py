"""Writing to a TCP transport without a reactor turn in between, for streams that fan out.

Twisted's C{transport.write} queues the bytes, registers the socket for writability, and sends them
on the next reactor iteration, then unregisters it: three system calls per write. A stream that
receives one small event per turn pays that for every subscriber. When nothing is queued on the
transport, L{write_now} sends at once (one system call) and hands only what the kernel did not take
to C{transport.write}, so ordering and backpressure stay Twisted's.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import abstract, tcp

_DIRECT = (tcp.Server, tcp.Client)


def write_now(transport: Any, data: bytes) -> None:
    """Send C{data} now if C{transport} is a plain TCP connection with nothing queued, else queue it."""
    if (
        type(transport) in _DIRECT
        and transport.connected
        and not transport.disconnecting
        and not transport._tempDataBuffer
        and transport.offset == len(transport.dataBuffer)
    ):
        try:
            sent = transport.socket.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            sent = 0  # let Twisted's own write path see and report the error
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
    the end of that read, with one system call. C{False} when the transport is not plain TCP.
    """
    if type(transport) not in _DIRECT or not transport.connected or "startWriting" in transport.__dict__:
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
