"""The WebSocket under an upstream connection: autobahn's client with a fast path for the frames a
Nostr relay conversation consists of, and the endpoint and factory each connection attempt uses.

L{UpstreamWebSocket} reports everything that happens to it to its owner (an L{IWebSocketOwner}, the
L{relayd.buzz.nostr_upstream.connection.UpstreamConnection} that opened it): transport up and down,
handshake done, each text message, close.
"""

from __future__ import annotations

import ipaddress
import os
import struct
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol
from autobahn.websocket.protocol import WebSocketProtocol
from autobahn.websocket.xormasker import create_xor_masker
from twisted.internet import defer, endpoints
from twisted.internet.interfaces import ITCPTransport
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure

from relayd.base.reactor import IReactor
from relayd.compat.autobahn import ws_data_received, ws_frames_direct, ws_parser_idle
from relayd.compat.tcp import write_now


class IWebSocketOwner(Protocol):
    """What an L{UpstreamWebSocket} tells the connection that opened it."""

    def on_transport_up(self, ws: "UpstreamWebSocket") -> None:
        """The TCP (or TLS) connection is made; the WebSocket handshake starts."""

    def on_transport_down(self, ws: "UpstreamWebSocket") -> None:
        """The transport is gone."""

    def on_open(self, ws: "UpstreamWebSocket") -> None:
        """The WebSocket handshake completed."""

    def on_message(self, ws: "UpstreamWebSocket", payload: bytes) -> None:
        """One whole message arrived."""

    def on_close(self, ws: "UpstreamWebSocket", reason: str) -> None:
        """The WebSocket closed (or its handshake failed)."""


_OPEN = WebSocketProtocol.STATE_OPEN
_TEXT_FIN = 0x81  # FIN + text opcode, no RSV bits
_SMALL_MASK = 1024  # below this, masking with Python integers beats building autobahn's masker


def _mask(payload: bytes, key: bytes) -> bytes:
    """RFC 6455 masking: XOR with the 4-byte key repeated."""
    n = len(payload)
    if n >= _SMALL_MASK:
        return create_xor_masker(key, n).process(payload)
    pad = (key * ((n >> 2) + 1))[:n]
    return (int.from_bytes(payload, "big") ^ int.from_bytes(pad, "big")).to_bytes(n, "big")


