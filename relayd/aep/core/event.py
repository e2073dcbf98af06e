"""An accepted event: the parsed envelope, the bytes it arrived as, and its encodings made once.

Fan-out asks an event for its wire form at a capture level; each form is produced at most once per
event (not once per subscriber) and, when no downlevel applies and the posted bytes hold no line
break, it *is* the posted bytes (docs/decisions.md AEP-12: byte identity).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from relayd.aep.core.capture import downlevel
from relayd.aep.core.envelope import POSITION_LIMIT, EventKind, event_kind, kind_of_type
from relayd.aep.core.envelope import position as position_of
from relayd.base import jsoncodec
from relayd.base.jsoncodec import MAX_INT_DIGITS
from relayd.base.jsoncodec import JSONError as JSONError  # what parse_json raises, for the wing's callers

SEVERITY_RANK = {"debug": 0, "info": 1, "notice": 2, "warning": 3, "error": 4, "critical": 5}
NOTICE = SEVERITY_RANK["notice"]


_WIDEST_EXACT = 2**63  # orjson reads integers beyond 64 bits as (inexact) floats
# Deeper JSON is refused as invalid-json: orjson serialises at most this deep, and nothing the
# relay handles needs more. (orjson itself refuses more than 1024 levels, so parsing a deeper value
# cannot exhaust the C stack: setup.cfg requires a version with that limit.)
MAX_DEPTH = 255
# A run of more digits than the relay reads (jsoncodec.MAX_INT_DIGITS), found from the start of each
# run only (linear in the line): accepting a longer integer would store an event the relay could not
# parse again for a filter, a downlevel or a replay.
_LONG_DIGITS = re.compile(rb"(?<![0-9])[0-9]{%d}" % (MAX_INT_DIGITS + 1))


def _inexact_position(value: Any) -> bool:
    """Whether orjson read an envelope's C{seq} or C{epoch} as a double (an integer beyond 64 bits)."""
    if type(value) is not dict:
        return False
    seq = value.get("seq")
    if type(seq) is float and abs(seq) >= _WIDEST_EXACT:
        return True
    epoch = value.get("epoch")
    return type(epoch) is float and abs(epoch) >= _WIDEST_EXACT


# parse_json(data, exact=False): one JSON value, read strictly (UTF-8, no NaN/Infinity literals, at
# most MAX_DEPTH deep), positions kept exact. orjson does the work, but it reads integers beyond 64
# bits as floats and refuses numbers beyond the double range: an envelope whose epoch or seq it could
# only read that way, a value with such a number (JavaScript's JSON.parse, the reference's parser,
# reads it as infinity), or a value parsed exact (resume positions nested in a from list), goes
# through the standard library, whose integers are exact (docs/decisions.md AEP-3: positions are
# exact for any epoch). Numbers and text are read only as the relay can write them again: an integer
# of more than MAX_INT_DIGITS digits and a lone surrogate ("\ud800", no UTF-8 form) are refused, so
# anything this accepts can be re-read and re-encoded on every later path. JSONError otherwise.
parse_json = jsoncodec.Reader(
    read_int=jsoncodec.exact_int,
    fallback="numbers",
    inexact=_inexact_position,
    lone_surrogates=False,
    max_depth=MAX_DEPTH,
).loads

# dumps(obj): compact JSON like JavaScript's JSON.stringify: no spaces, UTF-8, key order kept, and a
# non-finite number (1e400 read as infinity) written as null. (Nothing the relay writes holds a lone
# surrogate: the parser refuses them; were one there, it would be written as "?".)
dumps = jsoncodec.Writer(surrogates="replace").dumps


