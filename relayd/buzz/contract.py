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
 - every JSON text gets an answer: numbers of any length (L{_parse_int}), nesting up to
   L{MAX_DEPTH}, any string; error messages quote at most L{MAX_ECHO} characters of a member
   name and are at most L{MAX_ERROR} long.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import orjson
from coincurve import PublicKeyXOnly

PROTOCOL_VERSION = 1
ACTION_VERSION = 1

ACTIONS: tuple[str, ...] = (
    "channel.read",
    "message.post",
    "message.reply",
    "reaction.add",
    "profile.set",
    "storage.address",
    "agents.create",
    "agents.update",
    "agents.delete",
)
PUBLISHING_ACTIONS = frozenset({"message.post", "message.reply", "reaction.add", "profile.set"})
BEST_EFFORT_ACTIONS = frozenset({"reaction.add"})

CODES: tuple[str, ...] = (
    "invalid_request",
    "unsupported_protocol_version",
    "unknown_action",
    "unsupported_action_version",
    "unsupported",
    "unauthenticated",
    "unauthorized",
    "request_id_conflict",
    "action_failed",
    "outcome_unknown",
    "internal",
)
# The status/code table of docs/broker.md, "Verdict codes".
_CODE_STATUSES: dict[str, frozenset[str]] = {c: frozenset({"failed"}) for c in CODES}
_CODE_STATUSES["outcome_unknown"] = frozenset({"indeterminate"})
_CODE_STATUSES["internal"] = frozenset({"failed", "indeterminate"})

STATUSES = ("succeeded", "failed", "indeterminate")

DEFAULT_LIMIT = 100
MAX_LIMIT = 500
MAX_CONTENT_BYTES = 65_536
MAX_MENTIONS = 50
MAX_NAME = 120
MAX_ABOUT = 2_000
MAX_PICTURE = 300
MAX_PROMPT = 20_000
MAX_SCALAR = 300
MAX_REACTION = 66
MAX_SLUG = 255
MAX_CHANNEL_TEXT = 128
MAX_REQUEST_ID = 128
MAX_CURSOR = 256
# Containers nested in one payload: the contract's deepest is a read outcome's tag (6 levels).
MAX_DEPTH = 32
# Characters of a member name (chosen by whoever sent the payload) an error message quotes.
MAX_ECHO = 64
# Longest error message: whatever a message quotes, a verdict never grows with the request.
MAX_ERROR = 512
# Integers with more digits than this are out of every range the contract has (2**64 has 20):
# they are read as a stand-in of the same sign instead of converting thousands of digits.
_MAX_INT_DIGITS = 40
_BIG = 10**_MAX_INT_DIGITS
RESPOND_TO = ("owner-only", "anyone")
STORAGE_KIND = 30174

# Unicode White_Space (Rust's char::is_whitespace); Python's str.strip() also strips U+001C-U+001F.
WHITE_SPACE = (
    "\u0009\u000a\u000b\u000c\u000d\u0020\u0085\u00a0\u1680"
    "\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)

_HEX = frozenset("0123456789abcdefABCDEF")
_LOWER_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_HEX128 = re.compile(r"[0-9a-fA-F]{128}\Z")
_LOWER_HEX128 = re.compile(r"[0-9a-f]{128}\Z")
_HEX36 = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\Z")
_HEX32 = re.compile(r"[0-9a-fA-F]{32}\Z")
_SLUG_SEGMENT = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}\Z")
_PRINTABLE = re.compile(r"[\x21-\x7e]+\Z")


