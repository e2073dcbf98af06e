"""An SSE reader as the tunnel relay sees it: where its events go, and what opening it hands back. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from relayd.mcp.store import SubscriberRecord


class Sink(Protocol):
    """Where the tunnel relay writes one SSE subscriber's events (implemented by the HTTP layer)."""

    def deliver(self, event: bytes) -> bool:
        """Queue one encoded SSE event; C{False} if the subscriber is closed or overflowed."""

    def end(self) -> None:
        """End the stream (its session ended or the relay is shutting down)."""


@dataclass
class StreamHandle:
    """An SSE subscriber just opened: its record, and the backlog events to write after the preamble."""

    record: SubscriberRecord
    backlog: list[bytes]