class Event(msgspec.Struct, gc=False, eq=False):
    """One valid event on its way through the relay.

    Build it with L{Event.of} from a value that passed the relay-grade check (pass the C{kind}
    L{classify} returned to skip classifying twice), or let L{admit} build it from the bytes alone.
    The parsed value, C{ev}, is then made only when something needs it (a filter, a capture
    downlevel): a relay whose consumers take every event as posted never builds it.

    A msgspec Struct untracked by the garbage collector (nothing an event refers to refers back to
    it), compared by identity: made and freed for about half what a class with slots costs, a part
    of every event of a batch (docs/performance.md, "Batched NDJSON ingest: third pass"). Its
    fields, in order: every one given, no default (a call in the old form, C{Event(ev, raw)},
    raises).
    """

    # The posted bytes, forwarded as they are (C{None} when SSE framing cannot carry them on one line).
    raw: bytes | None
    kind: EventKind
    type: str
    session: str | None
    position: tuple[int, int]
    key: tuple[str, str]
    severity: int
    capture: Any
    _ev: dict[str, Any] | None
    # Wire forms made so far, keyed by (form, capture level); most events never need one.
    _forms: dict[tuple[str, str | None], Any] | None

    @classmethod
    def of(cls, ev: dict[str, Any], raw: bytes | None, kind: EventKind | None = None) -> Event:
        """The event of the parsed value C{ev}, posted as C{raw} (C{None}: not posted as bytes)."""
        if kind is None:
            kind = event_kind(ev)
        if kind is EventKind.SEQUENCED:
            seq = ev["seq"]
            epoch = ev.get("epoch", 0)
            if type(seq) is int and type(epoch) is int:
                position: tuple[int, int] = (epoch, seq)
            else:  # integral floats, a non-integer epoch (counts as 0)
                position = position_of(ev)
        else:
            position = (0, -1)
        return cls(
            raw if raw is not None and raw.find(b"\n") < 0 and raw.find(b"\r") < 0 else None,
            kind,
            ev["type"],
            ev.get("session"),
            position,
            (ev["source"], ev["id"]),
            SEVERITY_RANK.get(ev.get("severity", "info"), 1),
            ev.get("capture"),
            ev,
            None,
        )

    @property
    def ev(self) -> dict[str, Any]:
        """The parsed event (parsed from the posted bytes on first use when L{admit} built it)."""
        ev = self._ev
        if ev is None:
            ev = self._ev = parse_json(self.raw)  # type: ignore[arg-type]
        return ev

    @property
    def sequenced(self) -> bool:
        return self.kind is EventKind.SEQUENCED

    def form(self, key: tuple[str, str | None]) -> Any:
        """A wire form made before under C{key} (form, capture level), or C{None}.

        The transports make each form once per event and level and keep it here, so a fan-out
        to any number of subscribers encodes the event once (relayd/aep/wire.py).
        """
        forms = self._forms
        return None if forms is None else forms.get(key)

    def keep(self, key: tuple[str, str | None], value: Any) -> Any:
        """Keep C{value} as the wire form C{key}; returns it."""
        if self._forms is None:
            self._forms = {}
        self._forms[key] = value
        return value

    def payload(self, level: str | None = None) -> bytes:
        """The compact JSON of the event, downlevelled to C{level} (C{None}: as received)."""
        key = ("json", level)
        payload = self.form(key)
        if payload is None:
            if level is None:
                payload = self.raw if self.raw is not None else dumps(self.ev)
            else:
                payload = dumps(downlevel(self.ev, level))
            self.keep(key, payload)
        return payload


_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]


class _Envelope(msgspec.Struct, gc=False):
    """What the relay reads from an event, typed as a plainly valid event has it; the rest of the
    line is validated, not built. A line that does not fit is left to the exact path."""

    aep: Literal["0.1"]
    id: _NonEmpty
    type: _NonEmpty
    time: _NonEmpty
    source: _NonEmpty
    agent: _NonEmpty
    session: str | msgspec.UnsetType = msgspec.UNSET
    seq: Annotated[int, msgspec.Meta(ge=0)] | msgspec.UnsetType = msgspec.UNSET
    epoch: int | msgspec.UnsetType = msgspec.UNSET
    severity: Literal["debug", "info", "notice", "warning", "error", "critical"] | msgspec.UnsetType = msgspec.UNSET
    capture: Literal["none", "metadata", "redacted", "full"] | msgspec.UnsetType = msgspec.UNSET


_read_envelope = msgspec.json.Decoder(_Envelope).decode
_LOWEST = -POSITION_LIMIT  # (made once: negating the 330-bit limit allocates)
_UNSET = msgspec.UNSET
# One scan finds what sends a line to the exact path: brackets (how deep it might nest), line breaks,
# and backslashes (whether an escape could have put a control character into an identifier).
_NOT_SPECIAL = bytes(b for b in range(256) if b not in b"[{\r\n\\")
# The shortest line L{_read_envelope} reads that nests deeper than MAX_DEPTH: the envelope's members
# at their shortest and one more, its value MAX_DEPTH arrays inside the envelope's braces (an opener
# and a closer a level). A line that reads as an envelope and is shorter holds at most MAX_DEPTH
# brackets outside its strings, so its brackets need no count: the exact path takes any depth it has.
_DEEP_LINE = len(b'{"aep":"0.1","id":"-","type":"-","time":"-","source":"-","agent":"-","":}') + 2 * MAX_DEPTH


