"""A session's POSTs rendered beside twisted.web (relayd.web.plain_request: the endpoint's C{mcp}, the
page's C{outbox} and C{inbox}) answer exactly as twisted.web's path does: the same requests, in
memory, to a relay with the plain path and one without, each with its page answering and a client
session initialized: the same statuses, headers and bodies, connections closed or kept, access lines
and counters; the plainest taken beside twisted.web, the rest declined to it."""

from __future__ import annotations

import re
import socket
from typing import Any, Callable

from prometheus_client import generate_latest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from relayd.base.metrics import REGISTRY
from relayd.web.answers import raw_response
from relayd.web.channel import RelayChannel
from relayd.web.plain_request import PlainRequest
from tests.support.inmemory import InMemoryMcpCase, InMemoryPage, InMemoryWing, Reply
from tests.support.mcp import AUTH, INIT, SESSION, TIMEOUT, TOKEN, McpRelayCase, initialized
from tests.support.mcp_clients import SimulatedPage, compact
from tests.support.metrics import Samples, parse
from tests.support.raw import parse_responses
from tests.support.redis import redis_flags
from tests.support.wing import Wing

ORIGIN = b"https://page.example"
CALL = compact({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "echo", "arguments": {}}})
NOTIFIED = compact({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 99}})
ANSWER = compact({"jsonrpc": "2.0", "id": 12345, "result": {}})  # (a response to nothing pending: forwarded)


def post(path: bytes, body: bytes, *headers: bytes, http: bytes = b"HTTP/1.1", length: bool = True) -> bytes:
    fields = [b"host: localhost", *headers]
    if length:
        fields.append(b"content-length: %d" % len(body))
    return b"POST %s %s\r\n" % (path, http) + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body


def mcp(sid: bytes, body: bytes, *headers: bytes, http: bytes = b"HTTP/1.1", auth: bool = True) -> bytes:
    given = [b"accept: application/json, text/event-stream", b"content-type: application/json"]
    if auth:
        given.append(b"authorization: Bearer " + TOKEN.encode())
    if sid:
        given.append(b"mcp-session-id: " + sid)
    return post(b"/%s/mcp" % SESSION.encode(), body, *given, *headers, http=http)


def outbox(body: bytes, *headers: bytes, query: bytes = b"?token=" + TOKEN.encode(), where: bytes = b"outbox") -> bytes:
    return post(b"/%s/%s%s" % (SESSION.encode(), where, query), body, b"content-type: application/json", *headers)


def chunked(request: bytes) -> bytes:
    head, _, body = request.partition(b"\r\n\r\n")
    head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.startswith(b"content-length"))
    return head + b"\r\ntransfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


