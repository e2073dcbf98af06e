"""One request layer for every wing: a route table and handlers that answer now or later (the answers
themselves, the refusals and the 404/405 are relayd.web.answers; docs/architecture.md, "A request").

A wing declares its routes as C{(path, method) -> handler}; a handler gets the request and the
path's named parts and returns an L{Answer}, a C{Deferred} of one, or L{TAKEN} when it has taken
the request over (an SSE stream, a WebSocket upgrade, a poll that finishes itself). An L{Answer}
returned at once is written in the same call, as C{Resource.render} returns bytes (the synchronous
fast path: no callback chain, no finish notification). A path the table does not know gets the
wing's JSON C{404}; a known path and another method its JSON C{405} with C{Allow}; C{HEAD} is
answered by the C{GET} handler, without the body.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar, Union

from twisted.internet.defer import Deferred, fail
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from relayd.web.answers import NOT_FOUND, Answer, Refusals, finish, method_rank, not_allowed, write_answer


class _Taken:
    def __repr__(self) -> str:
        return "TAKEN"


TAKEN: Final = _Taken()
"""What a handler returns when it has taken the request over and will finish it itself."""

Result = Union[Answer, "Deferred[Answer]", _Taken]
_T = TypeVar("_T")
Handler = Callable[..., Result]
"""C{handler(request, **parts)}: the path's named parts as keyword arguments (C{str})."""
HeaderCheck = Callable[[Request], "Answer | None"]
"""What a route refuses from a request's headers alone (a media type, a version), or C{None}: asked
before the body is read (L{RoutedResource.early_answer}) and by the handler itself."""


def answer_when(
    d: Deferred[_T], answer: Callable[[_T], Answer], refuse: Callable[[Failure], Answer]
) -> Answer | Deferred[Answer]:
    """C{answer(result)} or C{refuse(failure)} once C{d} fires: the answer itself when C{d} has
    fired already (a synchronous store: the fast path, written in the render call), else a
    C{Deferred} of it. One callback pair on C{d}, whichever way it goes.
    """
    now: list[Answer | Failure] = []
    later: list[Deferred[Answer]] = []

    def settle(result: Any, make: Callable[[Any], Answer]) -> None:
        outcome: Answer | Failure
        try:
            outcome = make(result)
        except Exception:
            outcome = Failure()  # a bug in make: the table's refusals answer it
        if not later:
            now.append(outcome)
        elif isinstance(outcome, Failure):
            later[0].errback(outcome)
        else:
            later[0].callback(outcome)

    d.addCallbacks(settle, settle, callbackArgs=(answer,), errbackArgs=(refuse,))
    if now:
        outcome = now[0]
        if isinstance(outcome, Failure):
            return fail(outcome)
        return outcome
    later.append(Deferred())
    return later[0]


_PART = re.compile(r"\{([a-z_]+)\}")

_NO_METHODS: Final = Answer(405)
_FOUND_MAX: Final = 4096  # paths whose lookup a route table keeps
_FOUND_PATH_MAX: Final = 256  # the longest path kept (a client's long paths would pin 16 KiB each)


@dataclass
class _Route:
    pattern: re.Pattern[bytes] | None  # None: matched by the exact path
    methods: dict[bytes, Handler] = field(default_factory=dict)
    other: Handler | None = None  # every method not named (C{"*"})
    checks: dict[bytes, HeaderCheck] = field(default_factory=dict)  # by method
    allow: bytes = b""
    not_allowed: Answer = _NO_METHODS  # its 405, made by RouteTable.add once its methods are known


