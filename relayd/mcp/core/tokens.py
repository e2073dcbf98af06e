"""What a tunnel session id and token may be, the only form of a token the relay keeps, and the
relay's own client labels. No I/O."""

from __future__ import annotations

import hashlib
import re
import secrets

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{4,64}")
TOKEN_MIN, TOKEN_MAX = 16, 128


def token_hash(token: str) -> str:
    """SHA-256 hex of a token (only the hash is stored)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def utf16_length(text: str) -> int:
    """Length in UTF-16 code units (JavaScript's C{.length}), which the token bounds count."""
    return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)


# Labels the relay issues (a standard-endpoint client's): no `client=` label can name one, so
# another holder of the session's token cannot subscribe to that client's replies.
RELAY_LABEL_PREFIX = "relayd:"


def relay_label() -> str:
    """A label for a client whose replies only the relay routes (never shown outside the relay)."""
    return RELAY_LABEL_PREFIX + secrets.token_hex(8)


def chosen_label(value: str | None) -> str | None:
    """A client-chosen C{client=} label as the tunnel uses it: C{None} (no label) when empty, and
    when it would name one of the relay's own labels."""
    if not value or value.startswith(RELAY_LABEL_PREFIX):
        return None
    return value


def label_tag(label: str) -> str:
    """What may stand for a label where others read it (a progress token): one-way, so nobody can
    subscribe under the label it was made from."""
    return hashlib.sha256(label.encode("utf-8")).hexdigest()[:16]
