"""Hostile input on the AEP wing's input side, against a real ``twistd -n relayd`` over real sockets.

Each class runs one relayd subprocess for all its tests (started on first use, stopped at the end of
the class). It is started with ``subprocess`` rather than the reactor, so that it outlives each
test's reactor-cleanliness check (tests/support/twistd.py's DetachedRelayd), and its listening
socket is made here and passed in the way systemd passes one: the port is known before relayd
runs, and the first request simply waits in the listen backlog until relayd accepts it. Every test
ends by checking that relayd's log holds no traceback.

The rules held here (docs/aep.md):

- an oversize body is answered 401/413/426 once, before the upload ends, whatever carries the token;
- a number is accepted only if the relay can read it again and write it again: integers of more
  than 4300 digits are ``invalid-json``; numbers beyond the double range read as JavaScript reads
  them (infinity, rendered ``Infinity`` in messages, written ``null`` when re-serialised); positions
  (``epoch``, ``seq``) have at most 99 digits (``invalid-event``);
- identifiers (``id``, ``source``, ``agent``, ``session``) hold no control character
  (``invalid-event``), lone surrogates are ``invalid-json`` everywhere, and nothing a client chose
  reaches an SSE framing line unescaped.
"""

from __future__ import annotations

import json
import os
import re
import socket
import uuid
from typing import Any, ClassVar
from urllib.parse import quote

import treq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.trial.unittest import SkipTest, SynchronousTestCase, TestCase
from twisted.web.client import HTTPConnectionPool

from relayd.aep.core.envelope import EventKind, classify
from relayd.aep.core.event import Event, JSONError, admit, event_from, parse_json
from relayd.aep.wire import sse_frame
from tests.support.aep import event, ndjson
from tests.support.raw import RawClient
from tests.support.redis import CI, shared_redis
from tests.support.sse import Message, SSEClient
from tests.support.twistd import DetachedRelayd
from tests.support.ws import WSClient

TOKEN = "hostile-t0ken"
AUTH = {"authorization": f"Bearer {TOKEN}"}
JSON_POST = {"aep-version": "0.1", "content-type": "application/json", **AUTH}
NDJSON_POST = {"aep-version": "0.1", "content-type": "application/x-ndjson", **AUTH}
TIMEOUT = 10.0
START_TIMEOUT = 60.0  # the first request waits in the backlog while relayd starts (2 cores, shared)
BAD_LOG = re.compile(rb"Traceback|Unhandled Error|Unhandled error|CRITICAL|\[-\] Exception", re.I)

