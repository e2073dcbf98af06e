"""Cheap clients for thousands of connections (L{HeldConnection}, L{open_many}), a server's memory from
/proc, and this process's open-file limit raised for them."""

from __future__ import annotations

import base64
import os
import resource
from typing import Any, Callable

from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.protocol import ClientFactory, Protocol

from tests.support.skips import missing

TIMEOUT = 30.0


def require_open_files(needed: int) -> None:
    """Raise our soft open-file limit; skip (fail under CI=true) when the hard limit is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        missing(f"needs {needed} open files, the hard limit allows {soft} (raise it: ulimit -n)")


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak RSS) of a process, in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                out[name] = int(value.split()[0]) * 1024
    return out


class HeldConnection(Protocol):
    """Sends one request, fires C{ready} once the response headers (or a 101) arrived, then idles.

    It reads (and forgets) whatever follows unless C{stop_reading} is set, in which case it stops
    reading from the socket as soon as the headers are in: a consumer that never reads.
    """

    def __init__(self, request: bytes, stop_reading: bool = False, watch: bytes | None = None) -> None:
        self.request = request
        self.stop_reading = stop_reading
        self.watch = watch
        self.ready: Deferred[bytes] = Deferred()
        self.seen: Deferred[None] = Deferred()
        self.lost: Deferred[None] = Deferred()
        self.head = b""
        self.received = 0

    def connectionMade(self) -> None:
        self.transport.write(self.request)

    def dataReceived(self, data: bytes) -> None:
        self.received += len(data)
        if not self.ready.called:
            self.head += data
            if b"\r\n\r\n" in self.head:
                status = self.head.split(b"\r\n", 1)[0]
                if self.stop_reading:
                    self.transport.pauseProducing()
                self.ready.callback(status)
        if self.watch is not None and not self.seen.called and self.watch in data:
            self.seen.callback(None)

    def connectionLost(self, reason: Any) -> None:
        if not self.ready.called:
            self.ready.errback(reason)
        if not self.lost.called:
            self.lost.callback(None)


def sse_request(path: str = "/stream", host: str = "localhost") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/event-stream\r\n\r\n".encode()


def ws_request(path: str = "/socket", host: str = "localhost") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


async def open_many(
    port: int, count: int, make: Callable[[], HeldConnection], wave: int = 250
) -> list[HeldConnection]:
    """Open C{count} connections in waves of C{wave} (a listen backlog is small); each must answer."""
    held: list[HeldConnection] = []
    for start in range(0, count, wave):
        batch = []
        for _ in range(min(wave, count - start)):
            protocol = make()
            reactor.connectTCP("127.0.0.1", port, SingleUseFactory(protocol), timeout=TIMEOUT)
            batch.append(protocol)
        results = await DeferredList([p.ready.addTimeout(TIMEOUT, reactor) for p in batch], consumeErrors=True)
        failed = [r for ok, r in results if not ok]
        assert not failed, f"{len(failed)} connections failed: {failed[0]}"
        held.extend(batch)
    return held


class SingleUseFactory(ClientFactory):
    """A factory for one already-made protocol (C{reactor.connectTCP(host, port, SingleUseFactory(p))})."""

    def __init__(self, protocol: HeldConnection) -> None:
        self.protocol_instance = protocol

    def buildProtocol(self, addr: Any) -> HeldConnection:
        return self.protocol_instance

    def clientConnectionFailed(self, connector: Any, reason: Any) -> None:
        if not self.protocol_instance.ready.called:
            self.protocol_instance.ready.errback(reason)


def close_all(held: list[HeldConnection]) -> None:
    for protocol in held:
        if protocol.transport is not None:
            protocol.transport.abortConnection()
