"""The MCP relay's HTTP surface: routing, statuses and bodies of docs/mcp.md, SSE and long-poll legs.

One leaf resource routes on the raw (not percent-decoded) request path, as the Node relay does:
C{{prefix}/register} and C{{prefix}/{session}/(inbox|outbox|events|poll|unregister)}; health at C{/},
C{/healthz} and C{{prefix}/}. The tunnel decides; this module only translates.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from twisted.internet.defer import CancelledError, Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http_headers import Headers
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from relayd.mcp.endpoint import Endpoint
from relayd.mcp.jsontext import loads_json
from relayd.mcp.polls import PollResult, parse_wait_ms
from relayd.mcp.store import INBOUND, OUTBOUND, SubscriberRecord
from relayd.mcp.streams import StreamHandle
from relayd.mcp.tunnel import Refused, TunnelRelay
from relayd.storage import StoreUnavailable
from relayd.web.auth import bearer_token, query_param
from relayd.web.body import EarlyAnswer, read_body
from relayd.web.cors import OriginPolicy
from relayd.web.sse import DEFAULT_MAX_BUFFER, SSEHub, SSEStream, sse_comment
from relayd.web.twisted_internals import request_gone

MAX_BODY = 256 * 1024
HEALTH_BODY = b'{"ok":true,"service":"agent-integrations-relay"}'
SSE_PREAMBLE = b"retry: 2000\n\n"
KEEPALIVE = b": keepalive\n\n"
KEEPALIVE_INTERVAL = 15.0
SHUTDOWN_COMMENT = sse_comment("relay shutting down")

_ROUTE = re.compile(rb"/([A-Za-z0-9_-]{4,64})/(inbox|outbox|events|poll|unregister|mcp|sse|messages)")
# The standard MCP endpoint's routes (relayd.mcp.endpoint answers them).
_ENDPOINT_ALLOW = {b"mcp": b"GET, POST, DELETE, OPTIONS", b"sse": b"GET, OPTIONS", b"messages": b"POST, OPTIONS"}
_ENDPOINT_CORS_HEADERS = (
    b"content-type, accept, authorization, mcp-session-id, mcp-protocol-version, mcp-method, mcp-name, last-event-id"
)
_METHODS = {
    b"register": b"POST",
    b"inbox": b"POST",
    b"outbox": b"POST",
    b"events": b"GET",
    b"poll": b"GET",
    b"unregister": b"POST",
}
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),
]
# What a known path allows (RFC 9110: a 405 names them in C{Allow}); HEAD wherever GET is.
_ALLOW = {route: b"GET, HEAD, OPTIONS" if m == b"GET" else b"POST, OPTIONS" for route, m in _METHODS.items()}
_HEALTH_ALLOW = b"GET, HEAD"
_STATUS = {"session_gone": 410, "too_many_sessions": 503, "buffer_full": 503, "too_many_subscribers": 503}
# A full buffer frees as readers take their frames: the client may retry soon.
BUFFER_FULL_RETRY_AFTER = b"5"


def unavailable_body(error: StoreUnavailable) -> bytes:
    """The 503 body when the shared store (Redis) does not answer: it names the store."""
    return b'{"error":"store_unavailable","store":"%s"}' % error.store.encode()


def status_for(reason: str) -> int:
    """HTTP status of a refusal: gone is 410, a cap 503, every other refusal 401."""
    return _STATUS.get(reason, 401)


def _gone(request: Request) -> bool:
    return request_gone(request) or bool(request.finished)


def _token(request: Request) -> str:
    # docs/decisions.md MCP-5: an Authorization: Bearer header wins over ?token=.
    return bearer_token(request) or query_param(request, "token") or ""


def _direction(request: Request) -> str:
    return OUTBOUND if query_param(request, "direction") == "outbound" else INBOUND


def _wait(request: Request) -> str | None:
    # Absent means the default wait; a value that is not UTF-8 reads as JavaScript's URLSearchParams
    # reads it (U+FFFD), which parses as no number: no parking.
    values = request.args.get(b"wait")
    return values[0].decode("utf-8", "replace") if values else None


def _label(request: Request) -> str | None:
    return query_param(request, "client") or None  # docs/decisions.md MCP-6: client= counts as no label


def _shed(request: Request) -> None:
    """Drop what a long-lived request no longer needs once its response has started or parked.

    The query arguments have been read and the response headers are on the wire: an idle relay
    would otherwise hold about 2 KB of them per open stream.
    """
    request.args = {}
    if request.startedWriting:
        request.responseHeaders = Headers()


class StreamSink:
    """The tunnel's view of one SSE response: buffers events until started, bounds what a paused
    (non-reading) client may have queued (docs/decisions.md MCP-9), and ends the response when told."""

    # Slots: an idle relay holds one per open stream.
    __slots__ = ("stream", "max_frames", "tunnel", "record", "_early", "_paused_frames", "_end_requested")

    def __init__(self, request: Request, hub: SSEHub, max_frames: int, max_bytes: int, tunnel: TunnelRelay) -> None:
        self.stream = SSEStream(request, hub, max_buffer=max_bytes)
        self.max_frames = max_frames
        self.tunnel = tunnel
        self.record: SubscriberRecord | None = None
        self._early: list[bytes] | None = []
        self._paused_frames = 0
        self._end_requested = False

    def start(self, preamble: bytes, record: SubscriberRecord) -> None:
        """Send status, headers, the preamble and anything delivered meanwhile."""
        early, self._early = self._early or [], None
        self.record = record
        self.stream.on_close = self.closed
        self.stream.start(_SSE_HEADERS, preamble + b"".join(early))
        _shed(self.stream.request)
        if self._end_requested:
            self.stream.close()

    def closed(self) -> None:
        """The stream ended (client went away, overflow, or the relay ended it): tell the tunnel."""
        record, self.record = self.record, None
        if record is not None:
            self.tunnel.close_stream(record).addErrback(self.tunnel._log_failure, "closing MCP stream failed")

    def deliver(self, event: bytes) -> bool:
        if self._early is not None:
            self._early.append(event)
            return True
        stream = self.stream
        if stream.paused:
            self._paused_frames += 1
            if self._paused_frames > self.max_frames:
                stream.abort()  # the client reconnects; its memory here is released now
                return False
        else:
            self._paused_frames = 0
        return stream.write(event)

    def end(self) -> None:
        if self._early is not None:
            self._end_requested = True
        else:
            self.stream.close()


class _PollAnswer:
    """Writes one poll's answer (bound methods, not closures: a parked poll holds this only)."""

    __slots__ = ("resource", "request", "deferred")

    def __init__(self, resource: McpResource, request: Request, deferred: Deferred[PollResult]) -> None:
        self.resource = resource
        self.request = request
        self.deferred = deferred

    def gone(self, _: Failure) -> None:
        # The client went away: un-park the poll; nothing is taken (docs/mcp.md).
        self.deferred.cancel()

    def answer(self, result: PollResult) -> None:
        request = self.request
        if _gone(request):
            # Taken but never delivered: back to the head.
            self.resource.tunnel.put_back(result).addErrback(self.resource.tunnel._log_failure, "MCP put-back failed")
            return
        body = result.body()
        request.setResponseCode(200)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"cache-control", b"no-store")
        request.setHeader(b"content-length", b"%d" % len(body))
        request.write(body)
        request.finish()

    def failure(self, f: Failure) -> None:
        if f.check(CancelledError):
            return
        resource = self.resource
        if isinstance(f.value, Refused):
            resource._refuse(self.request, f.value.reason)
            return
        if isinstance(f.value, StoreUnavailable):
            resource._finish_json(self.request, 503, unavailable_body(f.value))
            return
        resource._log.failure("MCP poll failed", f)
        resource._finish_json(self.request, 500, b'{"error":"internal_error"}')