class RelaydCase(TestCase):
    """A test case whose tests share one relayd started with C{options}."""

    timeout = 60
    options: ClassVar[list[str]] = ["--aep-token", TOKEN]
    relayd: ClassVar[DetachedRelayd | None] = None

    @classmethod
    def tearDownClass(cls) -> None:
        relayd = cls.__dict__.get("relayd")
        if relayd is not None:
            relayd.stop_now()
            cls.relayd = None

    async def _start(self) -> None:
        cls = type(self)
        started = cls.__dict__.get("relayd") is None  # (not a base class's)
        if started:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                sock.listen(512)
                options = ["--no-mcp", "--aep-listen", "systemd:domain=INET:name=relayd-aep"]
                cls.relayd = await DetachedRelayd.launch(options + cls.extra_options() + cls.options, (), sock)
                cls.relayd.ports["aep"] = sock.getsockname()[1]
            # (closed here: relayd holds it now, so if relayd dies connections are refused, not queued)
        self.relay = cls.relayd
        assert self.relay is not None
        self.port = self.relay.port("aep")
        self.url = f"http://127.0.0.1:{self.port}"
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(self.pool.closeCachedConnections)
        if started:
            code, _, _ = await self.request("GET", "/healthz", timeout=START_TIMEOUT)
            self.assertEqual(code, 200, self.relay.log.decode(errors="replace"))
            await self.relay.wait_for(rb'"GET /healthz" 200')  # not counted as the first test's own
        self.mark = len(self.relay.log)
        self.addCleanup(self.assert_clean_log)

    def setUp(self) -> Deferred[None]:
        return Deferred.fromCoroutine(self._start())

    @classmethod
    def extra_options(cls) -> list[str]:
        return []

    def new_log(self) -> bytes:
        return self.relay.log[self.mark :]

    def assert_clean_log(self) -> None:
        self.assertIsNone(self.relay.popen.poll(), "relayd exited")
        found = BAD_LOG.search(self.new_log())
        self.assertIsNone(found, self.new_log().decode(errors="replace")[-4000:])

    # Clients ---------------------------------------------------------------------------------

    async def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
        timeout: float = TIMEOUT,
    ) -> tuple[int, Any, bytes]:  # fmt: skip
        d = treq.request(method, self.url + path, data=body, headers=headers or {}, pool=self.pool)
        d.addTimeout(timeout, reactor)
        response = await d
        content = await treq.content(response)
        return response.code, response.headers, content

    async def post(self, body: bytes, headers: dict[str, str] = NDJSON_POST) -> tuple[int, Any]:
        code, _, content = await self.request("POST", "/events", body, headers)
        return code, json.loads(content) if content else None

    async def raw(self, data: bytes) -> bytes:
        """Send C{data} on a fresh connection; everything answered until the server closes."""
        client = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", self.port), client)
        client.transport.write(data)
        await client.closed.addTimeout(TIMEOUT, reactor)
        return client.received

    async def sse(self, params: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> SSEClient:
        query = "&".join(
            f"{k}={quote(v if isinstance(v, (str, bytes)) else json.dumps(v, separators=(',', ':')), safe='')}"
            for k, v in (params or {}).items()
        )
        client = await SSEClient.connect(self.url + "/stream?" + query, {**AUTH, **(headers or {})})
        self.addCleanup(client.close)
        return client

    async def history(self, params: dict[str, Any], headers: dict[str, str] | None = None) -> list[Message]:
        """A C{live=0} stream read to its end: the events, then C{replay-complete}."""
        client = await self.sse({**params, "live": "0"}, headers)
        self.assertEqual(client.code, 200, client.refusal)
        messages = await client.read_until_end()
        self.assertEqual(messages[-1].comment, "replay-complete")
        return messages[:-1]

    async def ws(self) -> WSClient:
        client = await WSClient.connect(f"ws://127.0.0.1:{self.port}/socket", AUTH)
        self.addCleanup(client.close)
        self.assertEqual((await client.hello())["type"], "hello")
        return client


def session_name() -> str:
    return "s-" + uuid.uuid4().hex[:10]


def line(ev: dict[str, Any]) -> bytes:
    return json.dumps(ev, separators=(",", ":")).encode()


def strict_json(text: str) -> Any:
    """JSON as a browser's JSON.parse reads it (no NaN/Infinity literals)."""
    return json.loads(text, parse_constant=lambda name: (_ for _ in ()).throw(ValueError(name)))


# 1. The early answer to an oversize body -----------------------------------------------------------


def post_head(target: bytes, length: int, version: bytes = b"0.1", extra: bytes = b"") -> bytes:
    return (
        b"POST " + target + b" HTTP/1.1\r\nHost: localhost\r\naep-version: " + version + b"\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n" % length + extra + b"\r\n"
    )


class OversizeBodyEarlyAnswer(RelaydCase):
    """With a token set, a body over --aep-max-body is answered once, before the upload ends, with the
    status the checks give in order (401, 426/415, 413), wherever the token is, and logged as one
    access line."""

    options = ["--aep-token", TOKEN, "--aep-max-body", "1024"]

    async def answered_once(self, data: bytes, status: int) -> bytes:
        reply = await self.raw(data)
        self.assertTrue(reply.startswith(b"HTTP/1.1 %d " % status), reply[:200])
        self.assertEqual(reply.count(b"HTTP/1.1 "), 1, reply)
        await self.relay.wait_for(rb'"POST /events" %d ' % status, since=self.mark)  # (written after the answer)
        lines = [line for line in self.new_log().splitlines() if line.strip()]
        self.assertEqual(len(lines), 1, lines)
        self.assertIn(b'"POST /events" %d ' % status, lines[0])
        return reply.partition(b"\r\n\r\n")[2]

    async def test_query_token_gets_413(self) -> None:
        body = await self.answered_once(post_head(b"/events?access_token=" + TOKEN.encode(), 5000) + b"x" * 2000, 413)
        self.assertEqual(json.loads(body), {"error": "payload-too-large", "max_bytes": 1024})

    async def test_no_token_gets_401(self) -> None:
        self.assertEqual(await self.answered_once(post_head(b"/events", 5000) + b"x" * 2000, 401), b"")

    async def test_wrong_query_token_gets_401(self) -> None:
        await self.answered_once(post_head(b"/events?x=1&access_token=nope", 5000) + b"x" * 2000, 401)

    async def test_query_token_then_version_gate(self) -> None:
        body = await self.answered_once(post_head(b"/events?access_token=" + TOKEN.encode(), 5000, b"9.9"), 426)
        self.assertEqual(json.loads(body)["versions"], ["0.1"])

    async def test_chunked_upload_with_query_token_gets_413(self) -> None:
        head = (
            b"POST /events?access_token=" + TOKEN.encode() + b" HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\n"
            b"content-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        await self.answered_once(head + b"400\r\n" + b"x" * 1024 + b"\r\n400\r\n" + b"y" * 1024 + b"\r\n", 413)

    async def test_exactly_the_limit_is_read_and_judged(self) -> None:
        ev = line(event(session_name(), 0))
        body = ev + b" " * (1024 - len(ev))
        head = post_head(b"/events?access_token=" + TOKEN.encode(), 1024, extra=b"connection: close\r\n")
        reply = await self.raw(head + body)
        self.assertTrue(reply.startswith(b"HTTP/1.1 202 "), reply[:200])


# 2 and 3. Numbers --------------------------------------------------------------------------------

DIGITS = 4300  # the longest integer the relay reads


def digits(n: int) -> int:
    return int("9" * n)


class NumbersOnEveryPath(RelaydCase):
    """A number is accepted only if every later path (filters, downlevel, replay over SSE and
    WebSocket) can read and write it again; a number in a checked field or a query never costs a 5xx,
    a hang or a lost reply."""

    async def test_integer_too_long_to_read_again_is_invalid_json_on_every_ingest_path(self) -> None:
        s = session_name()
        poison = line(event(s, 1, data={"n": 0})).replace(b'"n":0', b'"n":' + b"9" * (DIGITS + 1))
        for body, headers in ((poison, JSON_POST), (line(event(s, 0)) + b"\n" + poison + b"\n", NDJSON_POST)):
            code, answer = await self.post(body, headers)
            self.assertEqual(code, 400, answer)  # never 503, never a stored-but-refused batch
            self.assertEqual(answer["error"], "invalid-json")
            self.assertIn("more than 4300 digits", answer["detail"])
        client = await self.ws()
        client.send_raw(poison)
        self.assertEqual((await client.recv())["code"], "bad-json")
        self.assertEqual(await client.roundtrip(), [])
        self.assertEqual(await self.history({"from": [{"session": s}]}), [])  # nothing of either batch

    async def test_the_longest_integer_is_served_on_every_path(self) -> None:
        s = session_name()
        ev = event(s, 0, type="progress.status", capture="redacted", data={"n": digits(DIGITS), "message": "m"})
        raw = line(ev)
        filtered = await self.sse({"filter": {"session": s}})
        downlevelled = await self.sse({"filter": {"session": s}, "capture": "metadata"})
        live_ws = await self.ws()
        live_ws.send({"type": "subscribe", "id": "live", "filter": {"session": s}, "capture": "metadata"})
        self.assertEqual(await live_ws.recv(), {"type": "subscribed", "id": "live"})
        self.assertEqual(await self.post(raw), (202, None))

        self.assertEqual((await filtered.next_event()).data.encode(), raw)  # as posted
        downlevel = (await downlevelled.next_event()).json()
        self.assertEqual((downlevel["capture"], downlevel["data"]), ("metadata", {"n": digits(DIGITS)}))
        self.assertEqual((await live_ws.recv())["data"], {"n": digits(DIGITS)})
        (replayed,) = await self.history({"from": [{"session": s}]})
        self.assertEqual(replayed.data.encode(), raw)
        (replayed,) = await self.history({"filter": {"session": s}, "capture": "metadata"})
        self.assertEqual(replayed.json()["data"], {"n": digits(DIGITS)})
        client = await self.ws()
        client.send({"type": "subscribe", "id": "r", "filter": {"session": s}, "from": [{"session": s}]})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "r"})
        self.assertEqual((await client.recv())["data"]["n"], digits(DIGITS))

    async def test_infinity_and_wide_integers_are_re_encoded_as_json(self) -> None:
        # 1e400 sends the line to the exact parser, which keeps 2**64 + 1 exact; a line break in the
        # posted bytes (or a downlevel) makes the relay serialise the event itself.
        s = session_name()
        text = json.dumps(event(s, 0, type="progress.status", data={"wide": 2**64 + 1, "inf": 0}), indent=1)
        body = text.replace('"inf": 0', '"inf": 1e400').encode()
        as_stored = await self.sse({"filter": {"session": s}})
        downlevelled = await self.sse({"filter": {"session": s}, "capture": "none"})
        self.assertEqual(await self.post(body, JSON_POST), (202, None))
        self.assertEqual(strict_json((await as_stored.next_event()).data)["data"], {"wide": 2**64 + 1, "inf": None})
        self.assertNotIn("data", strict_json((await downlevelled.next_event()).data))
        (replayed,) = await self.history({"from": [{"session": s}]})
        self.assertEqual(strict_json(replayed.data)["data"], {"wide": 2**64 + 1, "inf": None})

    async def test_numbers_beyond_the_double_range_in_checked_fields(self) -> None:
        huge = "1" + "0" * 400
        s = session_name()
        code, answer = await self.post(line(event(s, 0)).replace(b'"aep":"0.1"', b'"aep":' + huge.encode()))
        self.assertEqual((code, answer["detail"]), (400, "unsupported aep version: Infinity"))
        for flt, message in (
            ('{"severity":{"gte":%s}}' % huge, b"unknown severity level: Infinity"),
            ('{"severity":{"lte":-%s}}' % huge, b"unknown severity level: -Infinity"),
            ('{"%s":1}' % ("1" * 5000), b"unknown filter key: " + b"1" * 5000),
            ('{"severity":{"%s":"info"}}' % ("2" * 5000), b"severity comparison allows gte/lte only"),
        ):
            client = await self.sse({"filter": flt})
            self.assertEqual((client.code, client.refusal), (400, message))
        client = await self.ws()
        for frame in (
            '{"type":"subscribe","id":1,"capture":%s}' % huge,
            '{"type":"subscribe","id":2,"filter":{"severity":{"gte":%s}}}' % huge,
            '{"type":"subscribe","id":3,"filter":{"%s":true}}' % ("1" * 5000),
            '{"type":"subscribe","id":4,"from":[{"session":"x","seq":%s}]}' % huge,
            '{"type":"subscribe","id":5,"from":[{"session":"x","epoch":1e400}]}',
        ):
            client.send_raw(frame.encode())
            reply = await client.recv()
            self.assertEqual((reply["type"], reply["code"]), ("error", "invalid-filter"), frame[:80])
        self.assertEqual(await client.roundtrip(), [])

    async def test_attention_option_ids_beyond_the_double_range_are_labelled_infinity(self) -> None:
        s = session_name()
        downlevelled = await self.sse({"filter": {"session": s}, "capture": "metadata"})
        ev = event(s, 0, type="attention.requested", capture="full", subject=10**400,
                   data={"prompt": "p", "kind": -(10**400), "options": [{"id": 0, "label": "secret"}]})  # fmt: skip
        body = line(ev).replace(b'"id":0', b'"id":1' + b"0" * 400)
        self.assertEqual(await self.post(body), (202, None))  # (was 503, with the event stored)
        data = (await downlevelled.next_event()).json()["data"]
        self.assertEqual(data["options"][0]["label"], "Infinity")
        self.assertEqual(data["prompt"], "a requests -Infinity: Infinity")

    async def test_positions_have_at_most_99_digits(self) -> None:
        s = session_name()
        widest = 10**99 - 1
        for ev, detail in (
            (event(s, 10**99), "seq out of range (at most 99 digits)"),
            (event(s, 0, epoch=10**99), "epoch out of range (at most 99 digits)"),
            (event(s, 0, epoch=-(10**99)), "epoch out of range (at most 99 digits)"),
            (event(s, 0, epoch=1e300), "epoch out of range (at most 99 digits)"),
            (event(s, 1e300), "seq out of range (at most 99 digits)"),
        ):
            code, answer = await self.post(line(ev))
            self.assertEqual((code, answer), (400, {"error": "invalid-event", "line": 0, "detail": detail}))
        client = await self.ws()
        client.send(event(s, 10**99, id="over"))
        self.assertEqual(await client.recv(), {"type": "error", "cause": "over", "code": "invalid-event",
                                               "detail": "seq out of range (at most 99 digits)"})  # fmt: skip
        self.assertEqual(await self.post(line(event(s, widest, epoch=widest))), (202, None))
        (replayed,) = await self.history({"from": [{"session": s}]})
        self.assertEqual(replayed.id, f"{s}:{widest}:{widest}")
        # Resuming from there (by `from` or Last-Event-ID) replays nothing more.
        self.assertEqual(await self.history({"from": [{"session": s, "epoch": widest, "seq": widest}]}), [])
        self.assertEqual(await self.history({}, {"last-event-id": replayed.id}), [])

    async def test_query_numbers_of_any_shape(self) -> None:
        s = session_name()
        self.assertEqual(await self.post(line(event(s, 0))), (202, None))
        for entry in ('{"session":"%s","seq":1e400}', '{"session":"%s","seq":-2}', '{"session":"%s","seq":1.5}',
                      '{"session":"%s","epoch":true}', '{"session":"%s","seq":"5"}',
                      '{"session":"%s","seq":%s}' % ("%s", "9" * 100), '{"session":"%s","seq":%s}' % ("%s", "9" * 5000),
                      '{"session":"%s","epoch":-%s}' % ("%s", "9" * 5000)):  # fmt: skip
            client = await self.sse({"from": "[" + entry % s + "]"})
            self.assertEqual(client.code, 400, entry[:60])
        # A Last-Event-ID that could name no held event is ignored (the stream replays nothing).
        for value in (f"{s}:0:" + "9" * 5000, f"{s}:" + "9" * 100 + ":0", f"{s}:0:-1", f"{s}:0:1e3"):
            client = await self.sse({"live": "0"}, {"last-event-id": value})
            self.assertEqual(client.code, 200, value[:60])  # (the 5000 digits were a 503)
            self.assertEqual([m.comment for m in await client.read_until_end()], ["replay-complete"])


