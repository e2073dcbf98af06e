"""What an AEP consumer asks for: the stream query, resume positions and C{Last-Event-ID}.

Shared by the transports: the SSE stream reads its query here (L{stream_query}); a WebSocket
C{subscribe} validates its C{from} with the same L{parse_from_entries} (docs/decisions.md AEP-2).

Subscribers that open together mostly ask the same few things (a dashboard's tabs, a fleet of
agents each reconnecting to its session): what a valid C{filter} or C{from} value reads as is kept,
by its raw bytes, in a small bounded table (L{_Readings}), so a storm of reconnects parses and
compiles each distinct value once. Compiled filters are pure predicates and resume positions
immutable tuples, so one reading serves every stream that sent the same bytes; a value that is
refused is read afresh each time (an error path, not a hot one).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

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


# What the readings table holds: at most this many values, each at most this many bytes long (a few
# hundred KB in all, whatever clients send).
READINGS_KEPT = 1024
READING_MAX_BYTES = 512

_V = TypeVar("_V")


class _Readings(Generic[_V]):
    """What short raw query values read as, the L{READINGS_KEPT} most recently added kept."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: dict[bytes, _V] = {}

    def get(self, raw: bytes) -> _V | None:
        return self._kept.get(raw)

    def keep(self, raw: bytes, value: _V) -> None:
        if len(raw) > READING_MAX_BYTES:
            return
        kept = self._kept
        if len(kept) >= READINGS_KEPT:
            del kept[next(iter(kept))]  # the oldest: a dict keeps insertion order
        kept[raw] = value


@dataclass(frozen=True, slots=True)
class _FilterReading:
    match: Callable[[dict[str, Any]], bool]
    pin: Pin | None
    filter_session: str | None
    near_misses: tuple[str, ...]


_filters: _Readings[_FilterReading] = _Readings()
_froms: _Readings[tuple[tuple[str, Position], ...]] = _Readings()


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
    reading = _read_filter(args.get(b"filter", [b""])[0])
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
        from_value = _read_from(raw_from, max_from)
    history_only = args.get(b"live", [None])[0] == b"0"
    return StreamQuery(
        reading.match, reading.pin, ceiling, from_value, history_only, reading.filter_session, reading.near_misses
    )


def _read_filter(raw: bytes) -> _FilterReading:
    """The C{filter} value C{raw}, validated and compiled (once per distinct short value)."""
    reading = _filters.get(raw)
    if reading is not None:
        return reading
    if raw:
        try:
            flt = parse_json(raw)
        except JSONError:
            raise BadRequest("bad filter JSON") from None
    else:
        flt = {}
    problem = filter_error(flt)
    if problem is not None:
        raise BadRequest(problem)
    session = flt.get("session")
    reading = _FilterReading(
        compile_filter(flt), pin_of(flt), session if isinstance(session, str) else None, tuple(near_misses(flt))
    )
    _filters.keep(raw, reading)
    return reading


def _read_from(raw: bytes, max_from: int) -> list[tuple[str, Position]]:
    """The resume positions of the C{from} value C{raw} (not C{all}), at most C{max_from} of them
    (read once per distinct short valid value; each stream gets its own list)."""
    entries = _froms.get(raw)
    if entries is None:
        try:
            parsed = parse_json(raw, exact=True)
        except JSONError:
            raise BadRequest("bad from JSON") from None
        if not isinstance(parsed, list):
            raise BadRequest("bad from JSON")
        if len(parsed) > max_from:
            raise BadRequest("from too large")
        try:
            entries = tuple(parse_from_entries(parsed))
        except ValueError as e:
            raise BadRequest(f"bad from entry: {e}") from None
        _froms.keep(raw, entries)
    elif len(entries) > max_from:
        raise BadRequest("from too large")  # (a reading kept under another relay's larger limit)
    return list(entries)


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
