"""Writing to a TCP transport without a reactor turn in between, for streams that fan out.

Twisted's C{transport.write} queues the bytes, registers the socket for writability, and sends them
on the next reactor iteration, then unregisters it: three system calls per write. A stream that
receives one small event per turn pays that for every subscriber. When nothing is queued on the
transport, L{write_now} sends at once (one system call) and hands only what the kernel did not take
to C{transport.write}, so ordering and backpressure stay Twisted's. Those writes need Twisted's
private transport state: they are defined in L{relayd.web.twisted_internals} and re-exported here.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import abstract

# The writes that reach into Twisted's transport state live with the other shortcuts.
from relayd.web.twisted_internals import hold_writes, release_writes, write_now

__all__ = ["hold_writes", "no_delay", "pause_reading", "release_writes", "resume_reading", "write_now"]


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
