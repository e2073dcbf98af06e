"""The Buzz agent broker contract: strict parsing, validation and serialisation, both directions.

Pure: no I/O, no clock, no randomness. The host parses requests with L{parse_request} and every
response it writes goes through L{serialize_response}, whose output the strict reader
L{parse_response} accepts. Client-side helpers (L{build_request}, L{freeze}, L{read_http_response})
exist so tests can hold the host to the reader a conforming agent uses.

Rules (docs/broker.md, "HTTP" and "The nine actions"):
 - every object is strict: unknown member, missing required member, repeated key, or C{null} at any
   depth is malformed; an optional array is omitted when empty (C{[]} is malformed);
 - strings are trimmed with the Unicode White_Space set (not Python's C{str.strip}) except message
   content, cursors and request ids; name limits count code points, content/cursor/requestId bytes;
 - identities are normalised at every door: UUIDs to lowercase hyphenated (four spellings), hex to
   lowercase, public keys must be x-only secp256k1 points;
 - integers are integers (no bools, no floats), booleans are booleans;
 - every JSON text gets an answer: numbers of any length (C{strict_json._parse_int}), nesting up to
   L{MAX_DEPTH}, any string; error messages quote at most L{MAX_ECHO} characters of a member
   name and are at most L{MAX_ERROR} long.
"""

from __future__ import annotations

from relayd.buzz.core.contract.actions import ARGS, OUTCOMES
from relayd.buzz.core.contract.envelope import (
    REQUEST_MEMBERS,
    Request,
    Response,
    build_request,
    code_allows,
    correlate,
    extract_request_id,
    failed,
    freeze,
    indeterminate,
    mark_replayed,
    parse_request,
    parse_request_body,
    parse_response,
    read_http_response,
    serialize_response,
    succeeded,
    validate_request,
)
from relayd.buzz.core.contract.errors import ContractError, MalformedResponse, RequestIdError, TransportError
from relayd.buzz.core.contract.strict_json import dumps, loads_strict
from relayd.buzz.core.contract.tree import check_tree, quote
from relayd.buzz.core.contract.validators import (
    EVENT_MEMBERS,
    WHITE_SPACE,
    CheckedEvents,
    Shape,
    Validator,
    channel_id,
    content,
    cursor,
    hex64,
    is_xonly_point,
    pubkey,
    request_id,
    respond_to,
    signed_event,
    slug,
    trim,
)
from relayd.buzz.core.contract.vocabulary import (
    ACTION_VERSION,
    ACTIONS,
    BEST_EFFORT_ACTIONS,
    CODES,
    DEFAULT_LIMIT,
    MAX_ABOUT,
    MAX_CHANNEL_TEXT,
    MAX_CONTENT_BYTES,
    MAX_CURSOR,
    MAX_DEPTH,
    MAX_ECHO,
    MAX_ERROR,
    MAX_LIMIT,
    MAX_MENTIONS,
    MAX_NAME,
    MAX_PICTURE,
    MAX_PROMPT,
    MAX_REACTION,
    MAX_REQUEST_ID,
    MAX_SCALAR,
    MAX_SLUG,
    PROTOCOL_VERSION,
    PUBLISHING_ACTIONS,
    RESPOND_TO,
    STATUSES,
    STORAGE_KIND,
)

__all__ = [
    "ACTIONS",
    "ACTION_VERSION",
    "ARGS",
    "BEST_EFFORT_ACTIONS",
    "CODES",
    "DEFAULT_LIMIT",
    "EVENT_MEMBERS",
    "MAX_ABOUT",
    "MAX_CHANNEL_TEXT",
    "MAX_CONTENT_BYTES",
    "MAX_CURSOR",
    "MAX_DEPTH",
    "MAX_ECHO",
    "MAX_ERROR",
    "MAX_LIMIT",
    "MAX_MENTIONS",
    "MAX_NAME",
    "MAX_PICTURE",
    "MAX_PROMPT",
    "MAX_REACTION",
    "MAX_REQUEST_ID",
    "MAX_SCALAR",
    "MAX_SLUG",
    "OUTCOMES",
    "PROTOCOL_VERSION",
    "PUBLISHING_ACTIONS",
    "REQUEST_MEMBERS",
    "RESPOND_TO",
    "STATUSES",
    "STORAGE_KIND",
    "WHITE_SPACE",
    "CheckedEvents",
    "ContractError",
    "MalformedResponse",
    "Request",
    "RequestIdError",
    "Response",
    "Shape",
    "TransportError",
    "Validator",
    "build_request",
    "channel_id",
    "check_tree",
    "code_allows",
    "content",
    "correlate",
    "cursor",
    "dumps",
    "extract_request_id",
    "failed",
    "freeze",
    "hex64",
    "indeterminate",
    "is_xonly_point",
    "loads_strict",
    "mark_replayed",
    "parse_request",
    "parse_request_body",
    "parse_response",
    "pubkey",
    "quote",
    "read_http_response",
    "request_id",
    "respond_to",
    "serialize_response",
    "signed_event",
    "slug",
    "succeeded",
    "trim",
    "validate_request",
]
