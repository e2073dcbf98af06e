"""Scalar and object validators: each takes a decoded value and the path naming it, and returns
the value normalised (trimmed, lowercased, canonical) or raises L{ContractError}.

Also L{Shape}, the exact member set an object must have, and L{signed_event}, the seven-member
Nostr event a read outcome carries.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from coincurve import PublicKeyXOnly

from relayd.buzz.core.contract.errors import ContractError
from relayd.buzz.core.contract.tree import quote
from relayd.buzz.core.contract.vocabulary import (
    MAX_CHANNEL_TEXT,
    MAX_CONTENT_BYTES,
    MAX_CURSOR,
    MAX_REQUEST_ID,
    MAX_SLUG,
    RESPOND_TO,
)

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


def trim(s: str) -> str:
    """Trim Unicode White_Space (exactly that set) from both ends."""
    return s.strip(WHITE_SPACE)


def string(v: Any, path: str) -> str:
    """C{v} if it is a string."""
    if type(v) is not str:
        raise ContractError(f"{path} must be a string")
    return v


def integer(v: Any, path: str, lo: int, hi: int) -> int:
    """C{v} if it is an integer (not a boolean, not a float) within C{lo}..C{hi}."""
    if type(v) is not int:  # rejects bool (a subclass of int) and float
        raise ContractError(f"{path} must be an integer")
    if not lo <= v <= hi:
        raise ContractError(f"{path} must be between {lo} and {hi}")
    return v


def boolean(v: Any, path: str) -> bool:
    """C{v} if it is a boolean."""
    if type(v) is not bool:
        raise ContractError(f"{path} must be a boolean")
    return v


def channel_id(v: Any, path: str = "channelId") -> str:
    """Normalise a channel UUID from any of its four spellings to lowercase hyphenated."""
    s = trim(string(v, path))
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
    s = trim(string(v, path))
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
    s = string(v, path)
    if not (1 <= len(s) <= MAX_REQUEST_ID) or _PRINTABLE.match(s) is None:
        raise ContractError(f"{path} must be 1-{MAX_REQUEST_ID} printable ASCII characters without spaces")
    return s


def cursor(v: Any, path: str = "cursor") -> str:
    """1-256 bytes of printable ASCII without spaces; opaque and never altered."""
    s = string(v, path)
    if not (1 <= len(s) <= MAX_CURSOR) or _PRINTABLE.match(s) is None:
        raise ContractError(f"{path} must be 1-{MAX_CURSOR} printable ASCII characters without spaces")
    return s


def bounded_text(limit: int) -> Callable[[Any, str], str]:
    """A validator of trimmed, non-empty text of at most C{limit} code points."""

    def check(v: Any, path: str) -> str:
        s = trim(string(v, path))
        if not s:
            raise ContractError(f"{path} must not be empty")
        if len(s) > limit:  # len() counts code points, the contract's "characters"
            raise ContractError(f"{path} must be at most {limit} characters")
        return s

    return check


def content(v: Any, path: str = "content") -> str:
    """Message content: published verbatim; not blank; at most 64 KiB of UTF-8."""
    s = string(v, path)
    if not trim(s):
        raise ContractError(f"{path} must not be empty")
    if len(s) > MAX_CONTENT_BYTES or len(s.encode("utf-8")) > MAX_CONTENT_BYTES:
        raise ContractError(f"{path} is too large (limit {MAX_CONTENT_BYTES} bytes)")
    return s


def slug(v: Any, path: str = "slug") -> str:
    """A NIP-AE slug: C{core} or C{mem/} plus segments C{[a-z0-9][a-z0-9_-]{0,63}}, <= 255."""
    s = trim(string(v, path))
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
    """One of L{RESPOND_TO}, trimmed."""
    s = trim(string(v, path))
    if s not in RESPOND_TO:
        raise ContractError(f"{path} must be one of {', '.join(RESPOND_TO)}")
    return s


def json_object(v: Any, path: str) -> Mapping[str, Any]:
    """C{v} if it is an object that repeats no key."""
    if not isinstance(v, dict):
        raise ContractError(f"{path} must be an object")
    if getattr(v, "dups", None):
        raise ContractError(f"{path} repeats a key")
    return v


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
        obj = json_object(v, path)
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
    obj = json_object(v, path)
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
    sig = string(obj["sig"], f"{path}.sig")
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
        "created_at": integer(obj["created_at"], f"{path}.created_at", 0, 2**63 - 1),
        "kind": integer(obj["kind"], f"{path}.kind", 0, 65_535),
        "tags": tags,
        "content": string(obj["content"], f"{path}.content"),
        "sig": sig.lower(),
    }


class CheckedEvents(list[Any]):
    """Events that each came out of L{signed_event}: a host-built read outcome is not checked twice."""
