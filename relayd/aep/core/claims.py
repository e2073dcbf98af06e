"""Session claims: which emitter connection owns which session, for command routing and the roster.

A sequenced event sent over a WebSocket claims its session for that connection until it closes.
L{IClaims} answers "who claims session S" over every relayd instance; L{MemoryClaims} is the
single-process registry, L{relayd.aep.redis.claims.RedisClaims} the shared one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twisted.internet.defer import Deferred, succeed
from zope.interface import Interface, implementer

from relayd.aep.core.event import Event


@dataclass
class Claimant:
    """A connection that claims a session: enough to route a command to it and list it.

    @ivar local: the connection object when it lives in this process, else C{None}.
    """

    conn_id: str
    role: str
    identity: dict[str, Any]
    capabilities: dict[str, Any]
    local: Any = None
    order: tuple[Any, ...] = field(default_factory=tuple)

    @property
    def accepts(self) -> list[str] | None:
        """The declared C{control.accepts} list, or C{None} when the target declared none."""
        control = self.capabilities.get("control") if isinstance(self.capabilities, dict) else None
        accepts = control.get("accepts") if isinstance(control, dict) else None
        return accepts if isinstance(accepts, list) else None

    def roster_entry(self, session: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"session": session}
        identity = self.identity if isinstance(self.identity, dict) else {}
        caps = self.capabilities if isinstance(self.capabilities, dict) else {}
        if identity.get("agent"):
            entry["agent"] = identity["agent"]
        if identity.get("instance"):
            entry["instance"] = identity["instance"]
        if "control" in caps:
            entry["control"] = caps["control"]
        if "emits" in caps:
            entry["emits"] = caps["emits"]
        return entry


class IClaims(Interface):
    """The claim registry (methods return Deferreds; the in-memory one fires at once)."""

    def connect(conn: Any) -> None:
        """A connection opened (it may claim sessions once it has said hello)."""

    def disconnect(conn: Any) -> Deferred[None]:
        """A connection closed: its claims disappear."""

    def claim(conn: Any, session: str) -> Deferred[None]:
        """C{conn} claims C{session} (idempotent)."""

    def claimants(session: str) -> Deferred[list[Claimant]]:
        """The hello-done, non-consumer connections claiming C{session}, on every instance."""

    def roster() -> Deferred[list[dict[str, Any]]]:
        """One entry per (hello-done non-consumer connection, claimed session), connection order."""

    def deliver(claimant: Claimant, event: Event) -> Deferred[None]:
        """Send a command to the claimant, wherever it is connected."""


def claimant_of(conn: Any, order: tuple[Any, ...] = ()) -> Claimant:
    """The L{Claimant} view of a local connection."""
    return Claimant(
        conn_id=str(id(conn)),
        role=conn.role,
        identity=conn.identity if isinstance(conn.identity, dict) else {},
        capabilities=conn.capabilities if isinstance(conn.capabilities, dict) else {},
        local=conn,
        order=order,
    )


@implementer(IClaims)
class MemoryClaims:
    """Claims of this process's connections."""

    def __init__(self) -> None:
        self.connections: dict[Any, None] = {}  # insertion order is connection order
        self._owners: dict[str, list[Any]] = {}

    def connect(self, conn: Any) -> None:
        self.connections[conn] = None

    def disconnect(self, conn: Any) -> Deferred[None]:
        self.connections.pop(conn, None)
        for session in conn.claims:
            owners = self._owners.get(session)
            if owners is not None and conn in owners:
                owners.remove(conn)
                if not owners:
                    del self._owners[session]
        return succeed(None)

    def claim(self, conn: Any, session: str) -> Deferred[None]:
        owners = self._owners.setdefault(session, [])
        if conn not in owners:
            owners.append(conn)
            conn.claims.append(session)
        return succeed(None)

    def local_claimants(self, session: str) -> list[Any]:
        return [c for c in self._owners.get(session, ()) if c.hello_done and c.role != "consumer"]

    def claimants(self, session: str) -> Deferred[list[Claimant]]:
        return succeed([claimant_of(c) for c in self.local_claimants(session)])

    def local_roster(self) -> list[tuple[Any, str]]:
        return [
            (conn, session)
            for conn in self.connections
            if conn.hello_done and conn.role != "consumer"
            for session in conn.claims
        ]

    def roster(self) -> Deferred[list[dict[str, Any]]]:
        return succeed([claimant_of(conn).roster_entry(session) for conn, session in self.local_roster()])

    def deliver(self, claimant: Claimant, event: Event) -> Deferred[None]:
        claimant.local.send_command(event)
        return succeed(None)
