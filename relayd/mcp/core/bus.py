"""How MCP relay processes that share a store tell each other what only they can act on.

An SSE stream and a parked poll are bound to the process holding their connection. When a frame for
a stream held elsewhere is posted here, when a poll queue gains frames, or when a session ends, the
tunnel relay (L{relayd.mcp.core.tunnel.TunnelRelay}) tells the other processes through an L{IMcpBus}. One
process alone uses L{LocalBus}, which has no one to tell.
"""

from __future__ import annotations

from typing import Protocol

from twisted.internet.defer import Deferred, succeed
from zope.interface import Attribute, Interface, implementer

from relayd.base.errors import StoreUnavailable


class InstanceGone(StoreUnavailable):
    """No process listens for the instance that holds some streams (it died, or lost Redis)."""

    def __init__(self, instance: str) -> None:
        super().__init__("mcp", f"instance {instance} is not listening")
        self.instance = instance


class BusListener(Protocol):
    """What a bus calls on its tunnel relay when another process published something."""

    def bus_deliver(self, keys: list[str], event: bytes) -> None:
        """Write an encoded SSE event to the local streams with these queue keys."""

    def bus_wake(self, keys: list[str]) -> None:
        """Wake local polls parked on these queue keys (their queues gained frames)."""

    def bus_end(self, session_id: str) -> None:
        """End local streams and release local polls of a session that ended elsewhere."""

    def bus_reset(self) -> None:
        """The bus was away (frames may have been missed): end every local stream and poll."""


class IMcpBus(Interface):
    """Cross-process notifications of the MCP tunnel relay."""

    instance = Attribute("This process's id on the bus (C{str}); SSE subscriber records carry it.")
    remote = Attribute("Whether other processes may be listening (C{False}: nothing to publish).")

    def start(listener: BusListener) -> None:
        """Start delivering other processes' messages to C{listener}."""

    def stop() -> Deferred[None]:
        """Stop listening."""

    def deliver(instance: str, keys: list[str], event: bytes) -> Deferred[None]:
        """Have process C{instance} write C{event} to its streams with these queue keys.

        @raise InstanceGone: (errback) nobody listens for C{instance}.
        """

    def wake(keys: list[str]) -> Deferred[None]:
        """Wake polls parked anywhere on these queue keys."""

    def end_session(session_id: str) -> Deferred[None]:
        """End the session's streams and parked polls in every process."""


@implementer(IMcpBus)
class LocalBus:
    """One process: every stream and poll is local, so nothing is ever published."""

    instance = ""
    remote = False

    def start(self, listener: BusListener) -> None:
        pass

    def stop(self) -> Deferred[None]:
        return succeed(None)

    def deliver(self, instance: str, keys: list[str], event: bytes) -> Deferred[None]:
        raise AssertionError("a local bus has no other process to deliver to")

    def wake(self, keys: list[str]) -> Deferred[None]:
        return succeed(None)

    def end_session(self, session_id: str) -> Deferred[None]:
        return succeed(None)
