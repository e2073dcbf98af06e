"""The standard endpoint's answers: JSON-RPC errors as whole HTTP answers, the mapping of what fails
once a request is under way, and the one intake of a POST's body."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from twisted.python.failure import Failure
from twisted.web.server import Request

from relayd.base.errors import OutcomeUnknown, StoreUnavailable
from relayd.mcp.core import standard
from relayd.mcp.core.frames import Frame, json_rpc_items, posted_frame
from relayd.mcp.core.jsontext import dumps, loads_json
from relayd.mcp.core.tunnel import Refused
from relayd.web.answers import Answer, Refusals, json_answer
from relayd.web.request import read_body


def rpc_error(
    status: int, code: int, message: str, request_id: Any = None, headers: tuple[tuple[bytes, bytes], ...] = ()
) -> Answer:
    """A JSON-RPC error response as the whole HTTP answer."""
    return json_answer(status, standard.error_body(code, message, request_id), headers)


SESSION_GONE: Final = rpc_error(410, standard.SESSION_ENDED, "the tunnel session is gone")
UNAUTHORIZED: Final = rpc_error(
    401, standard.INVALID_REQUEST, "missing or wrong token", headers=((b"www-authenticate", b'Bearer realm="relayd"'),)
)
TOO_MANY_CLIENTS: Final = rpc_error(
    503, standard.TOO_MANY_PENDING, "too many client sessions", headers=((b"retry-after", b"5"),)
)
UNKNOWN_LEGACY_CLIENT: Final = rpc_error(404, standard.INVALID_REQUEST, "unknown or ended sessionId")
UNKNOWN_CLIENT: Final = rpc_error(404, standard.INVALID_REQUEST, "unknown or ended Mcp-Session-Id")
MISSING_CLIENT: Final = rpc_error(400, standard.INVALID_REQUEST, "missing Mcp-Session-Id")
NOT_JSON_RPC: Final = rpc_error(400, standard.PARSE_ERROR, "not a JSON-RPC 2.0 message")
ACCEPTED: Final = json_answer(202, b"")
ENDED: Final = json_answer(200, b"")
STORE_UNAVAILABLE: Final = rpc_error(503, standard.SESSION_ENDED, "store unavailable")
OUTCOME_UNKNOWN: Final = rpc_error(
    503,
    standard.OUTCOME_UNKNOWN,
    "outcome unknown: the store did not answer in time; the request may have been delivered to the page"
    " (a retry may run it twice)",
)


def _refused(error: Refused) -> Answer:
    reason = error.reason
    if reason == "session_gone":
        return SESSION_GONE
    if reason == "buffer_full":
        return rpc_error(503, standard.TOO_MANY_PENDING, "relay buffer full", headers=((b"retry-after", b"5"),))
    return rpc_error(400, standard.INVALID_REQUEST, reason)


REFUSALS: Final = Refusals(
    [
        (Refused, _refused),
        (OutcomeUnknown, lambda _: OUTCOME_UNKNOWN),
        (StoreUnavailable, lambda _: STORE_UNAVAILABLE),
    ],
    internal_error=rpc_error(500, -32603, "internal error"),
)
"""The endpoint's answers (JSON-RPC errors) to what fails once a request is under way."""


def not_forwarded(failure: Failure) -> Answer:
    """The answer to a store failure before anything was forwarded (the token check, a client
    session's lookup or subscription): nothing reached the page, whatever the store did."""
    if failure.check(StoreUnavailable):
        return STORE_UNAVAILABLE
    return REFUSALS.answer(failure)


def token_refused(reason: str) -> Answer:
    """The answer to a token the tunnel refused for its session."""
    return SESSION_GONE if reason == "session_gone" else UNAUTHORIZED


@dataclass(frozen=True, slots=True)
class Intake:
    """A POST's body, valid JSON-RPC 2.0: the posted bytes, their one parse (C{message}: an object or
    a batch), its messages and the requests among them."""

    body: bytes
    message: Any
    messages: list[dict[str, Any]]
    requests: list[dict[str, Any]]

    def frame(self) -> Frame | None:
        """The body as the tunnel's frame, as posted and parsed once (C{None}: presence, the relay's own)."""
        return posted_frame(self.body, self.message, self.messages)

    def request_frame(self, request: dict[str, Any], id_key: bytes | None = None) -> Frame | None:
        """One of its requests as a frame: the posted bytes when it is the whole body, else its
        compact JSON (a batch's element, or one whose progress token was rewritten); C{id_key}: its
        id's compact JSON, when the caller has written it."""
        raw = self.body if request is self.message else dumps(request)
        return posted_frame(raw, request, [request], id_key)


def read_messages(request: Request, one_request: bool = True) -> Intake | Answer:
    """The one intake of a POST to the endpoint: its body as JSON-RPC messages, or the 400 answer.

    C{one_request}: a batch may hold notifications and responses but not requests (each request is
    one exchange with the page, answered on its own).
    """
    body = read_body(request)
    parsed = json_rpc_items(body)
    if parsed is None:
        try:
            loads_json(body)  # (read again only to name the fault: never on the way of a valid message)
        except ValueError as e:
            return rpc_error(400, standard.PARSE_ERROR, f"not JSON: {e}")
        return NOT_JSON_RPC
    message, messages = parsed
    requests = [m for m in messages if standard.is_request(m)]
    if one_request and requests and len(messages) > 1:
        return rpc_error(400, standard.INVALID_REQUEST, "batches of requests are not supported")
    return Intake(body, message, messages, requests)