# (name, what one connection sends given the client session's id: each piece one read, complete
# answers expected); the relay and the pages settle once every piece is sent.
Case = tuple[str, Callable[[bytes], list[bytes]], int]
CASES: list[Case] = [
    ("a tools/call, held until the page answers", lambda sid: [mcp(sid, CALL)], 1),
    ("a tools/call from a listed origin", lambda sid: [mcp(sid, CALL, b"origin: " + ORIGIN)], 1),
    ("a tools/call from another origin", lambda sid: [mcp(sid, CALL, b"origin: https://else.example")], 1),
    ("a tools/call, connection: close", lambda sid: [mcp(sid, CALL, b"connection: close")], 1),
    ("a tools/call over HTTP/1.0", lambda sid: [mcp(sid, CALL, http=b"HTTP/1.0")], 1),
    ("a tools/call, chunked", lambda sid: [chunked(mcp(sid, CALL))], 1),
    ("a tools/call, expect: 100-continue", lambda sid: [mcp(sid, CALL, b"expect: 100-continue")], 1),
    ("a tools/call, its body in a second read", lambda sid: [mcp(sid, CALL)[:-9], mcp(sid, CALL)[-9:]], 1),
    ("a tools/call, then a notification while it is held",
     lambda sid: [mcp(sid, CALL), mcp(sid, NOTIFIED)], 2),
    ("two notifications pipelined in one read", lambda sid: [mcp(sid, NOTIFIED) + mcp(sid, NOTIFIED)], 2),
    ("a notification", lambda sid: [mcp(sid, NOTIFIED)], 1),
    ("a tools/call with a progress token",
     lambda sid: [mcp(sid, compact({"jsonrpc": "2.0", "id": 8, "method": "tools/call",
                                    "params": {"name": "echo", "_meta": {"progressToken": "p1"}}}))], 1),
    ("a tools/call under the stateless revision",
     lambda sid: [mcp(b"", CALL, b"mcp-protocol-version: 2026-07-28", b"mcp-method: tools/call", b"mcp-name: echo")], 1),
    ("an unsupported protocol version", lambda sid: [mcp(sid, CALL, b"mcp-protocol-version: 1999-01-01")], 1),
    ("no token", lambda sid: [mcp(sid, CALL, auth=False)], 1),
    ("another token", lambda sid: [mcp(sid, CALL, b"authorization: Bearer " + b"x" * 30, auth=False)], 1),
    ("an unknown client session", lambda sid: [mcp(b"nope-" + sid, CALL)], 1),
    ("no client session", lambda sid: [mcp(b"", CALL)], 1),
    ("not JSON", lambda sid: [mcp(sid, b"{nope")], 1),
    ("not JSON-RPC", lambda sid: [mcp(sid, b'{"id":1}')], 1),
    ("a batch of requests", lambda sid: [mcp(sid, b"[" + CALL + b"," + CALL.replace(b'"id":7', b'"id":9') + b"]")], 1),
    ("an empty body", lambda sid: [mcp(sid, b"")], 1),
    ("over the body limit", lambda sid: [mcp(sid, b" " * (256 * 1024) + NOTIFIED)], 1),
    ("the page's answer", lambda sid: [outbox(ANSWER)], 1),
    ("the page's answer, token in a header",
     lambda sid: [outbox(ANSWER, b"authorization: Bearer " + TOKEN.encode(), query=b"")], 1),
    ("the page's answer, connection: close", lambda sid: [outbox(ANSWER, b"connection: close")], 1),
    ("the page's answer, chunked", lambda sid: [chunked(outbox(ANSWER))], 1),
    ("the page's answer, another token", lambda sid: [outbox(ANSWER, query=b"?token=" + b"y" * 30)], 1),
    ("the page's answer, no token", lambda sid: [outbox(ANSWER, query=b"")], 1),
    ("the page's answer, not JSON", lambda sid: [outbox(b"{nope")], 1),
    ("the page's answer, from a listed origin", lambda sid: [outbox(ANSWER, b"origin: " + ORIGIN)], 1),
    ("the page's answers, two in one read", lambda sid: [outbox(ANSWER) + outbox(ANSWER)], 2),
    ("a frame to the page", lambda sid: [outbox(NOTIFIED, where=b"inbox")], 1),
    ("a frame to the page, labelled",
     lambda sid: [outbox(NOTIFIED, where=b"inbox", query=b"?client=agent-1&token=" + TOKEN.encode())], 1),
    ("an unregistered session's outbox", lambda sid: [post(b"/nosuchsession/outbox?token=t", ANSWER)], 1),
    ("an unregistered session's endpoint",
     lambda sid: [post(b"/nosuchsession/mcp", CALL, b"authorization: Bearer " + TOKEN.encode())], 1),
    ("a preflight", lambda sid: [b"OPTIONS /%s/mcp HTTP/1.1\r\nhost: localhost\r\norigin: %s\r\n\r\n"
                                 % (SESSION.encode(), ORIGIN)], 1),
]


def counters() -> Samples:
    samples = parse(generate_latest(REGISTRY).decode())
    return {key: value for key, value in samples.items() if key[0].startswith("relayd_") and key[0].endswith("_total")}


def grown(before: Samples, after: Samples) -> dict[Any, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key, 0.0)}