# 12. Framing lines ----------------------------------------------------------------------------------

FORGED = '\n\nevent: session.started\ndata: {"forged":true}\n\n'


class NoForgeryThroughFraming(RelaydCase):
    """Control characters in identifiers are refused at ingest on every path, resume positions naming
    such a session are refused, and what reaches an SSE framing line is escaped even if stored."""

    async def test_control_characters_in_identifiers_are_invalid_event(self) -> None:
        agent = "agent-" + uuid.uuid4().hex[:6]
        s = session_name()
        watcher = await self.sse({"filter": {"agent": agent}})
        for field, value in (("session", s + FORGED), ("session", s + "\r"), ("id", "i\u0000"), ("source", "s\u001b"),
                             ("session", s + "\u007f"), ("session", s + "\u2028x")):  # fmt: skip
            ev = {**event(s, 0, agent=agent), field: value}
            code, answer = await self.post(line(ev))
            if value.endswith("\u2028x"):  # not a line break in SSE: an ordinary character
                self.assertEqual(code, 202)
                continue
            self.assertEqual((code, answer["error"]), (400, "invalid-event"), (field, value))
            self.assertEqual(answer["detail"], f"control character in {field}")
        code, answer = await self.post(line({**event(s, 1, agent=agent), "agent": agent + "\n"}))
        self.assertEqual((code, answer["detail"]), (400, "control character in agent"))
        sentinel = line(event(s, 2, agent=agent, id="sentinel"))
        self.assertEqual(await self.post(sentinel), (202, None))
        first = await watcher.next_event()
        self.assertEqual((first.fields, first.id), (["event", "data", "id"], f"{s}\u2028x:0:0"))
        second = await watcher.next_event()
        self.assertEqual((second.data.encode(), second.id), (sentinel, f"{s}:0:2"))

    async def test_websocket_and_batches_refuse_them_too(self) -> None:
        s = session_name()
        client = await self.ws()
        client.send(event(s + FORGED, 0, id="evil", source="aep://test"))
        reply = await client.recv()
        self.assertEqual((reply["code"], reply["cause"]), ("invalid-event", "evil"))
        self.assertEqual(reply["detail"], "control character in session")
        code, answer = await self.post(ndjson(event(s, 0), event(s, 1, id="x\ny")))
        self.assertEqual(code, 400)
        self.assertEqual(answer, {"error": "invalid-event", "line": 1, "detail": "control character in id"})
        self.assertEqual(await self.history({"from": [{"session": s}]}), [])  # all or nothing
        self.assertEqual(await self.history({"from": "all", "filter": {"session": s + FORGED}}), [])

    async def test_resume_positions_naming_such_a_session_never_reach_a_comment(self) -> None:
        for session in ("x" + FORGED, "x\r", "x\u0000"):
            client = await self.sse({"from": [{"session": session, "seq": 3}]})
            self.assertEqual(client.code, 400)
            self.assertEqual(client.refusal, b"bad from entry: from entry session holds a control character")
        client = await self.ws()
        client.send({"type": "subscribe", "id": "f", "from": [{"session": "x\ny", "seq": 1}]})
        self.assertEqual((await client.recv())["code"], "invalid-filter")
        # A header cannot carry CR/LF; other controls in Last-Event-ID make it malformed (ignored).
        reply = await self.raw(
            b"GET /stream?live=0 HTTP/1.1\r\nHost: localhost\r\nauthorization: Bearer " + TOKEN.encode()
            + b"\r\nlast-event-id: x\x01: y\x0b:0:1\r\nconnection: close\r\n\r\n"
        )  # fmt: skip
        self.assertTrue(reply.startswith(b"HTTP/1.1 200 "), reply[:100])
        self.assertNotIn(b"\x01", reply)
        self.assertIn(b": replay-complete\n\n", reply)

    def test_a_stored_identifier_is_framed_escaped(self) -> None:
        # What another relayd (or an older one) stored is framed safely all the same.
        ev = {**event("a" + FORGED, 7), "type": "progress.status"}
        frame = sse_frame(Event.of(ev, line(ev)))
        lines = frame.split(b"\n")
        self.assertEqual([part.split(b":")[0] for part in lines], [b"event", b"data", b"id", b"", b""])
        escaped = "a" + FORGED.replace("\n", "\ufffd")
        self.assertEqual(lines[2], f"id: {escaped}:0:7".encode())