class McpResource(Resource):
    """Every route of the MCP relay under one prefix."""

    isLeaf = True
    _log = Logger()

    def __init__(
        self,
        tunnel: TunnelRelay,
        policy: OriginPolicy,
        hub: SSEHub,
        prefix: str = "",
        max_frames: int = 1000,
        max_bytes: int = DEFAULT_MAX_BUFFER,
        endpoint: Endpoint | None = None,
        demo: bytes | None = None,
    ) -> None:
        super().__init__()
        self.tunnel = tunnel
        self.endpoint = endpoint
        self.demo = demo
        self.policy = policy
        self.hub = hub
        self.prefix = prefix.encode("utf-8")
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self._health = {b"/", b"/healthz", self.prefix + b"/"}
        self._handlers: dict[bytes, Callable[[Request, str], Any]] = {
            route: getattr(self, "_" + route.decode()) for route in _METHODS
        }

    # routing -----------------------------------------------------------------------------------

    def render(self, request: Request) -> Any:
        body = self._render(request)
        if request.method == b"HEAD" and isinstance(body, bytes):
            # RFC 9110 §9.3.2: the headers GET would get (its length included), no body. Returning
            # the body would make Twisted drop it with a logged complaint.
            request.setHeader(b"content-length", b"%d" % len(body))
            return b""
        return body

    def _render(self, request: Request) -> Any:
        method = request.method
        if request.uri in self._health:
            if method == b"GET" or method == b"HEAD":
                request.setHeader(b"content-type", b"application/json")
                return HEALTH_BODY
            request.setHeader(b"allow", _HEALTH_ALLOW)
            return self._json(request, 405, b'{"error":"method_not_allowed"}')
        # docs/decisions.md MCP-3: every answer a browser may need to read carries CORS, 404 included.
        self.policy.apply(request)
        route, session_id = self._route(request.path)
        if route is None:
            return self._json(request, 404, b'{"error":"not_found"}')
        if route in _ENDPOINT_ALLOW or route == b"demo":
            return self._standard(request, route, session_id)
        if method == b"OPTIONS":
            request.setHeader(b"allow", _ALLOW[route])
            request.setResponseCode(204)
            return b""
        expected = _METHODS[route]
        if method == b"HEAD" and expected == b"GET":
            return self._head(request, route, session_id)
        if method != expected:
            request.setHeader(b"allow", _ALLOW[route])
            return self._json(request, 405, b'{"error":"method_not_allowed"}')
        handler = self._handlers[route]
        try:
            return handler(request, session_id)
        except Exception:
            self._log.failure("MCP {route} failed", route=route.decode())
            return self._json(request, 500, b'{"error":"internal_error"}')

    def _route(self, path: bytes) -> tuple[bytes | None, str]:
        prefix = self.prefix
        if not path.startswith(prefix + b"/"):
            return None, ""
        rest = path[len(prefix) :]
        if rest == b"/register":
            return b"register", ""
        if rest == b"/demo" and self.demo is not None:
            return b"demo", ""
        match = _ROUTE.fullmatch(rest)
        if match is None:
            return None, ""
        return match.group(2), match.group(1).decode("ascii")

    def _standard(self, request: Request, route: bytes, session_id: str) -> Any:
        """The standard MCP endpoint's routes and the demo page."""
        if route == b"demo":
            if request.method not in (b"GET", b"HEAD"):
                request.setHeader(b"allow", b"GET, HEAD")
                return self._json(request, 405, b'{"error":"method_not_allowed"}')
            assert self.demo is not None
            request.setHeader(b"content-type", b"text/html; charset=utf-8")
            request.setHeader(b"cache-control", b"no-store")
            return self.demo
        if self.endpoint is None:
            return self._json(request, 404, b'{"error":"not_found"}')
        if request.method == b"OPTIONS":
            request.setHeader(b"allow", _ENDPOINT_ALLOW[route])
            request.setHeader(b"access-control-allow-methods", _ENDPOINT_ALLOW[route])
            request.setHeader(b"access-control-allow-headers", _ENDPOINT_CORS_HEADERS)
            request.setResponseCode(204)
            return b""
        try:
            return self.endpoint.render(request, route, session_id)
        except Exception:
            self._log.failure("MCP endpoint failed")
            return self._json(request, 500, b'{"error":"internal_error"}')

    # answers -----------------------------------------------------------------------------------

    @staticmethod
    def _json(request: Request, status: int, body: bytes) -> bytes:
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        return body

    def _finish_json(self, request: Request, status: int, body: bytes) -> None:
        if _gone(request):
            return
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json")
        request.setHeader(b"content-length", b"%d" % len(body))
        request.write(body)
        request.finish()

    def _refuse(self, request: Request, reason: str) -> None:
        """Finish with a refusal's status and C{{"error": reason}} (and when to retry, if it passes)."""
        if reason == "buffer_full" and not _gone(request):
            request.setHeader(b"retry-after", BUFFER_FULL_RETRY_AFTER)
        self._finish_json(request, status_for(reason), b'{"error":"%s"}' % reason.encode())

    def _answer(self, request: Request, d: Deferred[Any], ok: Callable[[Any], bytes]) -> Any:
        """Answer C{200 ok(result)} or the refusal as C{{"error": reason}}."""

        def success(result: Any) -> None:
            self._finish_json(request, 200, ok(result))

        def failure(f: Failure) -> None:
            if isinstance(f.value, Refused):
                self._refuse(request, f.value.reason)
            elif isinstance(f.value, StoreUnavailable):
                self._finish_json(request, 503, unavailable_body(f.value))
            else:
                self._log.failure("MCP request failed", f)
                self._finish_json(request, 500, b'{"error":"internal_error"}')

        d.addCallbacks(success, failure)
        return NOT_DONE_YET

    def too_large(self, request: Request) -> EarlyAnswer:
        """docs/decisions.md MCP-2: a real 413 with CORS headers (the body limit's early answer)."""
        values = request.requestHeaders.getRawHeaders(b"origin")
        headers = self.policy.headers(values[0] if values else None)
        headers.append((b"content-type", b"application/json"))
        return 413, headers, b'{"error":"payload_too_large"}'

    # routes ------------------------------------------------------------------------------------

    def _register(self, request: Request, _: str) -> Any:
        try:
            body = loads_json(read_body(request))
        except ValueError:
            return self._json(request, 400, b'{"error":"invalid_json"}')
        session = body.get("session") if isinstance(body, dict) else None
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(session, str) or not isinstance(token, str):
            return self._json(request, 400, b'{"error":"missing_fields"}')
        return self._answer(request, self.tunnel.register(session, token), lambda _: b'{"ok":true}')

    def _inbox(self, request: Request, session_id: str) -> Any:
        body = read_body(request)  # read before auth, as the contract orders it
        d = self.tunnel.inbox(session_id, _token(request), body, _label(request))
        return self._answer(request, d, lambda _: b'{"ok":true}')

    def _outbox(self, request: Request, session_id: str) -> Any:
        body = read_body(request)
        d = self.tunnel.outbox(session_id, _token(request), body)
        return self._answer(request, d, lambda _: b'{"ok":true}')

    def _unregister(self, request: Request, session_id: str) -> Any:
        token = _token(request)
        if not token:
            # docs/decisions.md MCP-8: the browser hook sends {"token": ...} in the body.
            try:
                body = loads_json(read_body(request))
            except ValueError:
                body = None
            if isinstance(body, dict) and isinstance(body.get("token"), str):
                token = body["token"]
        d = self.tunnel.unregister(session_id, token)
        return self._answer(
            request, d, lambda already_gone: b'{"ok":true,"alreadyGone":true}' if already_gone else b'{"ok":true}'
        )

    def _events(self, request: Request, session_id: str) -> Any:
        tunnel = self.tunnel
        sink = StreamSink(request, self.hub, self.max_frames, self.max_bytes, tunnel)
        d = tunnel.open_stream(session_id, _token(request), _direction(request), _label(request), sink)

        def opened(handle: StreamHandle) -> None:
            if _gone(request):
                tunnel.close_stream(handle.record).addErrback(tunnel._log_failure, "closing MCP stream failed")
                return
            sink.start(SSE_PREAMBLE + b"".join(handle.backlog), handle.record)

        def refused(f: Failure) -> None:
            if isinstance(f.value, StoreUnavailable):
                self._finish_json(request, 503, unavailable_body(f.value))
                return
            if not isinstance(f.value, Refused):
                self._log.failure("MCP events failed", f)
                self._finish_json(request, 500, b'{"error":"internal_error"}')
                return
            self._refuse_stream(request, f.value.reason)

        d.addCallbacks(opened, refused)
        return NOT_DONE_YET

    @staticmethod
    def _refuse_stream(request: Request, reason: str) -> None:
        """An C{events} refusal: its status and an SSE C{error} event (reasons are the relay's own words)."""
        if _gone(request):
            return
        body = b"event: error\ndata: " + reason.encode() + b"\n\n"
        request.setResponseCode(status_for(reason))
        request.setHeader(b"content-type", b"text/event-stream")
        request.setHeader(b"content-length", b"%d" % len(body))
        request.write(body)
        request.finish()

    def _head(self, request: Request, route: bytes, session_id: str) -> Any:
        """HEAD on C{events} or C{poll}: the status and headers GET would get, without its work.

        HEAD is safe (RFC 9110 §9.2.1): it neither subscribes (no C{peer_joined}) nor takes frames;
        it authenticates like GET, so a bad token or a gone session answers as GET would.
        """

        def checked(reason: str | None) -> None:
            if _gone(request):
                return
            if reason is not None:
                if route == b"events":
                    self._refuse_stream(request, reason)
                else:
                    self._refuse(request, reason)
                return
            request.setResponseCode(200)
            if route == b"events":
                for name, value in _SSE_HEADERS:
                    request.setHeader(name, value)
            else:
                request.setHeader(b"content-type", b"application/json")
                request.setHeader(b"cache-control", b"no-store")
            request.finish()

        def failed(f: Failure) -> None:
            if isinstance(f.value, StoreUnavailable):
                self._finish_json(request, 503, unavailable_body(f.value))
                return
            self._log.failure("MCP HEAD failed", f)
            self._finish_json(request, 500, b'{"error":"internal_error"}')

        self.tunnel.check(session_id, _token(request)).addCallbacks(checked, failed)
        return NOT_DONE_YET

    def _poll(self, request: Request, session_id: str) -> Any:
        d = self.tunnel.poll(
            session_id,
            _token(request),
            _direction(request),
            parse_wait_ms(_wait(request)),
            query_param(request, "subscriber"),
            _label(request),
        )
        answer = _PollAnswer(self, request, d)
        if not d.called:
            request.notifyFinish().addErrback(answer.gone)
            _shed(request)
        d.addCallbacks(answer.answer, answer.failure)
        return NOT_DONE_YET

    # shutdown ----------------------------------------------------------------------------------

    def drain(self) -> None:
        """End every SSE stream with a final comment and answer every parked poll."""
        self.tunnel.draining = True
        self.hub.drain(SHUTDOWN_COMMENT)
        self.tunnel.drain()

    def remaining(self) -> int:
        """Streams, parked polls and endpoint requests still open."""
        pending = sum(len(c.pending) for c in self.endpoint.clients.values()) if self.endpoint is not None else 0
        return len(self.hub.streams) + self.tunnel.parked_polls() + pending
