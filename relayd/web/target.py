"""Request targets as a server reads them (RFC 9112 3.2)."""

from __future__ import annotations

import re

# http or https (case-insensitive), "://", the authority up to the path or query.
_ABSOLUTE = re.compile(rb"(?i:https?)://([^/?#]+)")


def origin_form(target: bytes) -> tuple[bytes, bytes | None]:
    """C{target} in origin form (path and query) and, for an absolute-form target
    (C{http://host:port/path?query}), its authority, which is then the request's C{Host} (RFC 9112
    3.2.2: a server MUST accept the absolute form and ignore the received C{Host}); C{None} for
    any other form. An empty path is C{/}."""
    if target[:1] == b"/":
        return target, None  # the usual form: one comparison
    match = _ABSOLUTE.match(target)
    if match is None:
        return target, None
    rest = target[match.end() :]
    if rest[:1] != b"/":
        rest = b"/" + rest
    return rest, match.group(1)
