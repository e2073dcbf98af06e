"""AEP over HTTP: ingest, discovery, health, introspection and the SSE stream (docs/aep.md)."""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Callable, Final, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import IResource
from twisted.web.server import NOT_DONE_YET, Request

from relayd.aep import metrics
from relayd.aep.core import backlog
from relayd.aep.core.backlog import HARD_BACKLOG, held_size
from relayd.aep.core.event import Event, dumps
from relayd.aep.core.filters import Pin
from relayd.aep.core.ingest import (
    ACCEPT_POST,
    JSON_TYPE,
    MEDIA_UNSUPPORTED,
    PARSE_SLICE,
    BatchParser,
    IngestError,
    IngestPolicy,
)
from relayd.aep.core.relay import (
    EventRelay,
    ReplayProducer,
    ReplayReader,
    Subscriber,
)
from relayd.aep.core.store import Position
from relayd.aep.query import BadRequest, last_event_id, stream_query
from relayd.aep.viewer import VIEWER_PATHS, viewer_answers
from relayd.aep.wire import SSE_LIVE_FORMS, frame_safe, sse_forms, sse_frame, sse_run
from relayd.base.errors import OutcomeUnknown, StoreRefused, StoreUnavailable
from relayd.process.browsers import LOOPBACK_ONLY, BrowserPolicy, Refusal
from relayd.web.answers import Answer, Refusals, finish, gone, json_answer
from relayd.web.auth import bearer_of, query_param, tokens_equal
from relayd.web.media import media_type
from relayd.web.request import read_body
from relayd.web.routes import TAKEN, Result, RoutedResource, RouteTable, answer_when
from relayd.web.simple_post import SimplePost
from relayd.web.streams.sse import SSEHub, SSEStream, sse_comment

# The answers browsers read across origins: those of /stream and /connections (CORS headers set
# by the policy in L{AEPResource.prepare}) and the 401.
CORS_PATHS = frozenset({b"/stream", b"/connections"})
PREFLIGHT = [
    (b"access-control-allow-methods", b"GET, OPTIONS"),
    (b"access-control-allow-headers", b"authorization, accept, content-type, last-event-id"),
    (b"access-control-max-age", b"86400"),
]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
]
_log = Logger()


# The answers given as they are (a 404 or 401 says nothing but its status).
ACCEPTED: Final = Answer(202)
NOT_FOUND: Final = Answer(404)
PREFLIGHT_ANSWER: Final = Answer(204, b"", PREFLIGHT)
STORE_UNAVAILABLE: Final = json_answer(503, dumps({"error": "store-unavailable", "store": "aep"}))
INTERNAL_ERROR: Final = json_answer(500, b'{"error":"internal-error"}')

# What the auth wall lets through: the health check (it tells the counts only with the token) and
# the CORS preflights (a browser sends them without credentials).
_OUTSIDE_THE_WALL = frozenset(
    {(b"GET", b"/healthz"), (b"HEAD", b"/healthz"), (b"OPTIONS", b"/stream"), (b"OPTIONS", b"/connections")}
)
# The viewer's files carry nothing of the relay's: the page asks its user for the token /stream needs.
_OUTSIDE_THE_WALL |= {(method, path.encode()) for path in VIEWER_PATHS for method in (b"GET", b"HEAD")}


def _not_allowed(allow: bytes) -> bytes:
    """The body of a C{405}, naming the methods the path takes."""
    return dumps({"error": "method-not-allowed", "allow": allow.decode("ascii").split(", ")})


def _accepted(_: object) -> Answer:
    return ACCEPTED


# The store was sent the batch and did not answer in time: it may hold it (docs/aep.md).
OUTCOME_UNKNOWN: Final = json_answer(
    503,
    dumps({
        "error": "outcome-unknown",
        "store": "aep",
        "detail": "the store did not answer in time: the batch may have been stored and delivered; "
        "retry it as it was (the same source and id per event): events already stored are not stored again",
    }),
)


