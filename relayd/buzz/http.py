"""C{POST /v1/action}: the HTTP binding of the broker contract."""

from __future__ import annotations

from typing import Any

from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET, Request

from relayd.buzz import contract
from relayd.buzz.host import BrokerHost
from relayd.web.body import BodyLimit, EarlyAnswer, read_body

_JSON = b"application/json"


class ActionResource(Resource):
    """The one endpoint. Every verdict is HTTP 200 with an envelope; only uncorrelatable bodies get 400."""

    isLeaf = True
    _log = Logger()

    def __init__(self, host: BrokerHost) -> None:
        super().__init__()
        self.host = host

    def render_POST(self, request: Request) -> Any:
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


def make_root(host: BrokerHost) -> Resource:
    """The resource tree: only C{/v1/action} exists."""
    root = Resource()
    v1 = Resource()
    root.putChild(b"v1", v1)
    v1.putChild(b"action", ActionResource(host))
    return root


def body_limit(max_bytes: int) -> BodyLimit:
    """The site's body cap: an oversize body gets 413 before the upload ends."""

    def respond(request: Any) -> EarlyAnswer:
        body = contract.dumps({"error": "invalid_request", "message": f"request body exceeds {max_bytes} bytes"})
        return 413, [(b"content-type", _JSON)], body

    return BodyLimit(max_bytes, respond)