def admit(raw: bytes) -> Event | None:
    """The event in C{raw} when it is plainly valid, without building its parsed value; else C{None}.

    The ingest hot path: one pass that checks the JSON and reads only the envelope. Anything out of
    the ordinary (not ASCII, possibly nested deeper than L{MAX_DEPTH}, a line break, invalid JSON,
    an envelope attribute of an unusual type or value, an invalid scope, an escaped character in an
    identifier, a number too long to re-read, a position beyond the relay's range) answers C{None},
    and the caller takes the exact path (L{parse_json}, then L{classify}), which finds the verdict
    and the reference's wording. What this admits, the exact path admits too (and can parse later).
    """
    if not raw.isascii():
        return None
    # (find: docs/architecture.md, hot paths)
    if len(raw) < _DEEP_LINE:
        # Too short to nest deeper than MAX_DEPTH: its brackets need no count, and three scans for
        # one byte each (memchr) cost less than copying out its special bytes (the usual event).
        if raw.find(b"\n") >= 0 or raw.find(b"\r") >= 0:
            return None
        escaped = raw.find(b"\\") >= 0
    else:
        special = raw.translate(None, _NOT_SPECIAL)
        if special.find(b"\r") >= 0 or special.find(b"\n") >= 0:
            return None
        escapes = special.count(b"\\")
        if len(special) - escapes > MAX_DEPTH:
            return None
        escaped = escapes > 0
    # msgspec skips the attributes it does not read without converting their numbers.
    if len(raw) > MAX_INT_DIGITS and _LONG_DIGITS.search(raw) is not None:
        return None
    try:
        env = _read_envelope(raw)
    except msgspec.MsgspecError:
        return None
    return _from_envelope(raw, env, escaped)


class PlainBody:
    """What an NDJSON body settles for every one of its lines, found once (L{plain_body})."""

    __slots__ = ("arrays", "shallow")

    def __init__(self, arrays: bool, shallow: bool) -> None:
        self.arrays = arrays  # whether any line may hold a "["
        self.shallow = shallow  # whether no line needs its brackets counted (see L{admit})


def plain_body(body: bytes, longest_line: int | None = None) -> PlainBody | None:
    """The checks L{admit} makes byte by byte in each line, made once in a whole NDJSON C{body}:
    C{None} unless it is ASCII with no carriage return and no backslash (then no line holds an
    escape or a line break); then whether no line can nest deeper than L{MAX_DEPTH}: every line
    (C{longest_line}: the length of the longest, when the caller knows it) too short to, or the
    body's brackets too few."""
    if not body.isascii() or body.find(b"\r") >= 0 or body.find(b"\\") >= 0:
        return None
    # Counting is the costly part (a byte at a time, a tenth of a batch's cost): lines are usually
    # too short to need it (then nothing is counted, and "[" is not looked for: no line's count
    # needs it), and "[" is often absent (then it is not counted).
    if longest_line is not None and longest_line < _DEEP_LINE:
        return PlainBody(True, True)
    arrays = body.find(b"[") >= 0
    return PlainBody(arrays, body.count(b"{") + (body.count(b"[") if arrays else 0) <= MAX_DEPTH)


