"""JSON-RPC frames as the tunnel relay carries them: what a valid posted frame is, and its encodings.

A L{Frame} keeps the bytes a client posted and makes each form the relay sends (an SSE event, a JSON
string literal for a poll answer) once, however many readers get it. No I/O.
"""

from __future__ import annotations

from typing import Any

import orjson

from relayd.mcp.core.jsontext import dumps, loads_json

PEER_JOINED = "notifications/peer_joined"
PEER_LEFT = "notifications/peer_left"
FRAMES_DROPPED = "notifications/frames_dropped"

# Only the relay emits presence; a posted frame carrying either method is refused (docs/mcp.md).
_RELAY_ONLY = frozenset((PEER_JOINED, PEER_LEFT))

_UNPARSED: Any = object()
_SSE_START = len(b"event: mcp\ndata: ")


class Frame:
    """One JSON-RPC frame: the posted bytes, the parsed message, and its encodings (each made once)."""

    __slots__ = ("raw", "_message", "_sse", "_json", "_key")

    def __init__(self, raw: bytes, message: Any = _UNPARSED, id_key: bytes | None = None) -> None:
        self.raw = raw
        self._message = message
        self._sse: bytes | None = None
        self._json: bytes | None = None
        self._key = id_key  # (given by a caller that has written the id already)

    @property
    def message(self) -> Any:
        """The parsed message."""
        if self._message is _UNPARSED:
            self._message = loads_json(self.raw)
        return self._message

    @classmethod
    def from_sse(cls, event: bytes) -> Frame:
        """The frame of an SSE event L{sse} made (another instance's, over the bus), unparsed."""
        frame = cls(event[_SSE_START:-2])
        frame._sse = event
        return frame

    @property
    def line(self) -> bytes:
        """The frame as one line: the posted bytes without CR/LF (the SSE event's data: why that is
        the same message, see L{sse})."""
        raw = self.raw
        # (find: docs/architecture.md, hot paths)
        if raw.find(b"\n") >= 0 or raw.find(b"\r") >= 0:
            return raw.translate(None, b"\r\n")
        return raw

    @property
    def sse(self) -> bytes:
        """The SSE event: one C{data:} line holding the whole frame (docs/decisions.md MCP-4).

        Valid JSON holds CR and LF only as whitespace between tokens (inside a string they must be
        escaped), so removing them leaves the same message and cannot join two tokens: no parse, no
        re-serialisation, nothing a client chose (huge numbers, lone-surrogate escapes) is changed,
        and no client byte can end the C{data:} line early. Frames without them pass byte for byte.
        """
        if self._sse is None:
            self._sse = b"event: mcp\ndata: " + self.line + b"\n\n"  # (from_sse reads it back)
        return self._sse

    @property
    def json_string(self) -> bytes:
        """The frame as a JSON string literal, the form a poll response carries."""
        if self._json is None:
            self._json = orjson.dumps(self.raw.decode("utf-8"))
        return self._json

    @property
    def is_request(self) -> bool:
        """A single request: a string C{method} and an id that is not null."""
        m = self.message
        return isinstance(m, dict) and isinstance(m.get("method"), str) and m.get("id") is not None

    @property
    def is_response(self) -> bool:
        """A single response: no string C{method} and an id that is not null."""
        m = self.message
        return isinstance(m, dict) and not isinstance(m.get("method"), str) and m.get("id") is not None

    @property
    def id_key(self) -> bytes:
        """The compact JSON of the id: C{1} and C{"1"} are different keys (written once per frame:
        the post correlates by it, the asker's client session finds its request by it)."""
        key = self._key
        if key is None:
            key = self._key = dumps(self.message["id"])
        return key

    def with_id(self, new_id: Any) -> Frame:
        """A copy with another id (re-serialised compactly)."""
        message = dict(self.message)
        message["id"] = new_id
        return Frame(dumps(message), message)


def notification(method: str, params: bytes) -> Frame:
    """A relay-made JSON-RPC notification; C{params} is already-encoded JSON (key order matters)."""
    raw = b'{"jsonrpc":"2.0","method":"' + method.encode() + b'","params":' + params + b"}"
    return Frame(raw)


def json_rpc_items(body: bytes) -> tuple[Any, list[dict[str, Any]]] | None:
    """The parsed body and its messages, if it is one JSON-RPC 2.0 message or a non-empty batch of
    them (each a request or notification with a string C{method}, or a response with an C{id} and
    exactly one of C{result}/C{error}); else C{None}."""
    if not body:
        return None
    try:
        message = loads_json(body)
    except ValueError:
        return None
    items = message if isinstance(message, list) else [message]
    if not items:
        return None
    for item in items:
        if not isinstance(item, dict) or item.get("jsonrpc") != "2.0":
            return None
        if not isinstance(item.get("method"), str) and ("id" not in item or ("result" in item) == ("error" in item)):
            return None
    return message, items


def parse_frame(body: bytes) -> Frame | None:
    """A valid frame (docs/mcp.md) or C{None}: JSON-RPC 2.0 that no client may forge (presence)."""
    parsed = json_rpc_items(body)
    return None if parsed is None else posted_frame(body, *parsed)


def posted_frame(body: bytes, message: Any, items: list[dict[str, Any]], id_key: bytes | None = None) -> Frame | None:
    """The frame of C{body}, already parsed by L{json_rpc_items} (C{message}, its C{items}; C{id_key}:
    its id's L{Frame.id_key}, when the caller has it), or C{None} when it carries what only the
    relay may send (presence)."""
    for item in items:  # (a loop, not any() over a generator: once per posted frame)
        method = item.get("method")
        if isinstance(method, str) and method in _RELAY_ONLY:
            return None
    return Frame(body, message, id_key)
