"""Where an AEP WebSocket conversation is (L{relayd.aep.websocket.AEPSocket}): one L{Phase} value,
each phase an object holding what exists only in it, so that no impossible combination (a
subscription before the hello, a hello deadline after it, a role without a hello) can be written.

L{SHUT} (before the upgrade) -> L{AwaitingHello} (upgraded) -> L{Greeted} (hello) -> L{SHUT} (closed).
The WebSocket closing handshake is autobahn's own C{state}; the flow's (what is queued, paused,
held) is L{relayd.aep.socket_flow.SocketFlow}'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from twisted.internet.interfaces import IDelayedCall

from relayd.aep.core.event import Event
from relayd.aep.core.relay import Emitter

if TYPE_CHECKING:
    from relayd.aep.websocket import WSSubscription


class AwaitingHello:
    """The phase from the upgrade to the client's hello: only a hello is read, and a connection that
    sends none by the C{deadline} is closed (it would be held for ever, and count against the fd
    limit)."""

    __slots__ = ("deadline",)

    def __init__(self, deadline: IDelayedCall | None) -> None:
        self.deadline = deadline


class Greeted:
    """The phase after the client's hello, until the connection closes: what the hello said, and
    what a connection has only from then on: its subscriptions, the sessions it claims (the claims
    registry keeps that list: L{relayd.aep.core.claims}) and the events it sent this reactor turn
    (ingested together at the turn's end)."""

    __slots__ = ("role", "identity", "capabilities", "subscriptions", "claims", "events")

    def __init__(self, role: str, identity: dict[str, Any], capabilities: dict[str, Any]) -> None:
        self.role = role
        self.identity = identity
        self.capabilities = capabilities
        self.subscriptions: dict[Any, WSSubscription] = {}
        self.claims: list[str] = []
        self.events: list[Event] = []


class Shut:
    """The phase of a connection that is not open: before the upgrade, or closed (the relay has
    forgotten it; nothing it sends is read, nothing is sent to it)."""

    __slots__ = ()


SHUT = Shut()
Phase = AwaitingHello | Greeted | Shut
_NO_CLAIMS: tuple[str, ...] = ()  # a connection that has not said hello claims nothing


class PhasedEmitter(Emitter):
    """What command routing, the claims registry and C{GET /connections} read of a connection
    (L{Emitter}), read from its phase."""

    phase: Phase

    @property
    def hello_done(self) -> bool:
        return type(self.phase) is Greeted

    @property
    def role(self) -> str:
        phase = self.phase
        return phase.role if type(phase) is Greeted else "both"

    @property
    def identity(self) -> dict[str, Any]:
        phase = self.phase
        return phase.identity if type(phase) is Greeted else {}

    @property
    def capabilities(self) -> dict[str, Any]:
        phase = self.phase
        return phase.capabilities if type(phase) is Greeted else {}

    @property
    def claims(self) -> list[str]:
        # (Only a greeted connection sends events, so only it claims: the registry appends to this.)
        phase = self.phase
        return phase.claims if type(phase) is Greeted else cast(list[str], _NO_CLAIMS)