class ContractError(ValueError):
    """A payload that breaks the contract; C{code} is the failed-verdict code it earns."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        if len(message) > MAX_ERROR:
            message = message[: MAX_ERROR - 1] + "\u2026"
        super().__init__(message)
        self.code = code
        self.message = message


class RequestIdError(ContractError):
    """The request cannot be correlated: not JSON, or its requestId is unusable (HTTP 400)."""


class MalformedResponse(ValueError):
    """A response that is not a host verdict for the request (the caller treats it as no answer)."""


# --- strict JSON -----------------------------------------------------------------------------------


class _Obj(dict[str, Any]):
    """A decoded JSON object that remembers which keys it saw more than once."""

    __slots__ = ("dups",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.dups: frozenset[str] = frozenset()
        if len(self) != len(pairs):
            seen: set[str] = set()
            dups: set[str] = set()
            for k, _ in pairs:
                (dups if k in seen else seen).add(k)
            self.dups = frozenset(dups)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _parse_int(digits: str) -> int:
    """An integer literal; one too long for any range is a same-signed stand-in beyond them all.

    Python refuses to convert more than 4,300 digits (the conversion is quadratic), which would
    make a valid JSON number an undecodable body instead of a member out of range.
    """
    if len(digits) <= _MAX_INT_DIGITS:
        return int(digits)
    return -_BIG if digits.startswith("-") else _BIG


_DECODER = json.JSONDecoder(object_pairs_hook=_Obj, parse_constant=_reject_constant, parse_int=_parse_int)


def quote(name: str) -> str:
    """A member name as an error message names it: quoted, escaped, at most L{MAX_ECHO} characters."""
    if len(name) <= MAX_ECHO:
        return repr(name)
    return repr(name[:MAX_ECHO]) + f"\u2026 ({len(name)} characters)"


def loads_strict(data: bytes | str) -> Any:
    """Decode JSON, keeping repeated-key information; raises C{ValueError} for non-JSON or bad UTF-8.

    Repeated keys, nulls, lone surrogates and deep nesting are found by L{check_tree}, so a caller
    can still read the requestId of an otherwise malformed body. Nesting beyond what the decoder
    itself handles (several hundred levels) raises C{RecursionError}.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        text = bytes(data).decode("utf-8")  # strict: invalid UTF-8 raises UnicodeDecodeError
    else:
        text = data
    value, end = _DECODER.raw_decode(text, _skip_ws(text, 0))
    if _skip_ws(text, end) != len(text):
        raise ValueError("trailing data after JSON value")
    return value


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\n\r":
        i += 1
    return i


def check_tree(value: Any, path: str = "$") -> None:
    """Reject a null, a repeated key, a string with a lone surrogate, a non-finite number, or
    containers nested more than L{MAX_DEPTH} deep, anywhere in C{value}."""
    # The common case (a sound tree) is walked without building a path per member; only a tree
    # with a fault is walked again to name where it is. Both stop at MAX_DEPTH, so neither can
    # exhaust the stack on a deeply nested payload.
    if not _tree_sound(value, 1):
        _check_tree(value, path, 1)


def _text_sound(s: str) -> bool:
    if s.isascii():  # O(1) in CPython: an ASCII string holds no surrogate
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _tree_sound(value: Any, depth: int) -> bool:
    t = type(value)
    if t is str:
        return _text_sound(value)
    if t is int or t is bool:
        return True
    if value is None:
        return False
    if isinstance(value, dict):
        if depth > MAX_DEPTH or getattr(value, "dups", None):
            return False
        for k, v in value.items():
            if not _text_sound(k) or not _tree_sound(v, depth + 1):
                return False
        return True
    if t is list:
        if depth > MAX_DEPTH:
            return False
        for v in value:
            if not _tree_sound(v, depth + 1):
                return False
        return True
    if t is float:
        return value == value and value not in (float("inf"), float("-inf"))
    return True


def _check_tree(value: Any, path: str, depth: int) -> None:
    if value is None:
        raise ContractError(f"{path} is null")
    t = type(value)
    if t is str:
        _check_scalar_text(value, path)
    elif isinstance(value, dict):
        if depth > MAX_DEPTH:
            raise ContractError(f"{path} nests deeper than {MAX_DEPTH} levels")
        dups = getattr(value, "dups", None)
        if dups:
            raise ContractError(f"{path} repeats key {quote(sorted(dups)[0])}")
        for k, v in value.items():
            _check_scalar_text(k, path)
            _check_tree(v, _member_path(path, k), depth + 1)
    elif t is list:
        if depth > MAX_DEPTH:
            raise ContractError(f"{path} nests deeper than {MAX_DEPTH} levels")
        for i, v in enumerate(value):
            _check_tree(v, f"{path}[{i}]", depth + 1)
    elif t is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ContractError(f"{path} is not a finite number")


