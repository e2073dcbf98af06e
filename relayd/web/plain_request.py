"""A plain POST (relayd.web.simple_post) rendered by a wing's route table beside twisted.web: the
same C{prepare}, early checks, handlers and answers as twisted.web's path, so every policy (auth,
CORS, origin, size, refusals) has one copy, without twisted.web's channel parsing and C{Request}.

L{PlainRequest} is the request those handlers read: only what a handler of a POST answered whole
asks of one (its target, headers, query, body, client; its response's status, headers and body,
and when it finishes). A handler that would take the request over (an SSE stream, an upgrade) is
no handler for a plain POST: the wing declines those before rendering (L{render_plain}'s caller).
"""

from __future__ import annotations

from collections.abc import Callable
from io import BytesIO
from typing import Any

from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionLost
from twisted.python.failure import Failure
from twisted.web.http import parse_qs
from twisted.web.server import NOT_DONE_YET, Request

from relayd.web.answers import Answer, Header, RenderedAnswer
from relayd.web.request import BodyLimit
from relayd.web.routes import RoutedResource
from relayd.web.simple_post import HeldAnswer, SimplePost

__all__ = ["PlainRequest", "query_args", "render_plain"]


# Header names known to be lower-case already (those relayd asks for and sets: a few dozen), so that
# a name is not lowered again for each request that names it. Filled as names come; a name not
# lower-case is never put here (it is lowered each time), and it stops growing when full.
_LOWER: set[bytes] = set()
_LOWER_KEPT = 256


def _lower(name: bytes) -> bytes:
    """C{name} lower-cased (remembered among L{_LOWER} when it already was)."""
    lowered = name.lower()
    if lowered == name and len(_LOWER) < _LOWER_KEPT:
        _LOWER.add(name)
    return lowered