class TwoRelays(InMemoryMcpCase):
    """Two MCP relays in memory, each with the session's page reading and a client session
    initialized: C{fast} with the plain path, C{slow} without (twisted.web's path only)."""

    flags: dict[str, Any] = {"mcp-cors": ["https://page.example"]}

    def setUp(self) -> None:
        super().setUp()
        self.fast = self.wing
        self.slow = InMemoryWing.build(self, "mcp", {"mcp-reap-interval-ms": "0", **self.flags})
        self.slow.site.simple_posts.clear()  # twisted.web's path only
        self.taken: list[tuple[bytes, bool]] = []  # (the route: mcp, outbox, inbox; whether rendered beside twisted.web)
        simple = self.fast.site.simple_posts
        handler = simple[b"/"]

        def watched(post: Any) -> Any:
            answer = handler(post)
            self.taken.append((post.path.partition(b"?")[0].rpartition(b"/")[2], answer is not None))
            return answer

        simple.clear()
        simple.claim(b"/", watched)
        self.page_of: dict[InMemoryWing, InMemoryPage] = {}
        self.sid_of: dict[InMemoryWing, bytes] = {}
        self.lines: dict[InMemoryWing, list[tuple[Any, ...]]] = {}
        for wing in (self.fast, self.slow):
            self.on(wing)
            self.register(SESSION)
            self.page_of[wing] = self.start_page(SESSION)
            connection = self.wing.open("POST", f"/{SESSION}/mcp", compact(INIT), {
                "content-type": "application/json", "authorization": f"Bearer {TOKEN}",
                "accept": "application/json, text/event-stream"})
            self.settle()
            self.sid_of[wing] = initialized(connection.reply()).encode()
            site, lines = wing.site, self.lines.setdefault(wing, [])
            original = site.access

            def access(*, original: Any = original, lines: Any = lines, **line: Any) -> None:
                lines.append((line["method"], line["path"], line["status"], line["sent"], line["peer"]))
                original(**line)

            site.access = access  # type: ignore[method-assign]
        self.taken.clear()

    def on(self, wing: InMemoryWing) -> None:
        """Drive C{wing} (and its page) from here on."""
        self.wing = wing
        self.pages = [self.page_of[wing]] if wing in self.page_of else []

    def run_case(self, wing: InMemoryWing, pieces: Callable[[bytes], list[bytes]]) -> tuple[list[Reply], bytes, bool]:
        """What C{wing} answers to C{pieces} on a new connection: its answers, their bytes as written
        (no Date, the client session's id as C{SID}, the relay's progress tag as C{TAG}), and whether it closed the connection."""
        self.on(wing)
        connection = wing.connect()
        for piece in pieces(self.sid_of[wing]):
            connection.send(piece)
        self.settle()
        written = re.sub(rb"\r\nDate: [^\r]*", b"", connection.received()).replace(self.sid_of[wing], b"SID")
        written = re.sub(rb"relayd:[0-9a-f]{16}:", b"relayd:TAG:", written)  # (each relay's progress tag)
        return connection.replies(), written, connection.closed



