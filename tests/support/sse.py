"""A real SSE client over treq that parses the stream into events and comments as they arrive."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredQueue
from twisted.web.client import HTTPConnectionPool

TIMEOUT = 5.0


@dataclass
class Message:
    """One SSE event or comment as received."""

    event: str | None = None
    data: str | None = None
    id: str | None = None
    comment: str | None = None
    raw: bytes = b""
    fields: list[str] = field(default_factory=list)

    def json(self) -> Any:
        assert self.data is not None, f"not an event: {self}"
        return json.loads(self.data)


def add_line(message: Message, line: bytes) -> None:
    """One non-empty line of an SSE message into C{message} (a comment, or a field)."""
    message.raw += line + b"\n"
    text = line.decode("utf-8")
    if text.startswith(":"):
        message.comment = text[1:].strip()
        return
    name, _, value = text.partition(":")
    value = value[1:] if value.startswith(" ") else value
    message.fields.append(name)
    if name == "event":
        message.event = value
    elif name == "data":
        message.data = value if message.data is None else message.data + "\n" + value
    elif name == "id":
        message.id = value


class SSEClient:
    """Open with L{connect}; read with L{next}; the stream's end fires L{ended}."""

    def __init__(self) -> None:
        self.queue: DeferredQueue[Message | None] = DeferredQueue()
        self.buffer = b""
        self.response: Any = None
        self.ended: Deferred[None] = Deferred()
        self.received = b""
        self._current = Message()
        self._done = False
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.refusal = b""

    @classmethod
    async def connect(cls, url: str, headers: dict[str, str] | None = None) -> SSEClient:
        client = cls()
        d = treq.get(url, headers=headers or {}, unbuffered=True, pool=client.pool)
        d.addTimeout(TIMEOUT, reactor)
        client.response = await d
        if client.response.code == 200:
            treq.collect(client.response, client._data).addBoth(client._end)
        else:  # a refusal: its body is the whole answer, and there is no stream to read
            client.refusal = await treq.content(client.response)
            client._end(None)
        return client

    @property
    def code(self) -> int:
        return self.response.code

    def header(self, name: str) -> str | None:
        values = self.response.headers.getRawHeaders(name)
        return values[0] if values else None

    def _data(self, chunk: bytes) -> None:
        self.received += chunk
        self.buffer += chunk
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            self._line(line)

    def _line(self, line: bytes) -> None:
        current = self._current
        if line == b"":
            if current.fields or current.comment is not None:
                self.queue.put(current)
            self._current = Message()
            return
        add_line(current, line)

    def _end(self, result: Any) -> None:
        self._done = True
        self.queue.put(None)
        if not self.ended.called:
            self.ended.callback(None)

    async def next(self, timeout: float = TIMEOUT) -> Message | None:
        """The next event or comment (C{None} once the stream has ended)."""
        d = self.queue.get()
        d.addTimeout(timeout, reactor)
        return await d

    async def next_event(self, timeout: float = TIMEOUT) -> Message:
        """The next event, skipping C{: ping} comments."""
        while True:
            msg = await self.next(timeout)
            assert msg is not None, "stream ended"
            if msg.comment is None:
                return msg

    async def read_until_end(self, timeout: float = TIMEOUT) -> list[Message]:
        """Everything until the server ends the stream."""
        out = []
        while True:
            msg = await self.next(timeout)
            if msg is None:
                return out
            out.append(msg)

    async def close(self) -> None:
        if self.response is not None and not self._done:
            # Dropping the connection is how an SSE consumer goes away.
            transport = getattr(getattr(self.response, "original", None), "_transport", None)
            if transport is not None:
                transport.stopProducing()
        await self.pool.closeCachedConnections()
        if self.response is not None and self.response.code == 200 and not self.ended.called:
            await self.ended
