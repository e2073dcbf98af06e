"""The contract's exceptions: a payload that breaks it, a request or response that cannot be read."""

from __future__ import annotations

from relayd.buzz.core.contract.vocabulary import MAX_ERROR


class ContractError(ValueError):
    """A payload that breaks the contract; C{code} is the failed-verdict code it earns."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        if len(message) > MAX_ERROR:
            message = message[: MAX_ERROR - 1] + "\u2026"
        super().__init__(message)
        self.code = code
        self.message = message


class RequestIdError(ContractError):
    """The request cannot be correlated: not JSON, or its requestId is unusable (HTTP 400)."""


class MalformedResponse(ValueError):
    """A response that is not a host verdict for the request (the caller treats it as no answer)."""


class TransportError(Exception):
    """No verdict: the request's fate is unknown (unreachable, no envelope, malformed envelope)."""
