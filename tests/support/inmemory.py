"""A relayd site served in memory: requests as bytes into relayd's own channel, answers read back,
time on a L{MemoryReactorClock}. No socket, no polling, no real reactor turn.

    site = InMemorySite.over(resource, body_limit=...)          # any root resource on a RelaySite
    wing = InMemoryWing.build(self, "aep", {"aep-token": "t"})  # a wing as makeService builds it
    reply = wing.request("GET", "/healthz")                      # .code .phrase .headers .body
    stream = wing.open("GET", "/stream")                         # an answer that comes later:
    wing.advance(0); stream.head(), stream.events()              # a stream's head and its events
    connection = wing.connect(); connection.send(raw); connection.replies()
    wing.advance(30)                                             # the wing's timers, by hand

L{InMemoryMcpCase} is the MCP wing's test case on it (L{tests.support.mcp.McpRelayCase}'s helpers);
L{InMemoryPage} is the simulated page on it, and L{InMemoryEndpointCase} the standard endpoint's
case with that page: a request forwarded to the page is answered once the test L{settle}s.

What it covers: the site's root resource and everything between it and the bytes: relayd's
L{RelaySite} (per-client counts, the access line, the plain-POST path of C{simple_posts}), its
L{RelayChannel} (header limits, deadlines on the site's clock, pipelining), its L{RelayRequest}
(the body cap, answers decided from the headers before the body), and the wing's resource (routes,
handlers, the auth wall, CORS) over the wing's own core. Each connection is a
L{twisted.internet.testing.StringTransport} handed to a protocol the site builds, as a listening
port would; what the site writes is parsed back into L{Reply}s. A wing's handlers answer within
L{Connection.send} when its store does (the in-memory one); a later answer is there once the test
has fired what it waited for, or advanced L{InMemorySite.clock}.

What still needs a socket (tests/support/wing.py, tests/support/raw.py): the kernel and the
reactor between the client and the channel: how bytes are split into reads, a client that stops
reading (TCP back-pressure, Twisted's producer pauses), a peer's reset, write buffering
(relayd.compat.tcp's held writes act on real TCP transports only), listeners and their endpoint
strings, the WebSocket upgrade (autobahn takes the transport over), Redis or a Nostr relay behind a
wing, and a whole process (tests/support/twistd.py).
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Mapping, Sequence

from twisted.internet.address import IPv4Address
from twisted.internet.error import ConnectionDone
from twisted.internet.testing import MemoryReactorClock, StringTransport
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase
from twisted.web.http_headers import Headers
from twisted.web.resource import IResource

from relayd.base.clock import Timekeeper
from relayd.base.config import Resolved, resolve
from relayd.process.settings import SETTINGS as PROCESS_SETTINGS
from relayd.web.site import RelaySite
from relayd.wing import Plumbing
from tests.support.mcp import AUTH, INIT, SESSION, TOKEN, initialized
from tests.support.mcp_clients import PageScript, compact
from tests.support.sse import Message, add_line


class TurnByTurn(MemoryReactorClock):
    """A L{MemoryReactorClock} that can also run one reactor turn (L{turn}): C{advance(0)} runs the
    calls due and, in the same go, those they schedule for now; a real reactor runs the latter on
    its next turn (what work sliced per turn, relayd.web.admission, is about)."""

    def turn(self) -> None:
        """Run the calls due now, as one reactor turn does; what they schedule for now waits."""
        self._sortCalls()
        due = {id(call) for call in self.calls if call.getTime() <= self.seconds()}
        while True:
            call = next((c for c in self.calls if id(c) in due), None)
            if call is None:
                return
            self.calls.remove(call)
            call.called = 1
            call.func(*call.args, **call.kw)


SERVER = IPv4Address("TCP", "127.0.0.1", 8080)
"""The local address every in-memory connection arrives on."""


class Reply:
    """One complete HTTP answer as the client read it: status, reason phrase, headers, body."""

    def __init__(self, code: int, phrase: bytes, headers: Headers, body: bytes, raw_headers: list[tuple[bytes, bytes]]) -> None:
        self.code = code
        self.phrase = phrase
        self.headers = headers
        self.body = body
        self.raw_headers = raw_headers
        """The header lines in the order written, names lower-cased."""

    def header(self, name: str) -> str | None:
        """The first value of header C{name}, or C{None}."""
        values = self.headers.getRawHeaders(name)
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"<Reply {self.code} {self.phrase!r} {self.body[:80]!r}>"


class _Incomplete(Exception):
    """More bytes are needed for the next answer."""


def _parse_one(data: bytes, head: bool, closed: bool) -> tuple[Reply, int]:
    """The answer at the front of C{data} and how many bytes it took."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        raise _Incomplete()
    status_line, *lines = data[:end].split(b"\r\n")
    version, code, phrase = [*status_line.split(b" ", 2), b"", b""][:3]
    if not version.startswith(b"HTTP/1.") or not code.isdigit():
        raise AssertionError(f"not an HTTP answer: {data[:200]!r}")
    headers = Headers()
    raw_headers = []
    for line in lines:
        name, _, value = line.partition(b":")
        headers.addRawHeader(name.strip(), value.strip())
        raw_headers.append((name.strip().lower(), value.strip()))
    start = end + 4
    status = int(code)
    if head or status < 200 or status in (204, 304):
        return Reply(status, phrase, headers, b"", raw_headers), start
    if b"chunked" in [v.lower() for v in headers.getRawHeaders(b"transfer-encoding", [])]:
        body, at = b"", start
        while True:
            size_end = data.find(b"\r\n", at)
            if size_end < 0:
                raise _Incomplete()
            size = int(data[at:size_end].split(b";")[0], 16)
            if len(data) < size_end + 2 + size + 2:
                raise _Incomplete()
            body += data[size_end + 2 : size_end + 2 + size]
            at = size_end + 2 + size + 2
            if size == 0:
                return Reply(status, phrase, headers, body, raw_headers), at
    length = headers.getRawHeaders(b"content-length")
    if length is not None:
        size = int(length[0])
        if len(data) - start < size:
            raise _Incomplete()
        return Reply(status, phrase, headers, data[start : start + size], raw_headers), start + size
    if not closed:
        raise _Incomplete()  # its body ends when the connection does
    return Reply(status, phrase, headers, data[start:], raw_headers), len(data)


