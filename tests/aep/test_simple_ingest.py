"""C{POST /events} answered beside twisted.web (relayd.web.simple_post) answers and stores exactly what
twisted.web's path does: the same requests, over real sockets, to a relay with it and one without; on
the in-memory log, on Redis (answered once the write is done) and behind a trusted proxy."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import generate_latest
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from relayd.base.metrics import REGISTRY
from relayd.compat import web as fence
from tests.support.aep import TOKEN, AEPRelay, OnRedis, event, events_of, ndjson, open_sse, start_relay, wait_until
from tests.support.metrics import Samples, parse
from tests.support.raw import Answer, RawClient, exchange

HEAD = b"POST /events HTTP/1.1\r\nhost: localhost\r\n"


def post(body: bytes, *headers: bytes, version: bytes = b"0.1", ctype: bytes = b"application/x-ndjson",
         token: bytes | None = TOKEN.encode(), http: bytes = b"HTTP/1.1") -> bytes:
    fields = [b"aep-version: " + version, b"content-type: " + ctype, *headers]
    if token is not None:
        fields.append(b"authorization: Bearer " + token)
    fields.append(b"content-length: %d" % len(body))
    head = HEAD.replace(b"HTTP/1.1", http)
    return head + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body


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
    ("connection: close, the official SDK's shape", [post(json.dumps(event("F", 4, "progress.status", id="F-4")).encode(),
                                                          b"connection: close", ctype=b"application/json")], 1),
    ("HTTP/1.0", [post(batch("H", 0, 1), http=b"HTTP/1.0")], 1),
    ("HTTP/1.0, keep-alive asked", [post(batch("H", 1, 1), b"connection: keep-alive", http=b"HTTP/1.0")], 1),
    ("HTTP/1.0, refused", [post(batch("H", 2, 1), token=None, http=b"HTTP/1.0")], 1),
    ("connection: close, refused", [post(batch("H", 2, 1), b"connection: close", version=b"0.2")], 1),
    ("x-forwarded-for", [post(batch("H", 3, 1), b"x-forwarded-for: 203.0.113.9")], 1),
    ("x-forwarded-for, connection: close", [post(batch("H", 4, 1), b"x-forwarded-for: 203.0.113.9", b"connection: close")], 1),
    ("HTTP/1.0, one JSON event", [post(json.dumps(event("H", 5, "progress.status", id="H-5")).encode(),
                                       ctype=b"application/json", http=b"HTTP/1.0")], 1),
    ("connection: close, then another request in the same write",
     [post(batch("I", 0, 1), b"connection: close") + post(batch("I", 1, 1))], 1),
    ("the head split across writes", [post(batch("I", 2, 1))[:30], post(batch("I", 2, 1))[30:]], 1),
    ("expect: 100-continue", [post(batch("F", 1, 1), b"expect: 100-continue")], 1),
    ("a command, routed", [post(ndjson(event("F", None, "control.pause", id="c1")))], 1),
    ("the body at its limit", [post(batch("G", 0, 1).ljust(4000, b"\n"))], 1),
    ("the body one over", [post(batch("G", 1, 1).ljust(4001, b"\n"))], 1),
    ("header fields at their limit", [post(batch("G", 2, 1), *(b"x-%d: 1" % n for n in range(495)))], 1),
    ("header fields one over", [post(batch("G", 3, 1), *(b"x-%d: 1" % n for n in range(496)))], 1),
    ("a header block near its limit", [post(batch("G", 4, 1), b"x-pad: " + b"p" * 16200)], 1),
]


# Counted where events are delivered, not where the request is answered: on Redis that is after the
# answer, as the fan-out comes back (an unroutable command's drop), so not within one exchange.
_DELIVERY_COUNTERS = ("relayd_events_dropped_total",)


def counters() -> Samples:
    """relayd's request-side counters in the process's registry (both relays of a test count under one name)."""
    samples = parse(generate_latest(REGISTRY).decode())
    return {
        key: value
        for key, value in samples.items()
        if key[0].startswith("relayd_") and key[0].endswith("_total") and key[0] not in _DELIVERY_COUNTERS
    }


def grown(before: Samples, after: Samples) -> dict[Any, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items() if value != before.get(key, 0.0)}


class SimpleIngestParity(TestCase):
    flags: dict[str, Any] = {}

    async def relays(self) -> tuple[AEPRelay, AEPRelay, list[bool]]:
        flags: dict[str, Any] = {"aep_token": TOKEN, "aep_max_batch": 5, "aep_max_body": 4000, **self.flags}
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
            before = counters()
            expected = await deferToThread(exchange, plain.wing.port, pieces, responses=count, timeout=2.0)
            counted = counters()
            got = await deferToThread(exchange, fast.wing.port, pieces, responses=count, timeout=2.0)
            self.assertEqual(len(got.responses), count, (name, got.describe()))
            self.assertEqual(self.seen(got), self.seen(expected), name)
            self.assertEqual(got.closed, expected.closed, name)
            # The same counts (requests by status, events ingested, refusals by reason) on both paths.
            self.assertEqual(grown(counted, counters()), grown(before, counted), name)
            fast_answers.append((name, got))
        self.assertEqual(accesses["fast"], accesses["plain"])
        self.assertEqual(await self.stored(fast), await self.stored(plain))
        # The plain cases were answered beside twisted.web, the others by it (the first is the plainest).
        self.assertTrue(taken[0])
        self.assertIn(True, taken[1:])
        self.assertIn(False, taken)

    async def stored(self, relay: AEPRelay) -> dict[str, list[bytes]]:
        """The events each session holds, as sent."""
        log = relay.core.log
        return {session: [e.raw for e in log._buffers[session].events if e] for session in log._buffers}

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
        self.assertEqual(len((await self.stored(fast))["A"]), 5)

    async def test_without_knowing_the_channel_is_between_requests_twisted_web_answers(self) -> None:
        self.patch(fence, "CHANNEL_BETWEEN_REQUESTS", False)
        fast, _, taken = await self.relays()
        answer = await deferToThread(exchange, fast.wing.port, [post(batch("A", 0, 1))])
        self.assertEqual(answer.responses[0].status, 202)
        self.assertEqual(taken, [])
        self.assertEqual(len((await self.stored(fast))["A"]), 1)


class SimpleIngestParityOnRedis(OnRedis, SimpleIngestParity):
    """On Redis the plain path answers once the write is done, as twisted.web's path does."""

    async def stored(self, relay: AEPRelay) -> dict[str, list[bytes]]:
        # (what a history-only stream replays: the events as sent, in each session's order)
        history = await open_sse(self, relay, {"authorization": "Bearer " + TOKEN}, live="0", from_="all")
        stored: dict[str, list[bytes]] = {}
        for message in events_of(await history.read_until_end()):
            sent = message.json()
            stored.setdefault(sent["session"], []).append(json.dumps(sent, sort_keys=True).encode())
        return stored


