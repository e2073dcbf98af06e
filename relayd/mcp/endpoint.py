"""Every tunnel session as a standard MCP endpoint: Streamable HTTP at C{{prefix}/{S}/mcp}, legacy
HTTP+SSE at C{{prefix}/{S}/sse}, so any MCP client connects with a URL and the session's token.

A client session (C{Mcp-Session-Id}, or one legacy SSE stream) is, to the tunnel, one labelled
C{outbound} reader of the tunnel session: its requests go to the page through L{TunnelRelay.forward}
with its label, so the tunnel's collision-free reply routing makes ids unique among clients and
brings each reply back to this client's sink with the client's own id. A 2026-07-28 request is one
such exchange under a label of its own. The rules (revisions, header checks, progress tokens) are
in L{relayd.mcp.standard}; this module is the transport.
"""

from __future__ import annotations

import secrets
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

from twisted.python.failure import Failure
from twisted.web.server import Request

from relayd.clock import Timekeeper
from relayd.coroutine import run
from relayd.mcp import standard
from relayd.mcp.frames import Frame
from relayd.mcp.jsontext import _dumps, loads_json
from relayd.mcp.store import OUTBOUND, ClientRecord, SubscriberRecord
from relayd.mcp.tokens import label_tag, relay_label
from relayd.mcp.tunnel import Refused, TunnelRelay
from relayd.storage import StoreUnavailable
from relayd.web.auth import bearer_token, query_param
from relayd.web.body import read_body
from relayd.web.cors import OriginPolicy
from relayd.web.routes import TAKEN, Answer, Handler, Refusals, Result, finish, gone, json_answer
from relayd.web.site import RelaySite
from relayd.web.streams.sse import SSEHub, SSEStream

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_MCP_EVENT = len(b"event: mcp\ndata: ")
# What each route takes (a preflight's Allow and allow-methods; the 405's Allow).
_ALLOW = {"mcp": b"GET, POST, DELETE, OPTIONS", "sse": b"GET, OPTIONS", "messages": b"POST, OPTIONS"}
_CORS_HEADERS = (
    b"content-type, accept, authorization, mcp-session-id, mcp-protocol-version, mcp-method, mcp-name, last-event-id"
)


