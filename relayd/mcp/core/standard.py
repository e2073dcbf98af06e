"""The rules of a standard MCP endpoint (Streamable HTTP and legacy HTTP+SSE), without I/O.

relayd carries every revision a page chooses to speak; what it decides itself is only transport:
which revision a request is in, whether its headers agree with its body, how a progress token is
made unique on the way to the page and restored on the way back, and the JSON-RPC error bodies of
its own refusals.
"""

from __future__ import annotations

from typing import Any

import orjson

from relayd.mcp.core.jsontext import dumps, loads_json

LEGACY = "2024-11-05"
HANDSHAKE_VERSIONS = frozenset(("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"))
STATELESS_VERSIONS = frozenset(("2026-07-28",))
SUPPORTED_VERSIONS = HANDSHAKE_VERSIONS | STATELESS_VERSIONS

PROTOCOL_VERSION_META = "io.modelcontextprotocol/protocolVersion"
SUBSCRIPTION_ID_META = "io.modelcontextprotocol/subscriptionId"
NAME_BEARING = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}

# JSON-RPC codes relayd answers with itself.
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
HEADER_MISMATCH = -32020
# Server-defined range (-32000..-32099 minus the spec's): the page did not answer / went away.
REQUEST_TIMEOUT = -32001
SESSION_ENDED = -32002
TOO_MANY_PENDING = -32003
# The store was sent the request and did not answer in time: it may have reached the page.
OUTCOME_UNKNOWN = -32004
# No page reads the session (its tab was closed, or it has not come back after a restart).
NO_PAGE = -32005
NO_PAGE_MESSAGE = (
    "no page is hosting this session: its tab was closed or lost its connection; open the page "
    "(the demo page keeps its session URL and token) and call again"
)

# A rewritten progress token: this prefix, the client's label tag, ":" and the original token's JSON.
TOKEN_PREFIX = "relayd:"


def error_body(code: int, message: str, request_id: Any = None) -> bytes:
    """A JSON-RPC error response (C{id} null when relayd could not read one)."""
    return dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})


def error_for(raw_id: bytes, code: int, message: str) -> bytes:
    """A JSON-RPC error for the request whose id is the compact JSON C{raw_id}."""
    return b'{"jsonrpc":"2.0","id":%b,"error":{"code":%d,"message":%b}}' % (raw_id, code, orjson.dumps(message))


def is_request(message: dict[str, Any]) -> bool:
    """A request: a string method and a non-null id."""
    return isinstance(message.get("method"), str) and message.get("id") is not None


def header_mismatch(message: dict[str, Any], version: str | None, method: str | None, name: str | None) -> str | None:
    """2026-07-28: why the routing headers disagree with the body (C{None} when they agree).

    The page never sees headers, so relayd is the one that can check them.
    """
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    body_version = meta.get(PROTOCOL_VERSION_META) if isinstance(meta, dict) else None
    if body_version is not None and body_version != version:
        return "MCP-Protocol-Version header does not match the request's protocol version"
    if method != message.get("method"):
        return "Mcp-Method header does not match the request body's method"
    key = NAME_BEARING.get(message["method"])
    if key is not None and name is not None and isinstance(params, dict) and params.get(key) != name:
        return "Mcp-Name header does not match the request body"
    return None


def progress_token(message: dict[str, Any]) -> Any:
    """The request's C{_meta.progressToken}, or C{None}."""
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return meta.get("progressToken") if isinstance(meta, dict) else None


def with_progress_token(message: dict[str, Any], tag: str) -> dict[str, Any]:
    """A copy whose progress token carries the client's label tag (L{relayd.mcp.core.tokens.label_tag}:
    unique per client session, restorable, and not the label that routes its replies)."""
    token = progress_token(message)
    if token is None:
        return message
    meta = dict(message["params"]["_meta"])
    meta["progressToken"] = TOKEN_PREFIX + tag + ":" + dumps(token).decode("utf-8")
    params = dict(message["params"])
    params["_meta"] = meta
    out = dict(message)
    out["params"] = params
    return out


def split_token(token: Any) -> tuple[str, Any] | None:
    """(label tag, original token) of a token made by L{with_progress_token}, else C{None}."""
    if not isinstance(token, str) or not token.startswith(TOKEN_PREFIX):
        return None
    tag, sep, original = token[len(TOKEN_PREFIX) :].partition(":")
    if not sep:
        return None
    try:
        return tag, loads_json(original.encode("utf-8"))
    except ValueError:
        return None


def restore_progress(message: dict[str, Any], original: Any) -> dict[str, Any]:
    """A progress notification carrying the client's own token again."""
    params = dict(message["params"])
    params["progressToken"] = original
    out = dict(message)
    out["params"] = params
    return out


def subscription_id(message: dict[str, Any]) -> Any:
    """2026-07-28: the listen request id a page stamped into a notification's C{_meta}, or C{None}."""
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return meta.get(SUBSCRIPTION_ID_META) if isinstance(meta, dict) else None


def with_subscription_id(message: dict[str, Any], client_id: Any) -> dict[str, Any]:
    """A copy stamped with the client's own listen id (the page saw the forwarded one)."""
    meta = dict(message["params"]["_meta"])
    meta[SUBSCRIPTION_ID_META] = client_id
    params = dict(message["params"])
    params["_meta"] = meta
    out = dict(message)
    out["params"] = params
    return out
