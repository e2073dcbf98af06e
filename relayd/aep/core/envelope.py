"""Relay-grade envelope checks and event classification (docs/aep.md).

Pure functions over decoded JSON values (dict/list/str/int/float/bool/None); no I/O.
"""

from __future__ import annotations

import enum
import math
import re
from decimal import Decimal
from typing import Final

__all__ = [
    "CAPTURE_LEVELS",
    "MAX_POSITION_DIGITS",
    "POSITION_LIMIT",
    "SEVERITIES",
    "EventKind",
    "classify",
    "envelope_error",
    "event_kind",
    "has_control",
    "is_command_type",
    "js_str",
    "kind_of_type",
    "limit_error",
    "position",
]

SEVERITIES: Final = ("debug", "info", "notice", "warning", "error", "critical")
CAPTURE_LEVELS: Final = ("none", "metadata", "redacted", "full")

_SEVERITY_SET: Final = frozenset(SEVERITIES)
_CAPTURE_SET: Final = frozenset(CAPTURE_LEVELS)
_REQUIRED_STRINGS: Final = ("id", "type", "time", "source", "agent")

# The reference uses JS regexes whose `$` only matches at the very end, so these are
# always applied with fullmatch (Python's `$` would also accept a trailing newline).
_TYPE_RE: Final = re.compile(r"x\.[a-z0-9_-]+(?:\.[a-z0-9_]+){2,}|[a-z0-9_]+(?:\.[a-z0-9_]+)+")
# JS `.` excludes every line terminator, not just "\n".
_COMMAND_RE: Final = re.compile(
    r"control\.(?:attention\.respond|cancel|pause|resume)|x\.[a-z0-9_-]+\.control\.[^\n\r\u2028\u2029]+"
)

# docs/decisions.md AEP-4: the one non-command foreign-emitter type (carries session, never seq).
FOREIGN_TYPE: Final = "attention.routed"

# relayd's own limits on top of the reference's check (L{limit_error}).
# Positions are stored as length-prefixed decimals with a two-digit length (the Redis log's keys),
# so an epoch or seq has at most 99 digits; beyond that no store could order or resume it.
MAX_POSITION_DIGITS: Final = 99
POSITION_LIMIT: Final = 10**MAX_POSITION_DIGITS  # exclusive, either sign
# Attributes whose values reach SSE framing lines (C{id:}) or identify an event in frames and
# routing: C0 controls and DEL (CR and LF above all: a line break would end the framing line) are
# refused in them. (Lone surrogates never get this far: the parser refuses them everywhere.)
_IDENTIFIERS: Final = ("id", "source", "agent", "session")
_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")


class EventKind(enum.Enum):
    """How the relay routes a valid event."""

    COMMAND = "command"  # control verbs: routed to one emitter, fanned out, never buffered
    AGENT_SCOPED = "agent"  # agent.*: live fan-out only, no session/seq
    FOREIGN = "foreign"  # attention.routed without seq: live fan-out only (docs/decisions.md AEP-4)
    SEQUENCED = "sequenced"  # everything else: buffered by (session, epoch, seq)


class _Undefined:
    """Marker for an absent attribute, rendered like JS ``undefined``."""

    def __repr__(self) -> str:
        return "undefined"


UNDEFINED: Final = _Undefined()


def _js_number(x: float) -> str:
    """Format a float exactly like ECMAScript ``Number.prototype.toString()``."""
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "Infinity" if x > 0 else "-Infinity"
    if x == 0:
        return "0"  # includes -0, which JS prints as "0"
    sign = "-" if x < 0 else ""
    # repr() gives the shortest round-tripping digits, which is what JS prints too;
    # only the layout (where the point goes, when to use an exponent) differs.
    _, digit_tuple, exponent = Decimal(repr(abs(x))).as_tuple()
    exp = int(exponent)  # finite here: NaN and the infinities were answered above
    digits = "".join(map(str, digit_tuple)).rstrip("0")
    exp += len("".join(map(str, digit_tuple))) - len(digits)
    k = len(digits)
    n = k + exp
    if k <= n <= 21:
        body = digits + "0" * (n - k)
    elif 0 < n <= 21:
        body = digits[:n] + "." + digits[n:]
    elif -6 < n <= 0:
        body = "0." + "0" * (-n) + digits
    else:
        e = n - 1
        mantissa = digits if k == 1 else digits[0] + "." + digits[1:]
        body = f"{mantissa}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + body


