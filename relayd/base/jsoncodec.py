"""JSON both ways, as relayd's protocols read and write it: orjson does the work, the standard
library takes over for what orjson refuses and JSON allows.

The mechanism is here once; a wing says which options it takes in a L{Reader} and a L{Writer} made
at import, and keeps what only it needs. Every reading is strict UTF-8, refuses the C{NaN} and
C{Infinity} literals (not JSON, though the standard library reads them) and reads the standard
library's integer literals with the function its policy names (Python refuses to convert more than
L{MAX_INT_DIGITS} digits); a refusal names its fault in one wording, whichever parser found it
(L{refusal_reason}). Every writing is compact (no spaces), UTF-8, keeps key order, and writes
a non-finite number as C{null}, as orjson and JavaScript's C{JSON.stringify} do. No I/O.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, NoReturn, Protocol

import orjson


class JSONError(ValueError):
    """Bytes that are not one JSON value (bad syntax or invalid UTF-8), or a value the policy refuses;
    its message is L{refusal_reason}'s (or the policy's own)."""


# Python's own limit on converting a digit string (sys.int_info.default_max_str_digits): a longer
# integer literal could be neither read exactly nor written again.
MAX_INT_DIGITS = 4300

_SURROGATE = re.compile(r"[\ud800-\udfff]")
_BOM = b"\xef\xbb\xbf"
# A backslash escape in a JSON string: a \\u escape's four hex digits, or the one character escaped.
_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[{")
_COMPACT = (",", ":")


def reject_constant(name: str) -> NoReturn:
    """The standard library's C{parse_constant}: C{NaN}, C{Infinity} and C{-Infinity} are not JSON."""
    raise ValueError(f"{name} is not JSON")


def exact_int(text: str) -> int:
    """An integer literal read exactly; L{ValueError} beyond L{MAX_INT_DIGITS} digits."""
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


def int_or_double(text: str) -> int | float:
    """An integer literal as orjson reads it: exact within 64 bits, else the nearest double.

    Never raises: beyond the double range it is +-inf, as JavaScript's C{JSON.parse} reads it (which
    reads every number as a double), and a literal too long for C{int()} is never converted.
    """
    if len(text) <= 20:
        value = int(text)
        if -(2**63) <= value < 2**64:
            return value
    return float(text)


class Loads(Protocol):
    """A L{Reader}'s reading function."""

    def __call__(self, data: bytes, exact: bool = False) -> Any: ...