# The rest of the HTTP input surface -------------------------------------------------------------------


class HTTPInputSurface(RelaydCase):
    """Media types, methods, and Unicode in bodies, tokens, queries and headers."""

    async def test_media_types_are_case_insensitive(self) -> None:
        for ctype in ("Application/JSON; charset=UTF-8", "APPLICATION/X-NDJSON", "application/Json"):
            code, answer = await self.post(line(event(session_name(), 0)), {**JSON_POST, "content-type": ctype})
            self.assertEqual(code, 202, (ctype, answer))
        code, _ = await self.post(b"{}", {**JSON_POST, "content-type": "application/json-patch+json"})
        self.assertEqual(code, 415)

    async def test_unknown_methods_on_known_paths_are_405_json_with_allow(self) -> None:
        for method, path, allow in (("PUT", "/events", "GET, HEAD, POST"), ("DELETE", "/stream", "GET, OPTIONS"),
                                    ("POST", "/healthz", "GET, HEAD"), ("PATCH", "/.well-known/aep", "GET, HEAD"),
                                    ("POST", "/socket", "GET")):  # fmt: skip
            code, headers, body = await self.request(method, path, b"{}", AUTH)
            self.assertEqual((code, headers.getRawHeaders("allow")), (405, [allow]), (method, path))
            self.assertEqual(json.loads(body), {"error": "method-not-allowed", "allow": allow.split(", ")})
        reply = await self.raw(
            b"BREW /events HTTP/1.1\r\nHost: localhost\r\nauthorization: Bearer %s\r\nconnection: close\r\n\r\n" % TOKEN.encode()
        )
        self.assertTrue(reply.startswith(b"HTTP/1.1 405 "), reply[:100])
        self.assertIn(b"\r\nAllow: GET, HEAD, POST\r\n", reply)
        code, _, body = await self.request("PUT", "/nowhere", b"", AUTH)
        self.assertEqual((code, body), (404, b""))

    async def test_unicode_in_bodies(self) -> None:
        s = session_name()
        ok = line(event(s, 0, type="progress.status", data={"m": "x"}))
        for body in (
            b"\xef\xbb\xbf" + ok,  # a byte order mark
            ok.replace(b'"m":"x"', b'"m":"\xff"'),  # invalid UTF-8
            ok.replace(b'"m":"x"', b'"m":"\\ud800"'),  # a lone surrogate
            ok.replace(b'"m":"x"', b'"n":1e400,"m":"\\udc00"'),  # one the fallback parser would read
            ok.replace(b'"m":"x"', b'"n":1e400,"\\ud800":1'),  # in a key
            ok.replace(b'"m":"x"', b'"m":"\x00"'),  # a raw control character
        ):
            code, answer = await self.post(body)
            self.assertEqual((code, answer["error"]), (400, "invalid-json"), body)
        downlevelled = await self.sse({"filter": {"session": s}, "capture": "none"})
        texts = await self.sse({"filter": {"session": s}})
        body = ok.replace(b'"m":"x"', b'"m":"\\ud83d\\ude00\\u0000\\u2028\\r\\n"')
        self.assertEqual(await self.post(body), (202, None))
        self.assertEqual((await texts.next_event()).data.encode(), body)  # forwarded as posted
        self.assertEqual((await downlevelled.next_event()).json()["capture"], "none")

    async def test_unicode_in_tokens_queries_and_headers(self) -> None:
        for request in (
            b"GET /events HTTP/1.1\r\nHost: localhost\r\nauthorization: Bearer \xff\xfe\r\nconnection: close\r\n\r\n",
            b"GET /events?access_token=%FF%00 HTTP/1.1\r\nHost: localhost\r\nconnection: close\r\n\r\n",
            b"GET /events?access_token=%s HTTP/1.1\r\nHost: localhost\r\nconnection: close\r\n\r\n" % quote(TOKEN + "\0").encode(),
        ):
            reply = await self.raw(request)
            self.assertTrue(reply.startswith(b"HTTP/1.1 401 "), (request, reply[:100]))
        for params, refusal in (
            ({"filter": '{"session":"\\ud800"}'}, b"bad filter JSON"),
            ({"filter": b"\xff"}, b"bad filter JSON"),  # not UTF-8
            ({"from": '[{"session":"\\udfff"}]'}, b"bad from JSON"),
            ({"capture": "\u00e9"}, "unknown capture level: \u00e9".encode()),
        ):
            client = await self.sse(params)
            self.assertEqual((client.code, client.refusal), (400, refusal), params)
        reply = await self.raw(
            b"GET /stream?live=0 HTTP/1.1\r\nHost: localhost\r\nauthorization: Bearer " + TOKEN.encode()
            + b"\r\nlast-event-id: \xff\xfe:0:1\r\nconnection: close\r\n\r\n"
        )  # fmt: skip
        self.assertTrue(reply.startswith(b"HTTP/1.1 200 "), reply[:100])


