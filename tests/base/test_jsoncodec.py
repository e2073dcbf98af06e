"""relayd/base/jsoncodec.py: each option of the codec at its limits, and each wing's reading and writing
held to the functions they replaced (copied below, as they were, as the reference)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import TestCase

from relayd.aep.core import event
from relayd.base import jsoncodec
from relayd.base.jsoncodec import MAX_INT_DIGITS, JSONError, Reader, Writer
from relayd.buzz import nostr
from relayd.buzz.core.contract import strict_json
from relayd.mcp.core import jsontext
from tests.support.cases import cases, expand

# --- The reference: the wings' functions before relayd.base.jsoncodec, as they were -----------------------
# (bench/jsoncodec.py times them against the new ones too.)


class OldAEPJSONError(ValueError):
    """relayd.aep.core.event.JSONError before the codec."""


def _aep_reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_WIDEST_EXACT = 2**63
_AEP_MAX_DEPTH = 255
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[{")
_AEP_MAX_INT_DIGITS = 4300
_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _aep_parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _AEP_MAX_INT_DIGITS:
        raise ValueError(f"integer of more than {_AEP_MAX_INT_DIGITS} digits")
    return int(text)


def _aep_lone_surrogate(value: Any) -> bool:
    stack = [value]
    while stack:
        node = stack.pop()
        kind = type(node)
        if kind is str:
            if not node.isascii() and _SURROGATE.search(node):
                return True
        elif kind is dict:
            stack.extend(node)
            stack.extend(node.values())
        elif kind is list:
            stack.extend(node)
    return False


def _aep_inexact(value: Any) -> bool:
    return type(value) is float and abs(value) >= _WIDEST_EXACT


def _aep_too_deep(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if type(node) is dict else node
        if depth > _AEP_MAX_DEPTH:
            return True
        stack.extend((child, depth + 1) for child in children if type(child) in (dict, list))
    return False


def _aep_brackets(data: bytes) -> int:
    return len(data.translate(None, _NOT_BRACKETS))


def old_aep_parse_json(data: bytes, exact: bool = False) -> Any:
    """relayd.aep.core.event.parse_json before the codec."""
    value: Any = None
    parsed = False
    if not exact:
        try:
            value = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            reason = str(e)
            if "64-bit" not in reason and "infinity" not in reason:
                raise OldAEPJSONError(reason) from None
        else:
            parsed = type(value) is not dict or not (_aep_inexact(value.get("seq")) or _aep_inexact(value.get("epoch")))
    if not parsed:
        try:
            value = json.loads(data.decode("utf-8"), parse_constant=_aep_reject_constant, parse_int=_aep_parse_int)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise OldAEPJSONError(str(e)) from None
        if _aep_lone_surrogate(value):
            raise OldAEPJSONError("lone surrogate in a string")
    if type(value) in (dict, list) and _aep_brackets(data) > _AEP_MAX_DEPTH and _aep_too_deep(value):
        raise OldAEPJSONError(f"nesting deeper than {_AEP_MAX_DEPTH} levels")
    return value


def old_aep_dumps(obj: Any) -> bytes:
    """relayd.aep.core.event.dumps before the codec."""
    try:
        return orjson.dumps(obj)
    except TypeError:
        text = json.dumps(_aep_finite(obj), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        return text.encode("utf-8", "replace")


def _aep_finite(value: Any) -> Any:
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is dict:
        return {k: _aep_finite(v) for k, v in value.items()}
    if kind in (list, tuple):
        return [_aep_finite(v) for v in value]
    return value


def _mcp_reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _mcp_js_number(text: str) -> int | float:
    if len(text) <= 20:
        value = int(text)
        if -(2**63) <= value < 2**64:
            return value
    return float(text)


def old_mcp_loads_json(data: bytes) -> Any:
    """relayd.mcp.core.jsontext.loads_json before the codec."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            return json.loads(data.decode("utf-8"), parse_constant=_mcp_reject_constant, parse_int=_mcp_js_number)
        except (UnicodeDecodeError, RecursionError) as e:
            raise ValueError(str(e)) from None


def _mcp_finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _mcp_finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mcp_finite(v) for v in value]
    return value


