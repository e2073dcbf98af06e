"""The MCP relay's HTTP surface: routing, statuses and bodies of docs/mcp.md, SSE and long-poll legs.

One route table (L{relayd.web.routes}) on the raw (not percent-decoded) request path, as the Node
relay does: C{{prefix}/register} and C{{prefix}/{session}/(inbox|outbox|events|poll|unregister)},
the standard MCP endpoint's C{{prefix}/{session}/(mcp|sse|messages)} and C{{prefix}/demo}; health at
C{/}, C{/healthz} and C{{prefix}/}. The tunnel decides; this module only translates.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

from twisted.internet.defer import CancelledError, Deferred
from twisted.python.failure import Failure
from twisted.web.server import Request

from relayd.base.coroutine import run_now
from relayd.base.errors import OutcomeUnknown, StoreUnavailable
from relayd.mcp.core.addresses import bound_key
from relayd.mcp.core.frames import Frame
from relayd.mcp.core.jsontext import dumps, loads_json
from relayd.mcp.core.polls import PollResult, parse_wait_ms
from relayd.mcp.core.store import INBOUND, OUTBOUND, SubscriberRecord
from relayd.mcp.core.streams import StreamHandle
from relayd.mcp.core.tokens import chosen_label
from relayd.mcp.core.tunnel import Pass, Refused, TunnelRelay
from relayd.mcp.endpoint import Endpoint, client_address, session_part
from relayd.process.cors import OriginPolicy
from relayd.web.answers import Answer, Refusals, finish, gone, json_answer
from relayd.web.auth import bearer_token, query_param
from relayd.web.plain_request import render_plain
from relayd.web.request import BodyLimit, read_body
from relayd.web.routes import TAKEN, Result, RoutedResource, RouteTable
from relayd.web.simple_post import HeldAnswer, SimplePost
from relayd.web.streams.sse import DEFAULT_MAX_BUFFER, SSEHub, SSEStream, sse_comment

MAX_BODY = 256 * 1024
HEALTH_BODY = b'{"ok":true,"service":"agent-integrations-relay"}'
SSE_PREAMBLE = b"retry: 2000\n\n"
KEEPALIVE = b": keepalive\n\n"
KEEPALIVE_INTERVAL = 15.0
SHUTDOWN_COMMENT = sse_comment("relay shutting down")

# What a session id in a path may be (another is an unknown path: 404).
SESSION_PART = "[A-Za-z0-9_-]{4,64}"
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),
]
_POLL_HEAD_HEADERS = [(b"content-type", b"application/json"), (b"cache-control", b"no-store")]
_STATUS = {"session_gone": 410, "too_many_sessions": 503, "buffer_full": 503, "too_many_subscribers": 503}
# A full buffer frees as readers take their frames: the client may retry soon.
BUFFER_FULL_RETRY_AFTER = b"5"


def unavailable_body(error: StoreUnavailable) -> bytes:
    """The 503 body when the shared store (Redis) does not answer: it names the store."""
    return b'{"error":"store_unavailable","store":"%s"}' % error.store.encode()


OUTCOME_UNKNOWN_BODY: Final = (
    b'{"error":"outcome_unknown","store":"mcp","detail":"the store (Redis) was sent the request and did not '
    b'answer in time: it may have taken effect (a frame may have been delivered); retrying may repeat it"}'
)


def status_for(reason: str) -> int:
    """HTTP status of a refusal: gone is 410, a cap 503, every other refusal 401."""
    return _STATUS.get(reason, 401)


def refused_answer(error: Refused) -> Answer:
    """A refusal's status and C{{"error": reason}} (and when to retry, if it passes)."""
    reason = error.reason
    headers = ((b"retry-after", BUFFER_FULL_RETRY_AFTER),) if reason == "buffer_full" else ()
    return json_answer(status_for(reason), b'{"error":"%s"}' % reason.encode(), headers)


REFUSALS: Final = Refusals(
    [
        (Refused, refused_answer),
        (OutcomeUnknown, lambda _: json_answer(503, OUTCOME_UNKNOWN_BODY)),
        (StoreUnavailable, lambda error: json_answer(503, unavailable_body(error))),
    ]
)
"""The MCP relay's answers to what its handlers raise or fail with (500 C{internal_error} otherwise)."""

OK: Final = json_answer(200, b'{"ok":true}')
OK_ALREADY_GONE: Final = json_answer(200, b'{"ok":true,"alreadyGone":true}')
HEALTH: Final = json_answer(200, HEALTH_BODY)
# Never written: finish() drops an answer to a client that has left.
_UNSENT: Final = Answer(499)