# Events read back from Redis ------------------------------------------------------------------------


class FromRedis(NumbersOnEveryPath):
    """The same number rules with the event log in Redis, plus what only a store shared by several
    relayds (of several versions) can hold."""

    prefix = f"hostile-{uuid.uuid4().hex[:8]}:"

    @classmethod
    def extra_options(cls) -> list[str]:
        try:
            redis = shared_redis()
        except SkipTest:
            if CI:
                raise
            return []
        return ["--redis", redis.url, "--redis-prefix", cls.prefix]

    async def _start(self) -> None:
        if "--redis" not in type(self).extra_options():
            raise SkipTest("redis-server is not installed")
        await super()._start()
        # Listening comes before the Redis pool is up: the class's first POST would be a 503.
        await self.relay.wait_for(rb"connected to Redis at ")

    async def test_stored_events_are_served_and_framed_escaped(self) -> None:
        from relayd.aep.redis.store import RedisEventLog
        from tests.support.redis import connected_redis

        redis = await connected_redis(shared_redis().url)
        self.addCleanup(redis.close)
        s = "a" + FORGED
        ev = {**event(s, 5), "data": {"wide": 2**64 + 1}}
        # As a relayd that accepted it would have stored it (in its newline-free wire form).
        await RedisEventLog(redis, 100, 100, self.prefix).append([Event.of(ev, line(ev))])
        (replayed,) = await self.history({"from": "all", "filter": {"session": s}})
        self.assertEqual(replayed.fields, ["event", "data", "id"])
        self.assertEqual(replayed.json()["data"], {"wide": 2**64 + 1})
        self.assertTrue(replayed.id.endswith(":0:5") and "\n" not in replayed.id)
        client = await self.ws()
        client.send({"type": "subscribe", "id": "r", "from": "all", "filter": {"session": s}})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "r"})
        self.assertEqual((await client.recv())["session"], s)

    async def test_lone_surrogate_resume_session_is_refused(self) -> None:
        client = await self.sse({"from": '[{"session":"\\ud800","seq":1}]'})
        self.assertEqual((client.code, client.refusal), (400, b"bad from JSON"))  # (was a 503)


