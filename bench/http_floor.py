"""Servers that do nothing with an ingest POST but answer it: what HTTP costs before relayd's work
(a benchmark tool, not a test). Run through the ingest scenario as another relay:

    python bench/aep.py ingest --target-cmd 'exec python bench/http_floor.py web {port}'
    python bench/aep.py ingest --target-cmd 'exec python bench/http_floor.py protocol {port}'
    python bench/aep.py ingest --target-cmd 'exec python bench/http_floor.py shortcuts {port}'
    python bench/aep.py single-redis --target-cmd 'exec python bench/http_floor.py redis {port} {redis}'

- C{web}: a plain twisted.web C{Site} whose one resource reads the body and answers C{202}
  (access log off): the floor of any relay built on twisted.web's C{Request}.
- C{protocol}: a bare Twisted C{Protocol} that frames requests by C{Content-Length} and answers
  C{202} (and closes after it for HTTP/1.0 or C{Connection: close}): the reactor's and the kernel's
  share (docs/performance.md, "Where the rest goes", "Issue 24: per-connection cost").
- C{shortcuts}: C{protocol} with relayd's own write shortcuts (relayd/compat/tcp.py: the answers of
  a read sent with one C{send} at its end, a connection closed after its answer closed within the
  read), where C{protocol} writes as Twisted does (a writability watch, the send on the next
  reactor turn, the watch removed): the least a Twisted server can pay.
- C{redis}: C{protocol}, answering each request once one Redis command that stores its body has
  been answered (C{SET}, on one connection to the Redis URL given, pipelined): what one Redis round
  trip per request costs a bare Twisted client, the floor of C{--redis}.
"""

from __future__ import annotations

import sys
from collections import deque
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from twisted.internet import endpoints, protocol, reactor
from twisted.web import resource, server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (relayd from this checkout, for its fence)

from relayd.compat.tcp import hold_writes, release_writes

ANSWER = b'HTTP/1.1 202 Accepted\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{"ok":true}'
CLOSING = ANSWER.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n")


class Accepting(resource.Resource):
    isLeaf = True

    def render_POST(self, request: Any) -> bytes:
        request.content.read()
        request.setResponseCode(202)
        request.setHeader(b"content-type", b"application/json")
        return b'{"ok":true}'


class Framing(protocol.Protocol):
    """Splits the stream into requests by the end of the headers and C{Content-Length}."""

    store: RedisFloor | None = None  # (the C{redis} floor: each body is stored before it is answered)
    shortcuts = False  # (the C{shortcuts} floor)

    def __init__(self) -> None:
        self.buffer = b""
        self.needed: int | None = None
        self.closing = False

    def dataReceived(self, data: bytes) -> None:
        held = self.shortcuts and hold_writes(self.transport)
        try:
            self.frame(data)
        finally:
            if held:
                release_writes(self.transport)

    def frame(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.needed is None:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = self.buffer[:end].lower()
                at = head.find(b"content-length:")
                self.needed = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
                # (HTTP/1.0, or Connection: close: the SDK-shaped load, a connection per request)
                self.closing = b"\r\nconnection: close" in head or head.split(b"\r\n", 1)[0].endswith(b"http/1.0")
                self.buffer = self.buffer[end + 4 :]
            if len(self.buffer) < self.needed:
                return
            body, self.buffer = self.buffer[: self.needed], self.buffer[self.needed :]
            self.needed = None
            if self.store is not None:
                self.store.send(body, self.answer)
            else:
                self.answer()
            if self.closing:
                return

    def answer(self) -> None:
        if self.closing:
            self.transport.write(CLOSING)  # type: ignore[union-attr]
            self.transport.loseConnection()  # type: ignore[union-attr]
        else:
            self.transport.write(ANSWER)  # type: ignore[union-attr]


class RedisFloor(protocol.Protocol):
    """One connection to Redis: C{SET relayd-floor BODY} per request, pipelined, each request answered
    when its reply (C{+OK}) comes, in order."""

    def __init__(self) -> None:
        self.waiting: deque[Any] = deque()
        self.replies = b""

    def send(self, body: bytes, answer: Any) -> None:
        self.waiting.append(answer)
        self.transport.write(  # type: ignore[union-attr]
            b"*3\r\n$3\r\nSET\r\n$12\r\nrelayd-floor\r\n$%d\r\n%s\r\n" % (len(body), body)
        )

    def dataReceived(self, data: bytes) -> None:
        self.replies += data
        lines = self.replies.split(b"\r\n")
        self.replies = lines.pop()
        for line in lines:
            if line != b"+OK":
                raise SystemExit(f"Redis answered {line!r}")
            self.waiting.popleft()()


def listen(port: int) -> None:
    reactor.listenTCP(port, protocol.Factory.forProtocol(Framing), interface="127.0.0.1")  # type: ignore[attr-defined]


def main() -> None:
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "redis":  # (its URL: redis://HOST:PORT[/DB], the DB not used)
        where = urlsplit(sys.argv[3])
        Framing.store = RedisFloor()
        redis = endpoints.TCP4ClientEndpoint(reactor, where.hostname or "127.0.0.1", where.port or 6379)
        connected = endpoints.connectProtocol(redis, Framing.store)
        connected.addCallback(lambda _: listen(port))
    elif mode == "web":
        site = server.Site(Accepting())
        site.log = lambda request: None  # type: ignore[method-assign]
        reactor.listenTCP(port, site, interface="127.0.0.1")  # type: ignore[attr-defined]
    else:
        Framing.shortcuts = mode == "shortcuts"
        listen(port)
    reactor.run()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
