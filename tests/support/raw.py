"""Raw HTTP over a blocking socket, for requests no HTTP client would send (run it in a thread).

L{raw_exchange} returns the bytes; L{exchange} parses what came back into complete responses and
says how the exchange ended (the server closed, or went quiet), for tests that judge every answer;
L{first_response} reads only the first answer's status, headers and body (L{raw_request} builds one).
L{RawClient} is the reactor-side counterpart: a TCP protocol that records what it receives.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.protocol import Protocol


def raw_exchange(url: str, request: bytes) -> bytes:
    """Send C{request} to the host:port of C{url}; everything the server answers until it closes."""
    host, port = url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(request)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class Response:
    """One complete HTTP response: its status, headers (names lower-cased, in order) and body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        """The first value of header C{name} (lower case), or C{None}."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def values(self, name: bytes) -> list[bytes]:
        """Every value of header C{name} (lower case)."""
        return [value for key, value in self.headers if key == name]


@dataclass
class Answer:
    """What one connection got back.

    @ivar responses: the complete responses, in order (interim C{1xx} responses left out).
    @ivar closed: the server closed (or reset) the connection.
    @ivar rest: bytes after the last complete response (an incomplete or unparseable one).
    @ivar elapsed: seconds from connecting to the end of the exchange.
    """

    responses: list[Response] = field(default_factory=list)
    closed: bool = False
    rest: bytes = b""
    elapsed: float = 0.0

    @property
    def answered(self) -> bool:
        return bool(self.responses)

    def describe(self) -> str:
        """A one-line account for assertion messages."""
        statuses = [r.status for r in self.responses]
        end = "closed" if self.closed else "still open (timed out)"
        return f"responses {statuses}, {end}, {len(self.rest)} unparsed bytes {self.rest[:80]!r}"


class _Incomplete(Exception):
    """More bytes are needed."""


class _Malformed(Exception):
    """The bytes are not an HTTP/1.x response."""


def _parse_one(data: bytes, head: bool, closed: bool) -> tuple[Response, int]:
    """One response from the front of C{data}: it and the number of bytes it took."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        raise _Incomplete()
    lines = data[:end].split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit() or len(parts[1]) != 3:
        raise _Malformed()
    status = int(parts[1])
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise _Malformed()
        headers.append((name.strip().lower(), value.strip()))
    response = Response(status, headers, b"")
    start = end + 4
    if head or status < 200 or status in (204, 304):
        return response, start
    if any(v.lower() == b"chunked" for v in response.values(b"transfer-encoding")):
        body, used = _dechunk(data[start:])
        response.body = body
        return response, start + used
    length = response.header(b"content-length")
    if length is not None:
        if not length.isdigit():
            raise _Malformed()
        if len(data) - start < int(length):
            raise _Incomplete()
        response.body = data[start : start + int(length)]
        return response, start + int(length)
    if not closed:
        raise _Incomplete()  # the body ends when the connection does
    response.body = data[start:]
    return response, len(data)


def _dechunk(data: bytes) -> tuple[bytes, int]:
    body, at = b"", 0
    while True:
        eol = data.find(b"\r\n", at)
        if eol < 0:
            raise _Incomplete()
        size_text = data[at:eol].split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise _Malformed() from None
        at = eol + 2
        if size == 0:
            trailer_end = data.find(b"\r\n", at)
            while trailer_end >= 0 and trailer_end != at:  # skip trailer fields
                at = trailer_end + 2
                trailer_end = data.find(b"\r\n", at)
            if trailer_end < 0:
                raise _Incomplete()
            return body, at + 2
        if len(data) < at + size + 2:
            raise _Incomplete()
        body += data[at : at + size]
        at += size + 2