@dataclass(frozen=True, slots=True)
class Reader:
    """How JSON text is read: orjson first, the standard library for what orjson refuses or reads
    less exactly than the policy needs.

    @ivar read_int: how the standard library reads an integer literal (orjson's reading is fixed:
        exact within 64 bits, beyond them a double).
    @ivar fallback: which of orjson's refusals the standard library reads instead: C{"numbers"},
        only a number orjson cannot hold (beyond the double range, or an integer beyond 64 bits
        where an orjson version refuses it: any other refusal is the answer, with orjson's reason);
        C{"any"}, every one (lone-surrogate escapes and nesting beyond orjson's limit too; text that
        is not JSON then fails with the standard library's reason).
    @ivar inexact: whether a value orjson read lost a precision the caller needs (an integer read
        as a double); the standard library then reads the text again. C{None}: never.
    @ivar lone_surrogates: whether a string may hold a lone surrogate (a valid JSON escape with no
        UTF-8 form; orjson refuses it, the standard library reads it).
    @ivar max_depth: the deepest nesting of arrays and objects accepted; C{None}: what the parsers take.
    """

    read_int: Callable[[str], int | float]
    fallback: Literal["numbers", "any"]
    inexact: Callable[[Any], bool] | None = None
    lone_surrogates: bool = True
    max_depth: int | None = None

    @property
    def loads(self) -> Loads:
        """The reading function: C{loads(data)}, or C{loads(data, exact=True)} to read with the
        standard library alone (every integer as C{read_int} reads it); the value of C{data}, or
        L{JSONError} if it is not JSON or the policy refuses it."""
        # Taken once, at import: a policy with nothing to check after orjson gets the reading
        # that returns orjson's value at once, so the hot paths pay what calling orjson from a
        # function of their own cost (bench/jsoncodec.py; the checks cost a few percent).
        return self._checked if self.inexact is not None or self.max_depth is not None else self._plain

    def _plain(self, data: bytes, exact: bool = False) -> Any:
        if exact:
            return self._standard(data)
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as e:
            return self._refused(data, e)

    def _checked(self, data: bytes, exact: bool = False) -> Any:
        if exact:
            value = self._standard(data)
        else:
            try:
                value = orjson.loads(data)
            except orjson.JSONDecodeError as e:
                value = self._refused(data, e)
            else:
                inexact = self.inexact
                if inexact is not None and inexact(value):
                    value = self._standard(data)
        max_depth = self.max_depth
        # Counting the brackets is cheap; only a text that has enough of them is walked.
        if (
            max_depth is not None
            and type(value) in (dict, list)
            and len(data.translate(None, _NOT_BRACKETS)) > max_depth
            and _deeper_than(value, max_depth)
        ):
            raise JSONError(f"nesting deeper than {max_depth} levels")
        return value

    def _refused(self, data: bytes, refusal: orjson.JSONDecodeError) -> Any:
        """What the standard library reads of C{data}, if the policy lets it read what orjson refused."""
        if self.fallback == "numbers" and not _number_refusal(refusal):
            raise JSONError(refusal_reason(data, refusal)) from None
        return self._standard(data)

    def _standard(self, data: bytes) -> Any:
        try:
            value = json.loads(data.decode("utf-8"), parse_constant=reject_constant, parse_int=self.read_int)
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise JSONError(refusal_reason(data, e)) from None
        if not self.lone_surrogates:
            lone = _lone_surrogate(value)
            if lone is not None:
                raise JSONError(_lone_surrogate_reason(ord(lone)))
        return value


def refusal_reason(data: bytes, error: Exception) -> str:
    """What is wrong with C{data}, which a JSON reader refused with C{error}: the one wording of a
    fault whichever parser found it and whichever way the text came in, so that every answer that
    names it (an ingest C{400}, a WebSocket C{bad-json}, a broker C{invalid_request}) says the same.

    Invalid UTF-8 is found here, at its byte (orjson's own reason names a surrogate that is not
    there); any other fault of the text in orjson's words, at a byte offset into C{data}; a lone
    surrogate escape by its code; a reason of the policy's own (L{exact_int}'s, L{reject_constant}'s,
    any other L{ValueError}'s) is kept as it is.
    """
    if data.startswith(_BOM):
        return "byte order mark at byte 0 (JSON text has none)"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not valid UTF-8 at byte {e.start}"
    if isinstance(error, (json.JSONDecodeError, RecursionError)) and not isinstance(error, orjson.JSONDecodeError):
        # Text the standard library found to be no JSON is named in orjson's words (its messages
        # are the ones every way in gives), unless orjson only refuses a number it cannot hold.
        error = _syntax_refusal(data) or error
    if isinstance(error, RecursionError):
        return "depth limit exceeded"
    if not isinstance(error, json.JSONDecodeError):  # (orjson's is one too)
        return str(error)
    if not text.strip(" \t\r\n"):
        return "no JSON value (the text is empty)"
    message, pos = error.msg, error.pos
    for constant in ("NaN", "Infinity"):
        if text.startswith(constant, pos):  # (orjson's reason is "unexpected character")
            sign = "-" if constant == "Infinity" and text[pos - 1 : pos] == "-" else ""
            return f"{sign}{constant} is not JSON"
    if "surrogate" in message:
        code = _lone_surrogate_escape(text, pos)
        if code is not None:
            return _lone_surrogate_reason(code)
    at = len(text[:pos].encode("utf-8"))
    if "control character" in message and pos < len(text):
        return f"control character U+{ord(text[pos]):04X} in a string at byte {at}"
    # The standard library's messages end "... at" when it names a position ("Invalid \\escape").
    return f"{message.removesuffix(' at').rstrip(':')} at byte {at}"