_ASK_FOR_BEARER: Final = (b"www-authenticate", b'Bearer realm="aep"')


def _ingest_refusal(e: IngestError) -> Answer:
    """The answer to an ingest refusal (L{relayd.aep.core.ingest}), counted."""
    metrics.ingest_refused.labels(relay="aep", reason=e.reason).inc()
    if e is MEDIA_UNSUPPORTED:
        return Answer(e.status, b"", [ACCEPT_POST])
    return Answer(e.status) if e.body is None else json_answer(e.status, dumps(e.body))


def _store_refusal(e: StoreUnavailable) -> Answer:
    # An outage, not a bug: one line, no traceback (ingest and replay log and count their own; a
    # refusal is logged once per outage by the store's client).
    if not isinstance(e, StoreRefused):
        _log.warn("request refused: {reason}", reason=str(e))
    return STORE_UNAVAILABLE


REFUSALS: Final = Refusals(
    [
        (BadRequest, lambda e: Answer(400, str(e).encode("utf-8"))),
        (IngestError, _ingest_refusal),
        (StoreUnavailable, _store_refusal),
    ],
    internal_error=INTERNAL_ERROR,
)
"""The wing's refusals: what its handlers raise, or the Deferreds they return fail with."""


_SSE_RUN = "sse"  # a run's joined frames in a fan-out's memo (L{Subscriber.deliver_run})


class SSESubscriber(Subscriber):
    """An SSE consumer: frames written to its stream, with the soft/hard backlog policy.

    The live events held while its replay is sent count against the same bounds as what its stream
    queues: they are what it has not been sent yet.
    """

    __slots__ = ("stream", "dropped")

    def __init__(
        self,
        match: Callable[[dict[str, Any]], bool],
        ceiling: str | None,
        stream: SSEStream,
        pin: Pin | None = None,
    ):
        super().__init__(match, ceiling, pin)
        self.stream = stream
        self.dropped = 0

    def held(self, event: Event) -> None:
        stream = self.stream
        if stream.closed:
            return
        size = held_size(event, self.level(event))
        verdict = backlog.hold(event, self.held_bytes + size + stream.backlog)
        if verdict == "keep":
            self.keep_held(event, size)
        elif verdict == "drop":
            self.dropped += 1
        else:
            backlog.CUT_OFF.inc(len(self._held or ()) + 1)  # it lags by more than the bound: it resumes by position
            self._held = deque()
            self.held_bytes = 0
            stream.abort()

    def deliver(self, event: Event) -> None:
        # Once per delivery of a fan-out. The common case, a live subscriber (not holding during a
        # replay) without a capture ceiling whose client reads, is what L{Subscriber.deliver} and
        # L{send} would do with it (no hold, nothing shed, the frame as stored), in one call and
        # one lookup of the event's cached frame; any other case goes through them.
        stream = self.stream
        if self._held is None and self.ceiling is None and not stream.paused:
            forms = event.form(SSE_LIVE_FORMS)
            if forms is None:
                forms = sse_forms(event)
            stream.write(forms[0], forms[1])  # (not paused: it cannot overflow, only refuse once closed)
            return
        super().deliver(event)

    def send(self, event: Event) -> None:
        stream = self.stream
        if stream.paused and backlog.sheds(event, stream.backlog):
            self.dropped += 1
            return
        frame, chunk = sse_forms(event, None if self.ceiling is None else self.level(event))
        if not stream.write(frame, chunk) and stream.discarded:
            backlog.CUT_OFF.inc(stream.discarded)  # the stream was just cut off with these frames unsent
            stream.discarded = 0

    def deliver_run(self, events: Sequence[Event], memo: dict[Any, Any]) -> None:
        stream = self.stream
        if self._held is not None or self.ceiling is not None or stream.paused:
            super().deliver_run(events, memo)  # held, downlevelled, or under the lag policy: one by one
            return
        forms = memo.get(_SSE_RUN)
        if forms is None:
            forms = memo[_SSE_RUN] = sse_run(events)
        if not stream.write(*forms) and stream.discarded:
            backlog.CUT_OFF.inc(stream.discarded)
            stream.discarded = 0


