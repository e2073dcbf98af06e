"""JSON text as the Node relay reads and writes it (C{JSON.parse} and C{JSON.stringify}).

orjson does the work; the json module takes over for what orjson refuses and JSON allows (numbers
beyond the double range, lone-surrogate escapes, nesting deeper than orjson's limit). No I/O.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _js_number(text: str) -> int | float:
    """An integer literal as orjson reads it: exact within 64 bits, else the nearest double.

    (JSON.parse reads every number as a double; Python's C{int()} refuses literals over 4300 digits.)
    """
    if len(text) <= 20:
        value = int(text)
        if -(2**63) <= value < 2**64:
            return value
    return float(text)  # never raises: beyond the double range it is +-inf, as in JavaScript


def loads_json(data: bytes) -> Any:
    """Parse JSON text; L{ValueError} for anything that is not JSON (invalid UTF-8 included)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        # orjson refuses what JSON (and JSON.parse) accepts: numbers beyond the double range, and
        # escapes of lone surrogates ("\ud800"). The json module reads them.
        try:
            return json.loads(data.decode("utf-8"), parse_constant=_reject_constant, parse_int=_js_number)
        except (UnicodeDecodeError, RecursionError) as e:
            raise ValueError(str(e)) from None


def _finite(value: Any) -> Any:
    """C{value} as JSON.stringify sees it: non-finite numbers are null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _dumps(value: Any) -> bytes:
    """Compact JSON of a parsed value; L{ValueError} if it cannot be written (nested too deep)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        pass
    # orjson refuses strings holding lone surrogates (which JSON can carry as escapes) and nesting
    # deeper than 254; the json module writes both. Non-ASCII stays as it is unless a lone surrogate
    # forces escapes (UTF-8 cannot carry one).
    try:
        value = _finite(value)
        try:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")
    except RecursionError:
        raise ValueError("nested too deep to serialise") from None