def _number_refusal(refusal: orjson.JSONDecodeError) -> bool:
    """Whether orjson refused a number it cannot hold (beyond the double range, or an integer beyond
    64 bits where an orjson version refuses it) rather than the text."""
    return "64-bit" in refusal.msg or "infinity" in refusal.msg


def _syntax_refusal(data: bytes) -> orjson.JSONDecodeError | None:
    """orjson's refusal of C{data} when it is about the text, else C{None}."""
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError as e:
        return None if _number_refusal(e) else e
    return None


def _lone_surrogate_reason(code: int) -> str:
    return f"lone surrogate \\u{code:04x} in a string"


def _lone_surrogate_escape(text: str, start: int) -> int | None:
    """The code of the first lone surrogate escape in C{text} from C{start}, or C{None}: a high
    surrogate escape not followed at once by a low one, or a low one on its own."""
    high, high_end = None, -1
    for escape in _ESCAPE.finditer(text, start):
        digits = escape.group(1)
        code = -1 if digits is None else int(digits, 16)
        if high is not None:
            if escape.start() == high_end and 0xDC00 <= code <= 0xDFFF:
                high = None
                continue
            return high
        if 0xD800 <= code <= 0xDBFF:
            high, high_end = code, escape.end()
        elif 0xDC00 <= code <= 0xDFFF:
            return code
    return high


@dataclass(frozen=True, slots=True)
class Writer:
    """How a value is written: compact JSON, UTF-8, key order kept, a non-finite number as C{null}.

    orjson writes it; the standard library writes what orjson refuses (integers beyond 64 bits,
    nesting deeper than orjson's limit, lone surrogates), with the same bytes for strings, integers,
    arrays and objects. A value nested too deep for the standard library too is a L{ValueError}.

    @ivar surrogates: what a string holding a lone surrogate (which UTF-8 cannot carry) makes of the
        text: C{"refuse"} raises L{UnicodeEncodeError}, C{"escape"} writes the whole text as ASCII
        (the surrogate as a C{\\u} escape), C{"replace"} writes C{?} for it.
    """

    surrogates: Literal["refuse", "escape", "replace"] = "refuse"

    def dumps(self, value: Any) -> bytes:
        """The compact JSON of C{value}."""
        try:
            return orjson.dumps(value)
        except TypeError:  # orjson.JSONEncodeError: integers beyond 64 bits, lone surrogates, depth
            return self._standard(value)

    def _standard(self, value: Any) -> bytes:
        surrogates = self.surrogates
        try:
            value = _finite(value)
            text = json.dumps(value, separators=_COMPACT, ensure_ascii=False, allow_nan=False)
            if surrogates == "escape":
                try:
                    return text.encode("utf-8")
                except UnicodeEncodeError:
                    return json.dumps(value, separators=_COMPACT, allow_nan=False).encode("ascii")
        except RecursionError:
            raise ValueError("nested too deep to serialise") from None
        return text.encode("utf-8", "replace" if surrogates == "replace" else "strict")


def _finite(value: Any) -> Any:
    """C{value} with infinities and NaN as C{None}, as orjson and C{JSON.stringify} write them
    (the standard library would write C{Infinity}, which is not JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _lone_surrogate(value: Any) -> str | None:
    """A lone surrogate in a string (or key) of C{value}, or C{None} (walked without recursion)."""
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is str:
            if not node.isascii():
                found = _SURROGATE.search(node)
                if found is not None:
                    return found.group()
        elif kind is dict:
            stack.extend(node)
            stack.extend(node.values())
        elif kind is list:
            stack.extend(node)
    return None


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether C{value} nests arrays/objects more than C{limit} levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if type(node) is dict else node
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if type(child) in (dict, list))
    return False