def admit_lines(lines: list[bytes], plain: PlainBody | None) -> list[Event | None]:
    """L{admit} of lines of one NDJSON body (split at line feeds, stripped), with what L{plain_body}
    found in the body; the verdict per line is L{admit}'s."""
    if plain is None:
        return [admit(line) for line in lines]
    if not plain.shallow or (lines and max(map(len, lines)) > MAX_INT_DIGITS):
        return [_admit_plain(line, plain) for line in lines]
    # The usual body: no line needs a check of its own, so each costs one decode and the event's
    # attributes, set here rather than through a call per line (L{_from_envelope}, which this
    # follows). Lines of a batch mostly repeat one type: its kind is looked up once per run.
    read, new, ranks, unset, limit, lowest = _read_envelope, Event, SEVERITY_RANK, _UNSET, POSITION_LIMIT, _LOWEST
    sequenced = EventKind.SEQUENCED
    admitted: list[Event | None] = []
    append = admitted.append
    last_type = ""
    # Lines of a batch mostly repeat their session and source: the events share one string of each
    # (and of the type) instead of one per event, fewer objects to free when they are trimmed.
    last_session: Any = None
    last_source = ""
    kind: EventKind | None = None
    for raw in lines:
        try:
            env = read(raw)
        except msgspec.MsgspecError:
            append(None)
            continue
        type_ = env.type
        if type_ != last_type:
            kind = kind_of_type(type_)
            last_type = type_
        else:
            type_ = last_type
        posted, seq = env.session, env.seq
        if posted == last_session:
            posted = last_session
        else:
            last_session = posted
        source = env.source
        if source == last_source:
            source = last_source
        else:
            last_source = source
        if kind is sequenced:
            if posted is unset or seq is unset:
                append(None)
                continue
            epoch = 0 if env.epoch is unset else env.epoch
            if seq >= limit or not lowest < epoch < limit:
                append(None)
                continue
            position = (epoch, seq)
        elif kind is None or seq is not unset or (posted is unset) is not (kind is EventKind.AGENT_SCOPED):
            append(None)  # see L{_from_envelope}
            continue
        else:
            position = (0, -1)
        severity, capture = env.severity, env.capture
        append(
            new(
                raw,
                kind,
                type_,
                None if posted is unset else posted,
                position,
                (source, env.id),
                1 if severity is unset else ranks[severity],
                None if capture is unset else capture,
                None,
                None,
            )
        )
    return admitted


def _admit_plain(raw: bytes, plain: PlainBody) -> Event | None:
    """L{admit} of a line of a body L{plain_body} settled as C{plain}: its depth (unless the body
    settled it) and the length of its numbers are checked here."""
    if (
        not plain.shallow
        and len(raw) >= _DEEP_LINE
        and raw.count(b"{") + (raw.count(b"[") if plain.arrays else 0) > MAX_DEPTH
    ):
        return None
    # msgspec skips the attributes it does not read without converting their numbers.
    if len(raw) > MAX_INT_DIGITS and _LONG_DIGITS.search(raw) is not None:
        return None
    try:
        env = _read_envelope(raw)
    except msgspec.MsgspecError:
        return None
    return _from_envelope(raw, env, False)


def _from_envelope(raw: bytes, env: _Envelope, escapes: bool) -> Event | None:
    """The event of C{raw}, whose checked envelope is C{env}, or C{None} (see L{admit})."""
    kind = kind_of_type(env.type)
    session, seq = env.session, env.seq
    # Only an escape can put a control character into an identifier (raw ones are invalid JSON).
    if escapes and not (env.id + env.source + env.agent + ("" if session is _UNSET else session)).isprintable():
        return None
    if kind is EventKind.SEQUENCED:
        if session is _UNSET or seq is _UNSET:
            return None
        epoch = 0 if env.epoch is _UNSET else env.epoch
        if seq >= POSITION_LIMIT or not _LOWEST < epoch < POSITION_LIMIT:
            return None
        position = (epoch, seq)
    elif kind is None:
        return None
    elif seq is not _UNSET or (session is _UNSET) is not (kind is EventKind.AGENT_SCOPED):
        return None  # agent.* carries neither; commands and attention.routed carry a session only
    else:
        position = (0, -1)
    severity, capture = env.severity, env.capture
    return Event(
        raw,
        kind,
        env.type,
        None if session is _UNSET else session,
        position,
        (env.source, env.id),
        1 if severity is _UNSET else SEVERITY_RANK[severity],
        None if capture is _UNSET else capture,
        None,
        None,
    )


def event_from(raw: bytes) -> Event:
    """An event the relay accepted before (from a store or another instance), rebuilt from its bytes."""
    event = admit(raw)
    return event if event is not None else Event.of(parse_json(raw), raw)


def stored_event(raw: bytes) -> Event | None:
    """L{event_from}, or C{None} for bytes this relayd cannot read back: an older relayd accepted
    numbers or text that ingest refuses now. Such an entry is skipped, never a failed replay."""
    try:
        return event_from(raw)
    except Exception:  # whatever the old bytes make the parser raise
        return None