def request_bytes(
    method: str | bytes, path: str | bytes, body: bytes | None = None, headers: Mapping[str, str] | Sequence[tuple[bytes, bytes]] = ()
) -> bytes:
    """An HTTP/1.1 request as a client library sends it: C{Host: localhost} unless C{headers} name
    one, and a C{Content-Length} when there is a C{body}."""
    pairs = [(k.encode() if isinstance(k, str) else k, v.encode() if isinstance(v, str) else v)
             for k, v in (headers.items() if isinstance(headers, Mapping) else headers)]
    names = {name.lower() for name, _ in pairs}
    if b"host" not in names:
        pairs.insert(0, (b"Host", b"localhost"))
    if body is not None and b"content-length" not in names and b"transfer-encoding" not in names:
        pairs.append((b"Content-Length", b"%d" % len(body)))
    method = method.encode() if isinstance(method, str) else method
    path = path.encode() if isinstance(path, str) else path
    head = b"%s %s HTTP/1.1\r\n" % (method, path) + b"".join(b"%s: %s\r\n" % pair for pair in pairs)
    return head + b"\r\n" + (body or b"")


class Connection:
    """One client connection to an in-memory site: what it sends is read by the site's channel at
    once, as one read; what the site writes is in L{received}."""

    def __init__(self, site: RelaySite, peer: IPv4Address) -> None:
        self.site = site
        self.transport = StringTransport(hostAddress=SERVER, peerAddress=peer)
        self.protocol = site.buildProtocol(peer)
        self.protocol.makeConnection(self.transport)
        self._lost = False

    def send(self, data: bytes) -> None:
        """The client sends C{data}: the channel reads it as one read."""
        self.protocol.dataReceived(data)

    def received(self) -> bytes:
        """Everything the site has written to this connection."""
        return self.transport.value()

    @property
    def closed(self) -> bool:
        """Whether the site closed (or began closing) the connection."""
        return bool(self.transport.disconnecting) or self._lost

    def replies(self, heads: int | Sequence[bool] = 0) -> list[Reply]:
        """The complete answers written so far, in order (interim 1xx answers left out). C{heads}
        says which answer C{HEAD} requests (no body follows): the first C{heads}, or those flagged."""
        flags = [True] * heads if isinstance(heads, int) else list(heads)
        data, replies, answered = self.received(), [], 0
        while data:
            try:
                reply, used = _parse_one(data, answered < len(flags) and flags[answered], self.closed)
            except _Incomplete:
                break
            data = data[used:]
            if reply.code >= 200:
                replies.append(reply)
                answered += 1
        return replies

    def reply(self, head: bool = False) -> Reply:
        """The one complete answer so far (to a C{head} request: no body); an AssertionError with
        the bytes when there is none (or more than one)."""
        replies = self.replies(int(head))
        if len(replies) != 1:
            raise AssertionError(f"expected one complete answer, got {len(replies)}: {self.received()[:400]!r}")
        return replies[0]

    def head(self) -> Reply:
        """The status and headers of the first answer once they are written (a stream's, whose body
        goes on; its L{body} so far is the reply's)."""
        data = self.received()
        end = data.find(b"\r\n\r\n")
        if end < 0:
            raise AssertionError(f"no answer's head yet: {data[:400]!r}")
        reply, _ = _parse_one(data[: end + 4], True, False)
        reply.body = self.body()
        return reply

    def status(self) -> int | None:
        """The status of the first answer once its head is written, else C{None}."""
        return self.head().code if b"\r\n\r\n" in self.received() else None

    def body(self) -> bytes:
        """The body of the first answer as far as it has come (a stream's), without its chunked framing."""
        data = self.received()
        end = data.find(b"\r\n\r\n")
        if end < 0:
            return b""
        head, rest = data[:end].lower(), data[end + 4 :]
        if b"transfer-encoding: chunked" not in head:
            return rest
        body = b""
        while True:
            size_end = rest.find(b"\r\n")
            if size_end < 0:
                return body
            size = int(rest[:size_end].split(b";")[0], 16)
            if size == 0 or len(rest) < size_end + 2 + size + 2:
                return body
            body += rest[size_end + 2 : size_end + 2 + size]
            rest = rest[size_end + 2 + size + 2 :]

    def ended(self) -> bool:
        """Whether the first answer is complete (a stream's last chunk written) or the connection closed."""
        return self.closed or bool(self.replies())

    def events(self) -> list[Message]:
        """The server-sent events and comments complete in L{body}, in order."""
        messages = []
        for block in self.body().split(b"\n\n")[:-1]:
            message = Message()
            for line in block.split(b"\n"):
                add_line(message, line)
            messages.append(message)
        return messages

    def lose(self) -> None:
        """The client goes away (or the site's close completes): the channel sees the connection lost."""
        if not self._lost:
            self._lost = True
            self.protocol.connectionLost(Failure(ConnectionDone()))