class RouteTable:
    """A wing's routes: C{(path, method) -> handler}.

    A path is exact (C{/healthz}) or holds named parts (C{/sessions/{session}/inbox}); a part matches
    one non-empty path segment, or what C{parts} says for its name (C{{"session": "[a-z0-9]{4,64}"}}:
    a path whose part does not match is not served, C{404}). Exact paths are found with one dictionary
    lookup. Paths are UTF-8, matched against the raw (not percent-decoded) request path. C{not_allowed}
    is the JSON body of a C{405}: the same for every path, or made per path from its C{Allow} value.
    """

    def __init__(
        self,
        not_found: Answer | None = None,
        not_allowed: bytes | Callable[[bytes], bytes] = b'{"error":"method_not_allowed"}',
        refusals: Refusals | None = None,
        parts: Mapping[str, str] | None = None,
    ) -> None:
        self.not_found = not_found or NOT_FOUND
        self.not_allowed = not_allowed
        self.refusals = refusals or Refusals()
        self.parts = dict(parts or {})
        self._exact: dict[bytes, _Route] = {}
        self._patterns: list[_Route] = []
        # Paths already looked up: a POST's is looked up at the end of its headers and again when it
        # is rendered, and a session's paths come back with every request (bounded, emptied when full).
        self._found: dict[bytes, tuple[_Route, dict[str, str]] | None] = {}

    def add(
        self,
        path: str,
        handlers: Mapping[str, Handler],
        prefix: str = "",
        *,
        head: bool = True,
        checks: Mapping[str, HeaderCheck] | None = None,
    ) -> None:
        """Serve C{prefix + path}: each method in C{handlers} by its handler (C{HEAD} by C{GET}'s if
        not named, unless C{head} is false: a stream, an upgrade, whose C{HEAD} is a C{405}).
        C{prefix} is literal (an operator's, braces and all); only C{path} names parts.

        A handler under C{"*"} takes every method not named (a protocol whose checks come before
        the method's, or whose C{405} is its own); C{Allow} lists the named ones. C{checks} are
        the L{HeaderCheck}s of some of the methods, asked before their body is read.
        """
        self._found.clear()
        methods = {m.encode("ascii"): h for m, h in handlers.items()}
        other = methods.pop(b"*", None)
        if head and b"GET" in methods and b"HEAD" not in methods:
            methods[b"HEAD"] = methods[b"GET"]
        if _PART.search(path):
            pieces = _PART.split(path)  # literal, name, literal, name, ..., literal
            regex = re.escape(prefix) + "".join(
                re.escape(p) if i % 2 == 0 else f"(?P<{p}>{self.parts.get(p, '[^/]+')})" for i, p in enumerate(pieces)
            )
            route = _Route(re.compile(regex.encode("utf-8")), methods)
            self._patterns.append(route)
        else:
            route = self._exact.setdefault((prefix + path).encode("utf-8"), _Route(None))
            route.methods.update(methods)
        if other is not None:
            route.other = other
        route.checks.update((m.encode("ascii"), check) for m, check in (checks or {}).items())
        route.allow = b", ".join(sorted(route.methods, key=method_rank))
        body = self.not_allowed(route.allow) if callable(self.not_allowed) else self.not_allowed
        route.not_allowed = not_allowed(route.allow, body)

    def _find(self, path: bytes) -> tuple[_Route, dict[str, str]] | None:
        """The route of C{path} and its named parts (shared: never changed by a caller), or C{None}."""
        found = self._found
        try:
            return found[path]
        except KeyError:
            pass
        route = self._search(path)
        if len(path) <= _FOUND_PATH_MAX:
            if len(found) >= _FOUND_MAX:
                found.clear()
            found[path] = route
        return route

    def _search(self, path: bytes) -> tuple[_Route, dict[str, str]] | None:
        route = self._exact.get(path)
        if route is not None:
            return route, {}
        for candidate in self._patterns:
            match = candidate.pattern.fullmatch(path)  # type: ignore[union-attr]
            if match is not None:
                return candidate, {k: v.decode("utf-8", "replace") for k, v in match.groupdict().items()}
        return None

    def resolve(self, method: bytes, path: bytes) -> tuple[Handler, dict[str, str]] | Answer:
        """The handler for C{method} on C{path} and the path's parts, or the C{404}/C{405} answer."""
        found = self._find(path)
        if found is None:
            return self.not_found
        route, parts = found
        handler = route.methods.get(method) or route.other
        if handler is None:
            return route.not_allowed
        return handler, parts

    def refuse_early(self, request: Request) -> Answer | None:
        """The C{404}/C{405} of C{request}'s method and path, or its route's L{HeaderCheck}'s answer;
        C{None} when the headers refuse nothing."""
        found = self._find(request.path)
        if found is None:
            return self.not_found
        route = found[0]
        method = request.method
        if method not in route.methods and route.other is None:
            return route.not_allowed
        check = route.checks.get(method)
        return None if check is None else check(request)

    def allowed(self, path: bytes) -> bytes | None:
        """The C{Allow} value of C{path} (its named methods), or C{None} when the table does not serve it."""
        found = self._find(path)
        return None if found is None else found[0].allow


class RoutedResource(Resource):
    """A wing's whole resource tree: one leaf that serves a L{RouteTable}.

    Subclasses may override L{prepare} to set headers every answer carries (CORS) or to answer a
    request before routing (C{OPTIONS} preflight).
    """

    isLeaf = True

    def __init__(self, table: RouteTable) -> None:
        super().__init__()
        self.table = table

    def prepare(self, request: Request) -> Answer | None:
        """Called before routing; an answer here is the response."""
        return None

    def early_answer(self, request: Request) -> Answer | None:
        """What the headers alone refuse, at their end, before a body is read (a site's
        L{BodyLimit.check}): L{prepare}'s answer, the route's C{404}/C{405} or its L{HeaderCheck}'s,
        with the headers L{prepare} set; C{None} to read the body and render."""
        answer = self.prepare(request) or self.table.refuse_early(request)
        if answer is None:
            return None
        set_before = [(name, value) for name, values in request.responseHeaders.getAllRawHeaders() for value in values]
        return Answer(answer.status, answer.body, (*set_before, *answer.headers))

    def render(self, request: Request) -> bytes | int:
        answer = self.prepare(request)
        if answer is None:
            resolved = self.table.resolve(request.method, request.path)
            if isinstance(resolved, Answer):
                answer = resolved
            else:
                handler, parts = resolved
                try:
                    result = handler(request, **parts)
                except Exception:
                    answer = self.table.refusals.answer(Failure())
                else:
                    if result is TAKEN:
                        return NOT_DONE_YET
                    # An Answer is asked first: isinstance against Deferred (an Awaitable, so an ABC)
                    # of anything else takes the ABC machinery's slow path, once per request.
                    if type(result) is not Answer and isinstance(result, Deferred):
                        return self._later(request, result)
                    answer = result  # type: ignore[assignment]
        return write_answer(request, answer)  # type: ignore[arg-type]

    def _later(self, request: Request, d: Deferred[Answer]) -> int:
        # A Deferred that has already fired is answered in this call, like a plain Answer. Arguments,
        # not closures: a request parked for minutes (a long-poll) holds two small tuples, no functions.
        d.addCallbacks(_answered, _failed, callbackArgs=(request,), errbackArgs=(request, self.table.refusals))
        return NOT_DONE_YET


def _answered(answer: Answer, request: Request) -> None:
    finish(request, answer)


def _failed(failure: Failure, request: Request, refusals: Refusals) -> None:
    finish(request, refusals.answer(failure))
