"""What an AEP consumer asks for: the stream query, resume positions and C{Last-Event-ID}.

Shared by the transports: the SSE stream reads its query here (L{stream_query}); a WebSocket
C{subscribe} validates its C{from} with the same L{parse_from_entries} (docs/decisions.md AEP-2).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from twisted.web.server import Request

from relayd.aep.core.capture import capture_error
from relayd.aep.core.envelope import MAX_POSITION_DIGITS, POSITION_LIMIT, has_control
from relayd.aep.core.event import JSONError, parse_json
from relayd.aep.core.filters import Pin, compile_filter, filter_error, near_misses, pin_of
from relayd.aep.core.store import Position

# `{session}:{epoch}:{seq}`, greedy so that sessions may contain ":" (JS `^(.+):(\d+):(\d+)$`);
# positions have at most MAX_POSITION_DIGITS digits, and a session no control character (what the
# relay can have stored), so a value that could not name a held event is ignored as malformed.
_DIGITS = f"[0-9]{{1,{MAX_POSITION_DIGITS}}}"
_LAST_EVENT_ID = re.compile(rf"([^\x00-\x1f\x7f]+):({_DIGITS}):({_DIGITS})")


class BadRequest(Exception):
    """A stream query refused before any stream headers: 400, plain text, CORS."""


@dataclass(frozen=True, slots=True)
class StreamQuery:
    """An SSE stream's query, validated.

    @ivar match: the compiled filter.
    @ivar pin: where the subscription index keeps the subscriber (L{pin_of}).
    @ivar ceiling: the capture level asked for, if any.
    @ivar from_value: C{"all"}, or the resume positions (empty: none given).
    @ivar history_only: C{live=0}: the replay, then the end of the stream.
    @ivar filter_session: the filter's session, when it names one.
    """

    match: Callable[[dict[str, Any]], bool]
    pin: Pin | None
    ceiling: str | None
    from_value: str | list[tuple[str, Position]]
    history_only: bool
    filter_session: str | None
    near_misses: tuple[str, ...] = ()  # what the stream says of a filter key that looks like a typo


def stream_query(request: Request, max_from: int) -> StreamQuery:
    """The query of a C{GET /stream}: C{filter}, C{capture}, C{from} (at most C{max_from}) and C{live}.

    @raise BadRequest: naming what is wrong.
    """
    args = request.args
    raw_filter = args.get(b"filter", [b""])[0]
    if raw_filter:
        try:
            flt = parse_json(raw_filter)
        except JSONError:
            raise BadRequest("bad filter JSON") from None
    else:
        flt = {}
    problem = filter_error(flt)
    if problem is not None:
        raise BadRequest(problem)
    # Not query_param: a value that is not UTF-8 is no capture level either (docs/decisions.md AEP-6).
    ceiling = args.get(b"capture", [b""])[0].decode("utf-8", "replace") or None
    if ceiling is not None:
        problem = capture_error(ceiling)
        if problem is not None:
            raise BadRequest(problem)
    raw_from = args.get(b"from", [b""])[0]
    from_value: str | list[tuple[str, Position]] = []
    if raw_from == b"all":
        from_value = "all"
    elif raw_from:
        try:
            parsed = parse_json(raw_from, exact=True)
        except JSONError:
            raise BadRequest("bad from JSON") from None
        if not isinstance(parsed, list):
            raise BadRequest("bad from JSON")
        if len(parsed) > max_from:
            raise BadRequest("from too large")
        try:
            from_value = parse_from_entries(parsed)
        except ValueError as e:
            raise BadRequest(f"bad from entry: {e}") from None
    history_only = args.get(b"live", [None])[0] == b"0"
    session = flt.get("session")
    filter_session = session if isinstance(session, str) else None
    return StreamQuery(
        compile_filter(flt), pin_of(flt), ceiling, from_value, history_only, filter_session, tuple(near_misses(flt))
    )


def parse_from_entries(value: Any) -> list[tuple[str, Position]]:
    """Validate a C{from} array of C{{session, epoch?, seq?}} (docs/decisions.md AEP-2: never crash).

    @raise ValueError: naming what is wrong.
    """
    if not isinstance(value, list):
        raise ValueError("from must be an array of resume positions or the string \"all\"")
    entries = []
    for item in value:
        if not isinstance(item, dict):
            raise ValueError("from entries must be objects {session, epoch, seq}")
        session = item.get("session")
        if not isinstance(session, str):
            raise ValueError("from entry needs a string session")
        if has_control(session):
            # No stored session holds one (ingest refuses them), and it must not reach a framing line.
            raise ValueError("from entry session holds a control character")
        epoch = _integer(item.get("epoch", 0), 0)
        seq = _integer(item.get("seq", -1), -1)
        if epoch is None or seq is None:
            raise ValueError("from entry epoch must be an integer >= 0 and seq an integer >= -1")
        if epoch >= POSITION_LIMIT or seq >= POSITION_LIMIT:
            raise ValueError(f"from entry epoch and seq have at most {MAX_POSITION_DIGITS} digits")
        entries.append((session, (epoch, seq)))
    return entries


def _integer(value: Any, minimum: int) -> int | None:
    """C{value} as an exact integer (an integral float too, as JSON.parse has it) if it is one >= minimum."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and value.is_integer():  # (never true for infinity or NaN)
        value = int(value)
    if isinstance(value, int) and value >= minimum:
        return value
    return None


def last_event_id(request: Request) -> tuple[str, Position] | None:
    """The resume position of a C{Last-Event-ID} header; a malformed value is ignored."""
    header = request.getHeader(b"last-event-id")
    if not header:
        return None
    try:
        found = _LAST_EVENT_ID.fullmatch(header.decode("utf-8"))
    except UnicodeDecodeError:
        return None
    if found is None:
        return None
    return found.group(1), (int(found.group(2)), int(found.group(3)))