def js_str(value: object) -> str:
    """Render a JSON value as JS ``String(value)`` does, for byte-exact error messages.

    Pass L{UNDEFINED} for an absent attribute (it renders as ``undefined``).
    """
    if value is UNDEFINED:
        return "undefined"
    if value is None:
        return "null"
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        # JS holds every number as a double; beyond 1e21 it switches to exponent form, and an
        # integer beyond the double range is what JSON.parse reads it as: Infinity.
        if abs(value) < 10**21:
            return str(value)
        try:
            return _js_number(float(value))
        except OverflowError:
            return "Infinity" if value > 0 else "-Infinity"
    if isinstance(value, float):
        return _js_number(value)
    if isinstance(value, (list, tuple)):
        # Array.prototype.join renders null/undefined elements as empty strings.
        return ",".join("" if v is None or v is UNDEFINED else js_str(v) for v in value)
    return "[object Object]"


def _is_js_integer(value: object) -> bool:
    """JS ``Number.isInteger``: integral ints and floats, never bool, never NaN/inf."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return True
    return isinstance(value, float) and value.is_integer()


def is_command_type(t: str) -> bool:
    """True for command types: ``control.{attention.respond,cancel,pause,resume}`` and ``x.{v}.control.*``.

    Acks (``control.accepted``, ``control.rejected``) are ordinary sequenced events, not commands.
    """
    return isinstance(t, str) and _COMMAND_RE.fullmatch(t) is not None


def envelope_error(ev: object) -> str | None:
    """Return the first relay-grade envelope problem of C{ev} (exact reference text), or None.

    Checks, in order: object, ``aep``, required strings, type syntax, scope, severity, capture.
    ``attention.routed`` follows the command rule (session, no seq) with its own messages.
    """
    if not isinstance(ev, dict):
        return "not an object"
    aep = ev.get("aep", UNDEFINED)
    if not (isinstance(aep, str) and aep == "0.1"):
        return f"unsupported aep version: {js_str(aep)}"
    for key in _REQUIRED_STRINGS:
        v = ev.get(key)
        if not isinstance(v, str) or not v:
            return f"missing/invalid {key}"
    t: str = ev["type"]
    if _TYPE_RE.fullmatch(t) is None:
        return f"bad type syntax: {t}"
    # Presence, not value, decides: the reference tests `!== undefined`, so an explicit
    # null session/seq counts as present.
    if t.startswith("agent."):
        if "session" in ev or "seq" in ev:
            return "agent-scoped events omit session/seq"
    elif _COMMAND_RE.fullmatch(t) is not None:
        if not isinstance(ev.get("session"), str):
            return "command events require session (target)"
        if "seq" in ev:
            return "command events omit seq"
    elif t == FOREIGN_TYPE:
        if not isinstance(ev.get("session"), str):
            return "foreign-emitter events require session"
        if "seq" in ev:
            return "foreign-emitter events omit seq"
    else:
        if not isinstance(ev.get("session"), str):
            return "session required"
        seq = ev.get("seq")
        if not _is_js_integer(seq) or seq < 0:  # type: ignore[operator]
            return "seq required (integer >= 0)"
    if "severity" in ev:
        sev = ev["severity"]
        if not (isinstance(sev, str) and sev in _SEVERITY_SET):
            return "bad severity"
    if "capture" in ev:
        cap = ev["capture"]
        if not (isinstance(cap, str) and cap in _CAPTURE_SET):
            return "bad capture"
    return None


def has_control(text: str) -> bool:
    """Whether C{text} holds a C0 control or DEL (C{isprintable} first: it is C and nearly always true)."""
    return not text.isprintable() and _CONTROL_RE.search(text) is not None


def _position_too_wide(value: object) -> bool:
    return _is_js_integer(value) and not -POSITION_LIMIT < value < POSITION_LIMIT  # type: ignore[operator]


def limit_error(ev: dict, kind: EventKind) -> str | None:
    """relayd's own refusal of an event of C{kind} that passed L{envelope_error}, or None.

    An identifier attribute holding a control character (it could end an SSE framing line and
    forge what follows), or a sequenced event's C{epoch}/C{seq} of more than L{MAX_POSITION_DIGITS}
    digits.
    """
    for key in _IDENTIFIERS:
        value = ev.get(key)
        if type(value) is str and has_control(value):
            return f"control character in {key}"
    if kind is EventKind.SEQUENCED:
        for key in ("epoch", "seq"):
            if _position_too_wide(ev.get(key)):
                return f"{key} out of range (at most {MAX_POSITION_DIGITS} digits)"
    return None


def event_kind(ev: dict) -> EventKind:
    """Classify an event that already passed L{envelope_error}."""
    t: str = ev["type"]
    if t.startswith("agent."):
        return EventKind.AGENT_SCOPED
    if _COMMAND_RE.fullmatch(t) is not None:
        return EventKind.COMMAND
    if t == FOREIGN_TYPE:
        return EventKind.FOREIGN
    return EventKind.SEQUENCED


def position(ev: dict) -> tuple[int, int]:
    """``(epoch, seq)`` of a valid sequenced event as exact ints, for lexicographic ordering.

    docs/decisions.md AEP-3: never a float key (``epoch * 2**40 + seq`` loses precision once epoch >= 8192).
    ``epoch`` is not checked at relay grade; an absent, null or non-integer epoch counts as
    the consumer default 0. Raises ValueError when the event has no integer ``seq``.
    """
    seq = ev.get("seq")
    if not _is_js_integer(seq):
        raise ValueError("event has no integer seq")
    epoch = ev.get("epoch", 0)
    return (int(epoch) if _is_js_integer(epoch) else 0, int(seq))  # type: ignore[arg-type]


# Valid type strings seen so far and their kinds: types repeat endlessly, so the regexes run once per
# type rather than once per event. Bounded so a stream of unique types cannot grow it without end.
_KIND_OF_TYPE: dict[str, EventKind] = {}
_KIND_CACHE_MAX: Final = 4096


def kind_of_type(t: str) -> EventKind | None:
    """The kind of an event of type C{t}, or C{None} when C{t} is no valid type (cached per type)."""
    kind = _KIND_OF_TYPE.get(t)
    if kind is None:
        if _TYPE_RE.fullmatch(t) is None:
            return None
        if t.startswith("agent."):
            kind = EventKind.AGENT_SCOPED
        elif _COMMAND_RE.fullmatch(t) is not None:
            kind = EventKind.COMMAND
        elif t == FOREIGN_TYPE:
            kind = EventKind.FOREIGN
        else:
            kind = EventKind.SEQUENCED
        if len(_KIND_OF_TYPE) >= _KIND_CACHE_MAX:
            _KIND_OF_TYPE.clear()
        _KIND_OF_TYPE[t] = kind
    return kind


def classify(ev: object) -> EventKind | str:
    """The kind of a valid event, else the L{envelope_error} message: one pass for the hot path.

    The common case (plain types, int positions) is checked inline; anything unusual falls back to
    L{envelope_error} so the messages stay exactly the reference's, then to relayd's own
    L{limit_error}.
    """
    if type(ev) is dict:
        get = ev.get
        t = get("type")
        if (
            get("aep") == "0.1"
            and type(get("id")) is str
            and type(t) is str
            and type(get("time")) is str
            and type(get("source")) is str
            and type(get("agent")) is str
            and ev["id"]
            and t
            and ev["time"]
            and ev["source"]
            and ev["agent"]
        ):
            kind = kind_of_type(t)
            if kind is not None and _scope_ok(ev, kind) and _levels_ok(ev) and _plain_identifiers(ev):
                return kind
    problem = envelope_error(ev)
    if problem is not None:
        return problem
    kind = event_kind(ev)  # type: ignore[arg-type]
    return limit_error(ev, kind) or kind  # type: ignore[arg-type]


def _plain_identifiers(ev: dict) -> bool:
    # One C call for the usual case; a miss only means the exact checks run.
    session = ev.get("session")
    text = ev["id"] + ev["source"] + ev["agent"] + (session if type(session) is str else "")
    return text.isprintable()


def _scope_ok(ev: dict, kind: EventKind) -> bool:
    if kind is EventKind.SEQUENCED:
        seq = ev.get("seq")
        epoch = ev.get("epoch", 0)
        return (
            type(ev.get("session")) is str
            and type(seq) is int
            and 0 <= seq < POSITION_LIMIT
            and type(epoch) is int
            and -POSITION_LIMIT < epoch < POSITION_LIMIT
        )
    if kind is EventKind.AGENT_SCOPED:
        return "session" not in ev and "seq" not in ev
    return type(ev.get("session")) is str and "seq" not in ev


def _levels_ok(ev: dict) -> bool:
    severity = ev.get("severity", "info")
    capture = ev.get("capture", "metadata")
    return type(severity) is str and severity in _SEVERITY_SET and type(capture) is str and capture in _CAPTURE_SET