class PlainPostParity(TwoRelays):
    def test_every_post_is_answered_as_twisted_web_answers_it(self) -> None:
        taken: dict[str, list[tuple[bytes, bool]]] = {}
        for name, pieces, count in CASES:
            before = counters()
            _, expected, expected_closed = self.run_case(self.slow, pieces)
            counted = counters()
            self.taken.clear()
            got, written, closed = self.run_case(self.fast, pieces)
            taken[name] = list(self.taken)
            self.assertEqual(len(got), count, (name, written))
            self.assertEqual(written, expected, name)
            self.assertEqual(closed, expected_closed, name)
            self.assertEqual(grown(counted, counters()), grown(before, counted), name)
        self.assertEqual(self.lines[self.fast], self.lines[self.slow])
        # (what the page read: the same messages, but for each relay's random ids)
        self.assertEqual(len(self.page_of[self.fast].seen), len(self.page_of[self.slow].seen))
        self.assertEqual(self.page_of[self.fast].methods(), self.page_of[self.slow].methods())
        # The plainest were rendered beside twisted.web; the rest it answered (declined with nothing
        # done). (The page's own answers on its outbox are among what each case took.)
        for name in ("a tools/call, held until the page answers", "a tools/call from a listed origin",
                     "a tools/call, connection: close", "a tools/call over HTTP/1.0", "a notification",
                     "an unknown client session", "not JSON", "a batch of requests"):
            self.assertIn((b"mcp", True), taken[name], name)
        for name in ("the page's answer", "the page's answer, token in a header", "the page's answer, not JSON"):
            self.assertIn((b"outbox", True), taken[name], name)
        self.assertIn((b"inbox", True), taken["a frame to the page, labelled"])
        for name in ("a tools/call, chunked", "a tools/call, expect: 100-continue", "a tools/call with a progress token",
                     "a tools/call under the stateless revision", "no token", "another token", "an empty body",
                     "over the body limit", "a tools/call from another origin", "an unsupported protocol version"):
            self.assertNotIn((b"mcp", True), taken[name], name)
        for name in ("the page's answer, another token", "the page's answer, no token", "the page's answer, chunked"):
            self.assertNotIn((b"outbox", True), taken[name], name)

    def test_a_held_answer_to_a_client_that_left_is_not_written(self) -> None:
        self.on(self.fast)
        connection = self.fast.connect()
        connection.send(mcp(self.sid_of[self.fast], CALL))
        self.assertEqual(self.taken, [(b"mcp", True)])
        connection.lose()
        self.settle()  # the page answers: nobody to write it to
        self.assertEqual(connection.received(), b"")
        self.assertEqual(self.page_of[self.fast].methods()[-1], "tools/call")


class HeldWithoutADeferred(TwoRelays):
    def watch_answers(self) -> list[Any]:
        """What the plain path's handler answers each POST with, in order."""
        answers: list[Any] = []
        handler = self.fast.site.simple_posts[b"/"]

        def watched(post: Any) -> Any:
            answer = handler(post)
            answers.append(answer)
            return answer

        self.fast.site.simple_posts.clear()
        self.fast.site.simple_posts.claim(b"/", watched)
        return answers

    def test_a_held_post_s_answer_is_handed_over_directly(self) -> None:
        # The plain path's held POST is told its answer by a direct call (a HeldAnswer), not
        # through a Deferred made, called back and chained per held POST.
        answers = self.watch_answers()
        replies, _, _ = self.run_case(self.fast, lambda sid: [mcp(sid, CALL)])
        self.assertEqual([reply.code for reply in replies], [200])
        self.assertNotIsInstance(answers[0], Deferred)
        self.assertIsInstance(answers[0], PlainRequest)

    def test_a_held_post_s_end_is_told_without_a_deferred(self) -> None:
        # The forwarded request learns that its client left from the request's own list of what
        # to tell (its PostReply, through watch_end), not through a notifyFinish Deferred per POST.
        answers = self.watch_answers()
        self.on(self.fast)
        connection = self.fast.connect()
        connection.send(mcp(self.sid_of[self.fast], CALL))
        (request,) = answers
        (told,) = request.notifications
        self.assertEqual(type(told).__name__, "PostReply")
        pending = told.pending
        self.assertIs(pending.reply, told)
        connection.lose()
        self.assertIsNone(pending.reply)  # abandoned: the page's answer goes nowhere
        self.assertEqual(request.notifications, [])


class HeaderNames(InMemoryMcpCase):
    def test_written_as_twisted_web_writes_them(self) -> None:
        # (a 401's WWW-Authenticate: a refusal the plain path writes once a shared store has answered)
        head = raw_response(401, ((b"www-authenticate", b"Bearer"), (b"etag", b"x")), b"", close=False,
                            date=b"D", capitalised=True)
        self.assertIn(b"\r\nWWW-Authenticate: Bearer\r\nETag: x\r\n", head)


