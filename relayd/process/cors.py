"""CORS origin policy: parsing and normalising it once at startup, and the per-request headers.

A policy is either "any origin" (C{*}) or a list of origins. C{Access-Control-Allow-Origin} holds one
origin or C{*}, so a list is enforced per request: a request whose C{Origin} exactly equals a listed
(normalised) origin gets it echoed back, every response carries C{Vary: Origin}, and anything else gets
no allow-origin header at all (never C{null}). Protocol-agnostic: any wing can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence
from urllib.parse import urlsplit

from twisted.web.iweb import IRequest

# Schemes whose origin serialisation is scheme://host[:port] with the default port dropped (WHATWG URL).
_DEFAULT_PORTS: dict[str, int | None] = {
    "http": 80,
    "https": 443,
    "ws": 80,
    "wss": 443,
    "ftp": 21,
}

ALLOW_METHODS = b"GET, POST, OPTIONS"
ALLOW_HEADERS = b"content-type, x-csrf-token, accept, authorization"
MAX_AGE = b"86400"


class CorsPolicyError(ValueError):
    """An origin policy that is refused at startup."""


@dataclass(frozen=True)
class OriginPolicy:
    """Which browser origins may read responses: any (C{*}) or the listed ones.

    @ivar origins: normalised origins, first occurrence order, no duplicates; empty for C{*}.
    """

    any: bool
    origins: tuple[str, ...] = ()

    def describe(self) -> str:
        """C{*} or the comma-joined list, as the startup line shows it."""
        return "*" if self.any else ",".join(self.origins)

    def headers(self, origin: bytes | None) -> list[tuple[bytes, bytes]]:
        """The CORS response headers for a request that sent C{Origin: origin} (or none)."""
        if self.any:
            allow: list[tuple[bytes, bytes]] = [(b"access-control-allow-origin", b"*")]
        else:
            allow = [(b"vary", b"Origin")]
            # The request origin is compared exactly, not normalised: a browser always sends the
            # serialised form, and "null" never equals a listed entry.
            if origin is not None and origin in self._allowed_bytes:
                allow.insert(0, (b"access-control-allow-origin", origin))
        return [
            *allow,
            (b"access-control-allow-methods", ALLOW_METHODS),
            (b"access-control-allow-headers", ALLOW_HEADERS),
            (b"access-control-max-age", MAX_AGE),
        ]

    def allows(self, origin: bytes) -> bool:
        """Whether C{origin}, as a browser sends it, is listed (C{*} allows every one)."""
        return self.any or origin in self._allowed_bytes

    def apply(self, request: IRequest) -> None:
        """Set the CORS headers on C{request}'s response."""
        set_header = request.responseHeaders.setRawHeaders
        if self.any:
            # The same four headers for every request: no per-request list to build.
            for name, value in _ANY_HEADERS:
                set_header(name, [value])
            return
        values = request.requestHeaders.getRawHeaders(b"origin")
        for name, value in self.headers(values[0] if values else None):
            set_header(name, [value])

    @property
    def _allowed_bytes(self) -> frozenset[bytes]:
        # Cached lazily on the frozen instance.
        cached = self.__dict__.get("_allowed_cache")
        if cached is None:
            cached = frozenset(o.encode("ascii") for o in self.origins)
            object.__setattr__(self, "_allowed_cache", cached)
        return cached


ANY_ORIGIN = OriginPolicy(any=True)
_ANY_HEADERS = tuple(ANY_ORIGIN.headers(None))


def parse_origins(value: str | Sequence[str]) -> OriginPolicy:
    """Parse a policy: C{"*"}, a comma-separated string, or a sequence of entries (each may hold commas).

    Entries are trimmed, empty ones dropped, normalised and de-duplicated.

    @raise CorsPolicyError: empty list, C{*} mixed with origins, C{null}, or an entry that is not an
        origin (no scheme/host, or a path, query, fragment or credentials).
    """
    items = [value] if isinstance(value, str) else list(value)
    entries = [e.strip() for item in items for e in item.split(",")]
    entries = [e for e in entries if e]
    if not entries:
        raise CorsPolicyError("CORS origin list is empty: give * or at least one origin")
    if "*" in entries:
        if any(e != "*" for e in entries):
            raise CorsPolicyError("* (any origin) cannot be combined with specific origins")
        return ANY_ORIGIN
    seen: dict[str, None] = {}
    for entry in entries:
        seen.setdefault(normalise_origin(entry), None)
    return OriginPolicy(any=False, origins=tuple(seen))


def normalise_origin(entry: str) -> str:
    """The origin a browser would send for C{entry} (C{HTTPS://Example.com:443/} -> C{https://example.com}).

    @raise CorsPolicyError: as for L{parse_origins}.
    """
    if entry.lower() == "null":
        raise CorsPolicyError(f'"{entry}" is refused: null is what sandboxed and file:// pages send')
    not_origin = CorsPolicyError(f'"{entry}" is not an origin — expected scheme://host[:port]')
    if any(ch.isspace() for ch in entry) or "://" not in entry:
        raise not_origin
    try:
        parts = urlsplit(entry)
        port = parts.port
        hostname = parts.hostname
    except ValueError:
        raise not_origin from None
    scheme = parts.scheme.lower()
    if not scheme or not scheme[0].isalpha() or not hostname:
        raise not_origin
    has_extra = parts.username is not None or parts.password is not None or parts.path not in ("", "/")
    if has_extra or parts.query or parts.fragment or "?" in entry or "#" in entry:
        raise CorsPolicyError(f'"{entry}" has a path, query or credentials — an origin is scheme://host[:port] only')
    host = hostname.lower()
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            raise not_origin from None
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    if scheme in _DEFAULT_PORTS:
        if port is not None and port != _DEFAULT_PORTS[scheme]:
            host = f"{host}:{port}"
    elif port is not None:
        host = f"{host}:{port}"
    return f"{scheme}://{host}"


def policy_from_entries(entries: Iterable[str]) -> OriginPolicy:
    """Combine several configured values (a repeated flag) into one policy."""
    return parse_origins(list(entries))