class SimpleIngestOnALateStore(TestCase):
    """On the in-memory log a write answers at once; here it is made to answer later (on Redis every
    write does, and L{SimpleIngestParityOnRedis} covers that), so the plain path's answer, and the
    next request's, must wait for it."""

    flags: dict[str, Any] = {}
    relays = SimpleIngestParity.relays

    def store_answers_later(self, relay: AEPRelay) -> list[Deferred[Any]]:
        """Each ingest waits until the test fires its Deferred (in the list returned)."""
        writes: list[Deferred[Any]] = []
        ingest = relay.core.ingest

        def later(events: Any, *args: Any) -> Deferred[Any]:
            d: Deferred[Any] = Deferred()
            d.addCallback(lambda _: ingest(events, *args))
            writes.append(d)
            return d

        self.patch(relay.core, "ingest", later)
        self.patch(relay.core, "ingest_now", lambda events: False)  # (as a log that stores later declines)
        return writes

    async def connect(self, relay: AEPRelay) -> RawClient:
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", relay.wing.port), client)
        self.addCleanup(client.transport.loseConnection)
        return client

    async def test_the_answer_waits_for_a_store_that_answers_later_and_so_does_the_next_request(self) -> None:
        fast, _, taken = await self.relays()
        writes = self.store_answers_later(fast)
        client = await self.connect(fast)
        client.transport.write(post(batch("W", 0, 1)))
        await wait_until(lambda: len(writes) == 1)
        client.transport.write(post(batch("W", 1, 1), token=b"x"))  # (twisted.web's 401, after the 202)
        self.assertEqual(client.received, b"")  # nothing is answered before the store has the batch
        writes[0].callback(None)
        await client.wait_for(b"401 Unauthorized")
        self.assertLess(client.received.index(b"202 Accepted"), client.received.index(b"401 Unauthorized"))
        self.assertEqual(taken, [True, False])
        self.assertEqual(len(fast.core.log._buffers["W"]), 1)

    async def test_an_answer_that_waited_for_the_store_is_sent_and_closed_at_once(self) -> None:
        # (Redis: the answer comes with the store's reply, outside a read of the client's connection;
        # it is sent, and a closing connection closed, within that call, not on the next turn.)
        fast, _, taken = await self.relays()
        writes = self.store_answers_later(fast)
        client = await self.connect(fast)
        client.transport.write(post(batch("X", 0, 1), b"connection: close"))
        await wait_until(lambda: len(writes) == 1)
        site = fast.service.site
        self.assertEqual(site.open_connections(), 1)
        writes[0].callback(None)
        self.assertEqual(site.open_connections(), 0)  # sent and closed within the store's answer
        await client.closed
        self.assertIn(b"HTTP/1.1 202 Accepted", client.received)
        self.assertEqual(taken, [True])