class HeldPastTheIdleTimeout(TwoRelays):
    """A held POST waits for the page beyond the site's idle timeout on both paths (twisted.web runs
    no idle timer while it handles a request): the page's answer comes, and the connection's idle
    timeout runs again once it is written."""

    flags = {**TwoRelays.flags, "idle-timeout": "5"}

    def test_the_answer_comes_after_the_idle_timeout(self) -> None:
        for wing in (self.slow, self.fast):
            self.on(wing)
            connection = wing.connect()
            connection.send(mcp(self.sid_of[wing], CALL))
            wing.advance(6)  # (the page has not read it yet: it reads when the test settles)
            self.assertFalse(connection.closed, wing is self.fast)
            self.settle()
            [reply] = connection.replies()
            self.assertEqual(reply.code, 200)
            wing.advance(6)
            self.assertTrue(connection.closed, wing is self.fast)  # (idle once answered)


    def test_holding_a_post_cancels_no_timer(self) -> None:
        # The connection's idle timer, armed by the first answer, stays armed while the second POST
        # is held (not cancelled and armed anew per held POST); it does nothing if it fires meanwhile.
        self.on(self.fast)
        connection = self.fast.connect()
        connection.send(mcp(self.sid_of[self.fast], CALL))
        self.settle()
        armed = [call for call in self.fast.reactor.getDelayedCalls() if call.active()]
        connection.send(mcp(self.sid_of[self.fast], CALL.replace(b'"id":7', b'"id":8')))
        self.assertEqual(self.taken[-1], (b"mcp", True))
        self.assertEqual([call for call in armed if not call.active()], [])
        self.fast.advance(6)  # (past the idle timeout while held: nothing closes it)
        self.assertFalse(connection.closed)
        self.settle()
        self.assertEqual([reply.code for reply in connection.replies()], [200, 200])


