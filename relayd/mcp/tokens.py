"""What a tunnel session id and token may be, and the only form of a token the relay keeps. No I/O."""

from __future__ import annotations

import hashlib
import re

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{4,64}")
TOKEN_MIN, TOKEN_MAX = 16, 128


def token_hash(token: str) -> str:
    """SHA-256 hex of a token (only the hash is stored)."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def utf16_length(text: str) -> int:
    """Length in UTF-16 code units (JavaScript's C{.length}), which the token bounds count."""
    return len(text) + sum(1 for ch in text if ord(ch) > 0xFFFF)