class SimpleIngestParityBehindAProxy(TestCase):
    """Behind a trusted proxy the client named in the access line and counted is the forwarded one,
    on both paths; a client new to its connection is counted anew on the plain path too (the SDK
    opens a connection per event), and one at its cap is left to twisted.web's path, which answers
    the crowded 503 and counts the refusal once."""

    flags = {"trust_forwarded_for": 1}
    relays = SimpleIngestParity.relays

    async def test_the_forwarded_client_is_named_and_counted_as_twisted_web_does(self) -> None:
        fast, plain, taken = await self.relays()
        pieces = [post(batch("P", n, 1), b"x-forwarded-for: 10.0.0.1, 198.51.100.%d" % (n // 2)) for n in range(4)]
        seen = {}
        for name, relay in (("fast", fast), ("plain", plain)):
            peers: list[str] = []
            original = relay.service.site.access
            relay.service.site.access = lambda peers=peers, original=original, **line: (
                peers.append(line["peer"]), original(**line))[1]
            client = RawClient()
            await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", relay.wing.port), client)
            self.addCleanup(client.transport.loseConnection)
            for n, request in enumerate(pieces):
                client.transport.write(request)
                await wait_until(lambda n=n, client=client: client.received.count(b"HTTP/1.1 202 Accepted") == n + 1)
            seen[name] = peers
        self.assertEqual(seen["fast"], ["198.51.100.0", "198.51.100.0", "198.51.100.1", "198.51.100.1"])
        self.assertEqual(seen["fast"], seen["plain"])
        self.assertEqual(taken, [True, True, True, True])  # a client new to the connection too
        self.assertEqual(fast.service.site._clients, plain.service.site._clients)

    async def test_a_forwarded_client_at_its_cap_is_refused_as_twisted_web_does(self) -> None:
        self.flags = {"trust_forwarded_for": 1, "max_client_connections": 1}
        fast, plain, taken = await self.relays()
        answers = {}
        for name, relay in (("fast", fast), ("plain", plain)):
            before = counters()
            clients = []
            for n in range(3):  # the client's one connection, then two over its cap
                client = RawClient()
                await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", relay.wing.port), client)
                self.addCleanup(client.transport.loseConnection)
                client.transport.write(post(batch("Q", n, 1), b"x-forwarded-for: 198.51.100.7"))
                await wait_until(lambda client=client: b"\r\n\r\n" in client.received)
                clients.append(client.received.split(b"\r\n", 1)[0])
            answers[name] = (clients, grown(before, counters()), dict(relay.service.site._clients))
        self.assertEqual(answers["fast"], answers["plain"])
        self.assertEqual(answers["fast"][0][0], b"HTTP/1.1 202 Accepted")
        self.assertEqual(answers["fast"][0][1:], [b"HTTP/1.1 503 Service Unavailable"] * 2)
        self.assertEqual(taken, [True])  # (the crowded ones went to twisted.web's path, untouched)
