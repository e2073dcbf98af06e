"""Shared helpers for the MCP wing's tests: a broker on a fake clock, a recording sink, a TestCase reading refusals."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from relayd.clock import Clock
from relayd.mcp.broker import Broker, BrokerConfig, Refused
from relayd.mcp.store import OUTBOUND, MemoryStore

TOKEN = "tok_abcdefghijklmnopqrstuvwxyz01"
SESSION = "sess"


def fired(d: Deferred[Any]) -> Any:
    """The result of an already-fired Deferred (the memory store never waits); raises its failure.

    For setting up outside a test method; tests read results with successResultOf/failureResultOf."""
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "Deferred has not fired"
    if isinstance(out[0], Failure):
        out[0].raiseException()
    return out[0]


class RecordingSink:
    """An SSE sink that keeps what it is given."""

    def __init__(self, accept: bool = True) -> None:
        self.events: list[bytes] = []
        self.ended = False
        self.accept = accept

    def deliver(self, event: bytes) -> bool:
        self.events.append(event)
        return self.accept

    def end(self) -> None:
        self.ended = True

    def messages(self) -> list[Any]:
        """The JSON of each C{event: mcp} event."""
        out = []
        for event in self.events:
            assert event.startswith(b"event: mcp\ndata: ") and event.endswith(b"\n\n"), event
            out.append(json.loads(event[len(b"event: mcp\ndata: ") : -2]))
        return out


def make_broker(**config: Any) -> tuple[Broker, task.Clock, MemoryStore]:
    """A broker over a memory store on a fake clock (at epoch 1_700_000_000 s), session C{sess} registered."""
    reactor = task.Clock()
    reactor.advance(1_700_000_000)
    store = MemoryStore()
    broker = Broker(store, Clock(reactor), BrokerConfig(**config))
    fired(broker.register(SESSION, TOKEN))
    return broker, reactor, store


def frames_of(result: Any) -> list[Any]:
    """Parsed frames of a poll result."""
    return [json.loads(json.loads(f)) for f in result.frames]


class BrokerCase(TestCase):
    """A TestCase for the broker over a memory store, where every Deferred has fired on return."""

    def refusal(self, d: Deferred[Any]) -> str:
        """The reason of an already-fired refusal (fails the test on a result or another error)."""
        return self.failureResultOf(d, Refused).value.reason

    def open_sse(self, broker: Broker, direction: str = OUTBOUND, label: str | None = None) -> RecordingSink:
        """A recording sink subscribed to session C{sess} in C{direction}, as C{label}."""
        sink = RecordingSink()
        self.successResultOf(broker.open_stream(SESSION, TOKEN, direction, label, sink))
        return sink
