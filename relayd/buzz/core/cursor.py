"""Opaque read cursors: a keyset position (created_at, id), versioned and HMAC-bound to its read.

A cursor names the last event of a page in the broker's order (newest first, ties by id ascending);
the next page holds the events strictly after it. The MAC covers the principal, the channel and the
filter (thread root, mentions-only), so a cursor cannot be forged, nor replayed by another principal
or against another read. Wire form (printable ASCII, <= 256 bytes)::

    c1.<base64url(created_at:8 || id:32)>.<base64url(mac:16)>

The MAC key is derived from the host's key-encryption key, so cursors survive a restart.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct
from dataclasses import dataclass

VERSION = "c1"
_MAC_LEN = 16


class CursorError(ValueError):
    """A cursor this host did not issue for this read (foreign, tampered, or other version)."""


@dataclass(frozen=True)
class Position:
    """The last event of a page: read continues with events strictly older, or same second with larger id."""

    created_at: int
    event_id: str

    def is_after(self, created_at: int, event_id: str) -> bool:
        """Whether an event comes strictly after this position in newest-first, id-ascending order."""
        return created_at < self.created_at or (created_at == self.created_at and event_id > self.event_id)


@dataclass(frozen=True)
class Scope:
    """What a cursor is bound to."""

    principal: str
    channel: str
    root: str = ""
    mentions_only: bool = False

    def encode(self) -> bytes:
        return "\x00".join(
            (self.principal, self.channel, self.root, "1" if self.mentions_only else "0")
        ).encode("utf-8")


def derive_key(master: bytes) -> bytes:
    """The cursor MAC key from the host's master secret (domain-separated)."""
    return hmac.new(master, b"relayd/buzz/cursor/v1", hashlib.sha256).digest()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, scope: Scope, payload: bytes) -> bytes:
    return hmac.new(key, VERSION.encode() + b"\x00" + scope.encode() + b"\x00" + payload, hashlib.sha256).digest()[
        :_MAC_LEN
    ]


def issue(key: bytes, scope: Scope, pos: Position) -> str:
    """Encode and sign a position for one read scope."""
    payload = struct.pack(">Q", pos.created_at) + bytes.fromhex(pos.event_id)
    return f"{VERSION}.{_b64(payload)}.{_b64(_mac(key, scope, payload))}"


def open_cursor(key: bytes, scope: Scope, text: str) -> Position:
    """Check and decode a cursor issued by L{issue} for the same scope; raises L{CursorError}."""
    parts = text.split(".")
    if len(parts) != 3 or parts[0] != VERSION:
        raise CursorError("cursor was not issued by this host")
    try:
        payload = _unb64(parts[1])
        mac = _unb64(parts[2])
    except (binascii.Error, ValueError):
        raise CursorError("cursor was not issued by this host") from None
    # Only the canonical encoding is accepted, so a cursor has exactly one spelling.
    if _b64(payload) != parts[1] or _b64(mac) != parts[2]:
        raise CursorError("cursor was not issued by this host")
    if len(payload) != 40 or not hmac.compare_digest(mac, _mac(key, scope, payload)):
        raise CursorError("cursor was not issued by this host for this read")
    (created_at,) = struct.unpack(">Q", payload[:8])
    return Position(created_at, payload[8:].hex())
