"""What relayd answers over HTTP: L{Answer}, JSON answers, a wing's L{Refusals}, the JSON 404 and 405,
the one disconnect check, and L{raw_response}: the one hand-written response every answer that does
not go through twisted.web's request (the channel's refusals, the early answer to a body, the plain
POST) is written with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.http import RESPONSES, datetimeToString
from twisted.web.server import Request
from twisted.web.server import version as _server_version

from relayd.compat.web import watch_end as watch_end  # (re-exported: a wing tells a request's end through relayd.web)

JSON_TYPE: Final = b"application/json"
Header = tuple[bytes, bytes]


@dataclass(frozen=True, slots=True)
class Answer:
    """A complete response: status, body and headers (C{content-type} among them when there is a body)."""

    status: int
    body: bytes = b""
    headers: Sequence[Header] = ()


@dataclass(frozen=True, slots=True)
class RenderedAnswer(Answer):
    """An answer a route table rendered beside twisted.web (relayd.web.plain_request), with where
    twisted.web would write its C{Server} and C{Date}: after the first C{early} of its headers, those
    set at the end of the request's headers (the early check), before twisted.web processes it."""

    early: int = 0


def json_answer(status: int, body: bytes, headers: Iterable[Header] = ()) -> Answer:
    """An answer whose C{body} is JSON text already encoded."""
    return Answer(status, body, ((b"content-type", JSON_TYPE), *headers))


NOT_FOUND: Final = json_answer(404, b'{"error":"not_found"}')
INTERNAL_ERROR: Final = json_answer(500, b'{"error":"internal_error"}')
METHOD_ORDER: Final = {b"GET": 0, b"HEAD": 1, b"POST": 2, b"PUT": 3, b"PATCH": 4, b"DELETE": 5, b"OPTIONS": 6}
"""The order methods are listed in an C{Allow} value (others after them, alphabetically)."""


def method_rank(method: Any) -> tuple[int, bytes]:
    """C{method}'s place in an C{Allow} value (L{METHOD_ORDER})."""
    return METHOD_ORDER.get(method, 9), method


def not_allowed(allow: bytes, body: bytes = b'{"error":"method_not_allowed"}') -> Answer:
    """The JSON C{405} of a path whose methods are C{allow}."""
    return json_answer(405, body, ((b"allow", allow),))


_NO_CHANNEL: Final = object()  # a request type that has none (a test's DummyRequest) is never gone


def gone(request: Request) -> bool:
    """Whether nothing more can be written to C{request}: its client left, or it was finished.

    The one disconnect check: every answer given later, and every stream about to start, asks it.
    """
    # Twisted's request drops its channel (sets it to None) when its connection is lost.
    return bool(request.finished) or getattr(request, "channel", _NO_CHANNEL) is None


def write_answer(request: Request, answer: Answer) -> bytes:
    """Set C{answer}'s status and headers on C{request} and return the body to send (none for C{HEAD})."""
    # twisted.web knows no phrase for some codes relayd answers (426 read "Unknown Status").
    request.setResponseCode(answer.status, _REASONS.get(answer.status))
    headers = request.responseHeaders
    for name, value in answer.headers:
        headers.setRawHeaders(name, [value])
    body = answer.body
    if answer.status != 204 and answer.status != 304:
        request.setHeader(b"content-length", b"%d" % len(body))
    return b"" if request.method == b"HEAD" else body


def finish(request: Request, answer: Answer) -> None:
    """Send C{answer} as the whole response, unless the client has already gone."""
    if gone(request):
        return
    body = write_answer(request, answer)
    if body:
        request.write(body)
    request.finish()


class Refusals:
    """One wing's mapping from the exceptions its handlers raise (or fail with) to answers.

    The first entry whose type matches wins; anything else is a bug: logged with its traceback (on
    C{log}, the wing's logger, so that the record names the wing's relay; else this module's) and
    answered C{500} with the wing's internal-error body (which quotes nothing of the request).
    """

    _log = Logger()

    def __init__(
        self,
        mapping: Sequence[tuple[type[BaseException], Callable[[Any], Answer]]] = (),
        internal_error: Answer | None = None,
        log: Logger | None = None,
    ) -> None:
        self.mapping = tuple(mapping)
        self.internal_error = internal_error or INTERNAL_ERROR
        if log is not None:
            self._log = log

    def answer(self, failure: Failure) -> Answer:
        """The answer for C{failure}."""
        error = failure.value
        for kind, make in self.mapping:
            if isinstance(error, kind):
                return make(error)
        self._log.failure("a request failed", failure)
        return self.internal_error


