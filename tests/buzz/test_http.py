"""The broker's HTTP binding (relayd/buzz/http.py) on a RelaySite served in memory (tests/support/inmemory.py:
relayd's own channel and request, no socket), in front of a host
that answers what each test hands it: every answer that is not a verdict, byte for byte, and how a
verdict is written, now or later.

The host and the contract behind it are tested through a real broker elsewhere in tests/buzz; here
the host is a stand-in, so that a test decides when (and whether) a verdict is ready.
"""

from __future__ import annotations

import io
from typing import Any, Sequence

from twisted.internet.defer import Deferred, fail, succeed
from twisted.logger import LogEvent, globalLogPublisher
from twisted.trial.unittest import TestCase
from twisted.web.server import Request
from twisted.web.test.requesthelper import DummyRequest

from relayd.buzz.http import BrokerResource, body_limit
from tests.support.cases import cases, expand
from tests.support.inmemory import Connection, InMemorySite
from tests.support.raw import raw_request

JSON = (b"content-type", b"application/json")
NO_STORE = (b"cache-control", b"no-store")
VERDICT = b'{"type":"broker_result","protocolVersion":1,"requestId":"r-1","status":"succeeded"}'
NOT_FOUND = b'{"error":"not_found","message":"the broker serves only POST /v1/action and GET /healthz"}'
HEALTH = b'{"ok":true,"status":"ok","upstream":{"connected":true}}'
INTERNAL_ERROR = b'{"error":"internal_error","message":"internal broker fault"}'
# Headers every answer has that are not the broker's: the site's, and what the raw client asked for.
NOT_THE_BROKERS = (b"date", b"server", b"connection")


def length(body: bytes) -> tuple[bytes, bytes]:
    return (b"content-length", b"%d" % len(body))


class Host:
    """Stands in for BrokerHost: C{handle} returns C{result} when set, else a Deferred the test fires."""

    def __init__(self) -> None:
        self.result: Deferred[tuple[int, bytes]] | None = None
        self.pending: list[Deferred[tuple[int, bytes]]] = []

    def handle(self, authorization: Sequence[bytes] | None, body: bytes) -> Deferred[tuple[int, bytes]]:
        if self.result is not None:
            return self.result
        d: Deferred[tuple[int, bytes]] = Deferred()
        self.pending.append(d)
        return d


class Recording(BrokerResource):
    """The broker's resource, keeping the requests it renders (to see when one's client has left)."""

    def __init__(self, host: Any) -> None:
        super().__init__(host, lambda: {"connected": True})
        self.requests: list[Request] = []

    def render(self, request: Request) -> Any:
        self.requests.append(request)
        return super().render(request)


