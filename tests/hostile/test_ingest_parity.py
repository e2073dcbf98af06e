"""Every malformed body is answered alike on every way into the AEP wing (docs/aep.md, "What a refusal
names"): the plain-POST path beside twisted.web (a keep-alive POST in one write, on the in-memory
log), twisted.web's own path (the same POST with C{connection: close}, and with its body in a second
write) and the WebSocket ingest. Each way gets the same verdict and the same detail, in its own shape:
C{400 invalid-json} with the line, C{error bad-json}, or, for text that is not UTF-8 on a WebSocket,
the Close 1007 whose reason is that detail."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from tests.hostile.harness import Target, hostile, judge, request
from tests.support.aep import open_ws, start_relay
from tests.support.cases import cases, expand
from tests.support.raw import Answer, exchange

HEAD = b"POST /events HTTP/1.1\r\nhost: localhost\r\naep-version: 0.1\r\n"
EVENT = b'{"aep":"0.1","id":"e1","type":"session.started","time":"2026-12-03T00:00:00Z","source":"s","agent":"a","session":"S","seq":0'
SECOND = EVENT.replace(b'"e1"', b'"e2"').replace(b'"seq":0', b'"seq":1') + b"}"


def event_with(member: bytes) -> bytes:
    """The valid event with one more member, C{member} (raw bytes, after a comma)."""
    return EVENT + b"," + member + b"}"


@dataclass(frozen=True)
class Refused:
    """The verdict on a refused body: the detail every way names, and the NDJSON line it is on."""

    detail: str
    line: int = 0
    not_utf8: bool = False  # a WebSocket fails the connection (1007) rather than answering bad-json
    aep_only: bool = False  # JSON the AEP wing refuses by its own rule; MCP and the broker read it


ACCEPTED = None

# name: (body, NDJSON?, the verdict). Offsets count bytes from the start of the (stripped) line.
CASES: dict[str, tuple[bytes, bool, Refused | None]] = {
    "invalid_utf8": (event_with(b'"x":"\xff"'), False, Refused("not valid UTF-8 at byte 130", not_utf8=True)),
    "overlong_utf8": (event_with(b'"x":"\xc0\xaf"'), False, Refused("not valid UTF-8 at byte 130", not_utf8=True)),
    "raw_surrogate": (event_with(b'"x":"\xed\xa0\x80"'), False, Refused("not valid UTF-8 at byte 130", not_utf8=True)),
    "escaped_lone_surrogate": (event_with(b'"x":"\\ud800"'), False, Refused("lone surrogate \\ud800 in a string", aep_only=True)),
    "escaped_lone_low_surrogate_after_a_pair": (
        event_with(b'"x":"\\ud83d\\ude00\\udc01"'), False, Refused("lone surrogate \\udc01 in a string", aep_only=True)),
    "integer_of_5000_digits": (event_with(b'"x":' + b"7" * 5000), False, Refused("integer of more than 4300 digits", aep_only=True)),
    "integer_of_4301_digits": (event_with(b'"x":' + b"7" * 4301), False, Refused("integer of more than 4300 digits", aep_only=True)),
    "integer_of_4300_digits": (event_with(b'"x":' + b"7" * 4300), False, ACCEPTED),
    "nested_256_deep": (event_with(b'"x":' + b"[" * 255 + b"]" * 255), False, Refused("nesting deeper than 255 levels", aep_only=True)),
    "nested_255_deep": (event_with(b'"x":' + b"[" * 254 + b"]" * 254), False, ACCEPTED),
    "1e999": (event_with(b'"x":1e999'), False, ACCEPTED),
    "minus_1e999": (event_with(b'"x":-1e999'), False, ACCEPTED),
    "NaN": (event_with(b'"x":NaN'), False, Refused("NaN is not JSON")),
    "duplicate_keys": (event_with(b'"id":"e9"'), False, ACCEPTED),  # the last one counts, as in JSON.parse
    "nul_in_a_string": (event_with(b'"x":"\x00"'), False, Refused("control character U+0000 in a string at byte 130")),
    "nul_after_the_document": (EVENT + b"}\x00", False, Refused("unexpected content after document at byte 125")),
    "byte_order_mark": (b"\xef\xbb\xbf" + EVENT + b"}", False, Refused("byte order mark at byte 0 (JSON text has none)")),
    "truncated": (EVENT, False, Refused("unexpected end of data at byte 124")),
    "empty": (b"", False, Refused("no JSON value (the text is empty)")),
    "ndjson_bad_third_line": (EVENT + b"}\n" + SECOND + b"\n" + b'{"aep":"0.1",\n', True,
                              Refused("unexpected end of data at byte 13", line=2)),
    "ndjson_third_line_not_utf8": (EVENT + b"}\n" + SECOND + b'\n"\xff"\n', True,
                                   Refused("not valid UTF-8 at byte 1", line=2, not_utf8=True)),
}


def post(body: bytes, ndjson: bool, *headers: bytes) -> bytes:
    media = b"application/x-ndjson" if ndjson else b"application/json"
    fields = [b"content-type: " + media, *headers, b"content-length: %d" % len(body)]
    return HEAD + b"".join(field + b"\r\n" for field in fields) + b"\r\n" + body


def http_verdict(answer: Answer) -> tuple[int, Any]:
    """The status and JSON body of the first answer."""
    response = answer.responses[0]
    return response.status, json.loads(response.body) if response.body else None


@expand
class MalformedBodiesAnsweredAlike(TestCase):
    @cases(**CASES)
    async def test_every_way_in(self, body: bytes, ndjson: bool, verdict: Refused | None) -> None:
        relay = await start_relay(self)
        offered: list[bytes] = []
        simple = relay.service.site.simple_posts[b"/events"]

        def watched(post: Any) -> Any:
            offered.append(post.body)
            return simple(post)

        relay.service.site.simple_posts[b"/events"] = watched
        request = post(body, ndjson)
        ways = {
            "beside twisted.web": [request],
            "connection: close": [post(body, ndjson, b"connection: close")],
            "body in a second write": [request[: len(request) - len(body)], body] if body else [request[:-2], request[-2:]],
            "HTTP/1.0": [request.replace(b"HTTP/1.1", b"HTTP/1.0", 1)],
        }
        if verdict is None:
            expected: tuple[int, Any] = (202, None)
        else:
            expected = (400, {"error": "invalid-json", "line": verdict.line, "detail": verdict.detail})
        for way, pieces in ways.items():
            answer = await deferToThread(exchange, relay.wing.port, pieces, timeout=5.0)
            self.assertTrue(answer.responses, (way, answer.describe()))
            self.assertEqual(http_verdict(answer), expected, way)
        self.assertIn(body, offered)  # the one-write POST was the plain path's to answer or decline

        client = await open_ws(self, relay, hello={"versions": ["0.1"], "role": "emitter"})
        for line in body.split(b"\n")[:-1] if ndjson else [body]:
            client.send_raw(line)
        if verdict is not None and verdict.not_utf8:
            closed = client.closed
            closed.addTimeout(5.0, reactor)
            self.assertEqual(await closed, (1007, verdict.detail))
            return
        answered = await client.roundtrip()
        if verdict is None:
            self.assertEqual(answered, [])
        else:
            self.assertEqual(answered, [{"type": "error", "code": "bad-json", "detail": verdict.detail}])


VALID = EVENT + b"}"
HEADER_TOKEN = "parity-token"
MAX_BODY, MAX_BATCH = 1000, 2


def headed(fields: list[bytes], body: bytes = VALID) -> bytes:
    """A C{POST /events} with exactly these header C{fields} (and its length)."""
    head = b"POST /events HTTP/1.1\r\nhost: localhost\r\n"
    return head + b"".join(f + b"\r\n" for f in [*fields, b"content-length: %d" % len(body)]) + b"\r\n" + body


# The protocol's {"versions": [...]} with what a person needs beside it (relayd.aep.core.ingest).
VERSION_REFUSAL = {
    "versions": ["0.1"],
    "error": "version-unsupported",
    "header": "aep-version",
    "detail": "send the header aep-version: 0.1 (the AEP version this relay speaks) with every POST",
}

AUTH = b"authorization: Bearer " + HEADER_TOKEN.encode()
VERSION = b"aep-version: 0.1"
NDJSON = b"content-type: application/x-ndjson"
# name: (the request's header fields, its body, the status and JSON body every way in answers).
HEADER_CASES: dict[str, tuple[list[bytes], bytes, tuple[int, Any]]] = {
    "no_version": ([AUTH, NDJSON], VALID, (426, VERSION_REFUSAL)),
    "another_version": ([AUTH, b"aep-version: 0.2", NDJSON], VALID, (426, VERSION_REFUSAL)),
    "two_versions": ([AUTH, VERSION, VERSION, NDJSON], VALID, (426, VERSION_REFUSAL)),
    "another_media_type": ([AUTH, VERSION, b"content-type: text/plain"], VALID, (415, None)),
    "no_media_type": ([AUTH, VERSION], VALID, (415, None)),
    "no_token": ([VERSION, NDJSON], VALID, (401, None)),
    "another_token": ([b"authorization: Bearer nope", VERSION, NDJSON], VALID, (401, None)),
    "no_token_and_no_version": ([NDJSON], VALID, (401, None)),  # (the wall comes first)
    "over_the_body_cap": ([AUTH, VERSION, NDJSON], VALID + b" " * MAX_BODY, (413, {"error": "payload-too-large", "max_bytes": MAX_BODY})),
    "over_the_batch": ([AUTH, VERSION, NDJSON], b"\n".join([VALID, SECOND, VALID]),
                       (413, {"error": "too-many-events", "max": MAX_BATCH, "count": 3})),
    "version_and_media_in_other_case": ([AUTH, b"AEP-Version: 0.1", b"Content-Type: Application/JSON; charset=utf-8"],
                                        VALID, (202, None)),
}


@expand
class MalformedHeadersAnsweredAlike(TestCase):
    """What the headers refuse (the token, the version, the media type, the sizes) is answered alike
    on every HTTP way in: the plain-POST path (which, through the one ingest check, leaves every
    refusal to twisted.web's path), twisted.web's render, and the answer given from the headers
    alone before the body is read (the body in a second write)."""

    @cases(**HEADER_CASES)
    async def test_every_way_in(self, fields: list[bytes], body: bytes, expected: tuple[int, Any]) -> None:
        relay = await start_relay(self, aep_token=HEADER_TOKEN, aep_max_body=MAX_BODY, aep_max_batch=MAX_BATCH)
        request = headed(fields, body)
        ways = {
            "beside twisted.web": [request],
            "connection: close": [headed([*fields, b"connection: close"], body)],
            "HTTP/1.0": [request.replace(b"HTTP/1.1", b"HTTP/1.0", 1)],
            "body in a second write": [request[: len(request) - len(body)], body],
        }
        for way, pieces in ways.items():
            answer = await deferToThread(exchange, relay.wing.port, pieces, timeout=5.0)
            self.assertTrue(answer.responses, (way, answer.describe()))
            self.assertEqual(http_verdict(answer), expected, way)


class AfterTextThatIsNotUTF8(TestCase):
    """RFC 6455 8.1: a text message that is not UTF-8 fails the connection; what the client sent
    before it still counts (as before any other answer), what it sent after it is not read."""

    async def test_what_came_before_is_ingested_and_nothing_after_is_read(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={"versions": ["0.1"], "role": "emitter"})
        before = EVENT.replace(b'"S"', b'"before"') + b"}"
        after = EVENT.replace(b'"S"', b'"after"') + b"}"
        for message in (before, b'"\xff"', after):  # (one write: the relay reads them together)
            client.send_raw(message)
        closed = client.closed
        closed.addTimeout(5.0, reactor)
        self.assertEqual(await closed, (1007, "not valid UTF-8 at byte 1"))
        self.assertEqual(await relay.core.log.sessions(), ["before"])


# The single-document bodies, for the wings that read one JSON value per request.
DOCUMENTS = {name: (body, verdict) for name, (body, ndjson, verdict) in CASES.items() if not ndjson}
MCP_SESSION = "parity"
MCP_TOKEN = "parity_abcdefghijklmnopqrstuvwxyz"


@expand
class TheOtherWingsNameTheFaultAlike(TestCase):
    """The broker's C{POST /v1/action} and MCP's C{/register} and C{/{S}/mcp} refuse text that is no
    JSON in their own documented shapes, with the detail the AEP wing gives; JSON only the AEP wing
    refuses (a lone surrogate escape, a 5000-digit integer) is read there, and answered as whatever
    it then is (here: not a request)."""

    timeout = 120

    async def target(self) -> Target:
        target = await hostile(self)
        register = request(b"POST", b"/register", body=json.dumps({"session": MCP_SESSION, "token": MCP_TOKEN}).encode())
        judge(answer := await target.send("mcp", register))
        self.assertEqual(answer.responses[0].status, 200, answer.describe())
        return target

    @cases(**DOCUMENTS)
    async def test_broker_and_mcp(self, body: bytes, verdict: Refused | None) -> None:
        target = await self.target()
        not_json = verdict is not None and not verdict.aep_only
        json_type = [(b"content-type", b"application/json")]

        broker = await target.send("broker", request(b"POST", b"/v1/action", json_type, body))
        judge(broker)
        message = f"request body is not valid JSON: {verdict.detail}" if not_json else "requestId is missing"
        self.assertEqual(http_verdict(broker), (400, {"error": "invalid_request", "message": message}))

        register = await target.send("mcp", request(b"POST", b"/register", json_type, body))
        judge(register)
        expected: dict[str, Any] = {"error": "missing_fields"}
        if not_json:
            expected = {"error": "invalid_json", "detail": verdict.detail}
        self.assertEqual(http_verdict(register), (400, expected))

        headers = [*json_type, (b"accept", b"application/json, text/event-stream"),
                   (b"authorization", b"Bearer " + MCP_TOKEN.encode())]
        endpoint = await target.send("mcp", request(b"POST", f"/{MCP_SESSION}/mcp".encode(), headers, body))
        judge(endpoint)
        message = f"not JSON: {verdict.detail}" if not_json else "not a JSON-RPC 2.0 message"
        self.assertEqual(http_verdict(endpoint),
                         (400, {"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": message}}))