class AEPResource(RoutedResource):
    """The whole AEP HTTP surface, one route table; paths match exactly (a trailing slash is a 404).

    Every route but the health check, the two preflights and the viewer's files is behind the auth
    wall (L{prepare}), unknown paths and other methods too: without the token, nothing about the
    relay is told.
    """

    _log = Logger()

    def __init__(
        self,
        relay: EventRelay,
        hub: SSEHub,
        *,
        max_body: int,
        max_batch: int,
        socket: IResource | None = None,
        socket_counts: Callable[[], list[dict[str, Any]]] = lambda: [],
        browsers: BrowserPolicy = LOOPBACK_ONLY,
    ) -> None:
        self.relay = relay
        self.browsers = browsers
        self.hub = hub
        self.ingest_policy = IngestPolicy(max_body, max_batch)
        self.socket = socket
        self._socket_listing = socket_counts
        self.sse_subscribers = 0
        discovery = json.dumps(relay.discovery, indent=2, ensure_ascii=False).encode("utf-8")
        self._discovery = json_answer(200, discovery)
        self._viewer = viewer_answers()
        super().__init__(self._routes())

    def _routes(self) -> RouteTable:
        """The routes and their methods (C{405} with C{Allow} for any other on these paths). C{HEAD}
        is answered by C{GET} where that is a plain document; a stream or an upgrade has none."""
        table = RouteTable(not_found=NOT_FOUND, not_allowed=_not_allowed, refusals=REFUSALS)
        table.add("/healthz", {"GET": self.healthz})
        table.add("/events", {"GET": self.discovery, "POST": self.ingest}, checks={"POST": self._ingest_headers})
        table.add("/.well-known/aep", {"GET": self.discovery})
        table.add("/connections", {"GET": self.connections, "OPTIONS": self.preflight})
        table.add("/stream", {"GET": self.stream, "OPTIONS": self.preflight}, head=False)
        table.add("/socket", {"GET": self.upgrade}, head=False)
        for path in VIEWER_PATHS:
            table.add(path, {"GET": self.viewer})
        return table

    # The auth wall ---------------------------------------------------------------------------

    def authorized(self, request: Request) -> bool:
        return self._holds_token(_first(request.requestHeaders.getRawHeaders(b"authorization")), request)

    def _holds_token(self, authorization: bytes | None, request: Request | None) -> bool:
        """Whether the client presents the relay's token (or the relay has none): in its
        C{Authorization} header, or on a twisted.web C{request} its C{access_token} parameter."""
        token = self.relay.token
        if not token:
            return True
        if tokens_equal(bearer_of(authorization), token):
            return True
        return request is not None and tokens_equal(query_param(request, "access_token"), token)

    def wall(
        self, method: bytes, path: bytes, header: Callable[[bytes], bytes | None], request: Request | None = None
    ) -> Answer | None:
        """The auth wall, for every way in (C{header}: a request header's first value): without a
        token, a C{Host} or C{Origin} the browser policy refuses is C{403} (the WebSocket handshake
        included); with one, a client without it is C{401} with CORS (a browser may read it), but
        for what is outside the wall. C{None} lets the request through."""
        origin = header(b"origin")
        if not self.relay.token:  # the token keeps other pages out
            refusal = self.browsers.refusal(header(b"host"), origin)
            return None if refusal is None else _forbidden(refusal)
        if self._holds_token(header(b"authorization"), request) or (method, path) in _OUTSIDE_THE_WALL:
            return None
        # The protocol's empty body, with the scheme RFC 6750 asks a 401 to name (and CORS, so a
        # browser may read it).
        return Answer(401, b"", (_ASK_FOR_BEARER, *self.browsers.cors(origin)))

    def prepare(self, request: Request) -> Answer | None:
        """Before any route is looked up: the L{wall}; then CORS on every answer of the paths
        browsers read across origins."""
        raw = request.requestHeaders.getRawHeaders
        refused = self.wall(request.method, request.path, lambda name: _first(raw(name)), request)
        if refused is not None:
            return refused
        if request.path in CORS_PATHS:
            set_header = request.responseHeaders.setRawHeaders
            for name, value in self.browsers.cors(_first(raw(b"origin"))):
                set_header(name, [value])
        return None

    def too_large(self, request: Request) -> Answer:
        """The answer to a body over C{AEP_MAX_BODY}, once the headers passed the wall, the route
        and L{_ingest_headers} (L{RoutedResource.early_answer}: the reference's order of checks)."""
        return _ingest_refusal(self.ingest_policy.too_large())

    # Health, discovery and introspection -----------------------------------------------------

    def healthz(self, request: Request) -> Answer:
        body: dict[str, Any] = {"ok": True}
        if self.authorized(request):
            body.update(self.relay.counts())
        return json_answer(200, dumps(body))

    def discovery(self, request: Request) -> Answer:
        return self._discovery

    def connections(self, request: Request) -> Answer:
        counts = self.relay.counts()
        body = {
            "ok": True,
            "relay": {**counts, "control": bool(self.relay.token)},
            "connections": self._socket_listing(),
            "sse_subscribers": self.sse_subscribers,
        }
        return json_answer(200, dumps(body))

    def viewer(self, request: Request) -> Answer:
        """The live event viewer's page, script or style (L{relayd.aep.viewer})."""
        return self._viewer[request.path.decode("ascii")]

    def preflight(self, request: Request) -> Answer:
        return PREFLIGHT_ANSWER

    def upgrade(self, request: Request) -> Result:
        """A WebSocket opening handshake, handed to the socket resource (anything else is a 404)."""
        if self.socket is None or not _is_upgrade(request):
            return NOT_FOUND
        rendered = self.socket.render(request)
        if rendered is NOT_DONE_YET:
            return TAKEN
        return Answer(request.code, rendered)  # (it could build no protocol: its own answer)

    # Ingest ----------------------------------------------------------------------------------

    def _ingest_headers(self, request: Request) -> Answer | None:
        """An ingest's C{426} or C{415} (counted), asked before its body is read and again here."""
        versions = request.requestHeaders.getRawHeaders(b"aep-version")
        refused = self.ingest_policy.refusal(versions, media_type(request.getHeader(b"content-type")))
        return None if refused is None else _ingest_refusal(refused)

    def ingest(self, request: Request) -> Answer | Deferred[Answer]:
        """C{202} once the store has the batch; a batch of one slice into a synchronous store is
        answered in the render call (the fast path), a larger one a slice per reactor turn."""
        refusal = self._ingest_headers(request)
        if refusal is not None:
            return refusal
        policy, body, media = self.ingest_policy, read_body(request), media_type(request.getHeader(b"content-type"))
        events = policy.plain_events(body, media)
        if events is not None:
            return self._store(events)
        parser = policy.parser(body, media)
        if parser.step(PARSE_SLICE):  # (an IngestError is the table's refusal)
            return self._store(parser.result())
        answer: Deferred[Answer] = Deferred()
        self.hub.clock.call_later(0, self._parse, request, parser, answer)
        return answer

    def simple_ingest(self, post: SimplePost) -> Answer | Deferred[Answer] | None:
        """C{POST /events} read whole by the channel, beside twisted.web (relayd.web.simple_post),
        through the same L{wall} and ingest policy as L{ingest}: the C{202} of a valid batch of one
        slice (a C{Deferred} of it while the store writes), or C{None}, with nothing done, for
        twisted.web's path to answer anything else, refusals included, as it always does."""
        headers = post.headers.get
        if self.wall(b"POST", post.path, headers) is not None:
            return None
        version = headers(b"aep-version")
        content_type = headers(b"content-type")
        # (the SDK's exact header needs no reading)
        media = JSON_TYPE if content_type == JSON_TYPE else media_type(content_type)
        policy, body = self.ingest_policy, post.body
        if policy.refusal(None if version is None else (version,), media, len(body)) is not None:
            return None
        events = policy.plain_events(body, media)
        if events is not None:
            return self._store(events)
        try:
            parser = policy.parser(body, media)
            if not parser.step(PARSE_SLICE):
                return None
            events = parser.result()
        except IngestError:
            return None
        return self._store(events)

    def _parse(self, request: Request, parser: BatchParser, answer: Deferred[Answer]) -> None:
        """Parse one more slice of the batch; the next slice waits for the next reactor turn."""
        if gone(request):
            return  # nobody is waiting for the answer: stop paying for the body
        try:
            if not parser.step(PARSE_SLICE):
                self.hub.clock.call_later(0, self._parse, request, parser, answer)
                return
            stored = self._store(parser.result())
        except Exception:
            answer.errback()  # an IngestError, answered by the table's refusals
            return
        if isinstance(stored, Deferred):
            stored.chainDeferred(answer)
        else:
            answer.callback(stored)

    def _store(self, events: list[Event]) -> Answer | Deferred[Answer]:
        if not events:
            return ACCEPTED
        # 202 only once the store has the events: with the in-memory log that is now (stored within
        # this call, the answer returned from it); with Redis, when its reply is in. (A Deferred
        # chained to one still waiting for Redis also reads as "called": that test once answered
        # 202 before the write; answer_when goes by its callback having run.)
        if self.relay.ingest_now(events):
            return ACCEPTED
        return answer_when(self.relay.ingest(events), _accepted, self._append_failed)

    def _append_failed(self, failure: Failure) -> Answer:
        metrics.store_errors.labels(relay="aep", operation="append").inc()
        if failure.check(StoreRefused):
            return STORE_UNAVAILABLE  # its client logs a refusal once per outage
        if failure.check(StoreUnavailable):
            # An outage, not a bug: one line per refusal (the metric counts them), no traceback.
            self._log.warn("ingest refused: {reason}", reason=failure.getErrorMessage())
        else:
            self._log.failure("ingest failed in the event store", failure)
        return OUTCOME_UNKNOWN if failure.check(OutcomeUnknown) else STORE_UNAVAILABLE

    # SSE -------------------------------------------------------------------------------------

    def stream(self, request: Request) -> Result:
        """Open an SSE stream; its history is read before any header goes out (C{503} if the store
        cannot answer), then live delivery. (A L{BadRequest} is the table's C{400}.)"""
        query = stream_query(request, self.relay.max_from)
        stream = SSEStream(request, self.hub, max_buffer=HARD_BACKLOG)
        sub = SSESubscriber(query.match, query.ceiling, stream, query.pin)
        key = object()
        history_only, filter_session = query.history_only, query.filter_session
        if not history_only:
            # Registered (and holding live events) before the history is read, so nothing that
            # arrives meanwhile is missed whatever the store's latency.
            sub.hold()
            if not self.relay.subscribe(key, sub):
                body = dumps({"error": "limit-exceeded", "max_subscribers": self.relay.max_subscribers})
                return json_answer(503, body)
        # The history is read before any header goes out, so a store that cannot answer gets a
        # 503 the client can act on; with the in-memory log this all happens in this call.
        from_all = query.from_value == "all"
        d: Deferred[Any] = self.relay.expand_all() if from_all else succeed(query.from_value)
        d.addCallback(lambda entries: self._resume(request, entries, from_all))
        d.addCallback(lambda resolved: self._fetch(resolved, history_only, filter_session, sub))
        d.addCallbacks(
            lambda reader: self._open(request, key, sub, reader, history_only, query.near_misses),
            lambda f: finish(request, self._replay_failed(key, f)),
        )
        return TAKEN

    def _open(
        self,
        request: Request,
        key: object,
        sub: SSESubscriber,
        reader: ReplayReader,
        history_only: bool,
        near_misses: tuple[str, ...] = (),
    ) -> None:
        stream = sub.stream
        if gone(request) or stream.closed:  # gone, or cut off already for what it held
            self.relay.unsubscribe(key)
            return
        stream.on_close = lambda: self._closed(key)
        stream.start(SSE_HEADERS, held=not history_only)  # a history-only answer ends: its connection is reused
        for warning in near_misses:
            stream.write(sse_comment(warning))
        self.sse_subscribers += 1
        stream.produce(SSEReplay(sub, reader, history_only))

    def _replay_failed(self, key: object, failure: Failure) -> Answer:
        self.relay.unsubscribe(key)
        metrics.store_errors.labels(relay="aep", operation="replay").inc()
        metrics.replays.labels(relay="aep", outcome="failed").inc()
        self._log.warn("replay failed: {reason}", reason=failure.getErrorMessage())
        return STORE_UNAVAILABLE

    def _closed(self, key: object) -> None:
        self.sse_subscribers -= 1
        self.relay.unsubscribe(key)

    def _resume(self, request: Request, entries: list[tuple[str, Position]], from_all: bool) -> Any:
        if not entries:
            found = last_event_id(request)
            if found is not None:
                entries = [found]
        return entries, from_all

    def _fetch(
        self,
        resolved: tuple[list[tuple[str, Position]], bool],
        history_only: bool,
        filter_session: str | None,
        sub: SSESubscriber,
    ) -> Deferred[ReplayReader]:
        entries, from_all = resolved
        if history_only and filter_session is not None:
            if filter_session not in {session for session, _ in entries}:
                entries = [*entries, (filter_session, (0, -1))]
        reader = self.relay.reader(sub, entries, from_all)
        # The first page is read before any header goes out, so a store that cannot answer gets a
        # 503 (the rest is read as the client takes it).
        loaded = reader.load()
        d = loaded if isinstance(loaded, Deferred) else succeed(loaded)
        return d.addCallback(lambda _: reader)


