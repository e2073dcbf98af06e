"""C{POST /v1/action}: the HTTP binding of the broker contract, and C{GET /healthz}.

The broker serves one action resource, C{/v1/action}, with exactly one method on it, and its health
at C{/healthz} (C{GET}, C{HEAD}), through the one request layer (relayd/web/routes.py). Everything
else is answered in JSON before the credential or the body is looked at (RFC 9110): another path is
C{404}, another method C{405} with C{Allow}, a body that is not C{application/json} (or carries a
content coding) C{415}. No answer of this resource may be cached (C{Cache-Control: no-store}).

The credential is judged at the end of the headers too: a request the stores refuse at once (no,
a malformed, an unknown, a revoked or an expired credential) whose body is larger than
L{UNAUTHENTICATED_BODY_LIMIT} (or chunked) is answered C{401} there, and its body never read. A
smaller body is read: the contract answers a refused credential with a verdict that echoes the
body's C{requestId} (C{failed}/C{unauthenticated}), and that costs at most the limit per connection.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.server import Request

from relayd.buzz.core import contract
from relayd.buzz.core.host import BrokerHost
from relayd.web.answers import Answer, Refusals, json_answer
from relayd.web.media import media_type
from relayd.web.request import BodyLimit, read_body
from relayd.web.routes import RoutedResource, RouteTable, answer_when

_JSON = b"application/json"
_OWS = b" \t"
UNAUTHENTICATED_BODY_LIMIT = 64 * 1024
"""The largest body read from a request whose credential is refused (for its correlated verdict)."""


def _refusal(error: str, message: str) -> bytes:
    return contract.dumps({"error": error, "message": message})


# Every refusal is a constant: none quotes anything the request chose.
_NOT_FOUND = json_answer(404, _refusal("not_found", "the broker serves only POST /v1/action and GET /healthz"))
_NOT_ALLOWED = {  # the 405 body of each path, by its Allow value
    b"POST": _refusal("method_not_allowed", "/v1/action accepts only POST"),
    b"GET, HEAD": _refusal("method_not_allowed", "/healthz accepts only GET and HEAD"),
}
_NOT_JSON = json_answer(
    415,
    _refusal("unsupported_media_type", "the body must be sent as Content-Type: application/json"),
    ((b"accept-post", _JSON),),
)
_CODED = json_answer(
    415,
    _refusal("unsupported_media_type", "the body must be sent without a Content-Encoding"),
    ((b"accept-encoding", b"identity"),),
)
_UNAUTHENTICATED = json_answer(
    401,
    _refusal(
        "unauthenticated",
        f"credential missing, malformed or rejected; a body over {UNAUTHENTICATED_BODY_LIMIT} bytes"
        " (or chunked) is not read without a valid one",
    ),
    ((b"www-authenticate", b"Bearer"),),
)
# A host that fails instead of answering a verdict is a bug (BrokerHost.handle turns every fault into
# one): logged, on the broker's logger, with its traceback, and answered in the broker's words.
REFUSALS = Refusals(internal_error=json_answer(500, _refusal("internal_error", "internal broker fault")), log=Logger())


def is_json(content_types: Sequence[bytes] | None) -> bool:
    """Whether the request's C{Content-Type} header values name C{application/json}.

    Exactly one value; its media type compared case-insensitively (RFC 9110 8.3.1); parameters
    such as C{charset=utf-8} are allowed and ignored (the body is always read as UTF-8).
    """
    if not content_types or len(content_types) != 1:
        return False
    return media_type(content_types[0]) == _JSON


def _identity_coded(encodings: Sequence[bytes] | None) -> bool:
    """Whether no content coding other than C{identity} was applied to the body."""
    for value in encodings or ():
        for coding in value.split(b","):
            if coding.strip(_OWS).lower() not in (b"", b"identity"):
                return False
    return True


class BrokerResource(RoutedResource):
    """The broker's whole resource tree. Every verdict is HTTP 200 with an envelope; only
    uncorrelatable bodies get 400, requests that are not C{POST /v1/action} with a JSON body
    get the JSON 404, 405 or 415 above, and a host bug the JSON 500 of L{REFUSALS}."""

    def __init__(self, host: BrokerHost, upstream: Callable[[], dict[str, Any]] | None = None) -> None:
        self.host = host
        self.upstream = upstream
        table = RouteTable(not_found=_NOT_FOUND, not_allowed=_NOT_ALLOWED.__getitem__, refusals=REFUSALS)
        table.add("/v1/action", {"POST": self._action}, checks={"POST": self._before_body})
        table.add("/healthz", {"GET": self._health})
        super().__init__(table)

    def prepare(self, request: Request) -> Answer | None:
        """Every answer, verdict or not, is C{no-store}: a verdict is one agent's, a refusal of the moment."""
        request.setHeader(b"cache-control", b"no-store")
        return None

    def _health(self, request: Request) -> Answer:
        """C{200} while the broker answers (docs/decisions.md B-13): C{status} is C{degraded} while
        its Nostr relay cannot be reached, and C{upstream} says which relay, since when and why."""
        body: dict[str, Any] = {"ok": True, "status": "ok"}
        if self.upstream is not None:
            upstream = self.upstream()
            body["status"] = "ok" if upstream["connected"] else "degraded"
            body["upstream"] = upstream
        return json_answer(200, contract.dumps(body))

    def _action(self, request: Request) -> Answer | Deferred[Answer]:
        refusal = _media_refusal(request)
        if refusal is not None:
            return refusal
        verdict = self.host.handle(request.requestHeaders.getRawHeaders(b"authorization"), read_body(request))
        # A replay (every store answered at once) is answered by the render call itself; a verdict
        # that comes later is written then, unless its client has left (routes.gone): the host has
        # kept what a retry needs before it answers.
        return answer_when(verdict, _answer, REFUSALS.answer)

    def _before_body(self, request: Request) -> Answer | None:
        """What the headers of an action refuse before its body is read: its media type, then a
        credential the stores refuse at once when the body is too large to read for a verdict."""
        refusal = _media_refusal(request)
        if refusal is not None:
            return refusal
        length = _declared_length(request)
        if length is not None and length <= UNAUTHENTICATED_BODY_LIMIT:
            return None
        if self.host.refused_at_once(request.requestHeaders.getRawHeaders(b"authorization")):
            return _UNAUTHENTICATED
        return None


