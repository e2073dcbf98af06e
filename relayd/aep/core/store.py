"""Per-session bounded replay buffers: the C{IEventLog} interface and its in-memory implementation."""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from twisted.internet.defer import Deferred, succeed
from zope.interface import Attribute, Interface, implementer

from relayd.aep.core.event import Event

Position = tuple[int, int]


@dataclass(frozen=True)
class Replay:
    """What a resume position yields: the held events after it, and the earliest held position
    when the buffer no longer covers the gap (the C{replay-exhausted} marker), else C{None}.

    A paged read (C{limit}) also says where the next page starts: C{cursor}, opaque, C{None} once
    this page is the last.
    """

    events: Sequence[Event]
    exhausted: Position | None
    cursor: Any = None


class IEventLog(Interface):
    """Bounded, deduplicated, position-ordered history per session, with LRU session eviction."""

    capacity = Attribute("Events kept per session (C{AEP_BUFFER}).")
    max_sessions = Attribute("Sessions kept (C{AEP_MAX_SESSIONS}); the least recently written goes.")
    paged = Attribute("Whether a replay copies the events it answers (Redis): then it is read a page at a time.")

    def append(events: Sequence[Event]) -> Deferred[list[bool]]:
        """Admit sequenced events in order; fires with one flag per event (C{False}: a duplicate
        C{(source, id)}). Every write, duplicates too, refreshes its session's recency.

        A log that stores within the caller's call (the in-memory one) also has C{append_now},
        which answers the flags themselves: the relay then ingests without a Deferred."""

    def replay(session: str, after: Position, limit: int | None = None, cursor: Any = None) -> Deferred[Replay]:
        """The held events of C{session} strictly after C{after}, in position order.

        With C{limit}, a C{paged} store answers at most that many, and a C{cursor} to pass back
        for the next page (whose C{exhausted} then names the earliest held position when events
        between the pages were evicted meanwhile). The in-memory log answers every event at once
        (they are references).
        """

    def sessions() -> Deferred[list[str]]:
        """Held sessions, least recently written first."""

    def session_count() -> int:
        """How many sessions are held (cheap; for health and metrics)."""


class _SessionBuffer:
    __slots__ = ("events", "head", "ids")

    def __init__(self) -> None:
        # A list with a moving head: appends and trims are O(1); compaction is amortised.
        self.events: list[Event] = []
        self.head = 0
        self.ids: set[tuple[str, str]] = set()

    def __len__(self) -> int:
        return len(self.events) - self.head

    def insert(self, event: Event) -> None:
        events = self.events
        if len(events) == self.head or events[-1].position <= event.position:
            events.append(event)  # the usual case: in order
        else:
            # Equal positions keep arrival order: insert after every event not greater.
            index = bisect_right(events, event.position, lo=self.head, key=_position)
            events.insert(index, event)
        self.ids.add(event.key)

    def trim(self, capacity: int) -> None:
        while len(self) > capacity:
            oldest = self.events[self.head]
            self.events[self.head] = None  # type: ignore[call-overload]
            self.head += 1
            self.ids.discard(oldest.key)
        if self.head > 1024 and self.head * 2 > len(self.events):
            del self.events[: self.head]
            self.head = 0

    def earliest(self) -> Position | None:
        return self.events[self.head].position if len(self) else None

    def after(self, position: Position) -> list[Event]:
        index = bisect_right(self.events, position, lo=self.head, key=_position)
        return self.events[index:]


def _position(event: Event) -> Position:
    return event.position


def exhausted_marker(earliest: Position | None, after: Position) -> Position | None:
    """The earliest held position when a resume from C{after} would skip events, else C{None}.

    As the reference relay: only for a non-empty buffer, only for C{seq >= 0}, and only when the
    earliest held position lies beyond the one right after the requested position.
    """
    epoch, seq = after
    if earliest is None or seq < 0:
        return None
    return earliest if earliest > (epoch, seq + 1) else None