class UpstreamWebSocket(WebSocketClientProtocol):
    """autobahn's client with a fast path for the frames a relay conversation consists of.

    Per message, autobahn's generic machinery (debug-log argument formatting, a masker object, a
    frame header object, four callbacks and traffic statistics) cost more CPU than everything the
    broker does with the message. While the connection is open and no partial frame is buffered,
    whole unfragmented text frames are parsed here and handed straight to the owner, and text
    messages are framed and masked here; anything else (control frames, fragments, partial frames,
    oversize or non-minimal lengths, the handshake) goes through autobahn unchanged.
    """

    # An incomplete plain text frame at the end of a read is held here (as chunks, joined once it
    # is complete) instead of going to autobahn, which would then take every following frame.
    _held: list[bytes] | None = None
    _held_len = 0
    _need = 0  # bytes the held frame needs in all (its header's size while that is incomplete)
    recycled = False  # dropped by its connection for failing (UpstreamConnection._outcome)
    maxMessagePayloadSize: int  # autobahn's, copied from the factory when the connection opens

    def dataReceived(self, data: bytes) -> None:
        if self._held is not None:
            self._held.append(data)
            self._held_len += len(data)
            if self._held_len < self._need:
                return
            data = b"".join(self._held)
            self._held = None
        if (
            self.state == _OPEN
            and ws_parser_idle(self)
        ):
            used, need = self._fast_frames(data)
            if need:
                self._held = [data[used:] if used else data]
                self._held_len = len(data) - used
                self._need = need
                return
            if used == len(data):
                return
            if used:
                data = data[used:]
        ws_data_received(self, data)  # autobahn's path, minus its per-call debug-log formatting

    def _fast_frames(self, data: bytes) -> tuple[int, int]:
        """Deliver the complete plain text frames at the head of C{data}.

        Returns (bytes consumed, bytes needed): C{needed} is non-zero when what is left starts a
        plain text frame that is not complete yet (its full size, or its header's while that is
        cut); zero when what is left (if anything) is for autobahn.
        """
        n = len(data)
        i = 0
        limit = self.maxMessagePayloadSize
        owner = self.factory.owner
        while i < n:
            if data[i] != _TEXT_FIN:
                return i, 0
            avail = n - i
            if avail < 2:
                return i, 2
            b1 = data[i + 1]
            if b1 & 0x80:  # a masked server frame: autobahn refuses it
                return i, 0
            length = b1
            header = 2
            if length == 126:
                if avail < 4:
                    return i, 4
                (length,) = struct.unpack_from("!H", data, i + 2)
                header = 4
                if length < 126:
                    return i, 0
            elif length == 127:
                if avail < 10:
                    return i, 10
                (length,) = struct.unpack_from("!Q", data, i + 2)
                header = 10
                if length < 65536:
                    return i, 0
            if limit and length > limit:
                return i, 0
            if header + length > avail:
                return i, header + length
            end = i + header + length
            owner.on_message(self, data[i + header : end])
            i = end
            if self.state != _OPEN:
                return i, 0  # the message closed the connection: autobahn handles what follows
        return i, 0

    @property
    def can_send(self) -> bool:
        """Whether a message can be sent: open, not closing (autobahn refuses a send then; its own C{is_open} is a future)."""
        return self.state == _OPEN and self.transport is not None

    def send_text(self, payload: bytes) -> None:
        """Send one text message (framed and masked here while the connection is plainly open)."""
        if self.state != _OPEN or not ws_frames_direct(self) or self.transport is None:
            self.sendMessage(payload)
            return
        n = len(payload)
        if n < 126:
            header = bytes((_TEXT_FIN, 0x80 | n))
        elif n < 65536:
            header = struct.pack("!BBH", _TEXT_FIN, 0xFE, n)
        else:
            header = struct.pack("!BBQ", _TEXT_FIN, 0xFF, n)
        key = os.urandom(4)
        # Sent at once when nothing is queued: Twisted's write would cost a reactor turn and two
        # epoll registrations per request frame.
        write_now(self.transport, header + key + _mask(payload, key))

    def connectionMade(self) -> None:
        super().connectionMade()
        # autobahn means to disable Nagle but reads its option before copying it from the factory
        # (the AttributeError is swallowed). With Nagle on, a small frame written while an earlier
        # one is unacknowledged waits for the relay's delayed ACK: ~40 ms per request/response turn.
        try:
            cast(ITCPTransport, self.transport).setTcpNoDelay(True)
        except (AttributeError, OSError):  # not a TCP transport
            pass
        self.factory.owner.on_transport_up(self)

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        super().connectionLost(reason)
        self.factory.owner.on_transport_down(self)

    def onOpen(self) -> None:
        self.factory.owner.on_open(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.factory.owner.on_message(self, payload)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        self.factory.owner.on_close(self, reason or "")

def tcp_endpoint(reactor: IReactor, host: str, port: int, timeout: float) -> Any:
    """A plain TCP endpoint for an IP literal (HostnameEndpoint leaves a timer behind when cancelled)."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return endpoints.HostnameEndpoint(reactor, host, port, timeout=timeout)
    cls = endpoints.TCP6ClientEndpoint if ip.version == 6 else endpoints.TCP4ClientEndpoint
    return cls(reactor, host, port, timeout=timeout)


def connect(
    reactor: IReactor, url: str, owner: IWebSocketOwner, max_message: int, connect_timeout: float
) -> "defer.Deferred[Any]":
    """Start one connection attempt to C{url}; events go to C{owner}. Fires when the transport is made."""
    factory = WebSocketClientFactory(url)
    factory.noisy = False  # no "Starting factory" / "Stopping factory" lines per attempt
    factory.protocol = UpstreamWebSocket
    factory.owner = owner  # type: ignore[attr-defined]
    # autobahn's own handshake timers run on txaio's batched timer, outside the Timekeeper (and are
    # left behind when cancelled): disable them; the owner guards the handshake with its own timer.
    factory.setProtocolOptions(
        maxMessagePayloadSize=max_message,
        maxFramePayloadSize=max_message,
        openHandshakeTimeout=0,
        closeHandshakeTimeout=0,
        utf8validateIncoming=False,  # orjson rejects invalid UTF-8 anyway
    )
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or (443 if parts.scheme == "wss" else 80)
    ep: Any = tcp_endpoint(reactor, host, port, connect_timeout)
    if parts.scheme == "wss":
        from twisted.internet.ssl import optionsForClientTLS

        ep = endpoints.wrapClientTLS(optionsForClientTLS(host), ep)
    return cast("defer.Deferred[Any]", ep.connect(factory))