class _RequestFields:
    """A plain POST's headers as twisted.web's C{requestHeaders} reads them (one value per name)."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[bytes, bytes]) -> None:
        self.fields = fields

    def getRawHeaders(self, name: bytes, default: Any = None) -> Any:
        value = self.fields.get(name if name in _LOWER else _lower(name))
        return default if value is None else [value]

    def hasHeader(self, name: bytes) -> bool:
        return (name if name in _LOWER else _lower(name)) in self.fields


class _ResponseFields:
    """The response's headers as twisted.web's C{responseHeaders} keeps them: set in order, a name
    set again keeping its place."""

    __slots__ = ("fields",)

    def __init__(self) -> None:
        self.fields: dict[bytes, list[bytes]] = {}

    def setRawHeaders(self, name: bytes, values: list[bytes]) -> None:
        self.fields[name if name in _LOWER else _lower(name)] = list(values)

    def getRawHeaders(self, name: bytes, default: Any = None) -> Any:
        return self.fields.get(name if name in _LOWER else _lower(name), default)

    def hasHeader(self, name: bytes) -> bool:
        return (name if name in _LOWER else _lower(name)) in self.fields

    def getAllRawHeaders(self) -> Any:
        return self.fields.items()

    def lines(self) -> tuple[Header, ...]:
        # (a list built in one call, not a generator resumed per header)
        return tuple([(name, value) for name, values in self.fields.items() for value in values])


def query_args(query: bytes) -> dict[bytes, list[bytes]]:
    """The arguments of C{query} as twisted.web's request reads them (C{parse_qs(query, 1)}); a
    query of one argument with nothing to unquote or split (C{?token=...}) read without it."""
    # (find: docs/architecture.md, hot paths)
    if query.find(b"&") >= 0 or query.find(b";") >= 0 or query.find(b"%") >= 0 or query.find(b"+") >= 0:
        return parse_qs(query, 1)
    name, equals, value = query.partition(b"=")
    return {name: [value]} if equals else {}


class PlainRequest:
    """A plain POST as the request a route table's handlers read; its answer is an L{Answer}, now
    (L{answered}) or once it finishes (L{answer_to}: a L{HeldAnswer})."""

    method = b"POST"
    code = 200
    finished = False
    answered: RenderedAnswer | None = None
    """The response, once finished."""
    early = 0
    """How many of the response's headers were set by the early check (before twisted.web would
    set its C{Server} and C{Date}: L{RenderedAnswer})."""

    def __init__(self, post: SimplePost) -> None:
        self.uri = target = post.path
        path, _, query = target.partition(b"?")
        self.path = path
        self.args = query_args(query) if query else {}
        self.requestHeaders = _RequestFields(post.headers)
        self.responseHeaders = _ResponseFields()
        self.content = BytesIO(post.body)
        self.channel = post.channel
        self.clientproto = post.version
        self._written: list[bytes] = []
        self._answer_to: Callable[[Answer], object] | None = None
        # Told how the request ends, as twisted.web's request tells its own list: the Deferreds of
        # notifyFinish, and what relayd.compat.web's watch_end puts there instead of one.
        self.notifications: list[Any] = []

    # what a handler reads ------------------------------------------------------------------------

    def getHeader(self, name: bytes) -> bytes | None:
        return self.requestHeaders.fields.get(name if name in _LOWER else _lower(name))

    def getClientAddress(self) -> Any:
        return self.channel.getPeer()

    # what a handler answers -------------------------------------------------------------------

    def setResponseCode(self, code: int, message: bytes | None = None) -> None:
        self.code = code

    def setHeader(self, name: bytes, value: bytes) -> None:
        self.responseHeaders.fields[name if name in _LOWER else _lower(name)] = [value]

    def write(self, data: bytes) -> None:
        self._written.append(data)

    def notifyFinish(self) -> Deferred[None]:
        d: Deferred[None] = Deferred()
        self.notifications.append(d)
        return d

    def finish(self) -> None:
        self.finished = True
        answered = self.answered = RenderedAnswer(
            self.code, b"".join(self._written), self.responseHeaders.lines(), self.early
        )
        answer_to = self._answer_to
        if answer_to is not None:
            self._answer_to = None
            answer_to(answered)
        if self.notifications:  # (none for most: no list made for them)
            finishing, self.notifications = self.notifications, []
            for d in finishing:
                d.callback(None)

    def answer_to(self, write: Callable[[Answer], object]) -> None:
        """Hand the response to C{write} once the handler finishes it (a direct call: no Deferred
        per held request)."""
        if self.answered is not None:
            write(self.answered)
        else:
            self._answer_to = write

    def cancel(self) -> None:
        """The client left before the response: the request is gone, and told as twisted.web tells
        a request whose connection is lost."""
        self._answer_to = None
        self.channel = None  # (relayd.web.answers.gone: nothing more is written)
        finishing, self.notifications = self.notifications, []
        for d in finishing:
            d.errback(Failure(ConnectionLost("the client left before its answer")))


def render_plain(resource: RoutedResource, limit: BodyLimit | None, post: SimplePost) -> Answer | HeldAnswer | None:
    """C{post} rendered by C{resource} as twisted.web renders it, or C{None} (nothing done) when
    twisted.web's path would answer it early (L{BodyLimit.refusal}: its size, its route's checks),
    since an early answer is written otherwise. An empty body is declined too (twisted.web asks no
    early check of one)."""
    if not post.body:
        return None
    request = PlainRequest(post)
    seen: Request = request  # type: ignore[assignment]  # (not cast(): a call per request)
    if limit is not None and limit.refusal(seen, len(post.body)) is not None:
        return None
    request.early = sum(map(len, request.responseHeaders.fields.values()))
    rendered = resource.render(seen)
    if rendered is not NOT_DONE_YET:
        # (as twisted.web's Request.render writes what render returned, and finishes)
        request.write(rendered)  # type: ignore[arg-type]
        request.finish()
    if request.answered is not None:
        return request.answered
    return request