class BrokerCase(TestCase):
    def setUp(self) -> None:
        self.host = Host()
        self.resource = Recording(self.host)
        self.site = InMemorySite.over(self.resource, body_limit=body_limit(4096), relay="broker")
        self.addCleanup(self.site.close)

    def send(
        self, method: bytes, path: bytes, headers: Sequence[tuple[bytes, bytes]] = (), body: bytes | None = None
    ) -> Connection:
        """A connection that has sent one raw request."""
        connection = self.site.connect()
        connection.send(raw_request(method, path, list(headers), body))
        return connection

    def answer_on(self, connection: Connection, head: bool = False) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The status, the broker's headers (sorted) and the body of the answer on C{connection}."""
        response = connection.reply(head)
        return response.code, sorted(h for h in response.raw_headers if h[0] not in NOT_THE_BROKERS), response.body

    def answer(
        self, method: bytes, path: bytes, headers: Sequence[tuple[bytes, bytes]] = (), body: bytes | None = None
    ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """One raw exchange: the status, the broker's headers (sorted) and the body."""
        return self.answer_on(self.send(method, path, headers, body), head=method == b"HEAD")

    def render(self, host: Host) -> tuple[Any, DummyRequest]:
        """C{POST /v1/action} rendered by a broker before C{host}, outside any site: what render returned."""
        request = DummyRequest([b"v1", b"action"])
        request.method = b"POST"
        request.path = b"/v1/action"
        request.requestHeaders.setRawHeaders(b"content-type", [b"application/json"])
        request.content = io.BytesIO(b"{}")
        return BrokerResource(host).render(request), request  # type: ignore[arg-type]

    def leave(self) -> Request:
        """A client that posts, and closes its connection once the host holds its request."""
        connection = self.send(b"POST", b"/v1/action", [JSON], b"{}")
        self.assertEqual(len(self.host.pending), 1)
        (request,) = self.resource.requests
        lost: list[object] = []
        request.notifyFinish().addErrback(lost.append)
        connection.lose()
        self.assertEqual(len(lost), 1)  # the request learnt that its client left
        return request


@expand
class AnswersThatAreNotVerdicts(BrokerCase):
    """What the broker answers before a body or credential is looked at, and its health: status,
    headers and body exactly as docs/broker.md gives them (HEAD: the same headers, no body)."""

    @cases(
        not_found=(b"GET", b"/nowhere", (), None, 404, [JSON, NO_STORE, length(NOT_FOUND)], NOT_FOUND),
        not_found_head=(b"HEAD", b"/v1/action/", (), None, 404, [JSON, NO_STORE, length(NOT_FOUND)], b""),
        not_found_post=(b"POST", b"/healthz/", (JSON,), b"{}", 404, [JSON, NO_STORE, length(NOT_FOUND)], NOT_FOUND),
        action_get=(
            b"GET", b"/v1/action", (), None, 405,
            [(b"allow", b"POST"), JSON, NO_STORE, (b"content-length", b"71")],
            b'{"error":"method_not_allowed","message":"/v1/action accepts only POST"}',
        ),
        action_head=(
            b"HEAD", b"/v1/action", (), None, 405, [(b"allow", b"POST"), JSON, NO_STORE, (b"content-length", b"71")], b"",
        ),
        health_post=(
            b"POST", b"/healthz", (JSON,), b"{}", 405,
            [(b"allow", b"GET, HEAD"), JSON, NO_STORE, (b"content-length", b"77")],
            b'{"error":"method_not_allowed","message":"/healthz accepts only GET and HEAD"}',
        ),
        not_json=(
            b"POST", b"/v1/action", ((b"content-type", b"text/plain"),), b"{}", 415,
            [(b"accept-post", b"application/json"), JSON, NO_STORE, (b"content-length", b"102")],
            b'{"error":"unsupported_media_type","message":"the body must be sent as Content-Type: application/json"}',
        ),
        coded=(
            b"POST", b"/v1/action", (JSON, (b"content-encoding", b"gzip")), b"{}", 415,
            [(b"accept-encoding", b"identity"), JSON, NO_STORE, (b"content-length", b"95")],
            b'{"error":"unsupported_media_type","message":"the body must be sent without a Content-Encoding"}',
        ),
        health=(b"GET", b"/healthz", (), None, 200, [JSON, NO_STORE, length(HEALTH)], HEALTH),
        health_head=(b"HEAD", b"/healthz", (), None, 200, [JSON, NO_STORE, length(HEALTH)], b""),
    )  # fmt: skip
    def test_answer(
        self,
        method: bytes,
        path: bytes,
        headers: Sequence[tuple[bytes, bytes]],
        body: bytes | None,
        status: int,
        answer_headers: list[tuple[bytes, bytes]],
        answer_body: bytes,
    ) -> None:
        self.host.result = succeed((200, VERDICT))
        self.assertEqual(self.answer(method, path, headers, body), (status, sorted(answer_headers), answer_body))


class Verdicts(BrokerCase):
    """A verdict the host has at once is the render call's return value; one it has later is
    written when it comes, unless the client has left."""

    def test_a_replay_is_answered_in_the_render_call(self) -> None:
        # A replay (every store answered at once) is returned by render: twisted.web writes it in the
        # same call, with no callback chain and no write or finish of the resource's own.
        host = Host()
        host.result = succeed((200, VERDICT))
        body, request = self.render(host)
        self.assertEqual((body, request.responseCode, request.written, request.finished), (VERDICT, 200, [], 0))
        self.assertEqual(request.responseHeaders.getRawHeaders(b"content-type"), [b"application/json"])
        self.assertEqual(request.responseHeaders.getRawHeaders(b"cache-control"), [b"no-store"])

    def test_a_verdict_later(self) -> None:
        connection = self.send(b"POST", b"/v1/action", (JSON,), b"{}")
        self.assertEqual((len(self.host.pending), connection.received()), (1, b""))  # nothing said meanwhile
        self.host.pending[0].callback((200, VERDICT))
        self.assertEqual(self.answer_on(connection), (200, sorted([JSON, NO_STORE, length(VERDICT)]), VERDICT))

    def test_an_uncorrelatable_body_is_400_in_the_hosts_words(self) -> None:
        refusal = b'{"error":"invalid_request","message":"the body is not JSON"}'
        self.host.result = succeed((400, refusal))
        self.assertEqual(
            self.answer(b"POST", b"/v1/action", (JSON,), b"nope"),
            (400, sorted([JSON, NO_STORE, length(refusal)]), refusal),
        )

    def test_a_late_verdict_for_a_client_that_left_is_dropped(self) -> None:
        # The host keeps what a retry needs before it answers; the answer itself has nowhere to go,
        # and writing nothing is not an error (trial fails a test that logs one).
        request = self.leave()
        self.host.pending[0].callback((200, VERDICT))
        self.assertFalse(request.startedWriting)


class HostBugs(BrokerCase):
    """A host that fails instead of answering a verdict (BrokerHost.handle never should) is a bug:
    logged with its traceback under the broker's namespace, and answered C{500} in the broker's
    words, which quote nothing of the request."""

    def setUp(self) -> None:
        super().setUp()
        self.events: list[LogEvent] = []
        globalLogPublisher.addObserver(self.events.append)
        self.addCleanup(globalLogPublisher.removeObserver, self.events.append)

    def assert_logged_once(self) -> None:
        self.assertEqual(len(self.flushLoggedErrors(ZeroDivisionError)), 1)
        (event,) = [e for e in self.events if "log_failure" in e]
        self.assertTrue(event["log_namespace"].startswith("relayd.buzz."), event["log_namespace"])

    def test_failed_at_once_is_answered_in_the_render_call(self) -> None:
        host = Host()
        host.result = fail(ZeroDivisionError())
        body, request = self.render(host)
        self.assertEqual((body, request.responseCode, request.written), (INTERNAL_ERROR, 500, []))
        self.assertEqual(request.responseHeaders.getRawHeaders(b"content-type"), [b"application/json"])
        self.assertEqual(request.responseHeaders.getRawHeaders(b"cache-control"), [b"no-store"])
        self.assert_logged_once()

    def test_failed_later_is_a_json_500(self) -> None:
        connection = self.send(b"POST", b"/v1/action", (JSON,), b'{"requestId":"r-1"}')
        self.host.pending[0].errback(ZeroDivisionError())
        self.assertEqual(self.answer_on(connection), (500, sorted([JSON, NO_STORE, length(INTERNAL_ERROR)]), INTERNAL_ERROR))
        self.assert_logged_once()

    def test_failed_after_the_client_left_is_still_logged(self) -> None:
        request = self.leave()
        self.host.pending[0].errback(ZeroDivisionError())
        self.assertFalse(request.startedWriting)
        self.assert_logged_once()