def refused_stream_answer(error: Refused) -> Answer:
    """An C{events} refusal: its status and an SSE C{error} event (reasons are the relay's own words)."""
    body = b"event: error\ndata: " + error.reason.encode() + b"\n\n"
    return Answer(status_for(error.reason), body, ((b"content-type", b"text/event-stream"),))


def stream_refusal(failure: Failure) -> Answer:
    """The answer to an C{events} request that failed: a refusal as an SSE event, the rest as any route's."""
    if isinstance(failure.value, Refused):
        return refused_stream_answer(failure.value)
    return REFUSALS.answer(failure)


def _token(request: Request) -> str:
    # docs/decisions.md MCP-5: an Authorization: Bearer header wins over ?token=.
    return bearer_token(request) or query_param(request, "token") or ""


_FRAME_REFUSED: Final = Refused("invalid_token_or_frame")
_PASS: Final = "relayd_mcp_pass"  # the request attribute holding the Pass of its accepted token
_TOKEN: Final = "relayd_mcp_token"  # and the token itself, as the request presented it (read once)
_PREPARED: Final = "relayd_mcp_prepared"  # the request attribute saying its CORS headers are set


def _pass(request: Request) -> Pass | None:
    """The L{Pass} the token of an C{inbox} or C{outbox} POST got at the end of its headers, if any."""
    passed: Pass | None = getattr(request, _PASS, None)
    return passed


def _frame_token(request: Request) -> str:
    """The token of an C{inbox} or C{outbox} POST: as read at the end of its headers, once accepted
    there (L{McpResource._frame_check}), else read now."""
    token: str | None = getattr(request, _TOKEN, None)
    return _token(request) if token is None else token


def _direction(request: Request) -> str:
    return OUTBOUND if query_param(request, "direction") == "outbound" else INBOUND


def _wait(request: Request) -> str | None:
    # Absent means the default wait; a value that is not UTF-8 reads as JavaScript's URLSearchParams
    # reads it (U+FFFD), which parses as no number: no parking.
    values = request.args.get(b"wait")
    return values[0].decode("utf-8", "replace") if values else None


def _label(request: Request) -> str | None:
    # docs/decisions.md MCP-6: client= counts as no label, as does a name of the relay's own labels.
    return chosen_label(query_param(request, "client"))


def _shed(request: Request) -> None:
    """Drop what a parked poll no longer needs: its query arguments have been read (an SSE stream
    sheds this and more when it starts, relayd.web.streams.sse.SSEStream.start)."""
    request.args = {}


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
        self.stream.start(_SSE_HEADERS, preamble + b"".join(early), held=True)
        if self._end_requested:
            self.stream.close()

    def closed(self) -> None:
        """The stream ended (client went away, overflow, or the relay ended it): tell the tunnel."""
        record, self.record = self.record, None
        if record is not None:
            self.tunnel.close_stream(record).addErrback(self.tunnel.log_failure, "closing MCP stream failed")

    def deliver(self, frame: Frame) -> bool:
        event = frame.sse
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
    """One poll's answer (bound methods, not closures: a parked poll holds this only)."""

    __slots__ = ("tunnel", "request", "deferred")

    def __init__(self, tunnel: TunnelRelay, request: Request, deferred: Deferred[PollResult]) -> None:
        self.tunnel = tunnel
        self.request = request
        self.deferred = deferred

    def left(self, _: Failure) -> None:
        # The client went away: un-park the poll; nothing is taken (docs/mcp.md).
        self.deferred.cancel()

    def answer(self, result: PollResult) -> Answer:
        if gone(self.request):
            # Taken but never delivered: back to the head.
            self.tunnel.put_back(result).addErrback(self.tunnel.log_failure, "MCP put-back failed")
            return _UNSENT
        return json_answer(200, result.body(), ((b"cache-control", b"no-store"),))

    @staticmethod
    def cancelled(failure: Failure) -> Answer:
        # The poll was un-parked because its client left: nothing to answer, nothing to log.
        failure.trap(CancelledError)
        return _UNSENT


