"""The one backlog policy of a consumer, whatever its transport (SSE or WebSocket; docs/aep.md).

What a consumer has not been sent yet (its transport's queue, and the live events held while its
replay is sent) is its backlog. Past L{SOFT_BACKLOG}, while it does not read, live events below
C{notice} are dropped for it; past L{HARD_BACKLOG} it is cut off, and resumes by position.
"""

from __future__ import annotations

from typing import Final, Literal

from relayd.aep import metrics
from relayd.aep.core.event import NOTICE, Event

SOFT_BACKLOG: Final = 1024 * 1024  # above this, events below `notice` are dropped for a slow consumer
HARD_BACKLOG: Final = 8 * 1024 * 1024  # above this, the consumer is cut off (it resumes by position)
HELD_FRAMING: Final = 64  # bytes: a WebSocket frame header is at most 14; SSE's `event:`/`id:` lines about this

SLOW_CONSUMER: Final = metrics.events_dropped.labels(relay="aep", reason="slow-consumer")
CUT_OFF: Final = metrics.events_dropped.labels(relay="aep", reason="cut-off")

Verdict = Literal["keep", "drop", "cut-off"]


def held_size(event: Event, level: str | None) -> int:
    """What a held event will cost its consumer's backlog once framed, without framing it yet (a
    consumer that lags may never be sent it): its JSON plus a generous allowance for the framing."""
    return len(event.payload(level)) + HELD_FRAMING


def sheds(event: Event, unsent: int) -> bool:
    """Whether a live C{event} is dropped (and counted) for a consumer that does not read (its
    transport paused it), with C{unsent} bytes queued. (Asked only while paused: a fan-out's
    delivery to a reading client pays nothing for it.)"""
    if unsent > SOFT_BACKLOG and event.severity < NOTICE:
        SLOW_CONSUMER.inc()
        return True
    return False


def hold(event: Event, backlog: int) -> Verdict:
    """What becomes of a live C{event} held during a replay, C{backlog} the consumer's unsent bytes
    with it: kept; dropped (counted); or the consumer is cut off (the caller counts what it loses)."""
    if backlog > SOFT_BACKLOG and event.severity < NOTICE:
        SLOW_CONSUMER.inc()
        return "drop"
    if backlog > HARD_BACKLOG:
        return "cut-off"
    return "keep"
