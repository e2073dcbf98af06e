"""Writing to a TCP transport without a reactor turn in between, for streams that fan out.

Twisted's C{transport.write} queues the bytes, registers the socket for writability, and sends them
on the next reactor iteration, then unregisters it: three system calls per write. A stream that
receives one small event per turn pays that for every subscriber. When nothing is queued on the
transport, L{write_now} sends at once (one system call) and hands only what the kernel did not take
to C{transport.write}, so ordering and backpressure stay Twisted's.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.internet import tcp

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


def no_delay(transport: Any) -> None:
    """Disable Nagle's algorithm: a stream's small writes must not wait for the previous ACK."""
    try:
        transport.setTcpNoDelay(True)
    except (AttributeError, OSError, socket.error):
        pass  # not TCP (a UNIX socket, a test transport)
