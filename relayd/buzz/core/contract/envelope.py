"""The request and verdict envelopes: reading, validating, building and serialising both, and
holding a verdict to its request (docs/broker.md "HTTP")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from relayd.base import jsoncodec
from relayd.buzz.core.contract.actions import ARGS, OUTCOMES, check_args_semantics
from relayd.buzz.core.contract.errors import ContractError, MalformedResponse, RequestIdError, TransportError
from relayd.buzz.core.contract.strict_json import dumps, loads_strict
from relayd.buzz.core.contract.tree import check_tree, quote
from relayd.buzz.core.contract.validators import Shape, boolean, integer, json_object, request_id, string
from relayd.buzz.core.contract.vocabulary import (
    ACTION_VERSION,
    CODE_STATUSES,
    DEFAULT_LIMIT,
    PROTOCOL_VERSION,
    STATUSES,
)

REQUEST_MEMBERS = frozenset({"type", "protocolVersion", "requestId", "actionVersion", "action", "args"})
_ERROR_SHAPE = Shape({"code": lambda v, p: _code(v, p), "message": lambda v, p: string(v, p)})


def _code(v: Any, path: str) -> str:
    s = string(v, path)
    if s not in CODE_STATUSES:
        raise ContractError(f"{path} is not a known code")
    return s


@dataclass(frozen=True)


class Request:
    """A validated, normalised request; C{args} holds only present members, canonical values."""

    request_id: str
    action: str
    args: dict[str, Any]

    def effective_limit(self) -> int:
        """The page size a read answer is held to (the default page when C{limit} is absent)."""
        return int(self.args.get("limit", DEFAULT_LIMIT)) if self.action == "channel.read" else 0

    def to_wire(self) -> dict[str, Any]:
        return {
            "type": "broker_request",
            "protocolVersion": PROTOCOL_VERSION,
            "requestId": self.request_id,
            "actionVersion": ACTION_VERSION,
            "action": self.action,
            "args": self.args,
        }


def extract_request_id(tree: Any) -> str:
    """The usable requestId of a decoded body, or raise L{RequestIdError} (no verdict can correlate)."""
    if not isinstance(tree, dict):
        raise RequestIdError("request body is not a JSON object")
    if "requestId" in getattr(tree, "dups", ()):
        raise RequestIdError("requestId is repeated")
    if "requestId" not in tree:
        raise RequestIdError("requestId is missing")
    try:
        return request_id(tree["requestId"])
    except ContractError as e:
        raise RequestIdError(e.message) from None


def parse_request_body(body: bytes) -> tuple[str, Any]:
    """Decode a request body far enough to correlate it: returns (requestId, decoded tree).

    @raise RequestIdError: not UTF-8 JSON, or no usable requestId.
    """
    try:
        tree = loads_strict(body)
    except ValueError as e:
        # The fault named as every wing names it (relayd.base.jsoncodec); it quotes nothing from the body.
        raise RequestIdError(f"request body is not valid JSON: {jsoncodec.refusal_reason(body, e)}") from None
    except RecursionError:
        raise RequestIdError("request body nests too deeply to decode") from None
    return extract_request_id(tree), tree


def validate_request(tree: Any) -> Request:
    """Validate a decoded request envelope; raises L{ContractError} carrying the verdict code."""
    rid = extract_request_id(tree)
    # A different envelope version may have a different shape: judge the version first.
    if "protocolVersion" in tree and type(tree["protocolVersion"]) is int and not getattr(tree, "dups", None):
        if tree["protocolVersion"] != PROTOCOL_VERSION:
            raise ContractError("protocolVersion is not supported", "unsupported_protocol_version")
    check_tree(tree)
    for k in tree:
        if k not in REQUEST_MEMBERS:
            raise ContractError(f"request has unknown member {quote(k)}")
    for k in ("type", "protocolVersion", "actionVersion", "action", "args"):
        if k not in tree:
            raise ContractError(f"request is missing {k!r}")
    if tree["type"] != "broker_request":
        raise ContractError("type must be broker_request")
    version = integer(tree["protocolVersion"], "protocolVersion", 0, 65_535)
    if version != PROTOCOL_VERSION:
        raise ContractError("protocolVersion is not supported", "unsupported_protocol_version")
    action = string(tree["action"], "action")
    if action not in ARGS:
        raise ContractError("action is not known to this host", "unknown_action")
    av = integer(tree["actionVersion"], "actionVersion", 0, 65_535)
    if av != ACTION_VERSION:
        raise ContractError(f"actionVersion {av} is not supported for {action}", "unsupported_action_version")
    args = ARGS[action].parse(tree["args"], "args")
    check_args_semantics(action, args)
    return Request(rid, action, args)


def parse_request(body: bytes) -> Request:
    """Parse request bytes strictly (client-side reader and tests)."""
    _, tree = parse_request_body(body)
    return validate_request(tree)


def build_request(action: str, args: Mapping[str, Any], request_id: str, protocol_version: int = 1) -> Request:
    """Validate and normalise a request built in code (the client's construction door)."""
    if protocol_version != PROTOCOL_VERSION:
        raise ContractError("protocolVersion is not supported", "unsupported_protocol_version")
    tree = {
        "type": "broker_request",
        "protocolVersion": protocol_version,
        "requestId": request_id,
        "actionVersion": ACTION_VERSION,
        "action": action,
        "args": dict(args),
    }
    return validate_request(tree)


def freeze(request: Request) -> bytes:
    """Serialise a request once; these bytes are what every attempt and retry sends (I3)."""
    return dumps(request.to_wire())


# --- responses -----------------------------------------------------------------------------------


@dataclass(frozen=True)


class Response:
    """A verdict. C{replayed} is delivery metadata, never part of the stored verdict."""

    request_id: str
    status: str
    action: str | None = None
    outcome: dict[str, Any] | None = None
    code: str | None = None
    message: str | None = None
    replayed: bool = False

    def to_wire(self, replayed: bool | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "type": "broker_result",
            "protocolVersion": PROTOCOL_VERSION,
            "requestId": self.request_id,
            "status": self.status,
        }
        if self.status == "succeeded":
            out["action"] = self.action
            out["outcome"] = self.outcome
        else:
            out["error"] = {"code": self.code, "message": self.message}
        if self.replayed if replayed is None else replayed:
            out["replayed"] = True
        return out


def succeeded(request_id: str, action: str, outcome: dict[str, Any]) -> Response:
    return Response(request_id, "succeeded", action=action, outcome=outcome)


def failed(request_id: str, code: str, message: str) -> Response:
    status = "indeterminate" if code == "outcome_unknown" else "failed"
    return Response(request_id, status, code=code, message=message)


def indeterminate(request_id: str, code: str, message: str) -> Response:
    return Response(request_id, "indeterminate", code=code, message=message)


def serialize_response(resp: Response) -> bytes:
    """Serialise a verdict after checking it passes the strict reader (the host never emits junk).

    The reader's rules are applied to the values, not to bytes decoded back: a dict cannot repeat a
    key, the shape validators refuse C{null} where they check types, and the encoder refuses lone
    surrogates. Read outcomes whose events are L{CheckedEvents} skip the per-event check they
    already passed.
    """
    wire = resp.to_wire()
    try:
        _parse_response_tree(wire)
    except (ContractError, ValueError) as e:
        raise MalformedResponse(str(e)) from None
    return dumps(wire)


def mark_replayed(stored: bytes) -> bytes:
    """Add C{"replayed":true} to a stored verdict's bytes; the result is otherwise byte-identical."""
    assert stored.endswith(b"}")
    return stored[:-1] + b',"replayed":true}'


def parse_response(data: bytes | Any, request: Request | None = None) -> Response:
    """Read a response strictly; with C{request}, also hold it to that request (I5).

    @raise MalformedResponse: not a host verdict for the request.
    """
    try:
        if isinstance(data, bytearray):
            data = bytes(data)
        tree = loads_strict(data) if isinstance(data, (bytes, str)) else data
        check_tree(tree)
        resp = _parse_response_tree(tree)
    except (ContractError, ValueError, RecursionError) as e:
        raise MalformedResponse(str(e)) from None
    if request is not None:
        correlate(request, resp)
    return resp


def _parse_response_tree(tree: Any) -> Response:
    obj = json_object(tree, "response")
    status = obj.get("status")
    if status not in STATUSES:
        raise ContractError("status is not succeeded, failed or indeterminate")
    allowed = {"type", "protocolVersion", "requestId", "status", "replayed"}
    allowed |= {"action", "outcome"} if status == "succeeded" else {"error"}
    for k in obj:
        if k not in allowed:
            raise ContractError(f"response has member {quote(k)} not allowed with status {status}")
    for k in allowed - {"replayed"}:
        if k not in obj:
            raise ContractError(f"response is missing {k!r}")
    if obj["type"] != "broker_result":
        raise ContractError("type must be broker_result")
    if integer(obj["protocolVersion"], "protocolVersion", 0, 65_535) != PROTOCOL_VERSION:
        raise ContractError("protocolVersion is not supported")
    rid = request_id(obj["requestId"])
    replayed = boolean(obj["replayed"], "replayed") if "replayed" in obj else False
    if status == "succeeded":
        action = string(obj["action"], "action")
        if action not in OUTCOMES:
            raise ContractError("action is not known")
        outcome = OUTCOMES[action].parse(obj["outcome"], "outcome")
        return Response(rid, status, action=action, outcome=outcome, replayed=replayed)
    err = _ERROR_SHAPE.parse(obj["error"], "error")
    if status not in CODE_STATUSES[err["code"]]:
        raise ContractError(f"code {err['code']} cannot pair with status {status}")
    return Response(rid, status, code=err["code"], message=err["message"], replayed=replayed)


def code_allows(code: str, status: str) -> bool:
    """Whether the status/code table permits this pairing."""
    return status in CODE_STATUSES.get(code, frozenset())


def correlate(request: Request, resp: Response) -> None:
    """Hold a parsed response to its request (I5); raises L{MalformedResponse}."""
    if resp.request_id != request.request_id:
        raise MalformedResponse("requestId does not match the request")
    if resp.status != "succeeded":
        return
    if resp.action != request.action:
        raise MalformedResponse("outcome is for a different action")
    out = resp.outcome or {}
    args = request.args
    if request.action == "channel.read":
        limit = request.effective_limit()
        if len(out["messages"]) > limit:
            raise MalformedResponse(f"page exceeds the request's limit of {limit}")
    elif request.action == "agents.create":
        if out["channelId"] != args["channelId"]:
            raise MalformedResponse("channelId echo does not match the request")
    elif request.action in ("agents.update", "agents.delete"):
        target = args["target"]
        if "pubkey" in target and out["agentPubkey"] != target["pubkey"]:
            raise MalformedResponse("agentPubkey echo does not match the target")


def read_http_response(request: Request, status: int, body: bytes) -> Response:
    """Client rule for HTTP answers: a valid correlated envelope is the answer whatever the status.

    @raise TransportError: when no envelope for this request can be read.
    """
    try:
        return parse_response(body, request)
    except MalformedResponse as e:
        raise TransportError(f"HTTP {status}: no verdict ({e})") from None
