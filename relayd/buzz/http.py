"""C{POST /v1/action}: the HTTP binding of the broker contract, and C{GET /healthz}.

The broker serves one action resource, C{/v1/action}, with exactly one method on it, and its health
at C{/healthz} (C{GET}, C{HEAD}). Everything else is answered here, in JSON, before the credential or
the body is looked at (RFC 9110): another path is C{404}, another method C{405} with C{Allow}, a
body that is not C{application/json} (or carries a content coding) C{415}.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from relayd.buzz import contract
from relayd.buzz.host import BrokerHost
from relayd.web.body import BodyLimit, EarlyAnswer, read_body

_JSON = b"application/json"
ACTION_PATH = b"/v1/action"
HEALTH_PATH = b"/healthz"
_ALLOW = b"POST"
_ALLOW_HEALTH = b"GET, HEAD"
_OWS = b" \t"


def _refusal(error: str, message: str) -> bytes:
    return contract.dumps({"error": error, "message": message})


# Every refusal is a constant: none quotes anything the request chose.
_NOT_FOUND = _refusal("not_found", "the broker serves only POST /v1/action and GET /healthz")
_HEALTH_NOT_ALLOWED = _refusal("method_not_allowed", "/healthz accepts only GET and HEAD")
_NOT_ALLOWED = _refusal("method_not_allowed", "/v1/action accepts only POST")
_NOT_JSON = _refusal("unsupported_media_type", "the body must be sent as Content-Type: application/json")
_CODED = _refusal("unsupported_media_type", "the body must be sent without a Content-Encoding")


def is_json(content_types: Sequence[bytes] | None) -> bool:
    """Whether the request's C{Content-Type} header values name C{application/json}.

    Exactly one value; its media type compared case-insensitively (RFC 9110 8.3.1); parameters
    such as C{charset=utf-8} are allowed and ignored (the body is always read as UTF-8).
    """
    if not content_types or len(content_types) != 1:
        return False
    return content_types[0].split(b";", 1)[0].strip(_OWS).lower() == _JSON


def _identity_coded(encodings: Sequence[bytes] | None) -> bool:
    """Whether no content coding other than C{identity} was applied to the body."""
    for value in encodings or ():
        for coding in value.split(b","):
            if coding.strip(_OWS).lower() not in (b"", b"identity"):
                return False
    return True


class BrokerResource(Resource):
    """The broker's whole resource tree. Every verdict is HTTP 200 with an envelope; only
    uncorrelatable bodies get 400, and requests that are not C{POST /v1/action} with a JSON body
    get the JSON 404, 405 or 415 above."""

    isLeaf = True
    _log = Logger()

    def __init__(self, host: BrokerHost, upstream: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__()
        self.host = host
        self.upstream = upstream

    def render(self, request: Request) -> Any:
        if request.path == HEALTH_PATH:
            return self._health(request)
        if request.path != ACTION_PATH:
            return _refuse(request, 404, _NOT_FOUND)
        if request.method != b"POST":
            request.setHeader(b"allow", _ALLOW)
            return _refuse(request, 405, _NOT_ALLOWED)
        headers = request.requestHeaders
        if not is_json(headers.getRawHeaders(b"content-type")):
            request.setHeader(b"accept-post", _JSON)
            return _refuse(request, 415, _NOT_JSON)
        if not _identity_coded(headers.getRawHeaders(b"content-encoding")):
            request.setHeader(b"accept-encoding", b"identity")
            return _refuse(request, 415, _CODED)
        return self._action(request)

    def _health(self, request: Request) -> bytes:
        """C{200} while the broker answers (docs/decisions.md B-13): C{status} is C{degraded} while
        its Nostr relay cannot be reached, and C{upstream} says which relay, since when and why."""
        if request.method not in (b"GET", b"HEAD"):
            request.setHeader(b"allow", _ALLOW_HEALTH)
            return _refuse(request, 405, _HEALTH_NOT_ALLOWED)
        body: dict[str, Any] = {"ok": True, "status": "ok"}
        if self.upstream is not None:
            upstream = self.upstream()
            body["status"] = "ok" if upstream["connected"] else "degraded"
            body["upstream"] = upstream
        return _refuse(request, 200, contract.dumps(body))

    def _action(self, request: Request) -> Any:
        body = read_body(request)
        auth = request.requestHeaders.getRawHeaders(b"authorization")
        now: list[Any] = []
        later: list[bool] = []
        gone: list[bool] = []

        def answer(result: Any) -> None:
            if not later:
                now.append(result)  # answered within this call: returned below
                return
            if gone:
                return  # the client left; the verdict is recorded and a retry replays it
            if not isinstance(result, tuple):
                self._log.failure("a broker answer failed", result)
                request.setResponseCode(500)
                request.finish()
                return
            status, data = result
            _headers(request, status)
            request.setHeader(b"content-length", b"%d" % len(data))
            request.write(data)
            request.finish()

        self.host.handle(auth, body).addBoth(answer)
        if now:
            # A replay is answered in the reactor turn that read it: no finish notification or
            # callback chain; twisted.web sets the length and finishes.
            result = now[0]
            if isinstance(result, tuple):
                status, data = result
                _headers(request, status)
                return data
            self._log.failure("a broker answer failed", result)
            request.setResponseCode(500)
            return b""
        later.append(True)
        request.notifyFinish().addErrback(lambda _: gone.append(True))
        return NOT_DONE_YET


def _headers(request: Request, status: int) -> None:
    request.setResponseCode(status)
    request.setHeader(b"content-type", _JSON)
    request.setHeader(b"cache-control", b"no-store")


def _refuse(request: Request, status: int, body: bytes) -> bytes:
    """A JSON answer (a refusal, or health); a HEAD request gets its headers (and length) without the body."""
    _headers(request, status)
    if request.method == b"HEAD":
        request.setHeader(b"content-length", b"%d" % len(body))
        return b""
    return body


def make_root(host: BrokerHost, upstream: Callable[[], dict[str, Any]] | None = None) -> Resource:
    """The resource tree: one leaf that serves C{/v1/action} and C{/healthz} (with C{upstream()}, the
    relay's reachability) and refuses every other path."""
    return BrokerResource(host, upstream)


def body_limit(max_bytes: int) -> BodyLimit:
    """The site's body cap: an oversize body gets 413 before the upload ends."""

    def respond(request: Any) -> EarlyAnswer:
        body = contract.dumps({"error": "invalid_request", "message": f"request body exceeds {max_bytes} bytes"})
        return 413, [(b"content-type", _JSON)], body

    return BodyLimit(max_bytes, respond)
