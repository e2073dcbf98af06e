"""AEP over HTTP: ingest, discovery, health, introspection and the SSE stream (docs/aep.md)."""

from __future__ import annotations

import json
from collections import deque
from typing import Any, Callable, Sequence

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import IResource, Resource
from twisted.web.server import NOT_DONE_YET, Request

from relayd.aep import metrics
from relayd.aep.envelope import classify
from relayd.aep.event import NOTICE, Event, JSONError, admit, admit_lines, dumps, parse_json, plain_body
from relayd.aep.filters import Pin
from relayd.aep.query import BadRequest, last_event_id, stream_query
from relayd.aep.relay import HARD_BACKLOG, SOFT_BACKLOG, Relay, ReplayProducer, ReplayReader, Subscriber, held_size
from relayd.aep.store import Position
from relayd.aep.wire import frame_safe, sse_chunk, sse_frame
from relayd.storage import StoreUnavailable
from relayd.web.auth import bearer_token, query_param, tokens_equal
from relayd.web.body import EarlyAnswer, read_body
from relayd.web.sse import SSEHub, SSEStream, sse_comment
from relayd.web.twisted_internals import request_gone

JSON_TYPE = b"application/json"
NDJSON_TYPE = b"application/x-ndjson"

CORS_ANY = (b"access-control-allow-origin", b"*")
PREFLIGHT = [
    CORS_ANY,
    (b"access-control-allow-methods", b"GET, OPTIONS"),
    (b"access-control-allow-headers", b"authorization, accept, content-type, last-event-id"),
    (b"access-control-max-age", b"86400"),
]
SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"connection", b"keep-alive"),
    CORS_ANY,
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream
]
_SLOW_CONSUMER = metrics.events_dropped.labels(relay="aep", reason="slow-consumer")
_CUT_OFF = metrics.events_dropped.labels(relay="aep", reason="cut-off")


_HEADER_REFUSALS = {"426": "version-unsupported", "415": "unsupported-media-type"}


def _refused(reason: str) -> None:
    metrics.ingest_refused.labels(relay="aep", reason=_HEADER_REFUSALS.get(reason, reason)).inc()


# The methods of each route (C{405} and C{Allow} for any other on these paths). HEAD is answered
# like GET, without the body, where GET is a plain document.
ALLOWED: dict[bytes, tuple[bytes, ...]] = {
    b"/healthz": (b"GET", b"HEAD"),
    b"/events": (b"GET", b"HEAD", b"POST"),
    b"/.well-known/aep": (b"GET", b"HEAD"),
    b"/connections": (b"GET", b"HEAD", b"OPTIONS"),
    b"/stream": (b"GET", b"OPTIONS"),
    b"/socket": (b"GET",),
}
_HEAD_LIKE_GET = frozenset({b"/healthz", b"/events", b"/.well-known/aep", b"/connections"})


class IngestError(Exception):
    """An ingest refusal: its status and JSON body."""

    def __init__(self, status: int, body: dict[str, Any] | None) -> None:
        self.status = status
        self.body = body


# Lines parsed per reactor turn: a batch of 10 000 events (100-200 ms of parsing) never holds the
# reactor, and every other connection waits at most one slice.
PARSE_SLICE = 1000