def _one_answer(port: int, data: bytes) -> bytes:
    """The bytes of the first complete answer to C{data} on a new connection (blocking: a thread's)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(data)
        received = b""
        while not parse_responses(received, False)[0]:
            chunk = s.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


# On a shared store the token is checked once the body is read (no early refusal): the refusals too
# are rendered beside twisted.web, once the store has answered. (request, status) each.
WRONG = b"authorization: Bearer " + b"w" * 30
REDIS_CASES: list[tuple[bytes, int]] = [
    (mcp(b"", CALL, WRONG, auth=False), 401),
    (mcp(b"unknown-client", CALL), 404),
    (mcp(b"", CALL), 400),
    (post(b"/gonesession/mcp", CALL, b"authorization: Bearer " + TOKEN.encode()), 410),
    (outbox(ANSWER, query=b"?token=" + b"w" * 30), 401),
    (outbox(ANSWER, b"origin: " + ORIGIN), 200),
    (outbox(b"{nope"), 401),
    (outbox(NOTIFIED, where=b"inbox"), 200),
]


class PlainPostParityOnRedis(McpRelayCase):
    """On Redis (the token checked by the store once the body is in): the same bytes on both paths."""

    with_redis = True
    flags = TwoRelays.flags

    async def test_answered_as_twisted_web_answers(self) -> None:
        fast = self.wing
        await self.register(SESSION)
        slow = await Wing.start("mcp", {"mcp-reap-interval-ms": "0", **self.flags, **redis_flags()}, {})
        self.addCleanup(slow.stop)
        slow.service.site.simple_posts.clear()  # twisted.web's path only
        registration = compact({"session": SESSION, "token": TOKEN})
        registered = await deferToThread(_one_answer, slow.port, post(b"/register", registration))
        self.assertEqual(registered[9:12], b"200")
        taken: list[bool] = []
        handler = fast.service.site.simple_posts[b"/"]

        def watched(post: Any) -> Any:
            answer = handler(post)
            taken.append(answer is not None)
            return answer

        fast.service.site.simple_posts.clear()
        fast.service.site.simple_posts.claim(b"/", watched)
        for request, status in REDIS_CASES:
            expected = await deferToThread(_one_answer, slow.port, request)
            got = await deferToThread(_one_answer, fast.port, request)
            self.assertEqual(got[9:12], b"%d" % status, got)
            self.assertEqual(re.sub(rb"\r\nDate: [^\r]*", b"", got), re.sub(rb"\r\nDate: [^\r]*", b"", expected))
        self.assertEqual(taken, [True] * len(REDIS_CASES))


class UnderAPrefix(InMemoryMcpCase):
    """The wing claims its prefix's paths only: under C{--mcp-prefix} a session's POST is rendered
    beside twisted.web, a path outside the prefix goes to twisted.web (its 404)."""

    flags = {"mcp-prefix": "/relay"}

    def test_the_prefix_s_paths_are_claimed(self) -> None:
        taken: list[bytes] = []
        simple = self.wing.site.simple_posts
        handler = simple[b"/relay/"]

        def watched(post: Any) -> Any:
            answer = handler(post)
            if answer is not None:
                taken.append(post.path)
            return answer

        simple.clear()
        simple.claim(b"/relay/", watched)
        self.register(SESSION)
        self.assertEqual(self.post(f"/{SESSION}/outbox?token={TOKEN}", raw=ANSWER).code, 200)
        self.assertEqual(self.wing.post(f"/{SESSION}/outbox?token={TOKEN}", ANSWER).code, 404)
        self.assertEqual(taken, [b"/relay/%s/outbox?token=%s" % (SESSION.encode(), TOKEN.encode())])


class HeldPostWhoseClientLeaves(McpRelayCase):
    """A client that closes its connection while its C{tools/call} is held (the page has read it, not
    answered) is noticed when the connection closes, on the plain path as on twisted.web's: its
    pending call forgets its reply then, not when the page's answer finds nobody to write to. Real
    sockets: the close is seen only by a connection that still reads."""

    async def held_then_left(self) -> Any:
        """The pending call of a held POST whose (raw socket) client closed, once the relay's
        connection has seen it close."""
        await self.register(SESSION)
        page = SimulatedPage(self, SESSION, silent=frozenset({"tools/call"}))
        await page.start()
        sid = initialized(await self.post(f"/{SESSION}/mcp", INIT, **{**AUTH, "content-type": "application/json"}))
        lost: Deferred[None] = Deferred()
        original = RelayChannel.connectionLost
        with socket.create_connection(("127.0.0.1", self.port)) as s:
            port = s.getsockname()[1]

            def connectionLost(channel: RelayChannel, reason: Any = None) -> None:
                mine = getattr(channel.transport.getPeer(), "port", None) == port
                original(channel, reason)
                if mine and not lost.called:
                    lost.callback(None)

            self.patch(RelayChannel, "connectionLost", connectionLost)
            s.sendall(mcp(sid.encode(), CALL))
            while page.methods()[-1:] != ["tools/call"]:
                await page.next_seen(len(page.seen) + 1)  # (held once the page has read it)
        await lost.addTimeout(TIMEOUT, reactor)  # (a bound on a failing run, not a wait)
        [pending] = self.service.resource.endpoint.clients[sid].pending.values()
        return pending

    async def test_on_the_plain_path(self) -> None:
        taken: list[bool] = []
        handler = self.wing.service.site.simple_posts[b"/"]

        def watched(post: Any) -> Any:
            answer = handler(post)
            taken.append(answer is not None)
            return answer

        self.wing.service.site.simple_posts.clear()
        self.wing.service.site.simple_posts.claim(b"/", watched)
        pending = await self.held_then_left()
        self.assertIsNone(pending.reply)  # forgotten: nothing is kept for a client that left
        self.assertEqual(taken[-1:], [True])  # (the held POST was the plain path's)

    async def test_on_twisted_web_s_path(self) -> None:
        self.wing.service.site.simple_posts.clear()
        pending = await self.held_then_left()
        self.assertIsNone(pending.reply)