def _rpc_error(
    status: int, code: int, message: str, request_id: Any = None, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> Answer:
    """A JSON-RPC error response as the whole HTTP answer."""
    return json_answer(status, standard.error_body(code, message, request_id), headers)


SESSION_GONE: Final = _rpc_error(410, standard.SESSION_ENDED, "the tunnel session is gone")
UNAUTHORIZED: Final = _rpc_error(
    401, standard.INVALID_REQUEST, "missing or wrong token", headers=((b"www-authenticate", b'Bearer realm="relayd"'),)
)
TOO_MANY_CLIENTS: Final = _rpc_error(
    503, standard.TOO_MANY_PENDING, "too many client sessions", headers=((b"retry-after", b"5"),)
)
UNKNOWN_LEGACY_CLIENT: Final = _rpc_error(404, standard.INVALID_REQUEST, "unknown or ended sessionId")
UNKNOWN_CLIENT: Final = _rpc_error(404, standard.INVALID_REQUEST, "unknown or ended Mcp-Session-Id")
MISSING_CLIENT: Final = _rpc_error(400, standard.INVALID_REQUEST, "missing Mcp-Session-Id")
NOT_JSON_RPC: Final = _rpc_error(400, standard.PARSE_ERROR, "not a JSON-RPC 2.0 message")
ACCEPTED: Final = json_answer(202, b"")
ENDED: Final = json_answer(200, b"")


def _refused(error: Refused) -> Answer:
    reason = error.reason
    if reason == "session_gone":
        return SESSION_GONE
    if reason == "buffer_full":
        return _rpc_error(503, standard.TOO_MANY_PENDING, "relay buffer full", headers=((b"retry-after", b"5"),))
    return _rpc_error(400, standard.INVALID_REQUEST, reason)


REFUSALS: Final = Refusals(
    [
        (Refused, _refused),
        (StoreUnavailable, lambda _: _rpc_error(503, standard.SESSION_ENDED, "store unavailable")),
    ],
    internal_error=_rpc_error(500, -32603, "internal error"),
)
"""The endpoint's answers (JSON-RPC errors) to what fails once a request is under way."""


@dataclass(frozen=True, slots=True)
class Intake:
    """A POST's body, valid JSON-RPC 2.0, and the requests among its messages."""

    body: bytes
    requests: list[dict[str, Any]]


def read_messages(request: Request, one_request: bool = True) -> Intake | Answer:
    """The one intake of a POST to the endpoint: its body as JSON-RPC messages, or the 400 answer.

    C{one_request}: a batch may hold notifications and responses but not requests (each request is
    one exchange with the page, answered on its own).
    """
    body = read_body(request)
    messages = standard.parse_message(body)
    if messages is None:
        try:
            loads_json(body)  # (read again only to name the fault: never on the way of a valid message)
        except ValueError as e:
            return _rpc_error(400, standard.PARSE_ERROR, f"not JSON: {e}")
        return NOT_JSON_RPC
    requests = [m for m in messages if standard.is_request(m)]
    if one_request and requests and len(messages) > 1:
        return _rpc_error(400, standard.INVALID_REQUEST, "batches of requests are not supported")
    return Intake(body, requests)


@dataclass(frozen=True)
class EndpointConfig:
    """The endpoint's bounds and timings (flags in C{relayd.mcp.config})."""

    request_timeout_ms: float = 60_000
    client_idle_ms: float = 1_800_000
    max_clients: int = 10_000
    clients_per_session: int = 64
    # Client sessions one client address holds on this process (0: no bound); at this bound and at
    # max_clients, idle ones (no pending request, no open stream) end first, least recently used first.
    clients_per_address: int = 1000
    pending_per_client: int = 64
    pending_per_session: int = 1000
    event_buffer_frames: int = 64
    event_buffer_bytes: int = 1024 * 1024
    # A stream whose client stops reading is cut once this many bytes wait for it (--mcp-queue-bytes).
    stream_max_bytes: int = 8 * 1024 * 1024


def _message_event(raw: bytes, event_id: bytes | None = None) -> bytes:
    # Page frames arrive without CR/LF (tunnel-framed) or re-serialised compactly: one data line.
    if event_id is None:
        return b"event: message\ndata: " + raw + b"\n\n"
    return b"id: " + event_id + b"\nevent: message\ndata: " + raw + b"\n\n"


class _NoPending(dict[bytes, "_Pending"]):
    """The pending requests of every client session that has none: one shared empty dict that
    refuses writes (an idle client session held an emptied dict of its own, 224 bytes, once its
    C{initialize} was answered)."""

    def __setitem__(self, key: bytes, value: _Pending) -> None:
        raise TypeError("the shared empty pending table is read-only: use Client.add_pending")


_NO_PENDING: Final = _NoPending()


class _Pending:
    """One forwarded request awaiting the page's answer."""

    __slots__ = ("client", "key", "raw_id", "request", "stream", "timer", "forwarded", "progress", "sse_ok", "settled")

    def __init__(self, client: Client, key: bytes, request: Request | None, sse_ok: bool) -> None:
        self.client = client
        self.key = key
        self.raw_id = key
        self.request = request
        self.stream: SSEStream | None = None
        self.timer: Any = None
        self.forwarded: Any = None
        self.progress: bytes | None = None
        self.sse_ok = sse_ok
        self.settled = False

    def settle(self) -> None:
        """Count this request out of its session's pending total (once)."""
        if not self.settled:
            self.settled = True
            self.client.endpoint.release(self.client.session)

    def send(self, raw: bytes) -> bool:
        """A message about this request (progress, the page's request): on its stream if it may have one."""
        request = self.request
        if request is None or not self.sse_ok or gone(request):
            return False
        if self.stream is None:
            endpoint = self.client.endpoint
            self.stream = SSEStream(request, endpoint.hub, max_buffer=endpoint.config.stream_max_bytes)
            self.stream.start(_SSE_HEADERS + self.client.session_header())
        self.stream.write(_message_event(raw))
        return True

    def answer(self, raw: bytes, status: int = 200) -> None:
        """The response ends the exchange: the stream's last event, or the JSON body."""
        self.settle()
        self.client.endpoint.clock.cancel(self.timer)
        self.timer = None
        request, self.request = self.request, None
        if self.client.legacy:
            self.client.push(raw)
            return
        if request is None or gone(request):
            return
        if self.stream is not None:
            self.stream.write(_message_event(raw))
            self.stream.close()
            return
        finish(request, json_answer(status, raw, self.client.session_header()))

    def expire(self) -> None:
        """The page did not answer in time: a JSON-RPC error, and the page is told to stop."""
        self.timer = None
        client = self.client
        if client.take_pending(self.key) is None:
            return
        client.forget_progress(self)
        self.answer(standard.error_for(self.raw_id, standard.REQUEST_TIMEOUT, "the page did not answer in time"))
        client.cancel_at_page(self, "timeout")

    def abandoned(self, _: object) -> None:
        """The client closed the POST before the answer (2026-07-28: that is its cancellation)."""
        client = self.client
        if self.request is None or client.pending.get(self.key) is not self:
            return
        self.request = None
        if client.stateless:
            client.take_pending(self.key)
            self.settle()
            client.endpoint.clock.cancel(self.timer)
            client.cancel_at_page(self, "client closed the request")
            client.close()


class Client:
    """One MCP client session on one tunnel session, and the tunnel's L{Sink} for its label."""

    __slots__ = (
        "endpoint", "id", "session", "token", "label", "record", "legacy", "stateless", "pending",
        "progress", "stream", "events", "events_bytes", "next_event", "delivered", "last_used", "ended", "origin",
        "address",
    )

    def __init__(
        self,
        endpoint: Endpoint,
        session: str,
        token: str,
        legacy: bool = False,
        stateless: bool = False,
        attach: ClientRecord | None = None,
        client_id: str | None = None,
        address: str = "",
    ) -> None:
        self.endpoint = endpoint
        self.address = address  # the client address that made or attached it (its per-address count)
        self.id = client_id or secrets.token_urlsafe(24)  # 192 random bits
        self.session = session
        self.token = token
        self.label = attach.label if attach is not None else relay_label()
        # Created here (it announced presence and owns the shared record), or attached to a client
        # session another instance created (--redis: the client's requests may land anywhere).
        self.origin = attach is None
        self.record: SubscriberRecord | None = None
        self.legacy = legacy
        self.stateless = stateless
        self.pending: dict[bytes, _Pending] = _NO_PENDING  # its own dict while a request is pending
        # Made when first needed: an idle client session holds neither (memory per idle client).
        self.progress: dict[bytes, _Pending] | None = None
        self.stream: SSEStream | None = None
        self.events: deque[tuple[int, bytes]] | None = None
        self.events_bytes = 0
        self.next_event = 1
        self.delivered = 0
        self.last_used = endpoint.clock.seconds()
        self.ended = False

    def add_pending(self, key: bytes, pending: _Pending) -> None:
        """Remember a forwarded request until its answer (a dict of its own from the first one)."""
        if self.pending is _NO_PENDING:
            self.pending = {}
        self.pending[key] = pending

    def take_pending(self, key: bytes) -> _Pending | None:
        """Forget a pending request; the last one gone, the session's dict goes with it."""
        pending = self.pending.pop(key, None)
        if pending is not None and not self.pending:
            self.pending = _NO_PENDING
        return pending

    def idle(self) -> bool:
        """Nothing in flight and no stream open: ending it now loses the client nothing it waits for."""
        stream = self.stream
        return not (self.pending or self.stateless or self.ended or (stream is not None and not stream.closed))

    def session_header(self) -> list[tuple[bytes, bytes]]:
        if self.legacy or self.stateless:
            return []
        return [(b"mcp-session-id", self.id.encode("ascii"))]

    # the tunnel's sink -------------------------------------------------------------------------

    def deliver(self, event: bytes) -> bool:
        """A page frame on this client's label (a reply to it, or something for every client)."""
        raw = event[_MCP_EVENT:-2]
        try:
            message = loads_json(raw)
        except ValueError:
            return True
        for item in message if isinstance(message, list) else [message]:
            if isinstance(item, dict):
                self._route(item, raw if not isinstance(message, list) else None)
        return True

    def _route(self, item: dict[str, Any], raw: bytes | None) -> None:
        method = item.get("method")
        if not isinstance(method, str):
            pending = self.take_pending(_dumps(item.get("id")))
            if pending is not None:
                self.forget_progress(pending)
                pending.answer(raw if raw is not None else _dumps(item))
                if self.stateless:
                    self.close()
            return
        if method == "notifications/progress":
            params = item.get("params")
            split = standard.split_token(params.get("progressToken") if isinstance(params, dict) else None)
            if split is not None:
                tag, original = split
                if tag != label_tag(self.label):
                    return  # another client's progress
                restored = _dumps(standard.restore_progress(item, original))
                pending = self.progress.get(_dumps(original)) if self.progress else None
                if pending is not None and pending.send(restored):
                    return
                self.push(restored)
                return
        if self.stateless:
            # One exchange: only what the page stamped with this exchange's (forwarded) id rides on
            # its stream (a listen stream's acknowledgement and events), with the client's own id.
            stamped = standard.subscription_id(item)
            if stamped is not None:
                for pending in self.pending.values():
                    if pending.forwarded is not None and _dumps(pending.forwarded) == _dumps(stamped):
                        pending.send(_dumps(standard.with_subscription_id(item, loads_json(pending.raw_id))))
            return
        self.push(raw if raw is not None else _dumps(item))

    def end(self) -> None:
        """The tunnel session ended (or the relay is draining): answer what is pending, end streams."""
        self.record = None  # the tunnel has forgotten it already
        self._finish("the tunnel session ended")
        if self.origin and not self.stateless:
            tunnel = self.endpoint.tunnel
            tunnel.store.delete_client(self.id).addErrback(tunnel._log_failure, "ending an MCP client session failed")

    # client side -------------------------------------------------------------------------------

    def push(self, raw: bytes) -> None:
        """A message for the client outside any pending POST: the GET stream (resumable) or the legacy stream."""
        if self.legacy:
            if self.stream is not None:
                self.stream.write(_message_event(raw))
            return
        n = self.next_event
        self.next_event += 1
        config = self.endpoint.config
        events = self.events
        if events is None:
            events = self.events = deque()
        events.append((n, raw))
        self.events_bytes += len(raw)
        while len(events) > config.event_buffer_frames or self.events_bytes > config.event_buffer_bytes:
            self.events_bytes -= len(events.popleft()[1])
        if self.stream is not None and not self.stream.closed:
            self.stream.write(_message_event(raw, self.endpoint.event_id(n)))
            self.delivered = n

    def replay(self, after: int | None) -> None:
        """Write buffered events after C{after} (C{Last-Event-ID}), or those never delivered."""
        start = self.delivered if after is None else after
        stream = self.stream
        assert stream is not None
        for n, raw in self.events or ():
            if n > start:
                stream.write(_message_event(raw, self.endpoint.event_id(n)))
                self.delivered = max(self.delivered, n)

    def forget_progress(self, pending: _Pending) -> None:
        if pending.progress is not None and self.progress:
            self.progress.pop(pending.progress, None)
            if not self.progress:
                self.progress = None  # (an emptied dict keeps its table: made again when needed)

    def cancel_at_page(self, pending: _Pending, reason: str) -> None:
        """Tell the page to stop working on a forwarded request (C{notifications/cancelled})."""
        if pending.forwarded is None:
            return
        body = _dumps(
            {
                "jsonrpc": "2.0",
                "method": "notifications/cancelled",
                "params": {"requestId": pending.forwarded, "reason": reason},
            }
        )
        self.endpoint.tunnel.inbox(self.session, self.token, body, self.label).addErrback(lambda _: None)

    def close(self, shared: bool = True) -> None:
        """The client ended (DELETE, idle, its legacy stream closed, its one exchange done).

        C{shared=False}: only this instance's attachment ends (the client session goes on elsewhere).
        """
        record, self.record = self.record, None
        self._finish("the client session ended")
        tunnel = self.endpoint.tunnel
        if record is not None:
            announce = self.origin and not self.stateless
            tunnel.close_stream(record, announce=announce).addErrback(
                tunnel._log_failure, "closing an MCP client session failed"
            )
        if shared and self.origin and not self.stateless:
            tunnel.store.delete_client(self.id).addErrback(tunnel._log_failure, "ending an MCP client session failed")

    def _finish(self, message: str) -> None:
        if self.ended:
            return
        self.ended = True
        self.endpoint.forget(self)
        pending, self.pending = self.pending, _NO_PENDING
        self.progress = None
        for p in pending.values():
            p.answer(standard.error_for(p.raw_id, standard.SESSION_ENDED, message))
        stream, self.stream = self.stream, None
        if stream is not None:
            stream.close()


def _count_out(counts: dict[str, int], key: str) -> None:
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def client_address(request: Request) -> str:
    """The client's address as the relay's site reads it (with --trust-forwarded-for, the forwarded
    one), what the per-address bounds count; C{""} when unknown (the connection is gone)."""
    site = getattr(request.channel, "site", None)
    return site.client_address(request) if isinstance(site, RelaySite) else ""


def _request_token(request: Request) -> str:
    return bearer_token(request) or query_param(request, "token") or ""


def _route(request: Request) -> str:
    # The route is the path's last segment (mcp, sse, messages).
    return request.path.rsplit(b"/", 1)[-1].decode("ascii")


def _header(request: Request, name: bytes) -> str | None:
    values = request.requestHeaders.getRawHeaders(name)
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        return ""


class Endpoint:
    """The standard MCP routes of every session: C{mcp} (Streamable HTTP), C{sse} and C{messages} (legacy)."""

    def __init__(self, tunnel: TunnelRelay, policy: OriginPolicy, hub: SSEHub, clock: Timekeeper, prefix: bytes,
                 config: EndpointConfig | None = None) -> None:
        self.tunnel = tunnel
        self.policy = policy
        self.hub = hub
        self.clock = clock
        self.prefix = prefix
        self.config = config or EndpointConfig()
        self.clients: dict[str, Client] = {}
        self.per_session: dict[str, int] = {}
        # Client sessions per client address (--mcp-max-clients-per-address).
        self.per_address: dict[str, int] = {}
        self.pending_per_session: dict[str, int] = {}
        self._reaper: Any = None
        # Event ids are "<tag>-<n>": a Last-Event-ID from another instance's numbering is not ours.
        self.tag = secrets.token_hex(3).encode("ascii")
        self._last_reap = clock.seconds()

    def event_id(self, n: int) -> bytes:
        return self.tag + b"-%d" % n

    def parse_event_id(self, value: str | None) -> int | None:
        """The number of one of this process's event ids, else C{None}."""
        if value is None:
            return None
        tag, _, n = value.partition("-")
        if tag.encode("ascii", "replace") != self.tag or not n.isdigit() or len(n) > 18:
            return None
        return int(n)

    def start(self) -> None:
        """Expire idle client sessions (checked a few times per idle period)."""
        if self._reaper is None:
            interval = max(1.0, self.config.client_idle_ms / 4000)
            self._reaper = self.clock.looping_call(interval, self.reap)

    def stop(self) -> None:
        if self._reaper is not None:
            self.clock.stop_loop(self._reaper)
            self._reaper = None

    def reap(self) -> None:
        """End client sessions idle past C{client_idle_ms} (an open GET stream or pending request is use)."""
        run(self._reap()).addErrback(self.tunnel._log_failure, "MCP client session reaping failed")

    async def _reap(self) -> None:
        now = self.clock.seconds()
        cutoff = now - self.config.client_idle_ms / 1000
        since, self._last_reap = self._last_reap, now
        store = self.tunnel.store
        shared = self.tunnel._remote
        idle_ms = self.config.client_idle_ms
        active: list[Client] = []
        for client in list(self.clients.values()):
            if client.stateless or client.ended:
                continue
            streaming = client.stream is not None and not client.stream.closed
            if client.pending or streaming or client.last_used >= cutoff:
                if client.pending or streaming or client.last_used >= since:
                    active.append(client)
            elif not client.origin:
                client.close(shared=False)  # an idle attachment; the client session lives on elsewhere
            elif not shared or await store.get_client(client.id) is None:
                client.close()  # idle here, and not kept alive by another instance either
        if active:
            # Used since the last pass: keep the shared record alive; one ended elsewhere (a DELETE
            # on another instance) ends here too.
            alive = await store.touch_clients([c.id for c in active], idle_ms)
            for client, exists in zip(active, alive, strict=True):
                if not exists:
                    client.close(shared=False)

    def release(self, session: str) -> None:
        """One pending request of C{session} is settled."""
        left = self.pending_per_session.get(session, 1) - 1
        if left > 0:
            self.pending_per_session[session] = left
        else:
            self.pending_per_session.pop(session, None)

    def forget(self, client: Client) -> None:
        if self.clients.pop(client.id, None) is not None:
            _count_out(self.per_session, client.session)
            if client.address:
                _count_out(self.per_address, client.address)

    # routes ------------------------------------------------------------------------------------

    def routes(self) -> dict[str, dict[str, Handler]]:
        """The endpoint's routes, under the relay's prefix: path -> method -> handler.

        The origin and the protocol version are checked before the method (L{_admit}), so every other
        method (C{"*"}, C{HEAD} included) is answered here too: the endpoint's own JSON-RPC C{405}.
        """
        return {
            "/{session}/mcp": {
                "POST": self._mcp_post,
                "GET": self._mcp_get,
                "DELETE": self._mcp_delete,
                "OPTIONS": self._preflight,
                "HEAD": self._not_allowed,
                "*": self._not_allowed,
            },
            "/{session}/sse": {
                "GET": self._sse,
                "OPTIONS": self._preflight,
                "HEAD": self._not_allowed,
                "*": self._not_allowed,
            },
            "/{session}/messages": {"POST": self._messages, "OPTIONS": self._preflight, "*": self._not_allowed},
        }

    @staticmethod
    def _preflight(request: Request, session: str) -> Answer:
        # The origin's CORS headers are already set (the relay's policy); these are the endpoint's.
        allow = _ALLOW[_route(request)]
        headers = (
            (b"allow", allow),
            (b"access-control-allow-methods", allow),
            (b"access-control-allow-headers", _CORS_HEADERS),
        )
        return Answer(204, b"", headers)

    def _mcp_post(self, request: Request, session: str) -> Result:
        return self._admit(request, session, lambda token, version: self._post(request, session, token, version))

    def _mcp_get(self, request: Request, session: str) -> Result:
        return self._admit(request, session, lambda token, _: self._get(request, session, token), stateful=True)

    def _mcp_delete(self, request: Request, session: str) -> Result:
        return self._admit(request, session, lambda token, _: self._delete(request, session, token), stateful=True)

    def _sse(self, request: Request, session: str) -> Result:
        return self._admit(request, session, lambda token, _: self._legacy_open(request, session, token))

    def _messages(self, request: Request, session: str) -> Result:
        return self._admit(request, session, lambda token, _: self._legacy_post(request, session))

    def _not_allowed(self, request: Request, session: str) -> Result:
        return self._admit(request, session, None)

    def _admit(
        self,
        request: Request,
        session: str,
        act: Callable[[str, str | None], None] | None,
        stateful: bool = False,
    ) -> Result:
        """Check what every request to the endpoint must pass, in the order the contract gives, then
        C{act(token, version)} once the tunnel has accepted the token for C{session}.

        C{act=None}: the method is not allowed; C{stateful}: nor is it under a stateless revision.
        CORS headers are already set.
        """
        request.setHeader(b"access-control-expose-headers", b"mcp-session-id, www-authenticate")
        origin = request.requestHeaders.getRawHeaders(b"origin")
        if origin and not self.policy.any and origin[0] not in self.policy._allowed_bytes:
            # The spec's DNS-rebinding rule: a browser page of another origin gets nothing.
            return _rpc_error(403, standard.INVALID_REQUEST, "origin not allowed")
        version = _header(request, b"mcp-protocol-version")
        if version is not None and version not in standard.SUPPORTED_VERSIONS:
            return _rpc_error(400, standard.INVALID_REQUEST, "unsupported MCP-Protocol-Version")
        if act is None or (stateful and version in standard.STATELESS_VERSIONS):
            allow = ((b"allow", _ALLOW[_route(request)]),)
            return _rpc_error(405, standard.INVALID_REQUEST, "method not allowed", headers=allow)
        token = _request_token(request)
        if not token:
            return UNAUTHORIZED

        def checked(reason: str | None) -> None:
            if reason == "session_gone":
                finish(request, SESSION_GONE)
            elif reason is not None:
                finish(request, UNAUTHORIZED)
            else:
                act(token, version)

        self.tunnel.check(session, token).addCallbacks(checked, lambda f: self._failed(request, f))
        return TAKEN

    # answers -----------------------------------------------------------------------------------

    @staticmethod
    def _failed(request: Request, f: Failure) -> None:
        finish(request, REFUSALS.answer(f))

    # Streamable HTTP ---------------------------------------------------------------------------

    def _post(self, request: Request, session: str, token: str, version: str | None) -> None:
        intake = read_messages(request)
        if isinstance(intake, Answer):
            finish(request, intake)
            return
        body, requests = intake.body, intake.requests
        accept = _header(request, b"accept") or ""
        sse_ok = "text/event-stream" in accept
        if version in standard.STATELESS_VERSIONS:
            if requests:
                m = requests[0]
                why = standard.header_mismatch(
                    m, version, _header(request, b"mcp-method"), _header(request, b"mcp-name")
                )
                if why is not None:
                    finish(request, _rpc_error(400, standard.HEADER_MISMATCH, why, m["id"]))
                    return
                client = self._new_client(request, session, token, stateless=True)
                if client is not None:
                    self._open(request, client, lambda: self._forward(request, client, m, sse_ok))
                return
            self._notify(request, session, token, None, body)
            return
        sid = _header(request, b"mcp-session-id")
        if sid is None:
            if len(requests) == 1 and requests[0].get("method") == "initialize":
                client = self._new_client(request, session, token)
                if client is not None:
                    self._open(request, client, lambda: self._forward(request, client, requests[0], sse_ok, first=True))
                return
            finish(request, MISSING_CLIENT)
            return

        def proceed(client: Client) -> None:
            if requests:
                self._forward(request, client, requests[0], sse_ok)
            else:
                self._notify(request, session, token, client.label, body)

        self._client(request, session, token, sid, proceed)

    def _notify(self, request: Request, session: str, token: str, label: str | None, body: bytes) -> None:
        """Notifications and responses: forwarded as they are (a response keeps the page's own id)."""
        d = self.tunnel.inbox(session, token, body, label)
        d.addCallbacks(lambda _: finish(request, ACCEPTED), lambda f: self._failed(request, f))

    def _new_client(self, request: Request, session: str, token: str, **kind: Any) -> Client | None:
        config = self.config
        address = client_address(request)
        if self.per_session.get(session, 0) >= config.clients_per_session or not self._room_for_a_client(address):
            finish(request, TOO_MANY_CLIENTS)
            return None
        if address:
            address = sys.intern(address)  # one string per address, however many client sessions
            self.per_address[address] = self.per_address.get(address, 0) + 1
        client = Client(self, session, token, address=address, **kind)
        self.clients[client.id] = client
        self.per_session[session] = self.per_session.get(session, 0) + 1
        return client

    def _room_for_a_client(self, address: str) -> bool:
        """Under the per-address and the per-process bound: end the least recently used idle client
        sessions that stand in the way; C{False} when too few of them are idle."""
        config = self.config
        bounds: list[tuple[int, int, str | None]] = [(config.max_clients, len(self.clients), None)]
        if address and config.clients_per_address:
            bounds.insert(0, (config.clients_per_address, self.per_address.get(address, 0), address))
        for cap, count, of_address in bounds:
            excess = count - cap + 1
            if excess <= 0:
                continue
            # A scan of every client session, only while a bound is reached.
            idle = [c for c in self.clients.values() if c.idle() and (of_address is None or c.address == of_address)]
            if len(idle) < excess:
                return False
            idle.sort(key=lambda c: c.last_used)
            for client in idle[:excess]:
                client.close()
        return True

    def _open(self, request: Request, client: Client, then: Any) -> None:
        """Subscribe the client's label to the page's frames, then go on."""

        def opened(handle: Any) -> None:
            if client.ended:
                self.tunnel.close_stream(handle.record, announce=not client.stateless)
                finish(request, SESSION_GONE)
                return
            client.record = handle.record
            for event in handle.backlog:
                client.deliver(event)
            if client.origin and not client.stateless:
                record = ClientRecord(client.session, client.label, client.legacy)
                stored = self.tunnel.store.put_client(client.id, record, self.config.client_idle_ms)
                stored.addCallbacks(lambda _: then(), failed_after)
            else:
                then()

        def failed_after(f: Failure) -> None:
            client.close(shared=False)
            self._failed(request, f)

        def failed(f: Failure) -> None:
            self.forget(client)
            client.ended = True
            self._failed(request, f)

        d = self.tunnel.open_stream(client.session, client.token, OUTBOUND, client.label, client,
                                    announce=client.origin and not client.stateless)
        d.addCallbacks(opened, failed)

    def _client(self, request: Request, session: str, token: str, sid: str, then: Any) -> None:
        """Find client session C{sid} of C{session} (here, or attach to it from the shared store) and
        call C{then(client)}; C{404} when there is none."""
        client = self.clients.get(sid)
        if client is not None:
            if client.session != session or client.legacy:
                finish(request, UNKNOWN_CLIENT)
                return
            client.last_used = self.clock.seconds()
            client.token = token
            then(client)
            return

        def found(record: ClientRecord | None) -> None:
            if record is None or record.session != session or record.legacy:
                finish(request, UNKNOWN_CLIENT)
                return
            existing = self.clients.get(sid)
            if existing is not None:  # attached meanwhile by a concurrent request
                self._client(request, session, token, sid, then)
                return
            attached = self._new_client(request, session, token, attach=record, client_id=sid)
            if attached is not None:
                self._open(request, attached, lambda: then(attached))

        self.tunnel.store.get_client(sid).addCallbacks(found, lambda f: self._failed(request, f))

    def _forward(
        self, request: Request, client: Client, message: dict[str, Any], sse_ok: bool, first: bool = False
    ) -> None:
        """Forward one request to the page; C{first}: the client session's C{initialize} (no session
        id was given out yet, so a refusal ends it)."""
        config = self.config
        key = _dumps(message["id"])
        session = client.session
        if key in client.pending:
            finish(request, _rpc_error(400, standard.INVALID_REQUEST, "request id already pending", message["id"]))
            return
        if len(client.pending) >= config.pending_per_client or (
            self.pending_per_session.get(session, 0) >= config.pending_per_session
        ):
            retry = ((b"retry-after", b"1"),)
            too_many = _rpc_error(429, standard.TOO_MANY_PENDING, "too many pending requests", message["id"], retry)
            finish(request, too_many)
            if client.stateless or first:
                client.close()
            return
        pending = _Pending(client, key, None if client.legacy else request, sse_ok)
        token = standard.progress_token(message)
        if token is not None:
            message = standard.with_progress_token(message, label_tag(client.label))
            pending.progress = _dumps(token)
            if client.progress is None:
                client.progress = {}
            client.progress[pending.progress] = pending
        client.add_pending(key, pending)
        self.pending_per_session[session] = self.pending_per_session.get(session, 0) + 1
        if not client.legacy:
            request.notifyFinish().addErrback(pending.abandoned)
        if message.get("method") != "subscriptions/listen":
            pending.timer = self.clock.call_later(config.request_timeout_ms / 1000, pending.expire)

        def sent(frame: Frame) -> None:
            pending.forwarded = frame.message.get("id")
            if client.legacy:
                finish(request, ACCEPTED)

        def refused(f: Failure) -> None:
            pending.settle()
            client.take_pending(key)
            client.forget_progress(pending)
            self.clock.cancel(pending.timer)
            self._failed(request, f)
            if client.stateless or first:
                client.close()

        d = self.tunnel.forward(session, client.token, _dumps(message), client.label)
        d.addCallbacks(sent, refused)

    def _get(self, request: Request, session: str, token: str) -> None:
        accept = _header(request, b"accept") or ""
        if "text/event-stream" not in accept:
            finish(request, _rpc_error(406, standard.INVALID_REQUEST, "Accept must include text/event-stream"))
            return
        sid = _header(request, b"mcp-session-id")
        if sid is None:
            finish(request, MISSING_CLIENT)
            return
        after = self.parse_event_id(_header(request, b"last-event-id"))

        def opened(client: Client) -> None:
            if gone(request):
                return
            if client.stream is not None:
                client.stream.close()  # one GET stream per client session: the newer one wins
            stream = SSEStream(request, self.hub, max_buffer=self.config.stream_max_bytes)
            client.stream = stream
            stream.start(_SSE_HEADERS, b": open\n\n", held=True)
            client.replay(after)

        self._client(request, session, token, sid, opened)

    def _delete(self, request: Request, session: str, token: str) -> None:
        sid = _header(request, b"mcp-session-id")
        if sid is None:
            finish(request, MISSING_CLIENT)
            return

        def found(record: ClientRecord | None) -> None:
            if record is None or record.session != session or record.legacy:
                finish(request, UNKNOWN_CLIENT)
                return
            local = self.clients.get(sid)
            if local is not None:
                local.close(shared=False)
            # Ended for every instance: the one that created it says peer_left at its next pass.
            self.tunnel.store.delete_client(sid).addCallbacks(
                lambda _: finish(request, ENDED), lambda f: self._failed(request, f)
            )

        local = self.clients.get(sid)
        if local is not None and local.origin:
            if local.session != session or local.legacy:
                found(None)
                return
            local.close()
            finish(request, ENDED)
            return
        self.tunnel.store.get_client(sid).addCallbacks(found, lambda f: self._failed(request, f))

    # legacy HTTP+SSE (2024-11-05) --------------------------------------------------------------

    def _legacy_open(self, request: Request, session: str, token: str) -> None:
        client = self._new_client(request, session, token, legacy=True)
        if client is None:
            return

        def start() -> None:
            if gone(request):
                client.close()
                return
            stream = SSEStream(request, self.hub, max_buffer=self.config.stream_max_bytes, on_close=client.close)
            client.stream = stream
            url = self.prefix + b"/" + session.encode() + b"/messages?sessionId=" + client.id.encode()
            if not bearer_token(request):
                # Only a client that could not send the header gets the token in its POST URL (quoted:
                # nothing it chose can end the SSE line).
                url += b"&token=" + quote(token, safe="").encode("ascii")
            stream.start(_SSE_HEADERS, b"event: endpoint\ndata: " + url + b"\n\n", held=True)

        self._open(request, client, start)

    def _legacy_post(self, request: Request, session: str) -> None:
        sid = query_param(request, "sessionId") or ""
        client = self.clients.get(sid)
        if client is None:
            # --redis: the client's stream is on another instance; its label routes the answers there.
            def found(record: ClientRecord | None) -> None:
                if record is None or record.session != session or not record.legacy:
                    finish(request, UNKNOWN_LEGACY_CLIENT)
                    return
                # Forwarded as it is: the answers reach the client's stream by its label, there.
                intake = read_messages(request, one_request=False)
                if isinstance(intake, Answer):
                    finish(request, intake)
                    return
                self._notify(request, session, _request_token(request), record.label, intake.body)

            self.tunnel.store.get_client(sid).addCallbacks(found, lambda f: self._failed(request, f))
            return
        if client.session != session or not client.legacy:
            finish(request, UNKNOWN_LEGACY_CLIENT)
            return
        intake = read_messages(request)
        if isinstance(intake, Answer):
            finish(request, intake)
            return
        client.last_used = self.clock.seconds()
        if intake.requests:
            self._forward(request, client, intake.requests[0], False)
        else:
            self._notify(request, session, client.token, client.label, intake.body)

    # shutdown ----------------------------------------------------------------------------------

    def open_clients(self) -> int:
        """Client sessions (Streamable HTTP and legacy) held by this process."""
        return len(self.clients)


__all__ = ["Client", "Endpoint", "EndpointConfig"]
