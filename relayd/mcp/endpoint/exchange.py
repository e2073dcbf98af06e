"""What every endpoint transport does with the client-session core: make or find a client session,
subscribe it to the page, forward one request and hand its answer back, forward notifications.

The transport's side of the core's protocols is here too: L{PostReply} (a Streamable HTTP POST
answered with JSON or an SSE stream) and L{StreamListener} (a GET or legacy SSE stream), which frame
what the core hands them as SSE C{message} events.
"""

from __future__ import annotations

from typing import Any, Final

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.server import Request

from relayd.mcp.core import standard
from relayd.mcp.core.clients import Client, ClientKind, Clients, Pending
from relayd.mcp.core.jsontext import dumps
from relayd.mcp.core.store import OUTBOUND, ClientRecord
from relayd.mcp.core.tokens import label_tag
from relayd.mcp.core.tunnel import Pass, TunnelRelay
from relayd.mcp.endpoint.admission import client_address
from relayd.mcp.endpoint.answers import (
    ACCEPTED,
    SESSION_GONE,
    TOO_MANY_CLIENTS,
    UNKNOWN_CLIENT,
    Intake,
    not_forwarded,
    rpc_error,
)
from relayd.web.answers import JSON_TYPE, Answer, Header, finish, gone, watch_end
from relayd.web.streams.sse import SSEHub, SSEStream

SSE_HEADERS: Final = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_LISTEN = "subscriptions/listen"
_log = Logger()


def message_event(raw: bytes, event_id: bytes | None = None) -> bytes:
    """One JSON-RPC message as an SSE C{message} event (with its resumable id, if it has one)."""
    # Page frames arrive without CR/LF (tunnel-framed) or re-serialised compactly: one data line.
    if event_id is None:
        return b"event: message\ndata: " + raw + b"\n\n"
    return b"id: " + event_id + b"\nevent: message\ndata: " + raw + b"\n\n"


_JSON_ONLY: Final = ((b"content-type", JSON_TYPE),)


def session_header(client: Client) -> tuple[Header, ...]:
    """The headers of a Streamable HTTP client session's JSON answers: their content type and its
    C{Mcp-Session-Id} (made once per client session, kept on it)."""
    headers: tuple[Header, ...] | None = client.answer_headers
    if headers is None:
        headers = client.answer_headers = (*_JSON_ONLY, (b"mcp-session-id", client.id.encode("ascii")))
    return headers


def json_only() -> tuple[Header, ...]:
    """The headers of a JSON answer that names no client session (the stateless revision's)."""
    return _JSON_ONLY


class PostReply:
    """A Streamable HTTP POST awaiting the page's answer: one JSON body, or an SSE stream (opened by
    the first message about the request, when the client accepts one) ending with the answer.
    C{headers}: the JSON answer's (L{session_header}, L{json_only}: its content type first)."""

    __slots__ = ("request", "sse_ok", "headers", "hub", "max_bytes", "stream", "pending")

    def __init__(
        self, request: Request, sse_ok: bool, headers: tuple[Header, ...], hub: SSEHub, max_bytes: int
    ) -> None:
        self.request = request
        self.sse_ok = sse_ok
        self.headers = headers
        self.hub = hub
        self.max_bytes = max_bytes
        self.stream: SSEStream | None = None
        self.pending: Pending | None = None  # (the request forwarded: told if the client leaves first)

    def send(self, raw: bytes) -> bool:
        request = self.request
        if not self.sse_ok or gone(request):
            return False
        if self.stream is None:
            self.stream = SSEStream(request, self.hub, max_buffer=self.max_bytes)
            self.stream.start([*SSE_HEADERS, *self.headers[1:]])  # (the stream's content type, not JSON's)
        self.stream.write(message_event(raw))
        return True

    def answer(self, raw: bytes) -> None:
        request = self.request
        if gone(request):
            return
        if self.stream is not None:
            self.stream.write(message_event(raw))
            self.stream.close()
            return
        finish(request, Answer(200, raw, self.headers))

    # How the POST ends, told as its notifyFinish Deferred would be (watch_end): no Deferred per
    # forwarded request.

    def callback(self, result: None) -> None:
        """The POST was answered."""

    def errback(self, reason: Failure) -> None:
        """The client closed the POST before its answer."""
        pending = self.pending
        if pending is None:
            return
        try:
            pending.abandoned()
        except Exception:
            # (Called from within the request's end, as a Deferred's errback would be, and as contained.)
            _log.failure("forgetting an abandoned MCP request failed")


class StreamListener:
    """A client session's SSE stream outside any request (the GET stream, the legacy stream)."""

    __slots__ = ("stream",)

    def __init__(self, stream: SSEStream) -> None:
        self.stream = stream

    @property
    def closed(self) -> bool:
        return self.stream.closed

    def message(self, raw: bytes, event_id: bytes | None) -> None:
        self.stream.write(message_event(raw, event_id))

    def close(self) -> None:
        self.stream.close()