# A property: whatever arrives on the HTTP surface ------------------------------------------------------

SETTINGS = settings(
    max_examples=int(os.environ.get("RELAYD_HYPOTHESIS_EXAMPLES", "80")),
    deadline=None,
    database=None,
    derandomize=os.environ.get("RELAYD_HYPOTHESIS_RANDOM") is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Numbers of every size and shape, as JSON text.
number_texts = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.sampled_from(["-0", "0.0", "1e400", "-1e400", "1E-400", "4.9e-324", "1.7976931348623157e308", "1e99999999999"]),
    # Integers at the limits: 99 digits (positions), the double range, 4300 digits (re-reading), and
    # a mantissa of thousands of digits.
    st.tuples(st.sampled_from(["", "-", "1."]), st.sampled_from([98, 99, 100, 308, 309, 400, 4299, 4300, 4301, 5000]))
    .map(lambda t: t[0] + "9" * t[1]),
    st.integers(1, 6000).map(lambda n: "7" * n),
)
# Strings as JSON text: escapes for controls, surrogates (paired or lone), BOM, line breaks.
string_texts = st.lists(
    st.sampled_from(["a", "\\n", "\\r", "\\u0000", "\\ud800", "\\udc00", "\\ud83d\\ude00", "\\ufeff", "\\u2028", "é",
                     "\\\\", '\\"', ":", "\\u001b", "data: x", "\\u007f"]),
    max_size=6,
).map(lambda parts: '"' + "".join(parts) + '"')  # fmt: skip
json_texts = st.recursive(
    st.one_of(number_texts, string_texts, st.sampled_from(["true", "false", "null"])),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3).map(lambda items: "[" + ",".join(items) + "]"),
        st.lists(st.tuples(string_texts, inner), max_size=3).map(
            lambda pairs: "{" + ",".join(f"{k}:{v}" for k, v in pairs) + "}"
        ),
    ),
    max_leaves=6,
)
ENVELOPE = ["aep", "id", "type", "time", "source", "agent", "session", "seq", "epoch", "severity", "capture"]
# Mostly attributes the envelope check does not look at (the event stays valid and must be served).
hostile_keys = st.one_of(
    st.sampled_from(["data", "subject", "run", "ext", "data"]), st.sampled_from(ENVELOPE), st.text(max_size=4)
)