def _declared_length(request: Request) -> int | None:
    """The body size C{Content-Length} declares, or C{None}: chunked, or more digits than C{int} reads
    (the site counts those as over its cap)."""
    values = request.requestHeaders.getRawHeaders(b"content-length")
    try:
        return int(values[0]) if values else None
    except ValueError:
        return None


def _media_refusal(request: Request) -> Answer | None:
    """The C{415} of an action whose body is not plain JSON (asked before the body is read too)."""
    headers = request.requestHeaders
    if not is_json(headers.getRawHeaders(b"content-type")):
        return _NOT_JSON
    if not _identity_coded(headers.getRawHeaders(b"content-encoding")):
        return _CODED
    return None


def _answer(verdict: tuple[int, bytes]) -> Answer:
    status, body = verdict
    return json_answer(status, body)


def make_root(host: BrokerHost, upstream: Callable[[], dict[str, Any]] | None = None) -> BrokerResource:
    """The resource tree: one leaf that serves C{/v1/action} and C{/healthz} (with C{upstream()}, the
    relay's reachability) and refuses every other path."""
    return BrokerResource(host, upstream)


def body_limit(max_bytes: int, check: Callable[[Request], Answer | None] | None = None) -> BodyLimit:
    """The site's body cap: an oversize body gets 413 before the upload ends (after C{check}, the
    resource's L{BrokerResource.early_answer}: what the headers alone refuse)."""

    too_large = json_answer(
        413, contract.dumps({"error": "invalid_request", "message": f"request body exceeds {max_bytes} bytes"})
    )

    def respond(request: Any) -> Answer:
        return too_large

    return BodyLimit(max_bytes, respond, check)
