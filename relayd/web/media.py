"""The one reading of a C{Content-Type} header every wing uses."""

from __future__ import annotations

_OWS = b" \t"  # optional white space (RFC 9110 5.6.3)


def media_type(value: bytes | None) -> bytes:
    """The media type of a C{Content-Type} header's C{value}: type and subtype lower-cased (they are
    case-insensitive, RFC 9110 8.3.1), parameters dropped; C{b""} without one."""
    return (value or b"").split(b";", 1)[0].strip(_OWS).lower()
