"""The AEP HTTP surface (aep.md §3) and the parity items of §9.5 that concern it: the wing's routes
and handlers in memory (tests/support/inmemory.py), through relayd's own site, channel and request;
the answers that must reach the client before its upload ends on a real loopback socket."""

from __future__ import annotations

import io
import json
from typing import Any

from twisted.internet import threads
from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import Clock as FakeTime
from twisted.trial.unittest import TestCase
from twisted.web.test.requesthelper import DummyRequest

from relayd.aep.core.relay import EventRelay
from relayd.aep.core.store import MemoryEventLog
from relayd.aep.http import AEPResource
from relayd.base.clock import Timekeeper
from relayd.base.errors import StoreUnavailable
from relayd.web.streams.sse import SSEHub, sse_comment
from tests.support.aep import INGEST, AEPRelay, aep_in_memory, event, ndjson, post_in_memory
from tests.support.inmemory import Reply
from tests.support.raw import raw_exchange

TOKEN = "s3cret-token"
JSON_INGEST = {"aep-version": "0.1", "content-type": "application/json"}


def header(response: Reply, name: str) -> str | None:
    return response.header(name)


class DiscoveryAndHealth(TestCase):
    def test_discovery_document_on_both_paths(self) -> None:
        relay = aep_in_memory(self, aep_buffer=8)
        for path in ("/events", "/.well-known/aep"):
            response = relay.get(path)
            self.assertEqual(response.code, 200)
            self.assertEqual(header(response, "content-type"), "application/json")
            self.assertIsNone(header(response, "access-control-allow-origin"))
            doc = response.json()
            self.assertEqual(list(doc), ["aep", "role", "endpoints", "capabilities"])
            self.assertEqual(doc["aep"], ["0.1"])
            self.assertEqual(doc["endpoints"], {"events": "/events", "stream": "/stream", "socket": "/socket"})
            self.assertEqual(doc["capabilities"]["replay"], {"buffer": 8, "all": True})
            self.assertEqual(doc["capabilities"]["capture"], ["none", "metadata", "redacted", "full"])
            self.assertTrue(response.body.startswith(b'{\n  "aep": [\n    "0.1"\n  ],'))  # 2-space pretty print

    def test_healthz_without_token_shows_counts(self) -> None:
        response = aep_in_memory(self).get("/healthz")
        self.assertEqual(response.code, 200)
        self.assertEqual(list(response.json()), ["ok", "sessions", "subscribers", "connections", "uptime_s"])

    def test_healthz_with_token_hides_counts_unless_authorized(self) -> None:
        relay = aep_in_memory(self, aep_token=TOKEN)
        response = relay.get("/healthz")
        self.assertEqual((response.code, response.json()), (200, {"ok": True}))
        self.assertIn("sessions", relay.get("/healthz", {"authorization": f"Bearer {TOKEN}"}).json())
        self.assertIn("sessions", relay.get(f"/healthz?access_token={TOKEN}").json())

    def test_connections_introspection(self) -> None:
        relay = aep_in_memory(self, aep_token=TOKEN, allow_origin=["*"])
        response = relay.get("/connections", {"authorization": f"Bearer {TOKEN}"})
        self.assertEqual(response.code, 200)
        self.assertEqual(header(response, "access-control-allow-origin"), "*")
        doc = response.json()
        self.assertEqual(doc["relay"]["control"], True)
        self.assertEqual(doc["connections"], [])
        self.assertEqual(doc["sse_subscribers"], 0)