@st.composite
def event_texts(draw: Any) -> bytes:
    """A valid event with a few attributes replaced by hostile JSON text."""
    ev = {k: json.dumps(v) for k, v in event("p", draw(st.integers(0, 3)), type=draw(
        st.sampled_from(["progress.status", "attention.requested", "agent.heartbeat", "tool.completed"]))).items()}
    if ev["type"] == '"agent.heartbeat"':
        ev.pop("session", None), ev.pop("seq", None)
    for key in draw(st.lists(hostile_keys, max_size=3)):
        ev[json.dumps(key)] = draw(json_texts)
    if draw(st.booleans()):
        ev['"data"'] = '{"options":[{"id":%s}],"prompt":"p","kind":%s}' % (draw(json_texts), draw(json_texts))
    text = "{" + ",".join(f"{k if k.startswith(chr(34)) else json.dumps(k)}:{v}" for k, v in ev.items()) + "}"
    return text.encode("utf-8", "surrogatepass")


bodies = st.one_of(
    event_texts(),
    st.lists(event_texts(), min_size=1, max_size=4).map(lambda lines: b"\n".join(lines)),
    json_texts.map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.binary(max_size=64),
    st.sampled_from([b"\xef\xbb\xbf{}", b"\x00", b"{\"a\":1}\r\n\r\n", b"\xed\xa0\x80"]),
)
query_values = st.one_of(json_texts, st.text(max_size=12), st.sampled_from(["all", "0", "1", "-1", "9" * 5000]))


