"""Shrink what an idle long-lived response holds once it only streams (docs/performance.md,
"Memory per idle stream").

Over a request's life Twisted gives its C{Request} and C{HTTPChannel} more instance attributes than
CPython's shared-key dicts hold, so each ends up with a combined dict sized for growth (about 1.5 KB
apiece). Thousands of SSE streams sit idle per process, each holding both. Once a stream's headers
are on the wire, L{slim_stream} rebuilds both dicts at their right size, without the entries that
only repeat the class's own value and without what only reading the request needed.

Every removal keeps behaviour: an entry identical to the class attribute it shadows reads the same
object once gone, and the few entries dropped outright are only read while a request is received or
before its headers are written (a later use raises C{AttributeError}: loud, never silent).
"""

from __future__ import annotations

from typing import Any, Final

from twisted.web.http_headers import Headers

from relayd.web.twisted_internals import REQUEST_SPENT_PRIVATE

_MISSING = object()

# Public twisted.web Request attributes that only serve receiving the request, finding its resource
# or writing its headers: the body (the stream's handler read it before starting), the cookies it
# came with and those to send (written with the headers), what traversal left (postpath) and the
# path session cookies are scoped to (sitepath; relayd keeps no sessions), and what traversal
# consumed (prepath: 56 B; the class's None is read instead). With them gone a streaming request
# keeps about 20 entries, which fit a dict of the next size down.
_REQUEST_SPENT = ("content", "received_cookies", "cookies", "postpath", "sitepath", "prepath", *REQUEST_SPENT_PRIVATE)
# The methods and versions a held stream's request line has, one object each for every stream (a
# request's own copies from parsing its line are 77 B).
_REQUEST_LINE_WORDS = {word: word for word in (b"GET", b"POST", b"HTTP/1.1", b"HTTP/1.0")}
# What the access line at a stream's end reads of the request's headers (RelaySite.client_address).
_KEPT_REQUEST_HEADERS = (b"x-forwarded-for",)


class SentHeaders(Headers):
    """Headers that are already on the wire, or already read: empty, and what is set on them is
    dropped (as it was when each stream had a fresh C{Headers} of its own: nothing is sent after
    the headers). One instance, L{SENT}, serves every held stream."""

    __slots__ = ()

    def setRawHeaders(self, name: Any, values: Any) -> None:
        pass

    def addRawHeader(self, name: Any, value: Any) -> None:
        pass

    def removeHeader(self, name: Any) -> None:
        pass


SENT: Final = SentHeaders()


def _class_value(cls: type, name: str) -> Any:
    """The plain class attribute C{name} would fall back to, or L{_MISSING} (descriptors count as
    missing: they could answer differently from the instance entry)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            value = vars(klass)[name]
            return _MISSING if hasattr(type(value), "__get__") else value
    return _MISSING


def compact(obj: Any, drop: tuple[str, ...] = ()) -> None:
    """Give C{obj} a right-sized instance dict: the entries named in C{drop} and those identical to
    the class attribute they shadow are left out (reading them answers the same object)."""
    cls = type(obj)
    kept = {}
    for name, value in vars(obj).items():
        if name in drop:
            continue
        if value is _class_value(cls, name):
            continue
        kept[name] = value
    obj.__dict__ = kept


def spent_headers(request: Any) -> None:
    """Once C{request}'s response headers are written: its response headers are L{SENT}, and of its
    request headers it keeps only what its access line will read (the parsed headers of an MCP GET
    stream are about 530 B, its response headers 104 B)."""
    request.responseHeaders = SENT
    headers = request.requestHeaders
    kept = {name: values for name in _KEPT_REQUEST_HEADERS if (values := headers.getRawHeaders(name))}
    request.requestHeaders = Headers(kept) if kept else SENT


def slim_stream(request: Any) -> None:
    """Compact C{request} and its channel once its response's headers are written and it only
    streams (L{relayd.web.streams.sse.SSEStream.start})."""
    if not getattr(request, "startedWriting", False):
        return  # the headers (and the cookies) are still to be written
    spent_headers(request)
    for name in ("method", "clientproto"):
        value = getattr(request, name, None)
        if isinstance(value, bytes):
            setattr(request, name, _REQUEST_LINE_WORDS.get(value, value))
    content = vars(request).get("content")
    if content is not None:
        content.close()  # what Twisted's connectionLost would do (an in-memory copy of the body)
    compact(request, _REQUEST_SPENT)
    channel = getattr(request, "channel", None)
    if channel is not None and hasattr(channel, "__dict__"):
        compact(channel)
