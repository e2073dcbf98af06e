"""Token extraction and constant-time comparison."""

from __future__ import annotations

import hmac

from twisted.web.iweb import IRequest


def bearer_token(request: IRequest) -> str | None:
    """The token of an C{Authorization: Bearer <token>} header (the scheme in any case, one space)."""
    values = request.requestHeaders.getRawHeaders(b"authorization")
    return bearer_of(values[0]) if values else None


def bearer_of(value: bytes | None) -> str | None:
    """The token of an C{Authorization} header's C{value} (L{bearer_token}'s reading), or C{None}."""
    # The scheme is case-insensitive (RFC 7235 2.1): `bearer x` is the same credential as `Bearer x`.
    if value is None or value[:7].lower() != b"bearer ":
        return None
    try:
        return value[7:].decode("utf-8")
    except UnicodeDecodeError:
        return None


def query_param(request: IRequest, name: str) -> str | None:
    """The first value of query parameter C{name}, decoded as UTF-8, or C{None}.

    C{None} too while the query is not parsed yet (C{args} is C{None} until the request is received).
    """
    args = request.args
    values = args.get(name.encode("ascii")) if args else None
    if not values:
        return None
    try:
        return values[0].decode("utf-8")
    except UnicodeDecodeError:
        return None


def tokens_equal(given: str | bytes | None, expected: str | bytes) -> bool:
    """Compare a presented token with the configured one in constant time."""
    if given is None:
        return False
    a = given.encode("utf-8") if isinstance(given, str) else given
    b = expected.encode("utf-8") if isinstance(expected, str) else expected
    return hmac.compare_digest(a, b)