class AuthWall(TestCase):
    def test_401_carries_cors_and_empty_body(self) -> None:
        relay = aep_in_memory(self, aep_token=TOKEN)
        for path in ("/events", "/stream", "/connections", "/nowhere"):
            response = relay.get(path, {"origin": "http://localhost:5173"})
            self.assertEqual(response.code, 401, path)
            self.assertEqual(header(response, "access-control-allow-origin"), "http://localhost:5173")
            self.assertEqual(header(response, "vary"), "Origin")
            self.assertEqual(response.body, b"")

    def test_wrong_token_on_post_is_401(self) -> None:
        relay = aep_in_memory(self, aep_token=TOKEN)
        self.assertEqual(post_in_memory(relay, event(), token="wrong").code, 401)
        self.assertEqual(post_in_memory(relay, event(), token=TOKEN).code, 202)

    def test_wrong_header_does_not_block_a_correct_query_token(self) -> None:
        relay = aep_in_memory(self, aep_token=TOKEN)
        response = relay.get(f"/events?access_token={TOKEN}", {"authorization": "Bearer nope"})
        self.assertEqual(response.code, 200)

    def test_bearer_scheme_in_any_case_then_one_space(self) -> None:
        """The scheme is case-insensitive (RFC 7235 2.1); the one space and the token are exact."""
        relay = aep_in_memory(self, aep_token=TOKEN)
        for value in (f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer {TOKEN}"):
            response = relay.get("/events", {"authorization": value})
            self.assertEqual(response.code, 200, value)
        for value in (f"Bearer  {TOKEN}", TOKEN, f"Bearer {TOKEN.upper()}", f"Basic {TOKEN}"):
            response = relay.get("/events", {"authorization": value})
            self.assertEqual(response.code, 401, value)
            self.assertEqual(response.headers.getRawHeaders(b"www-authenticate"), [b'Bearer realm="aep"'], value)

    def test_preflight_needs_no_token(self) -> None:
        relay = aep_in_memory(self, aep_token=TOKEN, allow_origin=["*"])
        for path in ("/stream", "/connections"):
            response = relay.request("OPTIONS", path)
            self.assertEqual(response.code, 204)
            self.assertEqual(header(response, "access-control-allow-origin"), "*")
            self.assertEqual(header(response, "access-control-allow-methods"), "GET, OPTIONS")
            self.assertEqual(
                header(response, "access-control-allow-headers"), "authorization, accept, content-type, last-event-id"
            )
            self.assertEqual(header(response, "access-control-max-age"), "86400")
        response = relay.request("OPTIONS", "/events")
        self.assertEqual(response.code, 401)  # other preflights hit the wall


class NotFound(TestCase):
    def test_other_paths_are_404_with_empty_body(self) -> None:
        relay = aep_in_memory(self)
        for method, path in (("GET", "/healthz/"), ("GET", "/x"), ("POST", "/x"), ("PUT", "/events/")):
            response = relay.request(method, path)
            self.assertEqual(response.code, 404, (method, path))
            self.assertEqual(response.body, b"")
            self.assertIsNone(header(response, "content-type"))

    def test_other_methods_on_known_paths_are_405_with_allow(self) -> None:
        relay = aep_in_memory(self)
        for method, path, allow in (
            ("PUT", "/events", "GET, HEAD, POST"), ("DELETE", "/stream", "GET, OPTIONS"), ("POST", "/healthz", "GET, HEAD"),
            ("TRACE", "/.well-known/aep", "GET, HEAD"), ("PATCH", "/connections", "GET, HEAD, OPTIONS"),
        ):  # fmt: skip
            response = relay.request(method, path)
            self.assertEqual(response.code, 405, (method, path))
            self.assertEqual(header(response, "allow"), allow)
            self.assertEqual(header(response, "content-type"), "application/json")
            self.assertEqual(response.json(), {"error": "method-not-allowed", "allow": allow.split(", ")})

    def test_head_answers_like_get_without_the_body(self) -> None:
        relay = aep_in_memory(self)
        for path in ("/healthz", "/events", "/.well-known/aep", "/connections"):
            get = relay.request("GET", path)
            head = relay.request("HEAD", path)
            self.assertEqual((head.code, head.body), (200, b""), path)
            self.assertEqual(header(head, "content-type"), "application/json")
            if path != "/connections" and path != "/healthz":  # (those two carry changing counts)
                self.assertEqual(header(head, "content-length"), str(len(get.body)))
        response = relay.request("HEAD", "/stream")
        self.assertEqual((response.code, response.body, header(response, "allow")), (405, b"", "GET, OPTIONS"))


class Ingest(TestCase):
    def test_version_gate_426_before_415(self) -> None:
        relay = aep_in_memory(self)
        for version in (None, "9.9"):
            headers = {"content-type": "text/plain"}
            if version:
                headers["aep-version"] = version
            response = relay.request("POST", "/events", b"{}", headers)
            self.assertEqual(response.code, 426)
            self.assertEqual(response.phrase, b"Upgrade Required")
            self.assertEqual(header(response, "content-type"), "application/json")
            refusal = response.json()
            self.assertEqual(refusal["versions"], ["0.1"])  # the protocol's member, as the reference sends it
            self.assertEqual((refusal["error"], refusal["header"]), ("version-unsupported", "aep-version"))

    def test_duplicated_version_header_is_426(self) -> None:
        headers = [(b"aep-version", b"0.1"), (b"aep-version", b"0.1"), (b"content-type", b"application/json")]
        response = aep_in_memory(self).request("POST", "/events", b"{}", headers)
        self.assertEqual(response.code, 426)

    def test_415_has_empty_body_and_no_content_type(self) -> None:
        relay = aep_in_memory(self)
        for ctype in ("text/plain", "application/jsonx", "application/json-seq"):
            response = relay.request("POST", "/events", b"{}", {"aep-version": "0.1", "content-type": ctype})
            self.assertEqual(response.code, 415, ctype)
            self.assertEqual(response.body, b"")
            self.assertIsNone(header(response, "content-type"))
            self.assertEqual(header(response, "accept-post"), "application/json, application/x-ndjson")
        for ctype in (" application/json ; charset=utf-8", "Application/JSON; charset=UTF-8", "APPLICATION/X-NDJSON"):
            # Media types are case-insensitive (RFC 9110 8.3.1).
            response = relay.request("POST", "/events", json.dumps(event()).encode(), {"aep-version": "0.1", "content-type": ctype})
            self.assertEqual(response.code, 202, ctype)

    def test_single_json_event_and_empty_bodies(self) -> None:
        relay = aep_in_memory(self)
        response = relay.request("POST", "/events", json.dumps(event()).encode(), JSON_INGEST)
        self.assertEqual((response.code, response.body), (202, b""))
        self.assertIsNone(header(response, "content-type"))
        response = relay.request("POST", "/events", b"", JSON_INGEST)
        self.assertEqual(response.code, 400)
        self.assertEqual(response.json()["error"], "invalid-json")
        response = relay.request("POST", "/events", b"  \n \n", INGEST)
        self.assertEqual((response.code, response.body), (202, b""))

    def test_json_array_is_not_an_object(self) -> None:
        response = aep_in_memory(self).request("POST", "/events", b"[1]", JSON_INGEST)
        self.assertEqual(response.code, 400)
        self.assertEqual(response.json(), {"error": "invalid-event", "line": 0, "detail": "not an object"})

    def test_reject_invalid_missing_id(self) -> None:
        ev = event()
        del ev["id"]
        response = post_in_memory(aep_in_memory(self), ev)
        self.assertEqual(response.code, 400)
        self.assertEqual(response.json(), {"error": "invalid-event", "line": 0, "detail": "missing/invalid id"})

    def test_bad_json_line_anywhere_ingests_nothing(self) -> None:
        relay = aep_in_memory(self)
        body = ndjson(event(seq=0)) + b"{not json\n" + ndjson(event(seq=2))
        response = relay.request("POST", "/events", body, INGEST)
        self.assertEqual(response.code, 400)
        self.assertEqual(response.json()["error"], "invalid-json")
        self.assertEqual(relay.service.relay.log.session_count(), 0)

    def test_invalid_utf8_is_invalid_json(self) -> None:
        response = aep_in_memory(self).request("POST", "/events", b'{"aep":"0.1","id":"\xff"}', JSON_INGEST)
        self.assertEqual(response.code, 400)
        self.assertEqual(response.json()["error"], "invalid-json")

    def test_too_many_events_carries_max_and_count(self) -> None:
        relay = aep_in_memory(self, aep_max_batch=3)
        response = post_in_memory(relay, *[event(seq=i) for i in range(4)])
        self.assertEqual(response.code, 413)
        self.assertEqual(response.json(), {"error": "too-many-events", "max": 3, "count": 4})
        self.assertEqual(relay.service.relay.log.session_count(), 0)

    def test_max_body_counts_bytes(self) -> None:
        ev = event(data={"text": "é" * 100})  # 100 characters, 200 bytes of UTF-8
        body = json.dumps(ev, ensure_ascii=False).encode()
        self.assertLess(len(body.decode()), 350)
        self.assertGreater(len(body), 350)
        response = aep_in_memory(self, aep_max_body=350).request("POST", "/events", body, JSON_INGEST)
        self.assertEqual(response.code, 413)

    def test_posted_command_without_token_is_accepted_and_dropped(self) -> None:
        relay = aep_in_memory(self)
        stream = relay.connect()
        stream.send(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n")
        cmd = event(seq=None, type="control.pause", id="cmd-1")
        self.assertEqual(post_in_memory(relay, cmd, event(seq=0)).code, 202)
        relay.advance(0)  # (the stream writes on its next turn)
        self.assertIn(b"event: session.started", stream.received())
        self.assertNotIn(b"control.pause", stream.received())  # the command never reached the stream

    def test_a_filter_key_spelled_like_a_core_attribute_is_named_in_a_comment(self) -> None:
        """`sesion` is a legal extension attribute (AEP's filter grammar), so it is not refused; the
        stream says what it is and which core attribute it is not."""
        relay = aep_in_memory(self)
        stream = relay.connect()
        stream.send(b'GET /stream?filter={"sesion":"S"} HTTP/1.1\r\nHost: localhost\r\n\r\n')
        relay.advance(0)
        self.assertIn(
            b': filter key "sesion" is an extension attribute, not "session": it matches only events carrying "sesion"\n\n',
            stream.received(),
        )
        plain = relay.connect()
        plain.send(b'GET /stream?filter={"session":"S","team":"x"} HTTP/1.1\r\nHost: localhost\r\n\r\n')
        relay.advance(0)
        self.assertNotIn(b"filter key", plain.received())


class EarlyAnswersOnTheWire(TestCase):
    """A body over the cap is refused before the client has sent it: what the client reads on a
    real connection while its upload is still under way."""

    async def asyncSetUpRelay(self, **flags: Any) -> AEPRelay:
        relay = await AEPRelay.start(**flags)
        self.addCleanup(relay.stop)
        return relay

    async def test_payload_too_large_arrives_before_the_upload_ends(self) -> None:
        relay = await self.asyncSetUpRelay(aep_max_body=1000)
        # Announce 10 MB but send only 2 KB: the answer must come without the rest of the body.
        head = (
            b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\ncontent-type: application/x-ndjson\r\n"
            b"content-length: 10000000\r\n\r\n" + b"x" * 2000
        )
        reply = await threads.deferToThread(raw_exchange, relay.url, head)
        status, _, rest = reply.partition(b"\r\n")
        self.assertEqual(status, b"HTTP/1.1 413 Payload Too Large")
        headers, _, body = rest.partition(b"\r\n\r\n")
        self.assertIn(b"connection: close", headers.lower())
        self.assertIn(b"content-type: application/json", headers.lower())
        self.assertEqual(json.loads(body), {"error": "payload-too-large", "max_bytes": 1000})

    async def test_payload_too_large_chunked(self) -> None:
        relay = await self.asyncSetUpRelay(aep_max_body=1000)
        head = (
            b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\ncontent-type: application/x-ndjson\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"7d0\r\n" + b"x" * 2000 + b"\r\n"
        )
        reply = await threads.deferToThread(raw_exchange, relay.url, head)
        self.assertTrue(reply.startswith(b"HTTP/1.1 413"), reply[:60])


class AcknowledgedMeansStored(TestCase):
    """A 202 goes out only once the store has the events (issue 5: nothing acknowledged is lost)."""

    def _post(self, log: MemoryEventLog) -> tuple[AEPResource, DummyRequest]:
        relay = EventRelay(log, token=None, buffer=10, max_from=10)
        resource = AEPResource(relay, SSEHub(Timekeeper(FakeTime()), 25, sse_comment("ping")), max_body=1 << 20, max_batch=10)
        request = DummyRequest([b"events"])
        request.method = b"POST"
        request.path = b"/events"
        request.requestHeaders.setRawHeaders(b"aep-version", [b"0.1"])
        request.requestHeaders.setRawHeaders(b"content-type", [b"application/x-ndjson"])
        request.content = io.BytesIO(ndjson(event()))
        request._disconnected = False
        return resource, request

    def test_no_202_while_the_store_is_still_writing(self) -> None:
        pending: Deferred[list[bool]] = Deferred()

        class SlowLog(MemoryEventLog):
            append_now = None  # (a log that answers through its Deferred only)

            def append(self, events):  # type: ignore[no-untyped-def]
                # Fired, but chained to a write still in flight: it reads as "called".
                return succeed(None).addCallback(lambda _: pending)

        resource, request = self._post(SlowLog(10, 10))
        resource.render(request)
        self.assertEqual(request.finished, 0)  # nothing said while the write is in flight
        pending.callback([True])
        self.assertEqual((request.finished, request.responseCode), (1, 202))

    def test_a_write_the_store_has_made_is_answered_by_the_render_call(self) -> None:
        # The fast path: a synchronous store's 202 is what render returns, as any plain answer
        # (no NOT_DONE_YET, no finish from a callback).
        resource, request = self._post(MemoryEventLog(10, 10))
        self.assertEqual((resource.render(request), request.responseCode), (b"", 202))
        self.assertEqual(request.responseHeaders.getRawHeaders(b"content-length"), [b"0"])

        class BrokenLog(MemoryEventLog):
            append_now = None

            def append(self, events):  # type: ignore[no-untyped-def]
                return fail(StoreUnavailable("aep"))

        resource, request = self._post(BrokenLog(10, 10))
        body = resource.render(request)
        self.assertEqual((request.responseCode, body), (503, b'{"error":"store-unavailable","store":"aep"}'))