class McpResource(RoutedResource):
    """Every route of the MCP relay under one prefix."""

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
        super().__init__(RouteTable(refusals=REFUSALS, parts={"session": SESSION_PART}))
        self.tunnel = tunnel
        self.endpoint = endpoint
        self.demo = demo
        self.policy = policy
        self.hub = hub
        self.prefix = prefix.encode("utf-8")
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.health_paths = frozenset({b"/", b"/healthz", self.prefix + b"/"})
        # The session paths whose plainest POSTs are rendered beside twisted.web (L{plain_post}).
        self._plain_paths = re.compile(
            re.escape(self.prefix) + b"/" + SESSION_PART.encode("ascii") + b"/(inbox|outbox|mcp)"
        )
        self._add_routes(prefix)

    def _add_routes(self, prefix: str) -> None:
        table = self.table
        table.add("/", {"GET": self._healthz})
        table.add("/healthz", {"GET": self._healthz})
        table.add("/", {"GET": self._healthz}, prefix)
        options = self._options
        table.add("/register", {"POST": self._register, "OPTIONS": options}, prefix)
        # A frame without a token, or with a wrong one, is refused as the tunnel would refuse it,
        # before its body is read.
        frame_check = {"POST": self._frame_check}
        table.add("/{session}/inbox", {"POST": self._inbox, "OPTIONS": options}, prefix, checks=frame_check)
        table.add("/{session}/outbox", {"POST": self._outbox, "OPTIONS": options}, prefix, checks=frame_check)
        table.add("/{session}/unregister", {"POST": self._unregister, "OPTIONS": options}, prefix)
        # HEAD on a stream or a poll authenticates without subscribing or taking (see _head).
        table.add("/{session}/events", {"GET": self._events, "HEAD": self._head_events, "OPTIONS": options}, prefix)
        table.add("/{session}/poll", {"GET": self._poll, "HEAD": self._head_poll, "OPTIONS": options}, prefix)
        if self.demo is not None:
            table.add("/demo", {"GET": self._demo}, prefix)
        if self.endpoint is not None:
            endpoint_check = {"POST": self.endpoint.early_check}
            for path, handlers in self.endpoint.routes().items():
                table.add(path, handlers, prefix, checks=endpoint_check if "POST" in handlers else None)

    # before routing ----------------------------------------------------------------------------

    def prepare(self, request: Request) -> Answer | None:
        if request.uri in self.health_paths:
            return None  # health carries no CORS
        if getattr(request, _PREPARED, False):
            return None  # (a POST's: set at the end of its headers, L{early_answer}; render asks again)
        # docs/decisions.md MCP-3: every answer a browser may need to read carries CORS, 404 included.
        self.policy.apply(request)
        if request.path in self.health_paths:
            # Health is the whole target, as the Node relay matches it: "/?x=1" is no route at all.
            return self.table.not_found
        setattr(request, _PREPARED, True)
        return None

    def plain_post(self, post: SimplePost, limit: BodyLimit) -> Answer | HeldAnswer | None:
        """A plain POST (relayd.web.simple_post) to a session's C{inbox}, C{outbox} or endpoint,
        rendered by this resource beside twisted.web (relayd.web.plain_request: the same checks,
        handlers and answers), or C{None} for twisted.web to answer: another path, an early refusal,
        or an endpoint POST that could be answered with a stream (L{Endpoint.answers_whole})."""
        match = self._plain_paths.fullmatch(post.path.partition(b"?")[0])
        if match is None:
            return None
        if match.group(1) == b"mcp" and (self.endpoint is None or not self.endpoint.answers_whole(post)):
            return None
        return render_plain(self, limit, post)

    def too_large(self, request: Request) -> Answer:
        """docs/decisions.md MCP-2: a real 413 with CORS headers (the body limit's early answer)."""
        values = request.requestHeaders.getRawHeaders(b"origin")
        headers = self.policy.headers(values[0] if values else None)
        return json_answer(413, b'{"error":"payload_too_large"}', headers)

    def _frame_check(self, request: Request) -> Answer | None:
        """The token of an C{inbox} or C{outbox} POST, at the end of its headers: missing, or refused
        by a store that answers at once (memory), which then keeps its L{Pass} on the request for
        the frame's post (the token is checked once). With a shared store (Redis) the frame's own
        store command authenticates it (one round trip per frame), so the body is read first."""
        token = _token(request)
        if not token:
            return refused_answer(_FRAME_REFUSED)
        session = session_part(self.prefix, request.path)
        if session is None or self.tunnel.shared:
            return None
        passed = self.tunnel.token_pass(session, token)
        reason = self.tunnel.check_at_once(session, token, passed)
        # (None or a str first: isinstance against Deferred, an ABC, is slow for anything else)
        if reason is not None and not isinstance(reason, str):
            answered: list[str | None] = []
            reason.addCallbacks(answered.append, lambda _: None)
            if not answered:
                return None  # (a failure is answered by the handler, which asks the store again)
            reason = answered[0]
        if reason is None:
            setattr(request, _PASS, passed)
            setattr(request, _TOKEN, token)
            return None
        return refused_answer(Refused(reason) if reason == "session_gone" else _FRAME_REFUSED)

    # routes ------------------------------------------------------------------------------------

    @staticmethod
    def _healthz(request: Request) -> Answer:
        return HEALTH

    def _demo(self, request: Request) -> Answer:
        assert self.demo is not None
        return Answer(200, self.demo, ((b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")))

    def _options(self, request: Request, session: str = "") -> Answer:
        # The preflight's CORS headers are set in prepare(); Allow names what the path takes.
        return Answer(204, b"", ((b"allow", self.table.allowed(request.path) or b""),))

    def _register(self, request: Request) -> Answer | Deferred[Answer]:
        try:
            body = loads_json(read_body(request))
        except ValueError as e:  # (a JSONError: the fault named as every wing names it)
            return json_answer(400, dumps({"error": "invalid_json", "detail": str(e)}))
        session = body.get("session") if isinstance(body, dict) else None
        token = body.get("token") if isinstance(body, dict) else None
        if not isinstance(session, str) or not isinstance(token, str):
            return json_answer(400, b'{"error":"missing_fields"}')
        return self.tunnel.register(session, token, bound_key(client_address(request))).addCallback(lambda _: OK)

    def _inbox(self, request: Request, session: str) -> Deferred[Answer]:
        body = read_body(request)  # read before auth, as the contract orders it
        return self.tunnel.inbox(session, _frame_token(request), body, _label(request), _pass(request)).addCallback(
            lambda _: OK
        )

    def _outbox(self, request: Request, session: str) -> Answer | Deferred[Answer]:
        body = read_body(request)
        sent = run_now(self.tunnel.from_page(session, _frame_token(request), body, _pass(request)))
        # Taken at once (the memory store): answered in this call, no Deferred made and chained.
        return OK if sent is None else sent.addCallback(lambda _: OK)

    def _unregister(self, request: Request, session: str) -> Deferred[Answer]:
        token = _token(request)
        if not token:
            # docs/decisions.md MCP-8: the browser hook sends {"token": ...} in the body.
            try:
                body = loads_json(read_body(request))
            except ValueError:
                body = None
            if isinstance(body, dict) and isinstance(body.get("token"), str):
                token = body["token"]
        d = self.tunnel.unregister(session, token)
        return d.addCallback(lambda already_gone: OK_ALREADY_GONE if already_gone else OK)

    def _events(self, request: Request, session: str) -> Result:
        tunnel = self.tunnel
        sink = StreamSink(request, self.hub, self.max_frames, self.max_bytes, tunnel)
        d = tunnel.open_stream(session, _token(request), _direction(request), _label(request), sink)

        def opened(handle: StreamHandle) -> None:
            if gone(request):
                tunnel.close_stream(handle.record).addErrback(tunnel.log_failure, "closing MCP stream failed")
                return
            sink.start(SSE_PREAMBLE + b"".join(frame.sse for frame in handle.backlog), handle.record)

        d.addCallbacks(opened, lambda f: finish(request, stream_refusal(f)))
        return TAKEN

    def _head_events(self, request: Request, session: str) -> Result:
        return self._head(request, session, _SSE_HEADERS, refused_stream_answer)

    def _head_poll(self, request: Request, session: str) -> Result:
        return self._head(request, session, _POLL_HEAD_HEADERS, refused_answer)

    def _head(
        self,
        request: Request,
        session: str,
        headers: list[tuple[bytes, bytes]],
        refused: Callable[[Refused], Answer],
    ) -> Result:
        """HEAD on C{events} or C{poll}: the status and headers GET would get, without its work.

        HEAD is safe (RFC 9110 §9.2.1): it neither subscribes (no C{peer_joined}) nor takes frames;
        it authenticates like GET, so a bad token or a gone session answers as GET would.
        """

        def checked(reason: str | None) -> None:
            if reason is not None:
                finish(request, refused(Refused(reason)))
                return
            if gone(request):
                return
            # Not an Answer: GET's length is unknown (a stream, a parked poll), so no content-length.
            request.setResponseCode(200)
            for name, value in headers:
                request.setHeader(name, value)
            request.finish()

        d = self.tunnel.check(session, _token(request))
        d.addCallbacks(checked, lambda f: finish(request, REFUSALS.answer(f)))
        return TAKEN

    def _poll(self, request: Request, session: str) -> Deferred[Answer]:
        d = self.tunnel.poll(
            session,
            _token(request),
            _direction(request),
            parse_wait_ms(_wait(request)),
            query_param(request, "subscriber"),
            _label(request),
        )
        answer = _PollAnswer(self.tunnel, request, d)
        if not d.called:
            request.notifyFinish().addErrback(answer.left)
            _shed(request)
        return d.addCallbacks(answer.answer, answer.cancelled)

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
