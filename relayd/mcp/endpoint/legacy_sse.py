"""The 2024-11-05 HTTP+SSE transport: C{GET {prefix}/{S}/sse} opens a client session whose stream
first names its POST URL (C{endpoint} event), then carries every answer; C{POST .../messages?sessionId=}
takes the client's messages and is answered C{202} (the answer rides on the stream)."""

from __future__ import annotations

from urllib.parse import quote

from twisted.python.failure import Failure
from twisted.web.server import Request

from relayd.mcp.core.clients import ClientKind
from relayd.mcp.endpoint.admission import Admitted
from relayd.mcp.endpoint.answers import UNKNOWN_LEGACY_CLIENT, not_forwarded, read_messages
from relayd.mcp.endpoint.exchange import SSE_HEADERS, Exchange, StreamListener
from relayd.web.answers import Answer, gone
from relayd.web.auth import bearer_token, query_param
from relayd.web.streams.sse import SSEStream

# A client session lasts as long as its SSE stream, which carries every answer (its POSTs get 202).
ON_ITS_STREAM = ClientKind(lasting=True, answers_on_stream=True)


class LegacySSE:
    """The HTTP+SSE transport's two routes."""

    def __init__(self, exchange: Exchange, prefix: bytes) -> None:
        self.exchange = exchange
        self.prefix = prefix

    async def open(self, request: Request, session: str, admitted: Admitted) -> Answer | None:
        exchange = self.exchange
        token = admitted.token
        client = exchange.new_client(request, session, token, ON_ITS_STREAM)
        if isinstance(client, Answer):
            return client
        refused = await exchange.open(client)
        if refused is not None:
            return refused
        if gone(request):
            client.close()
            return None
        max_bytes = exchange.clients.config.stream_max_bytes
        stream = SSEStream(request, exchange.hub, max_buffer=max_bytes, on_close=client.close)
        client.stream = StreamListener(stream)
        url = self.prefix + b"/" + session.encode() + b"/messages?sessionId=" + client.id.encode()
        if not bearer_token(request):
            # Only a client that could not send the header gets the token in its POST URL (quoted:
            # nothing it chose can end the SSE line).
            url += b"&token=" + quote(token, safe="").encode("ascii")
        stream.start(SSE_HEADERS, b"event: endpoint\ndata: " + url + b"\n\n", held=True)
        return None

    async def post(self, request: Request, session: str, admitted: Admitted) -> Answer | None:
        exchange = self.exchange
        sid = query_param(request, "sessionId") or ""
        client = exchange.clients.clients.get(sid)
        if client is None:
            # --redis: the client's stream is on another instance; its label routes the answers there.
            try:
                record = await exchange.tunnel.get_client(sid)
            except Exception:
                return not_forwarded(Failure())
            if record is None or record.session != session or not record.answers_on_stream:
                return UNKNOWN_LEGACY_CLIENT
            # Forwarded as it is: the answers reach the client's stream by its label, there.
            intake = read_messages(request, one_request=False)
            if isinstance(intake, Answer):
                return intake
            return await exchange.notify(session, admitted.token, record.label, intake, admitted.passed)
        if client.session != session or client.kind is not ON_ITS_STREAM:
            return UNKNOWN_LEGACY_CLIENT
        intake = read_messages(request)
        if isinstance(intake, Answer):
            return intake
        client.last_used = exchange.clients.clock.seconds()
        if intake.requests:
            return await exchange.forward(request, client, intake, None)
        return await exchange.notify(session, client.token, client.label, intake)
