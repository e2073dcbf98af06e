"""An event's wire forms: the SSE frame, its HTTP chunk and the WebSocket message.

Each is made once per event and capture level and kept on the event (L{Event.form}), so a
fan-out to any number of subscribers encodes the event once; the AEP core knows none of them.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from relayd.aep.core.envelope import EventKind
from relayd.aep.core.event import Event
from relayd.web.streams.sse import http_chunk, sse_event

# What may not reach an SSE framing line: ingest refuses these in identifiers (envelope.limit_error);
# this is the last line of defence for anything stored before, or by another relayd.
_UNFRAMEABLE = re.compile(r"[\x00-\x1f\x7f\ud800-\udfff]")


def frame_safe(text: str) -> bytes:
    """C{text} as UTF-8 for an SSE field or comment line: controls and surrogates become U+FFFD."""
    if not text.isprintable():
        text = _UNFRAMEABLE.sub("\ufffd", text)
    return text.encode("utf-8")


def _sse_id(session: str, position: tuple[int, int]) -> bytes:
    return frame_safe(f"{session}:{position[0]}:{position[1]}")


def sse_frame(event: Event, level: str | None = None) -> bytes:
    """The SSE frame (C{event:}, C{data:}, C{id:} when sequenced) at C{level}."""
    key = ("sse", level)
    frame = event.form(key)
    if frame is None:
        sse_id = None
        if event.kind is EventKind.SEQUENCED:
            sse_id = _sse_id(event.session, event.position)  # type: ignore[arg-type]
        frame = event.keep(key, sse_event(event.payload(level), frame_safe(event.type), sse_id))
    return frame


SSE_LIVE_FORMS: tuple[str, str | None] = ("sse+chunk", None)
"""The key of L{sse_forms} at no capture level (as stored) in an event's forms: a live SSE delivery
without a ceiling looks it up itself (C{event.form(SSE_LIVE_FORMS)}), one call fewer per delivery."""
# One key per capture level: the lookup below runs once per SSE delivery.
_SSE_FORMS_KEYS: dict[str | None, tuple[str, str | None]] = {None: SSE_LIVE_FORMS}


def sse_forms(event: Event, level: str | None = None) -> tuple[bytes, bytes]:
    """L{sse_frame} and its HTTP chunk together, made once per event and level: what an SSE
    subscriber of a live fan-out writes (one lookup per delivery, not one per form)."""
    key = _SSE_FORMS_KEYS.get(level)
    if key is None:
        key = _SSE_FORMS_KEYS.setdefault(level, ("sse+chunk", level))
    forms = event.form(key)
    if forms is None:
        frame = sse_frame(event, level)
        forms = event.keep(key, (frame, http_chunk(frame)))
    return forms


def sse_run(events: Sequence[Event]) -> tuple[bytes, bytes]:
    """The SSE frames of C{events} (as stored) joined, and that in HTTP chunked form: what every SSE
    subscriber of a run writes, made once for all of them."""
    frames = b"".join([sse_frame(event) for event in events])
    return frames, http_chunk(frames)


def ws_message(event: Event, level: str | None, factory: Any) -> Any:
    """An autobahn prepared text message at C{level}, framed once for every WebSocket."""
    key = ("ws", level)
    message = event.form(key)
    if message is None:
        message = event.keep(key, factory.prepareMessage(event.payload(level), isBinary=False))
    return message