class Exchange:
    """The client-session steps every transport takes, each an C{async def} that returns the
    request's L{Answer} when it ends the request, else the client session or C{None}."""

    def __init__(self, tunnel: TunnelRelay, clients: Clients, hub: SSEHub) -> None:
        self.tunnel = tunnel
        self.clients = clients
        self.hub = hub

    def new_client(
        self, request: Request, session: str, token: str, kind: ClientKind, **attach: Any
    ) -> Client | Answer:
        """A new client session of the transport's C{kind} (or this process's attachment to one), or
        the bounds' C{503}."""
        client = self.clients.add(session, token, client_address(request), kind, **attach)
        return TOO_MANY_CLIENTS if client is None else client

    async def open(self, client: Client) -> Answer | None:
        """Subscribe the client's label to the page's frames (the request's token is already
        accepted); the refusal, or C{None} once open."""
        tunnel = self.tunnel
        try:
            handle = await tunnel.open_stream(
                client.session, client.token, OUTBOUND, client.label, client,
                announce=client.origin and client.kind.lasting, checked=True,
            )
        except Exception:
            self.clients.forget(client)
            client.ended = True
            return not_forwarded(Failure())
        if client.ended:
            closed = tunnel.close_stream(handle.record, announce=client.kind.lasting)
            closed.addErrback(tunnel.log_failure, "closing an MCP client session failed")
            return SESSION_GONE
        client.record = handle.record
        for event in handle.backlog:
            client.deliver(event)
        if client.origin and client.kind.lasting:
            record = ClientRecord(client.session, client.label, client.kind.answers_on_stream)
            try:
                await tunnel.put_client(client.id, record, self.clients.config.client_idle_ms)
            except Exception:
                client.close(shared=False)
                return not_forwarded(Failure())
        return None

    def find_here(self, session: str, token: str, sid: str, kind: ClientKind) -> Client | Answer | None:
        """L{find}'s answer when client session C{sid} is held here (no coroutine made for the
        usual request); C{None} when it is not."""
        clients = self.clients
        client = clients.clients.get(sid)
        if client is None:
            return None
        if client.session != session or client.kind is not kind:
            return UNKNOWN_CLIENT
        client.last_used = clients.clock.seconds()
        client.token = token
        return client

    async def find(self, request: Request, session: str, token: str, sid: str, kind: ClientKind) -> Client | Answer:
        """Client session C{sid} of C{session} and of the transport's C{kind}: here, or attached from
        the shared store; else C{404}."""
        clients = self.clients
        while True:
            here = self.find_here(session, token, sid, kind)
            if here is not None:
                return here
            try:
                record = await self.tunnel.get_client(sid)
            except Exception:
                return not_forwarded(Failure())
            if record is None or record.session != session or record.answers_on_stream != kind.answers_on_stream:
                return UNKNOWN_CLIENT
            if sid in clients.clients:
                continue  # attached meanwhile by a concurrent request
            attached = self.new_client(request, session, token, kind, attach=record, client_id=sid)
            if isinstance(attached, Answer):
                return attached
            refused = await self.open(attached)
            return attached if refused is None else refused

    def post_reply(self, request: Request, sse_ok: bool, headers: tuple[Header, ...]) -> PostReply:
        """The L{Reply} of a request answered on its own POST (JSON, or SSE when C{sse_ok}), with
        C{headers} (L{session_header}, L{json_only})."""
        return PostReply(request, sse_ok, headers, self.hub, self.clients.config.stream_max_bytes)

    async def forward(
        self,
        request: Request,
        client: Client,
        intake: Intake,
        reply: PostReply | None,
        first: bool = False,
        checked: Pass | None = None,
    ) -> Answer | None:
        """Forward the one request of C{intake} to the page; C{None}: its answer comes later, through
        its L{Pending} and C{reply} (L{post_reply}); with no C{reply} (the client session's answers
        ride its stream) the request is answered C{202} now. C{first}: the client session's
        C{initialize} (no session id was given out yet, so a refusal ends it); C{checked}: the
        request's L{Pass} (its token, the client's now, accepted at admission)."""
        message = intake.requests[0]
        clients = self.clients
        config = clients.config
        key = dumps(message["id"])
        session = client.session
        if key in client.pending:
            return rpc_error(400, standard.INVALID_REQUEST, "request id already pending", message["id"])
        if len(client.pending) >= config.pending_per_client or (
            clients.pending_per_session.get(session, 0) >= config.pending_per_session
        ):
            retry = ((b"retry-after", b"1"),)
            if not client.kind.lasting or first:
                client.close()
            return rpc_error(429, standard.TOO_MANY_PENDING, "too many pending requests", message["id"], retry)
        pending = Pending(client, key, reply)
        token = standard.progress_token(message)
        if token is not None:
            message = standard.with_progress_token(message, label_tag(client.label))
            pending.progress = dumps(token)
            if client.progress is None:
                client.progress = {}
            client.progress[pending.progress] = pending
        client.add_pending(key, pending)
        clients.pending_per_session[session] = clients.pending_per_session.get(session, 0) + 1
        if reply is not None:
            reply.pending = pending
            watch_end(request, reply)
        timeout = None if message.get("method") == _LISTEN else config.request_timeout_ms / 1000
        if timeout is not None:
            pending.timer = clients.clock.call_after_timeout(timeout, pending.expire)
        try:
            frame, read = await self.tunnel.to_page(
                session, client.token, intake.request_frame(message, key), client.label, checked
            )
        except Exception:
            pending.settle()
            client.take_pending(key)
            client.forget_progress(pending)
            clients.clock.cancel(pending.timer)
            if not client.kind.lasting or first:
                client.close()
            raise
        pending.forwarded = frame.message.get("id")
        if not read and client.pending.get(key) is pending:
            pending.wait_for_page(timeout)  # no page reads the session: answer soon if none comes back
        return ACCEPTED if reply is None else None

    async def notify(
        self, session: str, token: str, label: str | None, intake: Intake, checked: Pass | None = None
    ) -> Answer:
        """Notifications and responses: forwarded as they are (a response keeps the page's own id)."""
        await self.tunnel.forward_frame(session, token, intake.frame(), label, checked)
        return ACCEPTED