class SSEReplay(ReplayProducer):
    """The source of one SSE stream's replay (L{SSEStream.produce}); then live delivery, or for
    C{live=0} the C{replay-complete} comment and the end of the stream."""

    __slots__ = ("history_only",)

    _log = Logger()

    def __init__(self, sub: SSESubscriber, reader: ReplayReader, history_only: bool) -> None:
        super().__init__(sub, reader)
        self.history_only = history_only

    def send_marker(self, session: str, epoch: int, seq: int) -> int:
        frame = sse_comment(frame_safe(f"replay-exhausted {session} {epoch}:{seq}"))
        self.sub.stream.write(frame)  # type: ignore[attr-defined]
        return len(frame)

    def send_event(self, event: Event) -> int:
        # The frame alone: its chunked form is only worth keeping for a live fan-out.
        frame = sse_frame(event, self.sub.level(event))
        self.sub.stream.write(frame)  # type: ignore[attr-defined]
        return len(frame)

    def finished(self) -> None:
        if self.history_only:
            self.sub.stream.close(sse_comment("replay-complete"))  # type: ignore[attr-defined]

    def failed(self, failure: Failure) -> None:
        """The store failed after the stream started: end it (the client resumes by position)."""
        if failure.check(StoreUnavailable):
            self._log.warn("replay failed: {reason}", reason=failure.getErrorMessage())
        else:
            self._log.failure("replay failed", failure)
        metrics.store_errors.labels(relay="aep", operation="replay").inc()
        metrics.replays.labels(relay="aep", outcome="failed").inc()
        self.sub.stream.abort()  # type: ignore[attr-defined]


def _first(values: Sequence[bytes] | None) -> bytes | None:
    return values[0] if values else None


def _forbidden(refusal: Refusal) -> Answer:
    """The C{403} of a C{Host} or C{Origin} the browser policy refuses, naming the flag to set."""
    return json_answer(403, dumps(refusal.body()))


def _is_upgrade(request: Request) -> bool:
    """A WebSocket opening handshake (anything else at C{/socket} is an ordinary 404)."""
    upgrade = request.getHeader(b"upgrade") or b""
    return request.method == b"GET" and b"websocket" in upgrade.lower()

