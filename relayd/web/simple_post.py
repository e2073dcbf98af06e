"""Plain POSTs read whole from one socket read, for a wing to answer without twisted.web's C{Request}.

twisted.web spends 1.4-1.9 µs per event of a 100-event ingest POST on its request machinery alone
(docs/performance.md, "What HTTP on twisted.web costs by itself"). A wing may register a path for
which it answers the plainest form of a POST itself (L{RelaySite.simple_posts}), or claim the paths
under a prefix (L{SimplePosts.claim}) and render them through its route table
(relayd.web.plain_request): the request line, headers and whole body in one read, HTTP/1.1, a
C{Content-Length} body, nothing that changes how the connection or the body is handled.
L{read_simple_post} recognises that form and nothing else; everything it declines, and everything
the wing declines, goes to twisted.web as before.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Handlers", "HeldAnswer", "SimplePost", "SimplePosts", "read_simple_post"]

# A header name: a token (RFC 9110 5.1).
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# Headers that change how the body is framed or the connection is used: twisted.web handles those.
_VERSIONS = (b"HTTP/1.1", b"HTTP/1.0")
_DECLINED = frozenset((b"transfer-encoding", b"expect", b"upgrade", b"te", b"trailer", b"http2-settings"))
# Header names seen before (most clients send the same few), each a token not among L{_DECLINED}, as
# they were sent: their lower-cased form, not checked and lowered again.
_NAMES: dict[bytes, bytes] = {}
_NAMES_KEPT = 256  # (a client chooses its names: at most this many are kept)
# Whole header lines seen before (a client sends the same Host, User-Agent, Content-Type ... with
# every request), each a token, a colon and a value: the lower-cased name and the value read from
# it. Emptied when full (a client chooses its lines). Not kept: a length, which changes from request
# to request, and a credential, which is not kept beyond its request.
_LINES: dict[bytes, tuple[bytes, bytes]] = {}
_LINES_KEPT = 256
_LINE_KEPT_MAX = 256  # the longest line kept (the usual ones are far shorter; a client's long ones are not kept)
_NOT_KEPT = frozenset((b"content-length", b"authorization", b"proxy-authorization", b"cookie"))


class SimplePost:
    """A plain POST: its path (the request target: with its query, for a path a wing claims by
    prefix), its headers (lower-cased names, each at most once), its body, its HTTP version, whether
    its connection closes once it is answered (as twisted.web decides), the handler its path has
    (L{read_simple_post}: looked up once), and the channel it came on (set by the channel before a
    wing sees it)."""

    __slots__ = ("body", "headers", "path", "version", "close", "handler", "channel")

    def __init__(
        self,
        path: bytes,
        headers: dict[bytes, bytes],
        body: bytes,
        version: bytes = b"HTTP/1.1",
        close: bool = False,
        handler: SimplePostHandler | None = None,
    ) -> None:
        self.path = path
        self.headers = headers
        self.body = body
        self.version = version
        self.close = close
        self.handler = handler
        self.channel: Any = None


class HeldAnswer(Protocol):
    """An answer that comes later, without a Deferred (relayd.web.plain_request's request): the
    channel says where to write it, or cancels it when its client leaves first."""

    def answer_to(self, write: Callable[[Any], object]) -> None:
        """Hand the answer to C{write} once there is one (at once if there is one already)."""

    def cancel(self) -> None:
        """The client left: nothing will be written."""


SimplePostHandler = Callable[[SimplePost], Any]
"""A wing's answer to a plain POST: an C{Answer}, a C{Deferred} of one, a L{HeldAnswer}, or C{None}
(declined, with nothing done: twisted.web answers it)."""


class SimplePosts:
    """The request targets whose plain POSTs wings answer themselves: exact paths (no query string),
    and the paths under a prefix a wing claims (a session's paths carry its id; with a query string
    too), whose handler reads the target and declines what is not its own."""

    __slots__ = ("_exact", "_prefixes")

    def __init__(self) -> None:
        self._exact: dict[bytes, SimplePostHandler] = {}
        self._prefixes: tuple[tuple[bytes, SimplePostHandler], ...] = ()

    def __setitem__(self, path: bytes, handler: SimplePostHandler) -> None:
        self._exact[path] = handler

    def claim(self, prefix: bytes, handler: SimplePostHandler) -> None:
        """Hand C{handler} every plain POST whose target starts with C{prefix} (an exact path wins)."""
        self._prefixes += ((prefix, handler),)

    def get(self, target: bytes) -> SimplePostHandler | None:
        """The handler of C{target}, or C{None}."""
        handler = self._exact.get(target)
        if handler is None:
            for prefix, claimed in self._prefixes:
                if target.startswith(prefix):
                    return claimed
        return handler

    def __getitem__(self, target: bytes) -> SimplePostHandler:
        handler = self.get(target)
        if handler is None:
            raise KeyError(target)
        return handler

    def __contains__(self, target: object) -> bool:
        return isinstance(target, bytes) and self.get(target) is not None

    def __bool__(self) -> bool:
        return bool(self._exact or self._prefixes)

    def clear(self) -> None:
        self._exact.clear()
        self._prefixes = ()


class Handlers(Protocol):
    """What L{read_simple_post} looks a target up in (L{SimplePosts}, or a plain dict)."""

    def get(self, target: bytes, /) -> SimplePostHandler | None: ...


def read_simple_post(
    data: bytes, handlers: Handlers, *, max_header_bytes: int, max_fields: int, max_length_digits: int
) -> SimplePost | None:
    """The POST that C{data} holds exactly (no byte before or after it), to a target that has one of
    C{handlers} (its target, query string included, looked up with C{handlers.get}, once: the
    post's C{handler}; L{SimplePosts} takes a query under a claimed prefix), or C{None} when C{data}
    is anything else or anything unusual: another method or version, a header block over C{max_header_bytes} or C{max_fields}, a bare line feed, a folded or
    repeated header, a header name that is not a token, a NUL, no C{Content-Length} (or one of more than
    C{max_length_digits} digits, or not all digits), a body not all there, bytes after it, C{Connection}
    other than C{keep-alive} or C{close}, or any of L{_DECLINED}."""
    line_end = data.find(b"\r\n", 0, max_header_bytes)
    if line_end < 0:
        return None
    method, _, rest = data[:line_end].partition(b" ")
    path, _, version = rest.partition(b" ")
    if method != b"POST" or version not in _VERSIONS:
        return None
    handler = handlers.get(path)
    if handler is None:
        return None
    end = data.find(b"\r\n\r\n", line_end, max_header_bytes + 2)
    if end < 0:
        return None
    block = data[line_end + 2 : end]  # (the header lines, joined by CRLF)
    lines = block.split(b"\r\n") if block else []
    if len(lines) > max_fields:
        return None
    # Each CR and each LF of the block one of the CRLFs between its lines: no bare line feed or
    # carriage return; and no NUL (which twisted.web refuses in a header value, RFC 9110 5.5, where
    # other controls and obs-text pass). Otherwise twisted.web's reading of it applies.
    if block:
        between = len(lines) - 1
        # (find: docs/architecture.md, hot paths)
        if block.count(b"\r") != between or block.count(b"\n") != between or block.find(b"\x00") >= 0:
            return None
    names, kept = _NAMES, _LINES
    headers: dict[bytes, bytes] = {}
    for line in lines:
        known = kept.get(line)
        if known is not None:
            headers[known[0]] = known[1]
            continue
        sent, colon, value = line.partition(b":")
        name = names.get(sent)
        if name is None:
            # A line that is not a token, a colon and a value (a folded line starts with white space,
            # a name is never followed by it), or a header twisted.web must handle.
            if not colon or _TOKEN.fullmatch(sent) is None:
                return None
            name = sent.lower()
            if name in _DECLINED:
                return None
            if len(names) < _NAMES_KEPT:
                names[sent] = name
        elif not colon:
            return None
        value = headers[name] = value.strip(b" \t")
        if name not in _NOT_KEPT and len(line) <= _LINE_KEPT_MAX:
            if len(kept) >= _LINES_KEPT:
                kept.clear()
            kept[line] = (name, value)
    if len(headers) != len(lines):
        return None  # a header repeated
    length = headers.get(b"content-length")
    if length is None or not length.isdigit() or len(length) > max_length_digits:
        return None
    connection = headers.get(b"connection")
    if connection is not None:
        connection = connection.lower()
        if connection != b"keep-alive" and connection != b"close":
            return None
    body = data[end + 4 :]
    if len(body) != int(length):
        return None
    # twisted.web keeps an HTTP/1.1 connection unless told to close, and never an HTTP/1.0 one
    # (HTTPChannel.checkPersistence): the same here.
    close = version != b"HTTP/1.1" or connection == b"close"
    return SimplePost(path, headers, body, version, close, handler)