class BatchParser:
    """An ingest body parsed a slice of lines at a time; nothing is ingested before all of it is
    valid (docs/decisions.md AEP-5).

    Plainly valid lines become events at once; the others are parsed exactly, so that the first
    invalid-json line is reported before the count and the first invalid-event line after it.
    """

    def __init__(self, body: bytes, ndjson: bool, max_batch: int) -> None:
        if ndjson:
            self.lines = [line for line in map(bytes.strip, body.split(b"\n")) if line]
        else:
            self.lines = [body.strip()]
        # A line feed ends an NDJSON line, so what the whole body settles holds for each line; a
        # JSON body is one value that may span lines (L{admit} refuses those, for SSE framing).
        self._plain = plain_body(body) if ndjson else None
        self._ndjson = ndjson
        self.max_batch = max_batch
        self._admitted: list[Event | None] = []
        self._values: dict[int, Any] = {}

    def step(self, count: int) -> bool:
        """Read up to C{count} more lines; C{True} once every line is read.

        @raise IngestError: 400 invalid-json naming what is wrong.
        """
        lines, admitted, values = self.lines, self._admitted, self._values
        start = len(admitted)
        end = min(len(lines), start + count)
        if self._ndjson:
            admitted.extend(admit_lines(lines[start:end], self._plain))
        else:
            admitted.extend(map(admit, lines[start:end]))
        for index in range(start, end):
            if admitted[index] is None:
                try:
                    values[index] = parse_json(lines[index])
                except JSONError as e:
                    raise IngestError(400, {"error": "invalid-json", "detail": str(e)}) from None
        return end == len(lines)

    def result(self) -> list[Event]:
        """The events, once L{step} has read every line.

        @raise IngestError: 413 too-many-events or 400 invalid-event with the line.
        """
        lines, admitted = self.lines, self._admitted
        if len(lines) > self.max_batch:
            raise IngestError(413, {"error": "too-many-events", "max": self.max_batch, "count": len(lines)})
        for index, value in self._values.items():
            kind = classify(value)
            if type(kind) is str:
                raise IngestError(400, {"error": "invalid-event", "line": index, "detail": kind})
            admitted[index] = Event(value, lines[index], kind)  # type: ignore[arg-type]
        return admitted  # type: ignore[return-value]


def parse_batch(body: bytes, ndjson: bool, max_batch: int) -> list[Event]:
    """Parse and validate a whole ingest body at once (L{BatchParser} in one step)."""
    parser = BatchParser(body, ndjson, max_batch)
    parser.step(len(parser.lines))
    return parser.result()


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
        backlog = self.held_bytes + size + stream.backlog
        if backlog > SOFT_BACKLOG and event.severity < NOTICE:
            self.dropped += 1
            _SLOW_CONSUMER.inc()
            return
        if backlog > HARD_BACKLOG:
            _CUT_OFF.inc(len(self._held or ()) + 1)  # it lags by more than the bound: it resumes by position
            self._held = deque()
            self.held_bytes = 0
            stream.abort()
            return
        self.keep_held(event, size)

    def send(self, event: Event) -> None:
        stream = self.stream
        if stream.backlog > SOFT_BACKLOG and event.severity < NOTICE:
            self.dropped += 1
            _SLOW_CONSUMER.inc()
            return
        level = self.level(event)
        if not stream.write(sse_frame(event, level), sse_chunk(event, level)) and stream.discarded:
            _CUT_OFF.inc(stream.discarded)  # the stream was just cut off with these frames unsent
            stream.discarded = 0