def old_mcp_dumps(value: Any) -> bytes:
    """relayd.mcp.core.jsontext.dumps before the codec."""
    try:
        return orjson.dumps(value)
    except TypeError:
        pass
    try:
        value = _mcp_finite(value)
        try:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
        except UnicodeEncodeError:
            return json.dumps(value, separators=(",", ":"), allow_nan=False).encode("ascii")
    except RecursionError:
        raise ValueError("nested too deep to serialise") from None


def _buzz_reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_OLD_BUZZ_DECODER = json.JSONDecoder(
    object_pairs_hook=strict_json._Obj, parse_constant=_buzz_reject_constant, parse_int=strict_json._parse_int
)


def old_buzz_loads_strict(data: bytes | str) -> Any:
    """relayd.buzz.core.contract.strict_json.loads_strict before the codec."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        text = bytes(data).decode("utf-8")
    else:
        text = data
    value, end = _OLD_BUZZ_DECODER.raw_decode(text, strict_json._skip_ws(text, 0))
    if strict_json._skip_ws(text, end) != len(text):
        raise ValueError("trailing data after JSON value")
    return value


def old_buzz_dumps(value: Any) -> bytes:
    """relayd.buzz.core.contract.strict_json.dumps before the codec (nostr.serialize_for_id wrote the same)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


# --- Comparing outcomes -------------------------------------------------------------------------------


def shape(value: Any) -> list[Any]:
    """C{value} in a form that compares types exactly (C{1}, C{1.0} and C{True} differ; NaN equals NaN;
    key order and an object's repeated keys count), walked without recursion (values nest 1,000 deep)."""
    out: list[Any] = []
    stack: list[tuple[bool, Any]] = [(False, value)]
    while stack:
        is_token, node = stack.pop()
        if is_token:
            out.append(node)
            continue
        kind = type(node)
        if kind is float:
            out.append(("float", repr(node)))
        elif isinstance(node, dict):
            out.append((kind.__name__, sorted(getattr(node, "dups", ())), len(node)))
            for k, v in reversed(node.items()):
                stack.extend(((False, v), (True, ("key", k))))
        elif isinstance(node, list):
            out.append(("list", len(node)))
            stack.extend((False, v) for v in reversed(node))
        else:
            out.append((kind.__name__, node))
    return out


