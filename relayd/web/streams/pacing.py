"""The one pacer of a long-lived answer: a bounded chunk per reactor turn, pulled from a source
while the client reads.

An SSE stream's replay (L{relayd.web.streams.sse.SSEStream.produce}) and a WebSocket subscription's
(L{relayd.aep.websocket.AEPSocket}) are read this way: the owner's once-per-turn flush calls
L{Pacer.pull} while its transport is not paused, and never while the client lags, so a replay of a
million events neither holds the reactor nor piles up in memory.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.defer import Deferred

Source = Callable[[], "bool | Deferred[Any]"]
"""Writes a bounded chunk to its owner each call and answers whether it has more, or a C{Deferred}
that fires once it has (it waits for its own source, a store's next page); it may end its owner."""


class Pacer:
    """The source an owner pulls a chunk from per turn, and whether it is waiting for its own."""

    __slots__ = ("source", "waiting", "_wake")

    def __init__(self, wake: Callable[[], None], source: Source | None = None) -> None:
        self.source = source
        self.waiting = False
        self._wake = wake  # schedules the owner's next flush

    @property
    def ready(self) -> bool:
        """Whether a chunk can be pulled now (there is a source, and it is not waiting)."""
        return self.source is not None and not self.waiting

    def start(self, source: Source) -> None:
        """Pull from C{source} from the owner's next flush on."""
        self.source = source
        self.waiting = False
        self._wake()

    def stop(self) -> None:
        self.source = None

    def pull(self, alive: Callable[[], bool]) -> bool:
        """Pull one chunk, if L{ready}; whether there is more to pull on the next turn.

        The source may end its owner (C{alive} then answers C{False}: the source is dropped) or
        start another one (kept instead)."""
        source = self.source
        if source is None or self.waiting:
            return False
        self.source = None  # (no re-entry: the source may flush its owner)
        more = source()
        if not more or not alive() or self.source is not None:
            return False
        self.source = source
        if more is True:
            return True
        self.waiting = True
        more.addBoth(self._ready)
        return False

    def _ready(self, result: object) -> None:
        # (The source's own failure is its own to handle: it ends its owner.)
        self.waiting = False
        if self.source is not None:
            self._wake()
