"""Strict JSON both ways: a decoder that remembers repeated keys and reads numbers of any length,
and the compact encoder every answer is written with.

Kept together as one unit (L{loads_strict}, L{dumps}, L{_parse_int} and what they use; the mechanism
both share with the other wings is L{relayd.base.jsoncodec}'s): what a payload means is judged elsewhere
(L{relayd.buzz.core.contract.tree}).
"""

from __future__ import annotations

import json
from typing import Any

from relayd.base import jsoncodec

# Integers with more digits than this are out of every range the contract has (2**64 has 20):
# they are read as a stand-in of the same sign instead of converting thousands of digits.
_MAX_INT_DIGITS = 40
_BIG = 10**_MAX_INT_DIGITS


class _Obj(dict[str, Any]):
    """A decoded JSON object that remembers which keys it saw more than once."""

    __slots__ = ("dups",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.dups: frozenset[str] = frozenset()
        if len(self) != len(pairs):
            seen: set[str] = set()
            dups: set[str] = set()
            for k, _ in pairs:
                (dups if k in seen else seen).add(k)
            self.dups = frozenset(dups)


def _parse_int(digits: str) -> int:
    """An integer literal; one too long for any range is a same-signed stand-in beyond them all.

    Python refuses to convert more than 4,300 digits (the conversion is quadratic), which would
    make a valid JSON number an undecodable body instead of a member out of range.
    """
    if len(digits) <= _MAX_INT_DIGITS:
        return int(digits)
    return -_BIG if digits.startswith("-") else _BIG


_DECODER = json.JSONDecoder(object_pairs_hook=_Obj, parse_constant=jsoncodec.reject_constant, parse_int=_parse_int)


def loads_strict(data: bytes | str) -> Any:
    """Decode JSON, keeping repeated-key information; raises C{ValueError} for non-JSON or bad UTF-8.

    Repeated keys, nulls, lone surrogates and deep nesting are found by L{check_tree}, so a caller
    can still read the requestId of an otherwise malformed body. Nesting beyond what the decoder
    itself handles (several hundred levels) raises C{RecursionError}.
    """
    if isinstance(data, (bytes, bytearray, memoryview)):
        text = bytes(data).decode("utf-8")  # strict: invalid UTF-8 raises UnicodeDecodeError
    else:
        text = data
    value, end = _DECODER.raw_decode(text, _skip_ws(text, 0))
    if _skip_ws(text, end) != len(text):
        raise json.JSONDecodeError("trailing data after JSON value", text, end)
    return value


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\n\r":
        i += 1
    return i


# dumps(value): compact UTF-8 JSON, as the host writes it (no whitespace, non-ASCII verbatim).
# orjson writes the same bytes as json.dumps(value, separators=(",", ":"), ensure_ascii=False) for the
# strings, integers, lists and objects the contract uses, several times faster; what it refuses
# (integers beyond 64 bits, lone surrogates) takes the stdlib path, which raises where it must (a
# lone surrogate: UnicodeEncodeError).
dumps = jsoncodec.Writer(surrogates="refuse").dumps