class AEPResource(Resource):
    """The whole AEP HTTP surface; paths match exactly (a trailing slash is a 404)."""

    isLeaf = True
    _log = Logger()

    def __init__(
        self,
        relay: Relay,
        hub: SSEHub,
        *,
        max_body: int,
        max_batch: int,
        socket: IResource | None = None,
        socket_counts: Callable[[], list[dict[str, Any]]] = lambda: [],
    ) -> None:
        super().__init__()
        self.relay = relay
        self.hub = hub
        self.max_body = max_body
        self.max_batch = max_batch
        self.socket = socket
        self._socket_listing = socket_counts
        self.sse_subscribers = 0
        self._discovery = json.dumps(relay.discovery, indent=2, ensure_ascii=False).encode("utf-8")

    # The auth wall ---------------------------------------------------------------------------

    def authorized(self, request: Request) -> bool:
        token = self.relay.token
        if not token:
            return True
        return tokens_equal(bearer_token(request), token) or tokens_equal(
            query_param(request, "access_token"), token
        )

    # Dispatch --------------------------------------------------------------------------------

    def render(self, request: Request) -> bytes | int:
        path, method = request.path, request.method
        if method == b"HEAD" and path in _HEAD_LIKE_GET:
            # The GET answer's status and headers (its content-length too), without its body.
            request.method = b"GET"
            try:
                self.render(request)
            finally:
                request.method = b"HEAD"
            return b""
        if path == b"/healthz" and method == b"GET":
            return self.healthz(request)
        if method == b"OPTIONS" and path in (b"/stream", b"/connections"):
            return _respond(request, 204, b"", PREFLIGHT)
        if not self.authorized(request):
            return _respond(request, 401, b"", [CORS_ANY])
        allowed = ALLOWED.get(path)
        if allowed is not None and method not in allowed:
            return self.not_allowed(request, allowed)
        if method == b"GET":
            if path == b"/connections":
                return self.connections(request)
            if path in (b"/events", b"/.well-known/aep"):
                return _respond(request, 200, self._discovery, [(b"content-type", JSON_TYPE)])
            if path == b"/stream":
                return self.stream(request)
        if path == b"/events" and method == b"POST":
            return self.ingest(request)
        if path == b"/socket" and self.socket is not None and _is_upgrade(request):
            return self.socket.render(request)
        return _respond(request, 404, b"")

    def not_allowed(self, request: Request, allowed: tuple[bytes, ...]) -> bytes:
        """C{405} for a method the path does not take, naming the ones it does."""
        body = dumps({"error": "method-not-allowed", "allow": [m.decode("ascii") for m in allowed]})
        body = _respond(request, 405, body, [(b"content-type", JSON_TYPE), (b"allow", b", ".join(allowed))])
        return b"" if request.method == b"HEAD" else body  # (Twisted would drop it, with a log line)

    def early_answer(self, request: Request) -> EarlyAnswer:
        """The answer to a body over C{AEP_MAX_BODY}, in the reference's order of checks."""
        if not self.authorized(request):
            return 401, [CORS_ANY], b""
        if request.path == b"/events" and request.method == b"POST":
            problem = self._header_problem(request)
            if problem is not None:
                _refused(str(problem[0]))
                return problem
        _refused("payload-too-large")
        body = dumps({"error": "payload-too-large", "max_bytes": self.max_body})
        return 413, [(b"content-type", JSON_TYPE)], body

    # Health and introspection ----------------------------------------------------------------

    def healthz(self, request: Request) -> bytes:
        body: dict[str, Any] = {"ok": True}
        if self.authorized(request):
            body.update(self.relay.counts())
        return _respond(request, 200, dumps(body), [(b"content-type", JSON_TYPE)])

    def connections(self, request: Request) -> bytes:
        counts = self.relay.counts()
        body = {
            "ok": True,
            "relay": {**counts, "control": bool(self.relay.token)},
            "connections": self._socket_listing(),
            "sse_subscribers": self.sse_subscribers,
        }
        return _respond(request, 200, dumps(body), [(b"content-type", JSON_TYPE), CORS_ANY])

    # Ingest ----------------------------------------------------------------------------------

    def _header_problem(self, request: Request) -> EarlyAnswer | None:
        versions = request.requestHeaders.getRawHeaders(b"aep-version")
        if versions != [b"0.1"]:
            return 426, [(b"content-type", JSON_TYPE)], b'{"versions":["0.1"]}'
        if _media_type(request) not in (JSON_TYPE, NDJSON_TYPE):
            return 415, [], b""
        return None

    def ingest(self, request: Request) -> bytes | int:
        problem = self._header_problem(request)
        if problem is not None:
            status, headers, body = problem
            _refused(str(status))
            return _respond(request, status, body, headers)
        parser = BatchParser(read_body(request), _media_type(request) == NDJSON_TYPE, self.max_batch)
        self._parse(request, parser)
        return NOT_DONE_YET

    def _parse(self, request: Request, parser: BatchParser) -> None:
        """Parse one slice of the batch; the next slice waits for the next reactor turn."""
        if request_gone(request):
            return  # nobody is waiting for the answer: stop paying for the body
        try:
            if not parser.step(PARSE_SLICE):
                self.hub.clock.call_later(0, self._parse, request, parser)
                return
            events = parser.result()
        except IngestError as e:
            _refused(str((e.body or {}).get("error", e.status)))
            _finish(request, e.status, dumps(e.body), [(b"content-type", JSON_TYPE)])
            return
        if not events:
            _finish(request, 202, b"")
            return
        d = self.relay.ingest(events)
        # 202 only once the store has the events: with the in-memory log that is now (the callback
        # runs at once); with Redis, when its reply is in. (A Deferred chained to one still waiting
        # for Redis also reads as "called": that test once answered 202 before the write.)
        d.addCallbacks(
            lambda _: _finish(request, 202, b""),
            lambda f: self._store_failed(request, f),
        )

    def _store_failed(self, request: Request, failure: Failure) -> None:
        if failure.check(StoreUnavailable):
            # An outage, not a bug: one line per refusal (the metric counts them), no traceback.
            self._log.warn("ingest refused: {reason}", reason=failure.getErrorMessage())
        else:
            self._log.failure("ingest failed in the event store", failure)
        metrics.store_errors.labels(relay="aep", operation="append").inc()
        body = dumps({"error": "store-unavailable", "store": "aep"})
        _finish(request, 503, body, [(b"content-type", JSON_TYPE)])

    # SSE -------------------------------------------------------------------------------------

    def stream(self, request: Request) -> bytes | int:
        try:
            query = stream_query(request, self.relay.max_from)
        except BadRequest as e:
            return _respond(request, 400, str(e).encode("utf-8"), [CORS_ANY])
        stream = SSEStream(request, self.hub, max_buffer=HARD_BACKLOG)
        sub = SSESubscriber(query.match, query.ceiling, stream, query.pin)
        key = object()
        history_only, from_value, filter_session = query.history_only, query.from_value, query.filter_session
        if not history_only:
            # Registered (and holding live events) before the history is read, so nothing that
            # arrives meanwhile is missed whatever the store's latency.
            sub.hold()
            if not self.relay.subscribe(key, sub):
                body = dumps({"error": "limit-exceeded", "max_subscribers": self.relay.max_subscribers})
                return _respond(request, 503, body, [(b"content-type", JSON_TYPE), CORS_ANY])
        # The history is read before any header goes out, so a store that cannot answer gets a
        # 503 the client can act on; with the in-memory log this all happens in this call.
        d: Deferred[Any] = self.relay.expand_all() if from_value == "all" else succeed(from_value)
        d.addCallback(lambda entries: self._resume(request, entries, from_value == "all"))
        d.addCallback(lambda resolved: self._fetch(resolved, history_only, filter_session, sub))
        d.addCallbacks(
            lambda reader: self._open(request, key, sub, reader, history_only),
            lambda f: self._store_unavailable(request, key, f),
        )
        return NOT_DONE_YET

    def _open(
        self,
        request: Request,
        key: object,
        sub: SSESubscriber,
        reader: ReplayReader,
        history_only: bool,
    ) -> None:
        stream = sub.stream
        if request_gone(request) or stream.closed:  # gone, or cut off already for what it held
            self.relay.unsubscribe(key)
            return
        stream.on_close = lambda: self._closed(key)
        stream.start(SSE_HEADERS)
        self.sse_subscribers += 1
        stream.produce(SSEReplay(sub, reader, history_only))

    def _store_unavailable(self, request: Request, key: object, failure: Failure) -> None:
        self.relay.unsubscribe(key)
        metrics.store_errors.labels(relay="aep", operation="replay").inc()
        metrics.replays.labels(relay="aep", outcome="failed").inc()
        self._log.warn("replay failed: {reason}", reason=failure.getErrorMessage())
        body = dumps({"error": "store-unavailable", "store": "aep"})
        _finish(request, 503, body, [(b"content-type", JSON_TYPE), CORS_ANY])

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


def _is_upgrade(request: Request) -> bool:
    """A WebSocket opening handshake (anything else at C{/socket} is an ordinary 404)."""
    upgrade = request.getHeader(b"upgrade") or b""
    return request.method == b"GET" and b"websocket" in upgrade.lower()


def _media_type(request: Request) -> bytes:
    """The request's media type, lower-cased (type and subtype are case-insensitive, RFC 9110 8.3.1)."""
    value = request.getHeader(b"content-type") or b""
    return value.split(b";", 1)[0].strip().lower()


def _respond(request: Request, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    request.setResponseCode(status)
    for name, value in headers:
        request.responseHeaders.setRawHeaders(name, [value])
    if body or status not in (204,):
        request.setHeader(b"content-length", b"%d" % len(body))
    return body


def _finish(request: Request, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    if request_gone(request):
        return
    request.write(_respond(request, status, body, headers))
    request.finish()