def _member_path(path: str, key: str) -> str:
    """C{path.key} for a plain short key, C{path['odd key']} (bounded by L{quote}) for any other."""
    if len(key) <= MAX_ECHO and key.isidentifier() and key.isascii():
        return f"{path}.{key}"
    return f"{path}[{quote(key)}]"


def _check_scalar_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ContractError(f"{path} holds a lone surrogate") from None


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON, as the host writes it (no whitespace, non-ASCII verbatim).

    orjson writes the same bytes as C{json.dumps(value, separators=(",", ":"), ensure_ascii=False)}
    for the strings, integers, lists and objects the contract uses, several times faster; what it
    refuses (integers beyond 64 bits, lone surrogates) takes the stdlib path, which raises where
    it must.
    """
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# --- scalar validators ---------------------------------------------------------------------------


def trim(s: str) -> str:
    """Trim Unicode White_Space (exactly that set) from both ends."""
    return s.strip(WHITE_SPACE)


def _str(v: Any, path: str) -> str:
    if type(v) is not str:
        raise ContractError(f"{path} must be a string")
    return v


def _int(v: Any, path: str, lo: int, hi: int) -> int:
    if type(v) is not int:  # rejects bool (a subclass of int) and float
        raise ContractError(f"{path} must be an integer")
    if not lo <= v <= hi:
        raise ContractError(f"{path} must be between {lo} and {hi}")
    return v


def _bool(v: Any, path: str) -> bool:
    if type(v) is not bool:
        raise ContractError(f"{path} must be a boolean")
    return v


def channel_id(v: Any, path: str = "channelId") -> str:
    """Normalise a channel UUID from any of its four spellings to lowercase hyphenated."""
    s = trim(_str(v, path))
    if len(s) > MAX_CHANNEL_TEXT:
        raise ContractError(f"{path} is too long")
    if s.startswith("urn:uuid:"):
        s = s[9:]
        ok = _HEX36.match(s) is not None
    elif s.startswith("{") and s.endswith("}"):
        s = s[1:-1]
        ok = _HEX36.match(s) is not None
    elif len(s) == 32:
        ok = _HEX32.match(s) is not None
        if ok:
            s = f"{s[:8]}-{s[8:12]}-{s[12:16]}-{s[16:20]}-{s[20:]}"
    else:
        ok = _HEX36.match(s) is not None
    if not ok:
        raise ContractError(f"{path} is not a UUID")
    return s.lower()


def hex64(v: Any, path: str) -> str:
    """Trim and lowercase a 64-character hex identifier (event id, d-tag)."""
    s = trim(_str(v, path))
    if len(s) != 64 or not _HEX.issuperset(s):
        raise ContractError(f"{path} must be 64 hex characters")
    return s.lower()


_valid_points: dict[str, bool] = {}


def is_xonly_point(hex_lower: str) -> bool:
    """Whether 64 lowercase hex characters are the x coordinate of a secp256k1 point (cached)."""
    known = _valid_points.get(hex_lower)
    if known is None:
        try:
            PublicKeyXOnly(bytes.fromhex(hex_lower))
            known = True
        except Exception:
            known = False
        if len(_valid_points) > 65_536:
            _valid_points.clear()
        _valid_points[hex_lower] = known
    return known


def pubkey(v: Any, path: str = "pubkey") -> str:
    """A public key: 64 hex, lowercased, and a valid x-only secp256k1 point."""
    s = hex64(v, path)
    if not is_xonly_point(s):
        raise ContractError(f"{path} is not a valid public key")
    return s


def request_id(v: Any, path: str = "requestId") -> str:
    """1-128 bytes of printable ASCII without spaces; never trimmed."""
    s = _str(v, path)
    if not (1 <= len(s) <= MAX_REQUEST_ID) or _PRINTABLE.match(s) is None:
        raise ContractError(f"{path} must be 1-{MAX_REQUEST_ID} printable ASCII characters without spaces")
    return s


def cursor(v: Any, path: str = "cursor") -> str:
    """1-256 bytes of printable ASCII without spaces; opaque and never altered."""
    s = _str(v, path)
    if not (1 <= len(s) <= MAX_CURSOR) or _PRINTABLE.match(s) is None:
        raise ContractError(f"{path} must be 1-{MAX_CURSOR} printable ASCII characters without spaces")
    return s


def _text(limit: int) -> Callable[[Any, str], str]:
    def check(v: Any, path: str) -> str:
        s = trim(_str(v, path))
        if not s:
            raise ContractError(f"{path} must not be empty")
        if len(s) > limit:  # len() counts code points, the contract's "characters"
            raise ContractError(f"{path} must be at most {limit} characters")
        return s

    return check


def content(v: Any, path: str = "content") -> str:
    """Message content: published verbatim; not blank; at most 64 KiB of UTF-8."""
    s = _str(v, path)
    if not trim(s):
        raise ContractError(f"{path} must not be empty")
    if len(s) > MAX_CONTENT_BYTES or len(s.encode("utf-8")) > MAX_CONTENT_BYTES:
        raise ContractError(f"{path} is too large (limit {MAX_CONTENT_BYTES} bytes)")
    return s


def slug(v: Any, path: str = "slug") -> str:
    """A NIP-AE slug: C{core} or C{mem/} plus segments C{[a-z0-9][a-z0-9_-]{0,63}}, <= 255."""
    s = trim(_str(v, path))
    if len(s) > MAX_SLUG:
        raise ContractError(f"{path} must be at most {MAX_SLUG} characters")
    if s == "core":
        return s
    if s.startswith("mem/"):
        segs = s[4:].split("/")
        if segs and all(_SLUG_SEGMENT.match(seg) for seg in segs):
            return s
    raise ContractError(f"{path} must be 'core' or a mem/... path")


def respond_to(v: Any, path: str = "respondTo") -> str:
    s = trim(_str(v, path))
    if s not in RESPOND_TO:
        raise ContractError(f"{path} must be one of {', '.join(RESPOND_TO)}")
    return s


def _limit(v: Any, path: str) -> int:
    return _int(v, path, 1, MAX_LIMIT)


def _mentions(v: Any, path: str) -> list[str]:
    if type(v) is not list:
        raise ContractError(f"{path} must be an array")
    if not v:
        raise ContractError(f"{path} must be omitted when empty")
    if len(v) > MAX_MENTIONS:
        raise ContractError(f"{path} has too many entries (limit {MAX_MENTIONS})")
    return [pubkey(x, f"{path}[{i}]") for i, x in enumerate(v)]


def _target(v: Any, path: str) -> dict[str, str]:
    obj = _object(v, path)
    if set(obj) == {"pubkey"}:
        return {"pubkey": pubkey(obj["pubkey"], f"{path}.pubkey")}
    if set(obj) == {"name"}:
        return {"name": _text(MAX_NAME)(obj["name"], f"{path}.name")}
    raise ContractError(f"{path} must have exactly one of pubkey or name")


def _object(v: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(v, dict):
        raise ContractError(f"{path} must be an object")
    if getattr(v, "dups", None):
        raise ContractError(f"{path} repeats a key")
    return v


# --- shapes: the eighteen argument and outcome member sets ---------------------------------------

Validator = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Shape:
    """An exact member set: every member required or optional, with its validator."""

    required: Mapping[str, Validator]
    optional: Mapping[str, Validator] = field(default_factory=dict)

    @property
    def members(self) -> frozenset[str]:
        return frozenset(self.required) | frozenset(self.optional)

    def parse(self, v: Any, path: str) -> dict[str, Any]:
        obj = _object(v, path)
        for k in obj:
            if k not in self.required and k not in self.optional:
                raise ContractError(f"{path} has unknown member {quote(k)}")
        out: dict[str, Any] = {}
        for k, check in self.required.items():
            if k not in obj:
                raise ContractError(f"{path} is missing {k!r}")
            out[k] = check(obj[k], f"{path}.{k}")
        for k, check in self.optional.items():
            if k in obj:
                out[k] = check(obj[k], f"{path}.{k}")
        return out


_name = _text(MAX_NAME)
_scalar = _text(MAX_SCALAR)

ARGS: dict[str, Shape] = {
    "channel.read": Shape(
        {"channelId": channel_id},
        {
            "rootEventId": hex64,
            "mentionsOnly": _bool,
            "cursor": cursor,
            "limit": _limit,
        },
    ),
    "message.post": Shape({"channelId": channel_id, "content": content}, {"mentions": _mentions}),
    "message.reply": Shape(
        {"channelId": channel_id, "replyToEventId": hex64, "content": content},
        {"mentions": _mentions},
    ),
    "reaction.add": Shape(
        {"channelId": channel_id, "targetEventId": hex64, "reaction": _text(MAX_REACTION)}
    ),
    "profile.set": Shape(
        {}, {"displayName": _name, "about": _text(MAX_ABOUT), "picture": _text(MAX_PICTURE)}
    ),
    "storage.address": Shape({"slug": slug}),
    "agents.create": Shape(
        {"channelId": channel_id, "displayName": _name, "systemPrompt": _text(MAX_PROMPT)},
        {"runtime": _scalar, "provider": _scalar, "model": _scalar, "respondTo": respond_to},
    ),
    "agents.update": Shape(
        {"target": _target},
        {
            "displayName": _name,
            "systemPrompt": _text(MAX_PROMPT),
            "runtime": _scalar,
            "provider": _scalar,
            "model": _scalar,
            "respondTo": respond_to,
        },
    ),
    "agents.delete": Shape({"target": _target}),
}

EVENT_MEMBERS = frozenset({"id", "pubkey", "created_at", "kind", "tags", "content", "sig"})


def _plain_tags(tags: Any) -> bool:
    if type(tags) is not list:
        return False
    for t in tags:
        if type(t) is not list:
            return False
        for x in t:
            if type(x) is not str:
                return False
    return True


def signed_event(v: Any, path: str = "event") -> dict[str, Any]:
    """A Nostr event with exactly the seven NIP-01 members (shape only; signatures are the caller's).

    An event already in canonical form (as relays send them) is returned as it is; anything else
    is checked member by member and a normalised copy returned.
    """
    if type(v) is dict and v.keys() == EVENT_MEMBERS:
        eid, pk, created_at, kind, sig = v["id"], v["pubkey"], v["created_at"], v["kind"], v["sig"]
        if (
            type(eid) is str
            and _LOWER_HEX64.match(eid) is not None
            and type(pk) is str
            and _LOWER_HEX64.match(pk) is not None
            and type(created_at) is int
            and 0 <= created_at < 2**63
            and type(kind) is int
            and 0 <= kind <= 65_535
            and type(v["content"]) is str
            and type(sig) is str
            and _LOWER_HEX128.match(sig) is not None
            and _plain_tags(v["tags"])
            and is_xonly_point(pk)
        ):
            return v
    obj = _object(v, path)
    if obj.keys() != EVENT_MEMBERS:
        extra = sorted(set(obj) - EVENT_MEMBERS)
        raise ContractError(f"{path} has unknown member {quote(extra[0])}" if extra else f"{path} lacks a member")
    tags = obj["tags"]
    if type(tags) is not list:
        raise ContractError(f"{path}.tags must be an array of string arrays")
    for t in tags:
        if type(t) is not list:
            raise ContractError(f"{path}.tags must be an array of string arrays")
        for x in t:
            if type(x) is not str:
                raise ContractError(f"{path}.tags must be an array of string arrays")
    sig = _str(obj["sig"], f"{path}.sig")
    if _HEX128.match(sig) is None:
        raise ContractError(f"{path}.sig must be 128 hex characters")
    # Relays send ids and keys already canonical: take them as they are when they are.
    eid = obj["id"]
    if type(eid) is not str or _LOWER_HEX64.match(eid) is None:
        eid = hex64(eid, f"{path}.id")
    pk = obj["pubkey"]
    if type(pk) is not str or _LOWER_HEX64.match(pk) is None or not is_xonly_point(pk):
        pk = pubkey(pk, f"{path}.pubkey")
    return {
        "id": eid,
        "pubkey": pk,
        "created_at": _int(obj["created_at"], f"{path}.created_at", 0, 2**63 - 1),
        "kind": _int(obj["kind"], f"{path}.kind", 0, 65_535),
        "tags": tags,
        "content": _str(obj["content"], f"{path}.content"),
        "sig": sig.lower(),
    }


class CheckedEvents(list[Any]):
    """Events that each came out of L{signed_event}: a host-built read outcome is not checked twice."""


def _messages(v: Any, path: str) -> list[dict[str, Any]]:
    if type(v) is CheckedEvents:
        if len(v) > MAX_LIMIT:
            raise ContractError(f"{path} holds more than {MAX_LIMIT} events")
        return v
    if type(v) is not list:
        raise ContractError(f"{path} must be an array")
    if len(v) > MAX_LIMIT:
        raise ContractError(f"{path} holds more than {MAX_LIMIT} events")
    return [signed_event(e, f"{path}[{i}]") for i, e in enumerate(v)]


def _updated_fields(v: Any, path: str) -> list[str]:
    if type(v) is not list or any(type(x) is not str for x in v):
        raise ContractError(f"{path} must be an array of strings")
    return list(v)


_published = Shape(
    {
        "eventId": hex64,
        "kind": lambda v, p: _int(v, p, 0, 2**32 - 1),
        "createdAt": lambda v, p: _int(v, p, 0, 2**64 - 1),
    }
)

OUTCOMES: dict[str, Shape] = {
    "channel.read": Shape({"messages": _messages}, {"nextCursor": cursor}),
    "message.post": _published,
    "message.reply": _published,
    "reaction.add": _published,
    "profile.set": _published,
    "storage.address": Shape(
        {"authorPubkey": pubkey, "kind": lambda v, p: _int(v, p, 0, 2**32 - 1), "dTag": hex64}
    ),
    "agents.create": Shape({"agentPubkey": pubkey, "displayName": _name, "channelId": channel_id}),
    "agents.update": Shape(
        {"agentPubkey": pubkey, "displayName": _name, "updatedFields": _updated_fields}
    ),
    "agents.delete": Shape({"agentPubkey": pubkey, "displayName": _name}),
}

REQUEST_MEMBERS = frozenset({"type", "protocolVersion", "requestId", "actionVersion", "action", "args"})
_ERROR_SHAPE = Shape({"code": lambda v, p: _code(v, p), "message": lambda v, p: _str(v, p)})


def _code(v: Any, path: str) -> str:
    s = _str(v, path)
    if s not in _CODE_STATUSES:
        raise ContractError(f"{path} is not a known code")
    return s


# --- requests ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """A validated, normalised request; C{args} holds only present members, canonical values."""

    request_id: str
    action: str
    args: dict[str, Any]

    def effective_limit(self) -> int:
        """The page size a read answer is held to (the default page when C{limit} is absent)."""
        return int(self.args.get("limit", DEFAULT_LIMIT)) if self.action == "channel.read" else 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "broker_request",
            "protocolVersion": PROTOCOL_VERSION,
            "requestId": self.request_id,
            "actionVersion": ACTION_VERSION,
            "action": self.action,
            "args": self.args,
        }


def extract_request_id(tree: Any) -> str:
    """The usable requestId of a decoded body, or raise L{RequestIdError} (no verdict can correlate)."""
    if not isinstance(tree, dict):
        raise RequestIdError("request body is not a JSON object")
    if "requestId" in getattr(tree, "dups", ()):
        raise RequestIdError("requestId is repeated")
    if "requestId" not in tree:
        raise RequestIdError("requestId is missing")
    try:
        return request_id(tree["requestId"])
    except ContractError as e:
        raise RequestIdError(e.message) from None


def parse_request_body(body: bytes) -> tuple[str, Any]:
    """Decode a request body far enough to correlate it: returns (requestId, decoded tree).

    @raise RequestIdError: not UTF-8 JSON, or no usable requestId.
    """
    try:
        tree = loads_strict(body)
    except ValueError:
        raise RequestIdError("request body is not valid JSON") from None
    except RecursionError:
        raise RequestIdError("request body nests too deeply to decode") from None
    return extract_request_id(tree), tree


def validate_request(tree: Any) -> Request:
    """Validate a decoded request envelope; raises L{ContractError} carrying the verdict code."""
    rid = extract_request_id(tree)
    # A different envelope version may have a different shape: judge the version first.
    if "protocolVersion" in tree and type(tree["protocolVersion"]) is int and not getattr(tree, "dups", None):
        if tree["protocolVersion"] != PROTOCOL_VERSION:
            raise ContractError("protocolVersion is not supported", "unsupported_protocol_version")
    check_tree(tree)
    for k in tree:
        if k not in REQUEST_MEMBERS:
            raise ContractError(f"request has unknown member {quote(k)}")
    for k in ("type", "protocolVersion", "actionVersion", "action", "args"):
        if k not in tree:
            raise ContractError(f"request is missing {k!r}")
    if tree["type"] != "broker_request":
        raise ContractError("type must be broker_request")
    version = _int(tree["protocolVersion"], "protocolVersion", 0, 65_535)
    if version != PROTOCOL_VERSION:
        raise ContractError("protocolVersion is not supported", "unsupported_protocol_version")
    action = _str(tree["action"], "action")
    if action not in ARGS:
        raise ContractError("action is not known to this host", "unknown_action")
    av = _int(tree["actionVersion"], "actionVersion", 0, 65_535)
    if av != ACTION_VERSION:
        raise ContractError(f"actionVersion {av} is not supported for {action}", "unsupported_action_version")
    args = ARGS[action].parse(tree["args"], "args")
    _check_args_semantics(action, args)
    return Request(rid, action, args)


def _check_args_semantics(action: str, args: dict[str, Any]) -> None:
    if action == "profile.set" and not args:
        raise ContractError("profile.set needs at least one of displayName, about, picture")
    if action == "agents.update" and len(args) < 2:
        raise ContractError("agents.update needs at least one field to change besides target")


def parse_request(body: bytes) -> Request:
    """Parse request bytes strictly (client-side reader and tests)."""
    _, tree = parse_request_body(body)
    return validate_request(tree)


def build_request(action: str, args: Mapping[str, Any], request_id: str, protocol_version: int = 1) -> Request:
    """Validate and normalise a request built in code (the client's construction door)."""
    if protocol_version != PROTOCOL_VERSION:
        raise ContractError("protocolVersion is not supported", "unsupported_protocol_version")
    tree = {
        "type": "broker_request",
        "protocolVersion": protocol_version,
        "requestId": request_id,
        "actionVersion": ACTION_VERSION,
        "action": action,
        "args": dict(args),
    }
    return validate_request(tree)


def freeze(request: Request) -> bytes:
    """Serialise a request once; these bytes are what every attempt and retry sends (I3)."""
    return dumps(request.to_wire())


# --- responses -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Response:
    """A verdict. C{replayed} is delivery metadata, never part of the stored verdict."""

    request_id: str
    status: str
    action: str | None = None
    outcome: dict[str, Any] | None = None
    code: str | None = None
    message: str | None = None
    replayed: bool = False

    def to_wire(self, replayed: bool | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "broker_result",
            "protocolVersion": PROTOCOL_VERSION,
            "requestId": self.request_id,
            "status": self.status,
        }
        if self.status == "succeeded":
            out["action"] = self.action
            out["outcome"] = self.outcome
        else:
            out["error"] = {"code": self.code, "message": self.message}
        if self.replayed if replayed is None else replayed:
            out["replayed"] = True
        return out


def succeeded(request_id: str, action: str, outcome: dict[str, Any]) -> Response:
    return Response(request_id, "succeeded", action=action, outcome=outcome)


def failed(request_id: str, code: str, message: str) -> Response:
    status = "indeterminate" if code == "outcome_unknown" else "failed"
    return Response(request_id, status, code=code, message=message)


def indeterminate(request_id: str, code: str, message: str) -> Response:
    return Response(request_id, "indeterminate", code=code, message=message)


def serialize_response(resp: Response) -> bytes:
    """Serialise a verdict after checking it passes the strict reader (the host never emits junk).

    The reader's rules are applied to the values, not to bytes decoded back: a dict cannot repeat a
    key, the shape validators refuse C{null} where they check types, and the encoder refuses lone
    surrogates. Read outcomes whose events are L{CheckedEvents} skip the per-event check they
    already passed.
    """
    wire = resp.to_wire()
    try:
        _parse_response_tree(wire)
    except (ContractError, ValueError) as e:
        raise MalformedResponse(str(e)) from None
    return dumps(wire)


def mark_replayed(stored: bytes) -> bytes:
    """Add C{"replayed":true} to a stored verdict's bytes; the result is otherwise byte-identical."""
    assert stored.endswith(b"}")
    return stored[:-1] + b',"replayed":true}'


def parse_response(data: bytes | Any, request: Request | None = None) -> Response:
    """Read a response strictly; with C{request}, also hold it to that request (I5).

    @raise MalformedResponse: not a host verdict for the request.
    """
    try:
        if isinstance(data, bytearray):
            data = bytes(data)
        tree = loads_strict(data) if isinstance(data, (bytes, str)) else data
        check_tree(tree)
        resp = _parse_response_tree(tree)
    except (ContractError, ValueError, RecursionError) as e:
        raise MalformedResponse(str(e)) from None
    if request is not None:
        correlate(request, resp)
    return resp


def _parse_response_tree(tree: Any) -> Response:
    obj = _object(tree, "response")
    status = obj.get("status")
    if status not in STATUSES:
        raise ContractError("status is not succeeded, failed or indeterminate")
    allowed = {"type", "protocolVersion", "requestId", "status", "replayed"}
    allowed |= {"action", "outcome"} if status == "succeeded" else {"error"}
    for k in obj:
        if k not in allowed:
            raise ContractError(f"response has member {quote(k)} not allowed with status {status}")
    for k in allowed - {"replayed"}:
        if k not in obj:
            raise ContractError(f"response is missing {k!r}")
    if obj["type"] != "broker_result":
        raise ContractError("type must be broker_result")
    if _int(obj["protocolVersion"], "protocolVersion", 0, 65_535) != PROTOCOL_VERSION:
        raise ContractError("protocolVersion is not supported")
    rid = request_id(obj["requestId"])
    replayed = _bool(obj["replayed"], "replayed") if "replayed" in obj else False
    if status == "succeeded":
        action = _str(obj["action"], "action")
        if action not in OUTCOMES:
            raise ContractError("action is not known")
        outcome = OUTCOMES[action].parse(obj["outcome"], "outcome")
        return Response(rid, status, action=action, outcome=outcome, replayed=replayed)
    err = _ERROR_SHAPE.parse(obj["error"], "error")
    if status not in _CODE_STATUSES[err["code"]]:
        raise ContractError(f"code {err['code']} cannot pair with status {status}")
    return Response(rid, status, code=err["code"], message=err["message"], replayed=replayed)


def code_allows(code: str, status: str) -> bool:
    """Whether the status/code table permits this pairing."""
    return status in _CODE_STATUSES.get(code, frozenset())


def correlate(request: Request, resp: Response) -> None:
    """Hold a parsed response to its request (I5); raises L{MalformedResponse}."""
    if resp.request_id != request.request_id:
        raise MalformedResponse("requestId does not match the request")
    if resp.status != "succeeded":
        return
    if resp.action != request.action:
        raise MalformedResponse("outcome is for a different action")
    out = resp.outcome or {}
    args = request.args
    if request.action == "channel.read":
        limit = request.effective_limit()
        if len(out["messages"]) > limit:
            raise MalformedResponse(f"page exceeds the request's limit of {limit}")
    elif request.action == "agents.create":
        if out["channelId"] != args["channelId"]:
            raise MalformedResponse("channelId echo does not match the request")
    elif request.action in ("agents.update", "agents.delete"):
        target = args["target"]
        if "pubkey" in target and out["agentPubkey"] != target["pubkey"]:
            raise MalformedResponse("agentPubkey echo does not match the target")


class TransportError(Exception):
    """No verdict: the request's fate is unknown (unreachable, no envelope, malformed envelope)."""


def read_http_response(request: Request, status: int, body: bytes) -> Response:
    """Client rule for HTTP answers: a valid correlated envelope is the answer whatever the status.

    @raise TransportError: when no envelope for this request can be read.
    """
    try:
        return parse_response(body, request)
    except MalformedResponse as e:
        raise TransportError(f"HTTP {status}: no verdict ({e})") from None