class InMemorySite:
    """A L{RelaySite} whose connections are in memory (see the module docstring).

    @ivar site: the site. @ivar clock: its L{Timekeeper}. @ivar reactor: the clock's reactor (a
        L{MemoryReactorClock}, or the C{task.Clock} a test handed in): L{advance} moves it.
    """

    def __init__(self, site: RelaySite) -> None:
        self.site = site
        self.clock: Timekeeper = site.clock
        self.reactor: Any = site.clock.reactor
        self.connections: list[Connection] = []

    @classmethod
    def over(cls, resource: IResource, **site_arguments: Any) -> InMemorySite:
        """A L{RelaySite} over C{resource} (with C{site_arguments}: C{body_limit}, C{settings}, ...)
        on a clock of its own."""
        site_arguments.setdefault("clock", Timekeeper(TurnByTurn()))
        return cls(RelaySite(resource, **site_arguments))

    def advance(self, seconds: float) -> None:
        """Let C{seconds} pass on the site's clock (its timers that fall due run)."""
        self.reactor.advance(seconds)

    def turn(self) -> None:
        """One reactor turn: the timers due now run, not those they schedule (L{TurnByTurn})."""
        self.reactor.turn()

    def connect(self, peer: str = "127.0.0.1", port: int = 40000) -> Connection:
        """A new client connection from C{peer} (lost at L{close})."""
        connection = Connection(self.site, IPv4Address("TCP", peer, port + len(self.connections)))
        self.connections.append(connection)
        return connection

    def open(
        self, method: str | bytes, path: str | bytes, body: bytes | None = None,
        headers: Mapping[str, str] | Sequence[tuple[bytes, bytes]] = (), *, peer: str = "127.0.0.1",
    ) -> Connection:
        """A new connection that has sent C{method} on C{path} (L{request_bytes}): for an answer that
        comes later (a parked request, a stream), read from it when the test has made it come."""
        connection = self.connect(peer)
        connection.send(request_bytes(method, path, body, headers))
        return connection

    def request(
        self, method: str | bytes, path: str | bytes, body: bytes | None = None,
        headers: Mapping[str, str] | Sequence[tuple[bytes, bytes]] = (), *, peer: str = "127.0.0.1",
    ) -> Reply:
        """C{method} on C{path} on a connection of its own (L{open}), which is then closed: its
        complete answer (an AssertionError with the bytes when it has none yet)."""
        connection = self.open(method, path, body, headers, peer=peer)
        try:
            return connection.reply(head=method in ("HEAD", b"HEAD"))
        finally:
            connection.lose()

    def get(self, path: str, headers: Mapping[str, str] | None = None) -> Reply:
        return self.request("GET", path, None, headers or {})

    def post(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> Reply:
        return self.request("POST", path, body, headers or {})

    def close(self) -> None:
        """Lose every connection still open and cancel the clock's timers."""
        for connection in self.connections:
            connection.lose()
        self.clock.shutdown()


class InMemoryWing(InMemorySite):
    """A wing (C{aep}, C{mcp} or C{buzz}) built from settings as C{relayd.tap.makeService} builds it
    (L{Plumbing}, then the wing's C{make_wing}) on a L{MemoryReactorClock}, its site served in
    memory. The service is not started: nothing listens (tests/support/wing.py starts one that does).

    @ivar service: the wing's service (C{service.relay}: the AEP core). @ivar settings: resolved.
    """

    def __init__(self, site: RelaySite, service: Any, settings: Resolved) -> None:
        super().__init__(site)
        self.service = service
        self.settings = settings

    @classmethod
    def build(
        cls, case: TestCase, name: str, given: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> InMemoryWing:
        """Wing C{name} with C{given} settings (as the command line gives them: names without
        C{--}, list values for repeatable flags) over C{environ} (none of the caller's by default);
        closed at C{case}'s cleanup. A wing on C{--redis} needs a socket: tests/support/wing.py."""
        config = importlib.import_module(f"relayd.{name}.config")
        make_wing = importlib.import_module(f"relayd.{name}.service").make_wing
        settings = resolve([*PROCESS_SETTINGS, *config.SETTINGS], dict(given or {}), dict(environ or {}))
        # (A MemoryReactorClock provides what a wing asks of its reactor, not all of relayd's IReactor.)
        reactor: Any = TurnByTurn()
        plumbing = Plumbing.from_settings(settings, reactor, Timekeeper(reactor))
        assert plumbing.redis is None, "an in-memory wing has no Redis: use tests/support/wing.py"
        service = make_wing(plumbing, settings)
        assert service is not None, f"the {name} wing is disabled by {given}"
        wing = cls(service.site, service, settings)
        case.addCleanup(wing.close)
        return wing


class InMemoryMcpCase(TestCase):
    """The MCP wing in memory per test: C{flags} and C{environ} configure it as those of
    L{tests.support.mcp.McpRelayCase} do, and its helpers (paths below the prefix) answer at once;
    C{events} and C{park} return the connection of an answer that comes later."""

    flags: Mapping[str, Any] = {}
    environ: Mapping[str, str] = {}

    def setUp(self) -> None:
        self.wing = InMemoryWing.build(self, "mcp", {"mcp-reap-interval-ms": "0", **self.flags}, self.environ)
        self.prefix = self.wing.settings["mcp-prefix"]
        self.service = self.wing.service
        self.tunnel = self.service.tunnel
        self.pages: list[InMemoryPage] = []

    def start_page(self, session: str = "sess", modern: bool = False, silent: frozenset[str] = frozenset()) -> InMemoryPage:
        """The simulated page of C{session} (registered), reading its inbound stream; it answers
        what it has read whenever the test L{settle}s."""
        page = InMemoryPage(self, session, modern, silent)
        self.pages.append(page)
        return page

    def settle(self, turns: int = 100) -> None:
        """Turn the clock (no time passes) and let every page answer what it read, until a turn
        brings a page nothing new: what the relay and the pages owe each other is then written."""
        for _ in range(turns):
            self.wing.advance(0)
            if not [page for page in self.pages if page.read()]:
                return
        raise AssertionError(f"the relay and its pages still exchanging after {turns} turns")

    def request(self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None) -> Reply:
        return self.wing.request(method, self.prefix + path, body, headers or {})

    def post(self, path: str, payload: Any = None, raw: bytes | None = None, **headers: str) -> Reply:
        body = raw if raw is not None else json.dumps(payload).encode()
        return self.request("POST", path, body, {"content-type": "application/json", **headers})

    def get(self, path: str, **headers: str) -> Reply:
        return self.request("GET", path, None, headers)

    def register(self, session: str = "sess", token: str = TOKEN) -> None:
        reply = self.post("/register", {"session": session, "token": token})
        assert reply.code == 200, reply.body

    def events(self, session: str = "sess", query: str = "", token: str = TOKEN, **headers: str) -> Connection:
        """An SSE stream's connection (open until the test's cleanup)."""
        return self.wing.open("GET", f"{self.prefix}/{session}/events?token={token}{query}", None, headers)

    def poll(self, session: str = "sess", query: str = "", token: str = TOKEN) -> Reply:
        return self.get(f"/{session}/poll?token={token}{query}")

    def park(self, session: str = "sess", query: str = "", token: str = TOKEN) -> Connection:
        """A poll whose answer comes later (its connection: L{Connection.reply} once it has)."""
        return self.wing.open("GET", f"{self.prefix}/{session}/poll?token={token}{query}")


class InMemoryPage:
    """The simulated page (L{PageScript}) of one session on an L{InMemoryMcpCase}: its inbound SSE
    stream is an in-memory connection; L{read} answers, on the outbox, every message that stream
    has brought since the last read (the case's L{InMemoryMcpCase.settle} calls it)."""

    def __init__(self, case: InMemoryMcpCase, session: str, modern: bool = False, silent: frozenset[str] = frozenset()) -> None:
        self.case = case
        self.session = session
        self.script = PageScript(modern, silent)
        self.seen = self.script.seen
        self.stream = case.events(session, "&direction=inbound")
        assert self.stream.status() == 200, self.stream.received()[:400]
        self._read = 0

    def send(self, message: dict[str, Any]) -> None:
        reply = self.case.post(f"/{self.session}/outbox?token={TOKEN}", raw=compact(message))
        assert reply.code == 200, reply.body

    def read(self) -> bool:
        """Answer the C{event: mcp} messages read since the last call; whether there were any."""
        messages = [message for message in self.stream.events() if message.event == "mcp"]
        fresh, self._read = messages[self._read :], len(messages)
        for message in fresh:
            for answer in self.script.answer(message.json()):
                self.send(answer)
        return bool(fresh)

    def methods(self) -> list[str]:
        return self.script.methods()


class InMemoryEndpointCase(InMemoryMcpCase):
    """The standard MCP endpoint (C{/SESSION/mcp}) in memory, with the simulated page of C{SESSION}
    registered and reading (L{page}); C{silent}: the methods the page never answers."""

    silent: frozenset[str] = frozenset()

    def setUp(self) -> None:
        super().setUp()
        self.register(SESSION)
        self.page = self.start_page(SESSION, silent=self.silent)
        self.url = f"/{SESSION}/mcp"

    def mcp_headers(self, sid: str | None, headers: Mapping[str, str]) -> dict[str, str]:
        given = {"content-type": "application/json", **AUTH}
        if sid is not None:
            given["mcp-session-id"] = sid
        given.update(headers)
        return given

    def send_mcp(self, message: Any, sid: str | None = None, **headers: str) -> Connection:
        """POST C{message} (JSON, or bytes as they are) to the endpoint: its connection, whose answer
        may come once the page has answered (L{settle}, then L{Connection.reply})."""
        body = message if isinstance(message, bytes) else compact(message)
        return self.wing.open("POST", self.prefix + self.url, body, self.mcp_headers(sid, headers))

    def mcp(self, message: Any, sid: str | None = None, **headers: str) -> Reply:
        """C{message}'s answer once the relay and the page have settled."""
        connection = self.send_mcp(message, sid, **headers)
        self.settle()
        try:
            return connection.reply()
        finally:
            connection.lose()

    def stream(self, sid: str, **headers: str) -> Connection:
        """The client session's GET stream (its connection)."""
        given = self.mcp_headers(sid, headers)
        del given["content-type"]
        return self.wing.open("GET", self.prefix + self.url, None, given)

    def initialize(self) -> str:
        return initialized(self.mcp(INIT))
