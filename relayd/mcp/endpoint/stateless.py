"""The 2026-07-28 stateless revision on C{{prefix}/{S}/mcp}: no client session is handed out; each
request is one exchange under a label of its own, checked against its C{Mcp-Method}/C{Mcp-Name}
headers, and ended by its answer (or by the client closing the POST: its cancellation)."""

from __future__ import annotations

from twisted.web.server import Request

from relayd.mcp.core import standard
from relayd.mcp.core.clients import ClientKind
from relayd.mcp.endpoint.admission import Admitted, header
from relayd.mcp.endpoint.answers import Intake, rpc_error
from relayd.mcp.endpoint.exchange import Exchange, json_only
from relayd.web.answers import Answer

# Each request is its own client session, ended by its answer or its cancellation; its answer goes
# to its POST.
ONE_EXCHANGE = ClientKind(lasting=False, answers_on_stream=False)


class Stateless:
    """The stateless transport's POST (its GET and DELETE are C{405}: L{Admission.admit})."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange

    async def post(
        self, request: Request, session: str, admitted: Admitted, intake: Intake, sse_ok: bool
    ) -> Answer | None:
        exchange = self.exchange
        if not intake.requests:
            return await exchange.notify(session, admitted.token, None, intake, admitted.passed)
        message = intake.requests[0]
        why = standard.header_mismatch(
            message, admitted.version, header(request, b"mcp-method"), header(request, b"mcp-name")
        )
        if why is not None:
            return rpc_error(400, standard.HEADER_MISMATCH, why, message["id"])
        client = exchange.new_client(request, session, admitted.token, ONE_EXCHANGE)
        if isinstance(client, Answer):
            return client
        refused = await exchange.open(client)
        if refused is not None:
            return refused
        reply = exchange.post_reply(request, sse_ok, json_only())
        return await exchange.forward(request, client, intake, reply, checked=admitted.passed)
