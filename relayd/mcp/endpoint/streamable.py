"""Streamable HTTP (the handshake revisions 2025-03-26 to 2025-11-25) at C{{prefix}/{S}/mcp}: POST,
GET and DELETE, each an C{async def} that returns the request's L{Answer} (C{None} when the answer
comes later: the page's, through the client session's L{Pending}, or an SSE stream)."""

from __future__ import annotations

from twisted.python.failure import Failure
from twisted.web.server import Request

from relayd.mcp.core import standard
from relayd.mcp.core.clients import Client, ClientKind
from relayd.mcp.endpoint.admission import Admitted, header
from relayd.mcp.endpoint.answers import (
    ENDED,
    MISSING_CLIENT,
    UNKNOWN_CLIENT,
    not_forwarded,
    read_messages,
    rpc_error,
)
from relayd.mcp.endpoint.exchange import SSE_HEADERS, Exchange, StreamListener, session_header
from relayd.mcp.endpoint.stateless import Stateless
from relayd.web.answers import Answer, gone
from relayd.web.streams.sse import SSEStream

# A client session (Mcp-Session-Id) outlives its requests; each answer goes to its POST, the rest to
# the resumable GET stream.
SESSIONS = ClientKind(lasting=True, answers_on_stream=False)


class StreamableHTTP:
    """The Streamable HTTP transport: client sessions named by C{Mcp-Session-Id}."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.stateless = Stateless(exchange)

    async def post(self, request: Request, session: str, admitted: Admitted) -> Answer | None:
        intake = read_messages(request)
        if isinstance(intake, Answer):
            return intake
        sse_ok = "text/event-stream" in (header(request, b"accept") or "")
        token = admitted.token
        if admitted.version in standard.STATELESS_VERSIONS:
            return await self.stateless.post(request, session, admitted, intake, sse_ok)
        exchange = self.exchange
        requests = intake.requests
        sid = header(request, b"mcp-session-id")
        if sid is None:
            if len(requests) != 1 or requests[0].get("method") != "initialize":
                return MISSING_CLIENT
            client = exchange.new_client(request, session, token, SESSIONS)
            if isinstance(client, Answer):
                return client
            refused = await exchange.open(client)
            if refused is not None:
                return refused
            reply = exchange.post_reply(request, sse_ok, session_header(client))
            return await exchange.forward(request, client, intake, reply, first=True, checked=admitted.passed)
        found = exchange.find_here(session, token, sid, SESSIONS)
        if found is None:
            found = await exchange.find(request, session, token, sid, SESSIONS)
        if isinstance(found, Answer):
            return found
        if requests:
            reply = exchange.post_reply(request, sse_ok, session_header(found))
            return await exchange.forward(request, found, intake, reply, checked=admitted.passed)
        return await exchange.notify(session, token, found.label, intake, admitted.passed)

    async def get(self, request: Request, session: str, admitted: Admitted) -> Answer | None:
        if "text/event-stream" not in (header(request, b"accept") or ""):
            return rpc_error(406, standard.INVALID_REQUEST, "Accept must include text/event-stream")
        sid = header(request, b"mcp-session-id")
        if sid is None:
            return MISSING_CLIENT
        clients = self.exchange.clients
        after = clients.parse_event_id(header(request, b"last-event-id"))
        client = await self.exchange.find(request, session, admitted.token, sid, SESSIONS)
        if isinstance(client, Answer):
            return client
        if gone(request):
            return None
        if client.stream is not None:
            client.stream.close()  # one GET stream per client session: the newer one wins
        stream = SSEStream(request, self.exchange.hub, max_buffer=clients.config.stream_max_bytes)
        client.stream = StreamListener(stream)
        stream.start(SSE_HEADERS, b": open\n\n", held=True)
        client.replay(after)
        return None

    async def delete(self, request: Request, session: str, admitted: Admitted) -> Answer:
        sid = header(request, b"mcp-session-id")
        if sid is None:
            return MISSING_CLIENT
        clients = self.exchange.clients.clients
        local: Client | None = clients.get(sid)
        if local is not None and local.origin:
            if local.session != session or local.kind is not SESSIONS:
                return UNKNOWN_CLIENT
            local.close()
            return ENDED
        tunnel = self.exchange.tunnel
        try:
            record = await tunnel.get_client(sid)
        except Exception:
            return not_forwarded(Failure())
        if record is None or record.session != session or record.answers_on_stream:
            return UNKNOWN_CLIENT
        local = clients.get(sid)
        if local is not None:
            local.close(shared=False)
        # Ended for every instance: the one that created it says peer_left at its next pass.
        await tunnel.delete_client(sid)
        return ENDED
