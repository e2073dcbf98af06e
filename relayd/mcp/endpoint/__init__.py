"""Every tunnel session as a standard MCP endpoint: Streamable HTTP at C{{prefix}/{S}/mcp} (the
handshake revisions, L{streamable}, and 2026-07-28, L{stateless}), legacy HTTP+SSE at
C{{prefix}/{S}/sse} and C{messages} (L{legacy_sse}), so any MCP client connects with a URL and the
session's token.

This package is the transport: L{admission} checks each request once, L{exchange} takes the steps
every transport shares; the client sessions themselves are the core's (L{relayd.mcp.core.clients}).
The rules (revisions, header checks, progress tokens) are in L{relayd.mcp.core.standard}.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.server import Request

from relayd.base.clock import Timekeeper
from relayd.base.coroutine import run_now
from relayd.mcp.core import standard
from relayd.mcp.core.clients import Client, Clients, EndpointConfig
from relayd.mcp.core.tunnel import TunnelRelay
from relayd.mcp.endpoint.admission import ALLOW, Admission, Admitted, client_address, route, session_part
from relayd.mcp.endpoint.answers import REFUSALS, not_forwarded, token_refused
from relayd.mcp.endpoint.exchange import Exchange
from relayd.mcp.endpoint.legacy_sse import LegacySSE
from relayd.mcp.endpoint.streamable import StreamableHTTP
from relayd.process.cors import OriginPolicy
from relayd.web.answers import Answer, finish
from relayd.web.routes import TAKEN, Handler, Result
from relayd.web.simple_post import SimplePost
from relayd.web.streams.sse import SSEHub

_CORS_HEADERS: Final = (
    b"content-type, accept, authorization, mcp-session-id, mcp-protocol-version, mcp-method, mcp-name, last-event-id"
)
TransportHandler = Callable[[Request, str, Admitted], Awaitable["Answer | None"]]


class _Admit:
    """One route's handler: admission, then the transport's C{async def} once the token is accepted."""

    __slots__ = ("admission", "handler", "stateful")

    def __init__(self, admission: Admission, handler: TransportHandler, stateful: bool = False) -> None:
        self.admission = admission
        self.handler = handler
        self.stateful = stateful  # not under a stateless revision (405)

    def __call__(self, request: Request, session: str) -> Result:
        admitted = self.admission.admit(request, session, stateful=self.stateful)
        if isinstance(admitted, Answer):
            return admitted
        answer = run_now(self._admitted(request, session, admitted))
        # The memory store answers at once: no Deferred made and read back for the answer (or the
        # None of an answer that comes later); a Redis round trip's comes through one.
        if type(answer) is Deferred:  # (not isinstance: an ABC's slow path for an Answer or None)
            answer.addCallbacks(_answered, _failed, callbackArgs=(request,), errbackArgs=(request,))
        else:
            _answered(answer, request)  # type: ignore[arg-type]  # (not cast(): a call per request)
        return TAKEN

    async def _admitted(self, request: Request, session: str, admitted: Admitted) -> Answer | None:
        reason = admitted.result
        if not admitted.settled or isinstance(reason, Failure):  # (settled: the store answered at once)
            try:
                reason = await admitted.checked()
            except Exception:
                return not_forwarded(Failure())
        if reason is not None:
            return token_refused(reason)
        return await self.handler(request, session, admitted)


def _answered(answer: Answer | None, request: Request) -> None:
    if answer is not None:
        finish(request, answer)


def _failed(failure: Failure, request: Request) -> None:
    finish(request, REFUSALS.answer(failure))


class Endpoint:
    """The standard MCP routes of every session: C{mcp} (Streamable HTTP), C{sse} and C{messages} (legacy)."""

    def __init__(
        self,
        tunnel: TunnelRelay,
        policy: OriginPolicy,
        hub: SSEHub,
        clock: Timekeeper,
        prefix: bytes,
        config: EndpointConfig | None = None,
    ) -> None:
        self.tunnel = tunnel
        self.client_sessions = Clients(tunnel, clock, config)
        self.admission = Admission(tunnel, policy, prefix)
        exchange = Exchange(tunnel, self.client_sessions, hub)
        self.streamable = StreamableHTTP(exchange)
        self.legacy = LegacySSE(exchange, prefix)

    # the client-session core's, for the service and the relay's drain ------------------------

    @property
    def clients(self) -> dict[str, Client]:
        """This process's client sessions by id."""
        return self.client_sessions.clients

    @property
    def config(self) -> EndpointConfig:
        return self.client_sessions.config

    @config.setter
    def config(self, config: EndpointConfig) -> None:
        self.client_sessions.config = config

    @property
    def tag(self) -> bytes:
        """What makes this process's event ids its own."""
        return self.client_sessions.tag

    def start(self) -> None:
        self.client_sessions.start()

    def stop(self) -> None:
        self.client_sessions.stop()

    def reap(self) -> None:
        self.client_sessions.reap()

    def open_clients(self) -> int:
        """Client sessions (Streamable HTTP and legacy) held by this process."""
        return self.client_sessions.open_clients()

    # routes ------------------------------------------------------------------------------------

    def early_check(self, request: Request) -> Answer | None:
        """What a POST's headers refuse, before its body is read (L{Admission.early_check})."""
        return self.admission.early_check(request)

    @staticmethod
    def answers_whole(post: SimplePost) -> bool:
        """Whether the answer to C{post}, a plain POST to C{mcp}, is one whole body, never a stream
        (so it may be rendered beside twisted.web, relayd.web.plain_request): not under the stateless
        revision (whose client cancels by closing the POST), and no progress token (whose
        notifications open a stream on the POST): the body names no C{progressToken}, nor anything
        escaped that could spell one."""
        version = post.headers.get(b"mcp-protocol-version")
        if version is not None and version.decode("utf-8", "replace") in standard.STATELESS_VERSIONS:
            return False
        body = post.body
        # (find: docs/architecture.md, hot paths)
        return body.find(b"progressToken") < 0 and body.find(b"\\u") < 0

    def routes(self) -> dict[str, dict[str, Handler]]:
        """The endpoint's routes, under the relay's prefix: path -> method -> handler.

        The origin and the protocol version are checked before the method (L{Admission.admit}), so
        every other method (C{"*"}, C{HEAD} included) is answered here too: the endpoint's own
        JSON-RPC C{405}.
        """
        admission, streamable, legacy = self.admission, self.streamable, self.legacy
        not_allowed = self._not_allowed
        return {
            "/{session}/mcp": {
                "POST": _Admit(admission, streamable.post),
                "GET": _Admit(admission, streamable.get, stateful=True),
                "DELETE": _Admit(admission, streamable.delete, stateful=True),
                "OPTIONS": self._preflight,
                "HEAD": not_allowed,
                "*": not_allowed,
            },
            "/{session}/sse": {
                "GET": _Admit(admission, legacy.open),
                "OPTIONS": self._preflight,
                "HEAD": not_allowed,
                "*": not_allowed,
            },
            "/{session}/messages": {
                "POST": _Admit(admission, legacy.post),
                "OPTIONS": self._preflight,
                "*": not_allowed,
            },
        }

    @staticmethod
    def _preflight(request: Request, session: str) -> Answer:
        # The origin's CORS headers are already set (the relay's policy); these are the endpoint's.
        allow = ALLOW[route(request)]
        headers = (
            (b"allow", allow),
            (b"access-control-allow-methods", allow),
            (b"access-control-allow-headers", _CORS_HEADERS),
        )
        return Answer(204, b"", headers)

    def _not_allowed(self, request: Request, session: str) -> Result:
        refusal = self.admission.admit(request, session, allowed=False)
        assert isinstance(refusal, Answer)  # (a method not allowed is refused before the token)
        return refusal


__all__ = ["Endpoint", "EndpointConfig", "client_address", "session_part"]
