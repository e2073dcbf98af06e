"""A real WebSocket client (autobahn) that queues what it receives."""

from __future__ import annotations

import json
from typing import Any

from autobahn.twisted.websocket import WebSocketClientFactory, WebSocketClientProtocol, connectWS
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredQueue

TIMEOUT = 5.0


class _Protocol(WebSocketClientProtocol):
    client: WSClient

    def onOpen(self) -> None:
        self.client.protocol = self
        if not self.client.opened.called:
            self.client.opened.callback(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.client.queue.put(payload)

    def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
        self.client.close_code = code
        self.client.close_reason = reason
        self.client.queue.put(None)
        if not self.client.opened.called:
            self.client.opened.errback(ConnectionError(f"closed before open: {code} {reason}"))
        if not self.client.closed.called:
            self.client.closed.callback((code, reason))


class WSClient:
    """Connect with L{connect}; C{send}/C{recv} JSON; C{closed} fires with (code, reason)."""

    def __init__(self) -> None:
        self.queue: DeferredQueue[bytes | None] = DeferredQueue()
        self.opened: Deferred[Any] = Deferred()
        self.closed: Deferred[tuple[int | None, str | None]] = Deferred()
        self.protocol: Any = None
        self.close_code: int | None = None
        self.close_reason: str | None = None

    @classmethod
    async def connect(cls, url: str, headers: dict[str, str] | None = None, context_factory: Any = None) -> WSClient:
        client = cls()
        factory = WebSocketClientFactory(url, headers=headers or {})
        factory.setProtocolOptions(autoPingInterval=0)
        client_ref = client

        class Protocol(_Protocol):
            client = client_ref

        factory.protocol = Protocol
        connectWS(factory, contextFactory=context_factory, timeout=TIMEOUT)
        d = client.opened
        d.addTimeout(TIMEOUT, reactor)
        await d
        return client

    def send(self, message: Any) -> None:
        self.protocol.sendMessage(json.dumps(message).encode("utf-8"))

    def send_raw(self, payload: bytes, binary: bool = False) -> None:
        self.protocol.sendMessage(payload, isBinary=binary)

    async def recv_raw(self, timeout: float = TIMEOUT) -> bytes | None:
        d = self.queue.get()
        d.addTimeout(timeout, reactor)
        return await d

    async def recv(self, timeout: float = TIMEOUT, skip_pings: bool = True) -> Any:
        """The next JSON message (C{None} once closed); relay pings are skipped."""
        while True:
            raw = await self.recv_raw(timeout)
            if raw is None:
                return None
            msg = json.loads(raw)
            if skip_pings and isinstance(msg, dict) and msg.get("type") == "ping":
                continue
            return msg

    async def hello(self, **fields: Any) -> Any:
        self.send({"type": "hello", "versions": ["0.1"], **fields})
        return await self.recv()

    async def roundtrip(self) -> list[Any]:
        """A ping/pong; returns what the relay sent before the pong (so nothing else is in flight)."""
        self.send({"type": "ping", "t": "sync"})
        before = []
        while True:
            msg = await self.recv()
            assert msg is not None, "closed during roundtrip"
            if msg.get("type") == "pong" and msg.get("t") == "sync":
                return before
            before.append(msg)

    async def close(self) -> None:
        if self.protocol is not None and not self.closed.called:
            self.protocol.sendClose(1000)
            d = self.closed
            d.addTimeout(TIMEOUT, reactor)
            await d