@implementer(IEventLog)
class MemoryEventLog:
    """C{IEventLog} in process memory."""

    paged = False

    def __init__(self, capacity: int, max_sessions: int) -> None:
        self.capacity = capacity
        self.max_sessions = max_sessions
        self._buffers: OrderedDict[str, _SessionBuffer] = OrderedDict()

    def append(self, events: Sequence[Event]) -> Deferred[list[bool]]:
        return succeed(self.append_now(events))

    def append_now(self, events: Sequence[Event]) -> list[bool]:
        """L{append} done within the call, its flags themselves: what a caller that answers at once
        asks (L{relayd.aep.core.relay.EventRelay.ingest_now}), without a Deferred."""
        if len(events) > 1:
            appended = self._append_run(events)
            if appended is not None:
                return appended
        admitted = []
        buffers = self._buffers
        capacity = self.capacity
        session: str | None = None
        buffer: Any = None
        for event in events:
            if event.session != session:
                # A batch is usually one session: its recency is refreshed once per run of events.
                session = event.session
                assert session is not None
                buffer = buffers.get(session)
                if buffer is None:
                    if len(buffers) >= self.max_sessions:
                        buffers.popitem(last=False)
                    buffer = buffers[session] = _SessionBuffer()
                else:
                    buffers.move_to_end(session)
                ids, held = buffer.ids, buffer.events
            key = event.key
            if key in ids:
                admitted.append(False)
                continue
            # (L{_SessionBuffer.insert} and L{_SessionBuffer.trim} inlined for the usual case: in
            # order, one over capacity. This loop runs once per ingested event.)
            if len(held) == buffer.head or held[-1].position <= event.position:
                held.append(event)
                ids.add(key)
            else:
                buffer.insert(event)
            if len(held) - buffer.head > capacity:
                head = buffer.head
                if len(held) - head == capacity + 1 and head < 1024:
                    ids.discard(held[head].key)
                    held[head] = None
                    buffer.head = head + 1
                else:
                    buffer.trim(capacity)
            admitted.append(True)
        return admitted

    def _append_run(self, events: Sequence[Event]) -> list[bool] | None:
        """L{append} of the usual batch: one session, in position order after what it holds, no key
        held or repeated. Each step is a C call over the batch (the per-event loop costs several
        hundred ns an event); the result is the loop's: every event kept, then the oldest evicted
        down to capacity. C{None}, with nothing changed, for any other batch."""
        session = events[0].session
        if [event.session for event in events].count(session) != len(events):
            return None
        keys = [event.key for event in events]
        fresh = set(keys)
        if len(fresh) != len(keys):
            return None
        positions = [event.position for event in events]
        if positions != sorted(positions):
            return None
        buffers = self._buffers
        buffer = buffers.get(session)  # type: ignore[arg-type]
        if buffer is not None:
            if not buffer.ids.isdisjoint(fresh) or (len(buffer) and buffer.events[-1].position > positions[0]):
                return None
            buffers.move_to_end(session)  # type: ignore[arg-type]
        else:
            if len(buffers) >= self.max_sessions:
                buffers.popitem(last=False)
            buffer = buffers[session] = _SessionBuffer()  # type: ignore[index]
        held, ids = buffer.events, buffer.ids
        held.extend(events)
        ids |= fresh
        head = buffer.head
        over = len(held) - head - self.capacity
        if over > 0:
            ids.difference_update([event.key for event in held[head : head + over]])
            held[head : head + over] = [None] * over  # type: ignore[list-item]
            head = buffer.head = head + over
            if head > 1024 and head * 2 > len(held):
                del held[:head]
                buffer.head = 0
        return [True] * len(events)

    def replay(self, session: str, after: Position, limit: int | None = None, cursor: Any = None) -> Deferred[Replay]:
        buffer = self._buffers.get(session)
        if buffer is None:
            return succeed(Replay((), None))
        return succeed(Replay(buffer.after(after), exhausted_marker(buffer.earliest(), after)))

    def sessions(self) -> Deferred[list[str]]:
        return succeed(list(self._buffers))

    def session_count(self) -> int:
        return len(self._buffers)