# twisted.web's reason phrases, but RFC 9110's where Twisted's are older (408, 413) or missing (431).
_REASONS = {
    **RESPONSES, 408: b"Request Timeout", 413: b"Payload Too Large", 426: b"Upgrade Required",
    431: b"Request Header Fields Too Large",
}
_FRAMING = frozenset((b"connection", b"content-length"))


def raw_response(
    status: int,
    headers: Iterable[Header],
    body: bytes,
    *,
    close: bool,
    head: bool = False,
    date: bytes | None = None,
    capitalised: bool = False,
    version: bytes = b"HTTP/1.1",
    dated_after: int = 0,
) -> bytes:
    """The bytes of a whole HTTP/1.1 response: status line, C{headers}, C{content-length} (of
    C{body}, which a C{head} answer does not send) and C{connection: close} when C{close}.

    The framing headers are this writer's: C{content-length} and C{connection} among C{headers} are
    not repeated. A C{date} (L{http_date}) adds the C{Server} and C{Date} lines twisted.web writes (and
    takes its reason phrases), and C{capitalised} writes header names as it does (C{Content-Type}), for an answer that
    stands in for one of its (its order too: C{Connection} first, as its channel sets it before the
    resource renders, and the client's C{version} on the status line); C{dated_after}: that many of
    C{headers} come before the C{Server} and C{Date} lines (L{RenderedAnswer.early}).
    """
    key = (status, headers, len(body), close, date is None, capitalised, version, dated_after)
    try:
        parts = _HEADS.get(key)
        kept = True
    except TypeError:  # (headers in a list: not kept)
        parts, kept = None, False
    if parts is None:
        parts = _head(status, headers, len(body), close, date is not None, capitalised, version, dated_after)
        if kept and len(_HEADS) < _HEADS_KEPT:
            _HEADS[key] = parts
    before, after = parts
    if head:
        body = b""
    return before + body if date is None else before + date + after + body


# The heads written before (relayd's own answers: a few), each as the bytes before its Date value
# and those after it (all of it before, undated).
_HEADS: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
_HEADS_KEPT = 256


def _head(
    status: int, headers: Iterable[Header], length: int, close: bool, dated: bool, capitalised: bool, version: bytes,
    dated_after: int = 0,
) -> tuple[bytes, bytes]:
    """L{raw_response}'s head: the bytes before the C{Date} value, and after it (through the blank line)."""
    reasons = _REASONS
    lines = [b"%s %d %s" % (version, status, reasons.get(status, b"Unknown Status"))]
    named = [
        b"%s: %s" % (_capitalised(name) if capitalised else name, value)
        for name, value in headers
        if name.lower() not in _FRAMING
    ]
    if dated:
        if close:
            lines.append(b"Connection: close")
        lines += named[:dated_after]
        del named[:dated_after]
        lines.append(b"Server: %s" % _server_version)
        lines.append(b"Date: ")  # (its value goes between the two parts)
    before = len(lines)
    lines += named
    lines.append(b"%s: %d" % (b"Content-Length" if capitalised else b"content-length", length))
    if close and not dated:
        lines.append(b"Connection: close" if capitalised else b"connection: close")
    if not dated:
        return b"\r\n".join(lines) + b"\r\n\r\n", b""
    return b"\r\n".join(lines[:before]), b"".join(b"\r\n" + line for line in lines[before:]) + b"\r\n\r\n"


# The last second whose Date value was formatted, and that value: a server answering thousands of
# requests a second formats one per second, not one per answer.
_date_of_second: tuple[int, bytes] = (-1, b"")


def http_date(when: float) -> bytes:
    """The C{Date} value of an answer at C{when} (seconds since the epoch, on the caller's clock), as
    twisted.web formats it (RFC 9110 IMF-fixdate), formatted once per second."""
    global _date_of_second
    second = int(when)
    cached_second, value = _date_of_second
    if second != cached_second:
        value = datetimeToString(second)
        _date_of_second = (second, value)
    return value


# The names twisted.web writes otherwise than capitalised (its http_headers' case mappings).
_CAPITALS: Final = {
    b"content-md5": b"Content-MD5", b"dnt": b"DNT", b"etag": b"ETag", b"p3p": b"P3P", b"te": b"TE",
    b"www-authenticate": b"WWW-Authenticate", b"x-xss-protection": b"X-XSS-Protection",
}  # fmt: skip


def _capitalised(name: bytes) -> bytes:
    """A header name as twisted.web writes it (C{content-type} -> C{Content-Type}, C{WWW-Authenticate})."""
    return _CAPITALS.get(name.lower()) or b"-".join(part.capitalize() for part in name.split(b"-"))
