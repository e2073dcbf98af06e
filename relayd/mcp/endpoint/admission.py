"""What every request to the standard endpoint must pass, in the order the contract gives: the
origin, the protocol version, the method, then the token, checked once per request.

The tunnel's check of the token is started by the first to ask: at the end of a POST's headers
(L{Admission.early_check}, before the body is read), else by the handler. Its answer is kept on the
request, so the handler never asks the store again.
"""

from __future__ import annotations

from typing import Final

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.server import Request

from relayd.mcp.core import standard
from relayd.mcp.core.tunnel import Pass, TunnelRelay
from relayd.mcp.endpoint.answers import UNAUTHORIZED, rpc_error, token_refused
from relayd.process.cors import OriginPolicy
from relayd.web.answers import Answer
from relayd.web.auth import bearer_token, query_param
from relayd.web.site import RelaySite

# What each route takes (a preflight's Allow and allow-methods; the 405's Allow).
ALLOW: Final = {"mcp": b"GET, POST, DELETE, OPTIONS", "sse": b"GET, OPTIONS", "messages": b"POST, OPTIONS"}
_ADMITTED: Final = "relayd_mcp_admitted"  # the request attribute holding its Admitted


class Admitted:
    """A request past the endpoint's header checks: its token, its protocol version and the
    tunnel's check of the token (started once, answered to whoever asks; C{passed}: the token's
    L{Pass} once accepted, for the request's post to the page)."""

    __slots__ = ("token", "version", "settled", "result", "waiting", "passed", "_pass")

    def __init__(
        self, token: str, version: str | None, token_pass: Pass, checked: str | Deferred[str | None] | None
    ) -> None:
        self.token = token
        self.version = version
        self.settled = False
        self.result: str | Failure | None = None  # the refusal reason, None (accepted) or the failure
        self.waiting: Deferred[str | None] | None = None
        self.passed: Pass | None = None
        self._pass = token_pass
        # (None or a str first: isinstance against Deferred, an ABC, is slow for anything else)
        if checked is None or isinstance(checked, str):
            self._settle(checked)  # (answered at once: TunnelRelay.check_at_once)
        else:
            checked.addBoth(self._settle)  # (kept here: a request never rendered leaves no unhandled failure)

    def _settle(self, result: str | Failure | None) -> None:
        if result is None:
            self.passed = self._pass
        self.settled, self.result = True, result
        waiting, self.waiting = self.waiting, None
        if waiting is not None:
            self._fire(waiting)

    def refused(self) -> str | None:
        """The tunnel's refusal reason, if it has answered with one already."""
        result = self.result
        return result if isinstance(result, str) else None

    def checked(self) -> Deferred[str | None]:
        """The tunnel's answer: C{None} (accepted) or the refusal reason; fails as the store failed."""
        d: Deferred[str | None] = Deferred()
        if self.settled:
            self._fire(d)
        else:
            self.waiting = d
        return d

    def _fire(self, d: Deferred[str | None]) -> None:
        result = self.result
        if isinstance(result, Failure):
            d.errback(result)
        else:
            d.callback(result)


class Admission:
    """The endpoint's admission of a request to one tunnel session."""

    def __init__(self, tunnel: TunnelRelay, policy: OriginPolicy, prefix: bytes) -> None:
        self.tunnel = tunnel
        self.policy = policy
        self.prefix = prefix

    def early_check(self, request: Request) -> Answer | None:
        """What the headers of a POST refuse, before its body is read (L{RoutedResource.early_answer}):
        every check of L{admit}, and the token's refusal once the tunnel has answered (at once in
        memory; with a shared store the lookup runs while the body arrives)."""
        session = session_part(self.prefix, request.path)
        if session is None:
            return None  # not a session's path: the route table answers it
        admitted = self.admit(request, session)
        if isinstance(admitted, Answer):
            return admitted
        reason = admitted.refused()
        return None if reason is None else token_refused(reason)

    def admit(self, request: Request, session: str, allowed: bool = True, stateful: bool = False) -> Answer | Admitted:
        """The refusal of C{request}, or its L{Admitted} with the token's check under way.

        C{allowed=False}: the method is not allowed; C{stateful}: nor is it under a stateless revision.
        CORS headers are already set.
        """
        admitted: Admitted | None = getattr(request, _ADMITTED, None)
        if admitted is not None:
            return admitted
        request.setHeader(b"access-control-expose-headers", b"mcp-session-id, www-authenticate")
        origin = request.requestHeaders.getRawHeaders(b"origin")
        if origin and not self.policy.allows(origin[0]):
            # The spec's DNS-rebinding rule: a browser page of another origin gets nothing.
            return rpc_error(403, standard.INVALID_REQUEST, "origin not allowed")
        version = header(request, b"mcp-protocol-version")
        if version is not None and version not in standard.SUPPORTED_VERSIONS:
            return rpc_error(400, standard.INVALID_REQUEST, "unsupported MCP-Protocol-Version")
        if not allowed or (stateful and version in standard.STATELESS_VERSIONS):
            allow = ((b"allow", ALLOW[route(request)]),)
            return rpc_error(405, standard.INVALID_REQUEST, "method not allowed", headers=allow)
        token = request_token(request)
        if not token:
            return UNAUTHORIZED
        tunnel = self.tunnel
        token_pass = tunnel.token_pass(session, token)
        admitted = Admitted(token, version, token_pass, tunnel.check_at_once(session, token, token_pass))
        setattr(request, _ADMITTED, admitted)
        return admitted


def session_part(prefix: bytes, path: bytes) -> str | None:
    """The session of a session's path (C{{prefix}/{session}/...}), as the route table reads it."""
    if not path.startswith(prefix + b"/"):
        return None
    return path[len(prefix) + 1 :].partition(b"/")[0].decode("utf-8", "replace")


def client_address(request: Request) -> str:
    """The client's address as the relay's site reads it (with --trust-forwarded-for, the forwarded
    one), what the per-address bounds count; C{""} when unknown (the connection is gone)."""
    site = getattr(request.channel, "site", None)
    return site.client_address(request) if isinstance(site, RelaySite) else ""


def request_token(request: Request) -> str:
    """The token a request presents: C{Authorization: Bearer}, else C{?token=}."""
    return bearer_token(request) or query_param(request, "token") or ""


def route(request: Request) -> str:
    """The endpoint route of a request: its path's last segment (mcp, sse, messages)."""
    return request.path.rsplit(b"/", 1)[-1].decode("ascii")


def header(request: Request, name: bytes) -> str | None:
    """A request header's first value as text (C{""} when it is not UTF-8), or C{None}."""
    values = request.requestHeaders.getRawHeaders(name)
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        return ""


