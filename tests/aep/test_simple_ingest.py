"""C{POST /events} answered beside twisted.web (relayd.web.simple_post) answers and stores exactly what
twisted.web's path does: the same requests, over real sockets, to a relay with it and one without."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from relayd.compat import web as fence
from tests.support.aep import TOKEN, AEPRelay, OnRedis, event, ndjson, start_relay, wait_until
from tests.support.raw import Answer, RawClient, exchange

HEAD = b"POST /events HTTP/1.1\r\nhost: localhost\r\n"


def post(body: bytes, *headers: bytes, version: bytes = b"0.1", ctype: bytes = b"application/x-ndjson",
         token: bytes | None = TOKEN.encode()) -> bytes:
    fields = [b"aep-version: " + version, b"content-type: " + ctype, *headers]
    if token is not None:
        fields.append(b"authorization: Bearer " + token)
    fields.append(b"content-length: %d" % len(body))
    return HEAD + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body


def batch(session: str, first: int, count: int) -> bytes:
    return ndjson(*(event(session, seq, "progress.status", id=f"{session}-{seq}") for seq in range(first, first + count)))


# (name, what one connection sends, complete answers expected); every piece is sent as its own write.
CASES: list[tuple[str, list[bytes], int]] = [
    ("plain", [post(batch("A", 0, 3))], 1),
    ("a single JSON event", [post(json.dumps(event("A", 3, "progress.status", id="A-3")).encode(),
                                  ctype=b"application/json; charset=utf-8")], 1),
    ("a retry: all duplicates", [post(batch("A", 0, 3))], 1),
    ("keep-alive, twice on one connection", [post(batch("B", 0, 2)), post(batch("B", 2, 2))], 2),
    ("pipelined in one write", [post(batch("B", 4, 1)) + post(batch("B", 5, 1))], 2),
    ("after a GET on the same connection", [b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n", post(batch("B", 6, 1))], 2),
    ("the body in a second write", [post(batch("C", 0, 2))[:-10], post(batch("C", 0, 2))[-10:]], 1),
    ("empty", [post(b"")], 1),
    ("blank lines only", [post(b"\n\n \n")], 1),
    ("no token", [post(batch("D", 0, 1), token=None)], 1),
    ("another token", [post(batch("D", 0, 1), token=b"wrong")], 1),
    ("a token that is not UTF-8", [post(batch("D", 0, 1), token=b"\xff")], 1),
    ("another version", [post(batch("D", 0, 1), version=b"0.2")], 1),
    ("another media type", [post(batch("D", 0, 1), ctype=b"text/plain")], 1),
    ("media type in capitals", [post(batch("D", 1, 1), ctype=b"Application/X-NDJSON")], 1),
    ("invalid JSON", [post(batch("D", 2, 1) + b"{nope\n")], 1),
    ("an invalid event", [post(batch("D", 3, 1) + b'{"aep":"0.1"}\n')], 1),
    ("over the batch limit", [post(batch("E", 0, 6))], 1),
    ("over the body limit", [post(batch("E", 0, 1) + b" " * 4000)], 1),
    ("connection: close", [post(batch("F", 0, 1), b"connection: close")], 1),
    ("expect: 100-continue", [post(batch("F", 1, 1), b"expect: 100-continue")], 1),
    ("a command, routed", [post(ndjson(event("F", None, "control.pause", id="c1")))], 1),
    ("the body at its limit", [post(batch("G", 0, 1).ljust(4000, b"\n"))], 1),
    ("the body one over", [post(batch("G", 1, 1).ljust(4001, b"\n"))], 1),
    ("header fields at their limit", [post(batch("G", 2, 1), *(b"x-%d: 1" % n for n in range(495)))], 1),
    ("header fields one over", [post(batch("G", 3, 1), *(b"x-%d: 1" % n for n in range(496)))], 1),
    ("a header block near its limit", [post(batch("G", 4, 1), b"x-pad: " + b"p" * 16200)], 1),
]


class SimpleIngestParity(TestCase):
    async def relays(self) -> tuple[AEPRelay, AEPRelay, list[bool]]:
        flags: dict[str, Any] = {"aep_token": TOKEN, "aep_max_batch": 5, "aep_max_body": 4000}
        fast, plain = await start_relay(self, **flags), await start_relay(self, **flags)
        plain.service.site.simple_posts.clear()  # twisted.web's path only
        taken: list[bool] = []
        handler = fast.service.site.simple_posts[b"/events"]

        def watched(request: Any) -> Any:
            answer = handler(request)
            taken.append(answer is not None)
            return answer

        fast.service.site.simple_posts[b"/events"] = watched
        return fast, plain, taken

    @staticmethod
    def seen(answer: Answer) -> list[tuple[int, list[tuple[bytes, bytes]], bytes]]:
        return [(r.status, [(n, v) for n, v in r.headers if n.lower() != b"date"], r.body) for r in answer.responses]

    async def test_every_request_is_answered_and_stored_as_twisted_web_does(self) -> None:
        fast, plain, taken = await self.relays()
        accesses: dict[str, list[tuple[Any, ...]]] = {"fast": [], "plain": []}
        for name, relay in (("fast", fast), ("plain", plain)):
            site, log = relay.service.site, accesses[name]
            original = site.access

            def access(*, original: Any = original, log: Any = log, **line: Any) -> None:
                log.append((line["method"], line["path"], line["status"], line["sent"], line["peer"]))
                original(**line)

            site.access = access
        fast_answers = []
        for name, pieces, count in CASES:
            expected = await deferToThread(exchange, plain.wing.port, pieces, responses=count, timeout=2.0)
            got = await deferToThread(exchange, fast.wing.port, pieces, responses=count, timeout=2.0)
            self.assertEqual(len(got.responses), count, (name, got.describe()))
            self.assertEqual(self.seen(got), self.seen(expected), name)
            self.assertEqual(got.closed, expected.closed, name)
            fast_answers.append((name, got))
        self.assertEqual(accesses["fast"], accesses["plain"])
        for session in "ABCDEF":
            self.assertEqual(fast.core.log._buffers.get(session) and [e.raw for e in fast.core.log._buffers[session].events if e],
                             plain.core.log._buffers.get(session) and [e.raw for e in plain.core.log._buffers[session].events if e],
                             session)
        # The plain cases were answered beside twisted.web, the others by it (the first is the plainest).
        self.assertTrue(taken[0])
        self.assertIn(True, taken[1:])
        self.assertIn(False, taken)

    async def test_plain_posts_one_after_another_on_a_connection_are_each_answered_beside_twisted_web(self) -> None:
        fast, _, taken = await self.relays()
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", fast.wing.port), client)
        self.addCleanup(client.transport.loseConnection)
        for n, request in enumerate([post(batch("A", 0, 2)), post(batch("A", 2, 2)), post(batch("A", 4, 1), token=b"x"),
                                     post(batch("A", 4, 1))]):
            client.transport.write(request)
            await wait_until(lambda n=n: client.received.count(b"HTTP/1.1 ") == n + 1)  # (each answered before the next)
        self.assertEqual(client.received.count(b"HTTP/1.1 202 Accepted"), 3)
        self.assertEqual(client.received.count(b"HTTP/1.1 401 Unauthorized"), 1)
        self.assertEqual(taken, [True, True, False, True])
        self.assertEqual(len(fast.core.log._buffers["A"]), 5)

    async def test_a_relay_on_redis_answers_every_post_through_twisted_web(self) -> None:
        # Its store answers later: nothing may be answered before the write is done.
        relay = await start_relay(self, **OnRedis().extra_relay_flags())
        self.assertEqual(relay.service.site.simple_posts, {})

    async def test_without_knowing_the_channel_is_between_requests_twisted_web_answers(self) -> None:
        self.patch(fence, "CHANNEL_BETWEEN_REQUESTS", False)
        fast, _, taken = await self.relays()
        answer = await deferToThread(exchange, fast.wing.port, [post(batch("A", 0, 1))])
        self.assertEqual(answer.responses[0].status, 202)
        self.assertEqual(taken, [])
        self.assertEqual(len(fast.core.log._buffers["A"]), 1)