def read(f: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """What C{f} makes of C{args}: its value's L{shape}, or the exception's kind and message (the old
    AEP JSONError and relayd.base.jsoncodec's are both C{"JSONError"})."""
    try:
        return ("value", shape(f(*args)))
    except (OldAEPJSONError, JSONError) as e:
        return ("JSONError", str(e))
    except ValueError as e:
        return ("ValueError", str(e))


def read_any_error(f: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
    """L{read}, for callers that catch any L{ValueError}: its message is what counts."""
    answer = read(f, *args)
    return ("ValueError", answer[1]) if answer[0] == "JSONError" else answer


def verdict(answer: tuple[Any, ...]) -> tuple[Any, ...]:
    """L{read}'s answer without an error's message: the codec names a fault in words of its own
    (L{jsoncodec.refusal_reason}), where the old functions passed on their parser's."""
    return answer if answer[0] == "value" else answer[:1]


def wrote(f: Callable[[Any], bytes], value: Any) -> tuple[Any, ...]:
    """What C{f} writes for C{value}, or the exception it raises."""
    try:
        return ("bytes", f(value))
    except Exception as e:
        return (type(e).__name__, str(e))


def nest(depth: int, inner: bytes = b"0", kind: str = "array") -> bytes:
    """JSON text of C{inner} inside C{depth} arrays or objects."""
    if kind == "array":
        return b"[" * depth + inner + b"]" * depth
    return b'{"k":' * depth + inner + b"}" * depth


def nested(depth: int, inner: Any = 0) -> Any:
    """A value of C{inner} inside C{depth} lists."""
    for _ in range(depth):
        inner = [inner]
    return inner


# Readings shaped as the wings' are, to test an option on its own.
STRICT = Reader(read_int=jsoncodec.exact_int, fallback="numbers", lone_surrogates=False, max_depth=255).loads
LENIENT = Reader(read_int=jsoncodec.int_or_double, fallback="any").loads


@expand
class IntegerReadings(TestCase):
    """The standard library path's integer readers."""

    @cases(at=(MAX_INT_DIGITS, True), over=(MAX_INT_DIGITS + 1, False))
    def test_exact_int_reads_up_to_the_limit(self, digits: int, read_it: bool) -> None:
        for sign in ("", "-"):
            text = sign + "7" * digits
            if read_it:
                self.assertEqual(jsoncodec.exact_int(text), int(text))
            else:
                with self.assertRaisesRegex(ValueError, "integer of more than 4300 digits"):
                    jsoncodec.exact_int(text)

    @cases(
        max_signed=(2**63 - 1, int), unsigned=(2**63, int), max_unsigned=(2**64 - 1, int), beyond=(2**64, float),
        min_signed=(-(2**63), int), below=(-(2**63) - 1, float), long=(10**30, float),
    )  # fmt: skip
    def test_int_or_double_reads_as_orjson_does(self, number: int, kind: type) -> None:
        value = jsoncodec.int_or_double(str(number))
        self.assertIs(type(value), kind)
        self.assertEqual(value, kind(number))
        self.assertEqual(shape(value), shape(orjson.loads(str(number))))

    def test_int_or_double_never_raises(self) -> None:
        self.assertEqual(jsoncodec.int_or_double("9" * (MAX_INT_DIGITS + 1)), math.inf)
        self.assertEqual(jsoncodec.int_or_double("-" + "9" * 400), -math.inf)

    def test_reject_constant(self) -> None:
        for name in ("NaN", "Infinity", "-Infinity"):
            with self.assertRaisesRegex(ValueError, f"^{name} is not JSON$"):
                jsoncodec.reject_constant(name)


@expand
class ReaderOptions(TestCase):
    def test_json_error_is_a_value_error(self) -> None:
        self.assertTrue(issubclass(JSONError, ValueError))

    @cases(max_signed=2**63 - 1, unsigned=2**63, max_unsigned=2**64 - 1)
    def test_integers_within_64_bits_are_exact_on_the_orjson_path(self, number: int) -> None:
        for loads in (STRICT, LENIENT):
            self.assertEqual(shape(loads(str(number).encode())), shape(number))

    def test_beyond_64_bits_orjson_reads_a_double(self) -> None:
        self.assertEqual(shape(STRICT(b"18446744073709551616")), shape(2.0**64))
        self.assertEqual(shape(STRICT(b"18446744073709551616", exact=True)), shape(2**64))
        self.assertEqual(shape(LENIENT(b"18446744073709551616", exact=True)), shape(2.0**64))

    def test_the_inexact_hook_sends_a_value_to_the_standard_library(self) -> None:
        seen: list[Any] = []

        def inexact(value: Any) -> bool:
            seen.append(value)
            return type(value) is float

        loads = Reader(read_int=jsoncodec.exact_int, fallback="numbers", inexact=inexact).loads
        self.assertEqual(shape(loads(b"18446744073709551616")), shape(2**64))
        self.assertEqual(shape(loads(b"[18446744073709551616]")), shape([2.0**64]))
        self.assertEqual(seen, [2.0**64, [2.0**64]])
        loads(b"1", exact=True)  # the standard library alone: nothing to ask
        self.assertEqual(len(seen), 2)

    @cases(largest="1e308", negative="-1e308", beyond="1e400", beyond_negative="-1e400")
    def test_numbers_at_and_beyond_the_double_range(self, text: str) -> None:
        for loads in (STRICT, LENIENT):
            self.assertEqual(shape(loads(text.encode())), shape(float(text)))

    def test_integer_literals_at_and_over_the_limit(self) -> None:
        # orjson refuses a 4300-digit integer as infinity: the standard library reads it.
        at, over = b"7" * MAX_INT_DIGITS, b"7" * (MAX_INT_DIGITS + 1)
        self.assertEqual(STRICT(at), int(at))
        self.assertEqual(STRICT(b"-" + at), -int(at))
        with self.assertRaisesRegex(JSONError, "^integer of more than 4300 digits$"):
            STRICT(over)
        self.assertEqual(LENIENT(over), math.inf)

    @cases(nan=b"NaN", infinity=b"Infinity", negative=b"-Infinity")
    def test_constants_are_refused_on_every_path(self, literal: bytes) -> None:
        for loads in (STRICT, LENIENT):
            with self.assertRaises(JSONError):
                loads(literal)
            with self.assertRaisesRegex(JSONError, " is not JSON$"):
                loads(b"[" + literal + b"]", exact=True)
        # A number only the standard library reads beside it: refused all the same.
        with self.assertRaisesRegex(JSONError, " is not JSON$"):
            LENIENT(b"[1e400," + literal + b"]")

    def test_fallback_numbers_answers_orjson_refusals_with_its_reason(self) -> None:
        with self.assertRaisesRegex(JSONError, "^NaN is not JSON$"):  # (orjson: "unexpected character")
            STRICT(b"[NaN,1e400]")
        with self.assertRaisesRegex(JSONError, r"^lone surrogate \\ud800 in a string$"):
            STRICT(b'"\\ud800"')

    def test_lone_surrogate_escapes(self) -> None:
        self.assertEqual(LENIENT(b'"\\ud800"'), "\ud800")
        self.assertEqual(LENIENT(b'{"\\udc00":1}'), {"\udc00": 1})
        with self.assertRaisesRegex(JSONError, r"^lone surrogate \\ud800 in a string$"):
            STRICT(b'["\\ud800"]', exact=True)
        with self.assertRaisesRegex(JSONError, r"^lone surrogate \\udc00 in a string$"):
            STRICT(b'[1e400,{"\\udc00":1}]')  # in a key, on the standard library's path
        refusing = Reader(read_int=jsoncodec.int_or_double, fallback="any", lone_surrogates=False).loads
        with self.assertRaisesRegex(JSONError, r"^lone surrogate \\ud800 in a string$"):
            refusing(b'"\\ud800"')
        # A pair is one character, not a lone surrogate.
        self.assertEqual(STRICT(b'"\\ud83d\\ude00"'), "\U0001f600")
        self.assertEqual(STRICT(b'"\\ud83d\\ude00"', exact=True), "\U0001f600")

    @cases(*[(kind, exact) for kind in ("array", "object") for exact in (False, True)])
    def test_max_depth_at_and_one_over(self, kind: str, exact: bool) -> None:
        self.assertEqual(STRICT(nest(255, kind=kind), exact=exact), json.loads(nest(255, kind=kind)))
        with self.assertRaisesRegex(JSONError, "^nesting deeper than 255 levels$"):
            STRICT(nest(256, kind=kind), exact=exact)
        self.assertEqual(LENIENT(nest(256, kind=kind)), json.loads(nest(256, kind=kind)))

    def test_brackets_in_strings_do_not_count(self) -> None:
        text = b'["' + b"[{" * 300 + b'"]'
        self.assertEqual(STRICT(text), ["[{" * 300])

    def test_beyond_the_parsers_depth(self) -> None:
        with self.assertRaisesRegex(JSONError, "^depth limit exceeded"):
            Reader(read_int=jsoncodec.exact_int, fallback="numbers").loads(nest(1025))
        # The standard library's own limit is named as orjson names it, at the bracket it refused.
        for exact in (False, True):
            with self.assertRaisesRegex(JSONError, "^depth limit exceeded at byte 1025$"):
                LENIENT(nest(1025), exact=exact)

    @cases(string=b'"\xff"', continuation=b'["\x80"]', truncated=b'"\xc3"', surrogate_utf8=b'"\xed\xa0\x80"')
    def test_invalid_utf8_is_refused_on_every_path(self, data: bytes) -> None:
        at = data.index(b'"') + 1  # the first byte of the string: the offset counts bytes, not characters
        for loads in (STRICT, LENIENT):
            for exact in (False, True):
                with self.assertRaisesRegex(JSONError, f"^not valid UTF-8 at byte {at}$"):
                    loads(data, exact=exact)

    def test_text_that_is_not_json(self) -> None:
        for data in (b"", b"[1,", b"1 2", b"{'a':1}", b"\xef\xbb\xbf1"):
            for loads in (STRICT, LENIENT):
                with self.assertRaises(JSONError):
                    loads(data)
                with self.assertRaises(JSONError):
                    loads(data, exact=True)


@expand
class RefusalReasons(TestCase):
    """A refusal names the fault in one wording, whichever parser found it (orjson, or the standard
    library after it): what each wing's answer to malformed JSON says (docs/aep.md)."""

    @cases(
        invalid_utf8=(b'["\xc3\xa9", "\xff"]', "not valid UTF-8 at byte 8"),  # bytes, not characters
        overlong=(b'"\xc0\xaf"', "not valid UTF-8 at byte 1"),
        encoded_surrogate=(b'"\xed\xa0\x80"', "not valid UTF-8 at byte 1"),
        truncated_utf8=(b'"\xc3', "not valid UTF-8 at byte 1"),
        byte_order_mark=(b"\xef\xbb\xbf[1]", "byte order mark at byte 0 (JSON text has none)"),
        empty=(b"", "no JSON value (the text is empty)"),
        white_space=(b" \r\n\t", "no JSON value (the text is empty)"),
        nul=(b'["\xc3\xa9\x00"]', "control character U+0000 in a string at byte 4"),
        unit_separator=(b'"\x1f"', "control character U+001F in a string at byte 1"),
        after_the_document=(b"[1]\x00", "unexpected content after document at byte 3"),
        truncated=(b'{"a":', "unexpected end of data at byte 5"),
        nan=(b"[1,NaN]", "NaN is not JSON"),
        infinity=(b"[Infinity]", "Infinity is not JSON"),
        minus_infinity=(b"[-Infinity]", "-Infinity is not JSON"),
        lone_high=(b'["\\ud800"]', "lone surrogate \\ud800 in a string"),
        high_then_high=(b'["\\ud800\\ud800"]', "lone surrogate \\ud800 in a string"),
        high_then_text=(b'["\\ud800x"]', "lone surrogate \\ud800 in a string"),
        lone_low_after_a_pair=(b'["\\ud83d\\ude00\\udc01"]', "lone surrogate \\udc01 in a string"),
        after_an_escaped_backslash=(b'["\\\\ud800", "\\udbff"]', "lone surrogate \\udbff in a string"),
        integer_over_the_limit=(b"[" + b"9" * (MAX_INT_DIGITS + 1) + b"]", f"integer of more than {MAX_INT_DIGITS} digits"),
    )
    def test_strict_and_lenient_readers_name_it_alike(self, data: bytes, reason: str) -> None:
        lenient_reads = reason.startswith(("lone surrogate", "integer of"))  # what LENIENT accepts
        for loads in (STRICT, LENIENT) if not lenient_reads else (STRICT,):
            for exact in (False, True):
                with self.assertRaises(JSONError) as refused:
                    loads(data, exact=exact)
                self.assertEqual(str(refused.exception), reason, (loads, exact))

    def test_a_number_orjson_cannot_hold_leaves_the_syntax_to_the_standard_library(self) -> None:
        # orjson refused the number, not the text: the standard library's reason, at its byte.
        for loads in (STRICT, LENIENT):
            with self.assertRaisesRegex(JSONError, "^Expecting value at byte 8$"):
                loads(b"[1e400, ")
            with self.assertRaisesRegex(JSONError, "^control character U\\+0001 in a string at byte 9$"):
                loads(b'[1e400, "\x01"]')


@expand
class WriterOptions(TestCase):
    def test_compact_utf8_in_key_order(self) -> None:
        value = {"z": [1, "é", None, True], "a": {"\u2028": 1.5}}
        expected = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        for surrogates in ("refuse", "escape", "replace"):
            dumps = Writer(surrogates).dumps
            self.assertEqual(dumps(value), expected)
            self.assertEqual(dumps({**value, "wide": 2**64}), expected[:-1] + b',"wide":18446744073709551616}')

    @cases(max_signed=2**63 - 1, max_unsigned=2**64 - 1, beyond=2**64, below=-(2**63) - 1, long=10**MAX_INT_DIGITS - 1)
    def test_integers_are_written_exactly(self, number: int) -> None:
        self.assertEqual(Writer().dumps([number]), b"[" + str(number).encode() + b"]")

    def test_non_finite_numbers_are_null_on_both_paths(self) -> None:
        value = [math.inf, -math.inf, math.nan, 1e308, (math.inf,)]
        self.assertEqual(Writer().dumps(value), b"[null,null,null,1e+308,[null]]")
        self.assertEqual(Writer().dumps([*value, 2**64]), b"[null,null,null,1e+308,[null],18446744073709551616]")
        self.assertEqual(Writer().dumps({"x": math.inf, "y": 2**64}), b'{"x":null,"y":18446744073709551616}')

    def test_lone_surrogate_refused(self) -> None:
        with self.assertRaises(UnicodeEncodeError):
            Writer("refuse").dumps(["é", "\ud800"])

    def test_lone_surrogate_escaped(self) -> None:
        self.assertEqual(Writer("escape").dumps(["é", "\ud800"]), b'["\\u00e9","\\ud800"]')
        self.assertEqual(Writer("escape").dumps({"\udc00": 1}), b'{"\\udc00":1}')

    def test_lone_surrogate_replaced(self) -> None:
        self.assertEqual(Writer("replace").dumps(["é", "\ud800"]), '["é","?"]'.encode())

    @cases(orjson=254, at_its_limit=255, over=256)
    def test_nesting_beyond_orjson(self, depth: int) -> None:
        self.assertEqual(Writer().dumps(nested(depth)), nest(depth))

    def test_nesting_beyond_the_standard_library_is_a_value_error(self) -> None:
        with self.assertRaisesRegex(ValueError, "^nested too deep to serialise$"):
            Writer().dumps(nested(5000))

    def test_what_json_cannot_hold_is_a_type_error(self) -> None:
        with self.assertRaises(TypeError):
            Writer().dumps({1, 2})


# --- Differential: each wing's new function answers as the old one did --------------------------------

_DIGITS = st.sampled_from([1, 2, 18, 19, 20, 21, 25, 309, 400, MAX_INT_DIGITS, MAX_INT_DIGITS + 1])
int_literals = st.builds(
    lambda sign, n, first: sign + str(first) + "0" * (n - 1) if n > 1 else sign + str(first),
    st.sampled_from(["", "-"]), _DIGITS, st.integers(1, 9),
) | st.integers(-(2**66), 2**66).map(str) | st.sampled_from(
    [str(2**63 - 1), str(2**63), str(2**64 - 1), str(2**64), str(-(2**63)), str(-(2**63) - 1), "0", "-0"]
)  # fmt: skip
float_literals = st.sampled_from(
    ["1e308", "-1e308", "1e400", "-1e400", "1.5", "-0.0", "1E2", "1e-400", "0.1", "1e19", "2e19", "9.3e18"]
) | st.floats(allow_nan=False, allow_infinity=False).map(repr)
string_literals = st.one_of(
    st.text(max_size=8).map(lambda s: json.dumps(s, ensure_ascii=False)),
    st.text(max_size=8).map(json.dumps),
    st.sampled_from(['"\\ud800"', '"\\udfff"', '"a\\udc00b"', '"\\ud83d\\ude00"', '"\\ud83d"', '"\\u0000"', '"é"']),
)
constants = st.sampled_from(["true", "false", "null", "NaN", "Infinity", "-Infinity"])
scalar_literals = st.one_of(int_literals, float_literals, string_literals, constants)
KEYS = st.sampled_from(['"seq"', '"epoch"', '"a"', '"a"', '"é"', '"\\ud800"', '"id"'])


def _array(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def _object(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(k + ":" + v for k, v in pairs) + "}"


json_texts = st.recursive(
    scalar_literals,
    lambda inner: st.lists(inner, max_size=4).map(_array) | st.lists(st.tuples(KEYS, inner), max_size=4).map(_object),
    max_leaves=12,
)


@st.composite
def json_bytes(draw: Callable[..., Any]) -> bytes:
    """JSON text, or nearly: numbers and escapes orjson refuses, deep nesting, broken bytes."""
    text = draw(json_texts).encode("utf-8", "surrogatepass")
    depth = draw(st.sampled_from([0, 0, 0, 1, 254, 255, 256, 1024, 1025]))
    if depth:
        text = nest(depth, text, draw(st.sampled_from(["array", "object"])))
    damage = draw(st.sampled_from([None, None, None, None, b"\xff", b"\xc3", b" ", b",", b"]", b"\n"]))
    if damage is not None:
        at = draw(st.integers(0, len(text)))
        text = text[:at] + damage + text[at:]
    return text


# Any code point, lone surrogates included (UTF-8 cannot carry them; JSON escapes can).
texts = st.text(st.characters(exclude_categories=()), max_size=8) | st.sampled_from(["\ud800", "a\udfffb", "é"])
json_values = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.sampled_from([1e16, -0.0, 2.0**64]),
        st.text(max_size=6), texts,
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@st.composite
def values_to_write(draw: Callable[..., Any], strategy: st.SearchStrategy[Any] = json_values) -> Any:
    value = draw(strategy)
    return nested(draw(st.sampled_from([0, 0, 0, 253, 254, 255, 300])), value)


class SameAnswers(TestCase):
    """Each wing's reading and writing on relayd.base.jsoncodec answers exactly as its old function did
    (a refusal in the codec's own words)."""

    @settings(max_examples=600, deadline=None)
    @given(json_bytes(), st.booleans())
    def test_aep_parse_json(self, data: bytes, exact: bool) -> None:
        self.assertEqual(verdict(read(event.parse_json, data, exact)), verdict(read(old_aep_parse_json, data, exact)))

    @settings(max_examples=300, deadline=None)
    @given(st.sampled_from(["seq", "epoch"]), int_literals | float_literals, st.booleans())
    def test_aep_parse_json_positions(self, name: str, number: str, nested_deep: bool) -> None:
        inner = "[" * 300 + "]" * 300 if nested_deep else "1"
        data = f'{{"type":"x.y","{name}":{number},"d":{inner}}}'.encode()
        for exact in (False, True):
            self.assertEqual(verdict(read(event.parse_json, data, exact)), verdict(read(old_aep_parse_json, data, exact)))

    @settings(max_examples=600, deadline=None)
    @given(json_bytes())
    def test_mcp_loads_json(self, data: bytes) -> None:
        # The old function let the json module's own errors through; every caller catches ValueError.
        self.assertEqual(verdict(read_any_error(jsontext.loads_json, data)), verdict(read_any_error(old_mcp_loads_json, data)))

    @settings(max_examples=300, deadline=None)
    @given(json_bytes())
    def test_buzz_loads_strict(self, data: bytes) -> None:
        # Deep text makes both raise RecursionError (check_tree's business, not the decoder's).
        try:
            old = read(old_buzz_loads_strict, data)
        except RecursionError:
            self.assertRaises(RecursionError, strict_json.loads_strict, data)
            return
        self.assertEqual(verdict(read(strict_json.loads_strict, data)), verdict(old))

    @settings(max_examples=400, deadline=None)
    @given(values_to_write())
    def test_aep_dumps(self, value: Any) -> None:
        self.assertEqual(wrote(event.dumps, value), wrote(old_aep_dumps, value))

    @settings(max_examples=400, deadline=None)
    @given(values_to_write())
    def test_mcp_dumps(self, value: Any) -> None:
        self.assertEqual(wrote(jsontext.dumps, value), wrote(old_mcp_dumps, value))

    @settings(max_examples=400, deadline=None)
    @given(values_to_write())
    def test_buzz_dumps(self, value: Any) -> None:
        new, old = wrote(strict_json.dumps, value), wrote(old_buzz_dumps, value)
        if new != old:
            # The one change: the old fallback wrote a non-finite number as NaN/Infinity (not JSON);
            # both paths now write null, as the orjson path always did.
            finite = _aep_finite(value)
            self.assertNotEqual(shape(finite), shape(value))
            self.assertEqual(new, wrote(old_buzz_dumps, finite))

    @settings(max_examples=300, deadline=None)
    @given(texts, st.integers(-(2**70), 2**70), st.integers(0, 2**16), st.lists(st.lists(texts, max_size=3)), texts)
    def test_nostr_preimage(self, pubkey: str, created_at: int, kind: int, tags: list[list[str]], content: str) -> None:
        args = (pubkey, created_at, kind, tags, content)
        self.assertEqual(
            wrote(lambda a: nostr.serialize_for_id(*a), args), wrote(lambda a: old_buzz_dumps([0, *a]), args)
        )