def parse_responses(data: bytes, closed: bool, heads: int | Sequence[bool] = 0) -> tuple[list[Response], bytes]:
    """The complete responses at the front of C{data} and what is left. C{heads} says which answer
    C{HEAD} requests (no body): the first C{heads}, or those whose flag is true."""
    flags = [True] * heads if isinstance(heads, int) else list(heads)
    responses: list[Response] = []
    while data:
        head = len(responses) < len(flags) and flags[len(responses)]
        try:
            response, used = _parse_one(data, head, closed)
        except (_Incomplete, _Malformed):
            break
        data = data[used:]
        if response.status >= 200:
            responses.append(response)
    return responses, data


def exchange(
    port: int,
    data: bytes | list[bytes],
    *,
    responses: int = 1,
    heads: int | Sequence[bool] = 0,
    timeout: float = 5.0,
    host: str = "127.0.0.1",
    half_close: bool = False,
) -> Answer:
    """Send C{data} (a list: one C{sendall} each) on a new connection and read until C{responses}
    complete responses have arrived, the server closes, or nothing arrives for C{timeout} seconds.

    A server that answers early and closes while the request is still being sent is normal (an
    oversize body); what it answered is kept. C{half_close} shuts the sending side once C{data}
    is sent (a client that breaks off its request). Blocking: call it from a thread.
    """
    started = time.monotonic()
    answer = Answer()
    received = b""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each piece its own segment
        for piece in [data] if isinstance(data, bytes) else data:
            try:
                s.sendall(piece)
            except OSError:
                break  # answered and closed early: read what came
        if half_close:
            try:
                s.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        while True:
            found, _ = parse_responses(received, False, heads)
            if len(found) >= responses:
                break
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            except OSError:
                answer.closed = True
                break
            if not chunk:
                answer.closed = True
                break
            received += chunk
    answer.responses, answer.rest = parse_responses(received, answer.closed, heads)
    answer.elapsed = time.monotonic() - started
    return answer


def first_response(port: int, request: bytes, timeout: float = 10.0) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send raw C{request} on a new connection; the status, headers and body of the answer.

    Blocking (for a worker thread). Unlike L{exchange} it needs no end of the answer: an open SSE
    stream counts as answered once its headers arrive. A connection closed (or a timeout) before a
    status line raises.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed without an answer (got {data!r})")
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if request.startswith(b"HEAD ") or status in (204, 304):
            return status, headers, b""
        length = headers.get(b"content-length")
        if length is None and headers.get(b"content-type", b"").startswith(b"text/event-stream"):
            return status, headers, b""  # a stream: it answered
        while length is None or len(rest) < int(length):
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, headers, rest if length is None else rest[: int(length)]


def raw_request(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]] | None = None, body: bytes | None = None
) -> bytes:
    """One HTTP/1.1 request as bytes (C{connection: close}; a content-length when there is a body)."""
    lines = [method + b" " + target + b" HTTP/1.1", b"host: localhost", b"connection: close"]
    lines += [name + b": " + value for name, value in headers or []]
    if body is not None:
        lines.append(b"content-length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


RAW_CLIENT_TIMEOUT = 5.0


class RawClient(Protocol):
    """A TCP client that records what it receives and when the server closes."""

    def __init__(self) -> None:
        self.received = b""
        self.closed: Deferred[None] = Deferred()
        self._waiting: list[tuple[bytes, Deferred[None]]] = []

    def dataReceived(self, data: bytes) -> None:
        self.received += data
        for needle, d in list(self._waiting):
            if needle in self.received:
                self._waiting.remove((needle, d))
                d.callback(None)

    def connectionLost(self, reason: Any) -> None:
        self.closed.callback(None)

    def wait_for(self, needle: bytes) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        if needle in self.received:
            d.callback(None)
        else:
            self._waiting.append((needle, d))
        return d.addTimeout(RAW_CLIENT_TIMEOUT, reactor)


async def connect_raw(case: Any, site: Any) -> RawClient:
    """A L{RawClient} connected to C{site}, listening on a free loopback port; the connection closed,
    then the port, when C{case} (a TestCase) ends."""
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    case.addCleanup(port.stopListening)
    client = RawClient()
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port.getHost().port), client)
    case.addCleanup(client.transport.loseConnection)
    return client
