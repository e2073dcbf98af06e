"""An in-process reader as the tunnel relay sees it: where its frames go, and what opening it hands back. No I/O."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from relayd.mcp.core.frames import Frame
from relayd.mcp.core.store import SubscriberRecord


class Sink(Protocol):
    """Where the tunnel relay hands one in-process reader its frames: an SSE stream (which writes
    each frame's L{Frame.sse}, made once for every stream) or an endpoint client session (which
    reads the parsed message)."""

    def deliver(self, frame: Frame) -> bool:
        """Take one frame; C{False} if the reader is closed or overflowed."""

    def end(self) -> None:
        """End the stream (its session ended or the relay is shutting down)."""


@dataclass
class StreamHandle:
    """A reader just opened: its record, and the backlog frames to hand it first."""

    record: SubscriberRecord
    backlog: list[Frame]
