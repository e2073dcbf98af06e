"""Unit tests of the body cap (relayd/web/request.py): the early answer comes before the upload ends."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from twisted.internet import task
from twisted.internet.address import IPv4Address
from twisted.internet.testing import StringTransport
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.resource import Resource
from twisted.web.server import Site

from relayd.web.answers import Answer
from relayd.web.request import BodyLimit, LimitedRequest, read_body

CAP = 10


class Echo(Resource):
    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[bytes] = []

    def render_POST(self, request: Any) -> bytes:
        body = read_body(request)
        self.bodies.append(body)
        return b"got %d" % len(body)

    def render_GET(self, request: Any) -> bytes:
        request.setResponseCode(404)
        return b""


class CappedSite(Site):
    requestFactory = LimitedRequest

    def __init__(self, resource: Resource, limit: BodyLimit | None) -> None:
        super().__init__(resource, reactor=task.Clock())
        self.body_limit = limit


class Harness:
    def __init__(self, cap: int | None = CAP) -> None:
        self.resource = Echo()
        self.answered: list[tuple[bytes, bytes]] = []
        self.args: list[Any] = []
        limit = BodyLimit(cap, self.respond) if cap is not None else None
        self.site = CappedSite(self.resource, limit)
        self.transport = StringTransport(peerAddress=IPv4Address("TCP", "127.0.0.1", 50000))
        self.protocol = self.site.buildProtocol(self.transport.getPeer())
        self.protocol.makeConnection(self.transport)

    def respond(self, request: Any) -> Answer:
        self.answered.append((request.method, request.path))
        self.args.append(request.args)
        body = json.dumps({"error": "payload-too-large", "max_bytes": CAP}).encode()
        return Answer(413, body, [(b"content-type", b"application/json")])

    def send(self, data: bytes) -> None:
        self.protocol.dataReceived(data)

    def status(self) -> bytes:
        return self.transport.value().split(b"\r\n", 1)[0]


def post_head(**headers: str) -> bytes:
    lines = [b"POST /events?x=1 HTTP/1.1", b"Host: x"] + [f"{k.replace('_', '-')}: {v}".encode() for k, v in headers.items()]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class WithContentLength(SynchronousTestCase):
    def test_oversize_length_is_answered_before_any_body_arrives(self) -> None:
        harness = Harness()
        harness.send(post_head(content_length="1000000"))
        self.assertEqual(harness.status(), b"HTTP/1.1 413 Payload Too Large")
        head, _, body = harness.transport.value().partition(b"\r\n\r\n")
        self.assertIn(b"content-type: application/json", head)
        self.assertIn(b"connection: close", head)
        self.assertIn(b"content-length: %d" % len(body), head)
        self.assertEqual(json.loads(body), {"error": "payload-too-large", "max_bytes": CAP})
        self.assertTrue(harness.transport.disconnecting)
        # The answer knows the request line, split as a rendered request has it: path and query.
        self.assertEqual(harness.answered, [(b"POST", b"/events")])
        self.assertEqual(harness.args, [{b"x": [b"1"]}])
        harness.send(b"x" * 5000)  # the rest of the upload is ignored
        self.assertEqual(harness.resource.bodies, [])  # never rendered

    def test_body_at_the_cap_is_accepted(self) -> None:
        harness = Harness()
        harness.send(post_head(content_length=str(CAP)) + b"0123456789")
        self.assertEqual(harness.status(), b"HTTP/1.1 200 OK")
        self.assertEqual(harness.resource.bodies, [b"0123456789"])
        self.assertEqual(harness.answered, [])

    def test_body_in_pieces_is_accepted_whole(self) -> None:
        harness = Harness()
        harness.send(post_head(content_length="6") + b"ab")
        harness.send(b"cd")
        self.assertEqual(harness.resource.bodies, [])
        harness.send(b"ef")
        self.assertEqual(harness.resource.bodies, [b"abcdef"])


class WithoutContentLength(SynchronousTestCase):
    def test_chunked_body_is_refused_as_soon_as_it_passes_the_cap(self) -> None:
        harness = Harness()
        harness.send(post_head(transfer_encoding="chunked") + b"6\r\n012345\r\n")
        self.assertEqual(harness.transport.value(), b"")  # under the cap so far
        harness.send(b"6\r\n6789ab\r\n")  # 12 bytes: over
        self.assertEqual(harness.status(), b"HTTP/1.1 413 Payload Too Large")
        self.assertTrue(harness.transport.disconnecting)
        harness.send(b"400\r\n" + b"z" * 1024 + b"\r\n0\r\n\r\n")
        self.assertEqual(harness.resource.bodies, [])
        self.assertEqual(harness.transport.value().count(b"HTTP/1.1"), 1)  # answered once

    def test_chunked_body_under_the_cap_is_accepted(self) -> None:
        harness = Harness()
        harness.send(post_head(transfer_encoding="chunked") + b"5\r\n01234\r\n5\r\n56789\r\n0\r\n\r\n")
        self.assertEqual(harness.status(), b"HTTP/1.1 200 OK")
        self.assertEqual(harness.resource.bodies, [b"0123456789"])

    def test_multibyte_characters_count_as_bytes(self) -> None:
        harness = Harness()
        body = "\u00e9" * 6  # 6 characters, 12 bytes
        harness.send(post_head(transfer_encoding="chunked") + b"c\r\n" + body.encode() + b"\r\n0\r\n\r\n")
        self.assertEqual(harness.status(), b"HTTP/1.1 413 Payload Too Large")


class Other(SynchronousTestCase):
    def test_no_limit_configured_means_no_cap(self) -> None:
        harness = Harness(cap=None)
        harness.send(post_head(content_length="100000") + b"y" * 100000)
        self.assertEqual(harness.resource.bodies, [b"y" * 100000])

    def test_body_less_request_reads_empty(self) -> None:
        harness = Harness()
        harness.send(b"POST /events HTTP/1.1\r\nHost: x\r\ncontent-length: 0\r\n\r\n")
        self.assertEqual(harness.resource.bodies, [b""])

    def test_read_body_without_content(self) -> None:
        self.assertEqual(read_body(SimpleNamespace(content=None)), b"")  # type: ignore[arg-type]

    def test_responses_claim_no_default_content_type(self) -> None:
        harness = Harness()
        harness.send(b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n")
        self.assertEqual(harness.status(), b"HTTP/1.1 404 Not Found")
        self.assertNotIn(b"content-type", harness.transport.value().lower())