def exchange(port: int, request: bytes, whole: bool) -> bytes | None:
    """Send a request on a blocking socket; the answer's head (or, C{whole}, all until close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as s:
        try:
            s.sendall(request)
        except OSError:
            pass  # answered (and closed) early
        data = b""
        try:
            while whole or b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
    return data if data.startswith(b"HTTP/1.1 ") else None


def status_of(reply: bytes | None) -> int | None:
    return int(reply.split(b" ", 2)[1]) if reply else None


class HostileProperties(RelaydCase):
    """Generated bodies, queries and headers: always an answer, never a 5xx, never a traceback, and
    /healthz answers after each."""

    timeout = 120
    options = ["--aep-token", TOKEN, "--aep-max-body", "65536", "--aep-max-batch", "3"]

    def check(self, reply: bytes | None) -> int:
        status = status_of(reply)
        assert status is not None, "no answer"
        assert status < 500, reply[:300]  # type: ignore[index]
        health = exchange(self.port, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nconnection: close\r\n\r\n", True)
        assert status_of(health) == 200, health
        bad = BAD_LOG.search(self.new_log())
        assert bad is None, self.new_log().decode(errors="replace")[-3000:]
        return status

    async def test_post_events(self) -> None:
        port = self.port
        # Subscribers that make the relay read and re-encode every event it accepts (a filter and a
        # downlevel): an event it could not serve would fail its own POST (or worse).
        await self.sse({"filter": {"agent": "a"}, "capture": "metadata"})
        await self.sse({"filter": {"severity": {"gte": "debug"}}, "capture": "none"})

        @SETTINGS
        @given(
            body=bodies,
            ctype=st.sampled_from(["application/json", "application/x-ndjson", "Application/X-NDJSON; charset=utf-8"]),
            method=st.sampled_from(["POST", "POST", "POST", "PUT", "PATCH"]),
            token=st.sampled_from([b"Bearer %s" % TOKEN.encode()] * 2 + [b"Bearer \xff", b"Bearer"]),
        )
        def answered(body: bytes, ctype: str, method: str, token: bytes) -> None:
            head = b"%s /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\ncontent-type: %s\r\nauthorization: %s\r\n" % (
                method.encode(), ctype.encode(), token)
            head += b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
            status = self.check(exchange(port, head + body, False))
            if status == 202:
                # Whatever was accepted can be read again and served re-encoded (a downlevel).
                for raw in filter(None, map(bytes.strip, body.split(b"\n"))):
                    event = admit(raw) or Event.of(parse_json(raw), raw)
                    json.loads(event.payload("none"))

        await threads.deferToThread(answered)

    async def test_get_stream_and_events_queries(self) -> None:
        port = self.port
        code, _ = await self.post(ndjson(*[event("p", i) for i in range(3)]))
        self.assertEqual(code, 202)

        @SETTINGS
        @given(
            path=st.sampled_from(["/stream", "/stream", "/events", "/.well-known/aep", "/connections"]),
            params=st.dictionaries(
                st.sampled_from(["filter", "from", "capture", "live", "access_token", "limit"]), query_values, max_size=4
            ),
            history=st.booleans(),
            last_event_id=st.none() | st.binary(max_size=30).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
            | st.sampled_from([b"p:0:1", b"p:0:" + b"9" * 5000, b"p:" + b"9" * 120 + b":1"]),
        )
        def answered(path: str, params: dict[str, str], history: bool, last_event_id: bytes | None) -> None:
            if history:
                params["live"] = "0"
            query = "&".join(f"{k}={quote(v.encode('utf-8', 'surrogatepass'), safe='')}" for k, v in params.items())
            head = b"GET %s?%s HTTP/1.1\r\nHost: localhost\r\nauthorization: Bearer %s\r\nconnection: close\r\n" % (
                path.encode(), query.encode(), TOKEN.encode())
            if last_event_id is not None:
                head += b"last-event-id: " + last_event_id + b"\r\n"
            whole = path != "/stream" or history  # a live stream never ends: its head is the answer
            reply = exchange(port, head + b"\r\n", whole)
            status = self.check(reply)
            if path == "/stream" and history and status == 200:
                assert reply.endswith(b": replay-complete\n\n\r\n0\r\n\r\n"), reply[-200:]  # type: ignore[union-attr]

        await threads.deferToThread(answered)


class EveryAcceptedEventCanBeServed(SynchronousTestCase):
    """In process, on the same generated lines: what the hot path admits, the exact path accepts as
    the same event, and every accepted event can be framed at every capture level, written as JSON a
    browser reads, and rebuilt from its stored form (what Redis and other instances hand back)."""

    @settings(SETTINGS, max_examples=int(os.environ.get("RELAYD_HYPOTHESIS_EXAMPLES", "400")))
    @given(raw=event_texts())
    def test_admitted_implies_servable(self, raw: bytes) -> None:
        fast = admit(raw)
        try:
            value = parse_json(raw)
        except JSONError:
            self.assertIsNone(fast, raw)
            return
        kind = classify(value)
        if fast is not None:
            self.assertIs(kind, fast.kind, raw)
            exact = Event.of(value, raw, kind)
            self.assertEqual((fast.session, fast.position, fast.key), (exact.session, exact.position, exact.key))
        if not isinstance(kind, EventKind):
            return
        event = Event.of(value, raw, kind)
        for level in (None, "none", "metadata", "redacted", "full"):
            lines = sse_frame(event, level).split(b"\n")
            self.assertEqual(lines[-2:], [b"", b""])
            fields = [line.split(b": ", 1)[0] for line in lines[:-2]]
            self.assertEqual(fields, [b"event", b"data", b"id"][: len(fields)])
            strict_json(event.payload(level).decode("utf-8"))
        stored = event_from(event.payload(None))
        self.assertEqual((stored.kind, stored.session, stored.position), (kind, event.session, event.position))
