"""attr-match subscription filters (docs/aep.md): validation and compiled predicates.

A filter is validated and compiled once per subscription; the resulting predicate runs per
event per subscriber, so all per-filter work (sets, prefix tuples, rank bounds) happens up front.
"""

from __future__ import annotations

import difflib
import math
import re
from typing import Any, Callable, Final, Iterable, NamedTuple

from relayd.aep.core.envelope import SEVERITIES, js_str

__all__ = ["Pin", "Predicate", "compile_filter", "filter_error", "index_value", "match_all", "near_misses", "pin_of"]

Predicate = Callable[[dict], bool]

_CORE_ATTRS: Final = frozenset(
    {
        "aep", "id", "type", "subject", "time", "source", "agent", "session", "run",
        "step", "seq", "epoch", "cause", "traceparent", "severity", "capture", "data",
    }
)  # fmt: skip
_FILTERABLE: Final = frozenset(
    {"id", "type", "subject", "source", "agent", "session", "run", "step", "epoch", "cause", "severity", "capture"}
)
_UNFILTERABLE: Final = frozenset({"time", "seq", "aep", "data"})
_EXTENSION_RE: Final = re.compile(r"[a-z0-9]{1,20}")
_TYPE_PATTERN_RE: Final = re.compile(r"(?:[a-z0-9_-]+\.)+\*")
_SEV_RANK: Final = {name: rank for rank, name in enumerate(SEVERITIES)}
# Consumers apply these defaults before comparing (docs/aep.md).
_DEFAULTS: Final = {"severity": "info", "capture": "metadata", "epoch": 0}
_MISSING: Final = object()

_ARRAY_INDEX_RE: Final = re.compile(r"0|[1-9][0-9]*")


def _js_key_order(obj: dict) -> list:
    """Keys in JS ``Object.keys`` order: array-index keys ascending, then insertion order.

    Only the choice of *first* error message depends on it, but that text is part of the protocol.
    """
    index_keys: list[tuple[int, str]] = []
    other: list = []
    for k in obj:
        # (At most 10 digits can be an array index; a longer key is never converted to a number.)
        if isinstance(k, str) and len(k) <= 10 and _ARRAY_INDEX_RE.fullmatch(k) and int(k) < 2**32 - 1:
            index_keys.append((int(k), k))
        else:
            other.append(k)
    if not index_keys:
        return other
    index_keys.sort()
    return [k for _, k in index_keys] + other


def _is_scalar(v: object) -> bool:
    return isinstance(v, (str, bool, int, float))


def filter_error(f: object) -> str | None:
    """Return the first problem of attr-match filter C{f} (exact reference text), or None if valid."""
    if not isinstance(f, dict):
        return "filter must be a JSON object"
    for key in _js_key_order(f):
        pred = f[key]
        if key in _UNFILTERABLE:
            return f"attribute not filterable: {key}"
        if key not in _FILTERABLE and not (
            isinstance(key, str) and _EXTENSION_RE.fullmatch(key) and key not in _CORE_ATTRS
        ):
            return f"unknown filter key: {key}"
        if key == "severity" and isinstance(pred, dict):
            for op in _js_key_order(pred):
                if op not in ("gte", "lte"):
                    return "severity comparison allows gte/lte only"
                level = pred[op]
                if not (isinstance(level, str) and level in _SEV_RANK):
                    return f"unknown severity level: {js_str(level)}"
            continue
        values = pred if isinstance(pred, list) else [pred]
        if not values:
            return f"empty inclusion array on {key}"
        for v in values:
            if not _is_scalar(v):
                return f"predicate values must be scalars ({key})"
            if isinstance(v, str) and "*" in v:
                if key != "type":
                    return f'glob patterns are only legal on "type" ({key})'
                if _TYPE_PATTERN_RE.fullmatch(v) is None:
                    return f"bad type pattern: {v} (form: prefix.*)"
    return None


def near_misses(f: dict) -> list[str]:
    """What to tell the subscriber of a valid filter C{f} about its extension keys spelled like a
    filterable core attribute (C{sesion}): legal (an extension attribute of that name), but almost
    always a typo that matches nothing. One sentence per such key, naming it and the attribute it
    is not; the SSE stream sends each as a comment, the WebSocket's C{subscribed} frame carries them
    as C{warnings}. (Both names match C{[a-z0-9]{1,20}}: nothing to escape on a comment line.)"""
    found = []
    for key in f:
        if key not in _FILTERABLE and isinstance(key, str):
            close = difflib.get_close_matches(key, sorted(_FILTERABLE), n=1, cutoff=0.8)
            if close:
                found.append(
                    f'filter key "{key}" is an extension attribute, not "{close[0]}": it matches only events carrying "{key}"'
                )
    return found


def match_all(ev: dict) -> bool:
    """The predicate of the empty filter ``{}``."""
    return True


def _severity_band(pred: dict) -> Predicate | None:
    lo = _SEV_RANK[pred["gte"]] if "gte" in pred else None
    hi = _SEV_RANK[pred["lte"]] if "lte" in pred else None
    if lo is None and hi is None:
        return None  # `{}` bounds nothing
    # Open bounds sit outside every rank, including the -1 an unknown level gets (JS indexOf).
    lo_ = -1 if lo is None else lo
    hi_ = len(SEVERITIES) if hi is None else hi

    def band(ev: dict) -> bool:
        sev = ev.get("severity")
        if sev is None:
            sev = "info"
        rank = _SEV_RANK.get(sev, -1) if isinstance(sev, str) else -1
        return lo_ <= rank <= hi_

    return band


class _StringIn:
    """Any-of string equality on an attribute without a default: the usual filter
    (C{"session": "S"}), compiled to one small object. A process may hold 100 000 of them, and
    the garbage collector's full passes visit every object (a closure with its cells and sets
    is about ten)."""

    __slots__ = ("key", "strs")

    def __init__(self, key: str, strs: set[str]) -> None:
        self.key = key
        # A few strings: a tuple, which the collector stops tracking; many: a set.
        self.strs: tuple[str, ...] | frozenset[str] = tuple(strs) if len(strs) <= 8 else frozenset(strs)

    def __call__(self, ev: dict) -> bool:
        val = ev.get(self.key)
        return isinstance(val, str) and val in self.strs


def _membership(key: str, values: Iterable[object]) -> Predicate:
    """Any-of strict (JS ``===``) equality, plus ``prefix.*`` globs when key is ``type``."""
    strs: set[str] = set()
    nums: set[float] = set()
    bools: set[bool] = set()
    prefixes: list[str] = []
    for v in values:
        if isinstance(v, str):
            if key == "type" and v.endswith(".*"):
                prefixes.append(v[:-1])  # keep the dot: "tool.*" must not match "toolbox.x"
            else:
                strs.add(v)
        elif isinstance(v, bool):
            # Kept apart from numbers: in Python True == 1, under JS === it is not.
            bools.add(v)
        elif isinstance(v, float) and math.isnan(v):
            continue  # NaN === NaN is false in JS; a set would match it by identity
        else:
            nums.add(v)  # type: ignore[arg-type]
    prefix_tuple = tuple(prefixes)
    default = _DEFAULTS.get(key, _MISSING)
    if strs and not (prefix_tuple or nums or bools) and default is _MISSING:
        return _StringIn(key, strs)

    def member(ev: dict) -> bool:
        val = ev.get(key, _MISSING)
        if default is not _MISSING and (val is _MISSING or val is None):
            val = default  # JS `??` also replaces an explicit null
        if isinstance(val, str):
            return val in strs or (bool(prefix_tuple) and val.startswith(prefix_tuple))
        if isinstance(val, bool):
            return val in bools
        if isinstance(val, (int, float)):
            return val in nums  # 1 == 1.0 as in JS
        return False  # absent, null, or a non-scalar extension value never matches

    return member


def compile_filter(f: dict) -> Predicate:
    """Compile a valid attr-match filter into a predicate over events.

    Members are ANDed; raises ValueError (with the L{filter_error} text) if C{f} is invalid.
    """
    err = filter_error(f)
    if err is not None:
        raise ValueError(err)
    checks: list[Predicate] = []
    for key, pred in f.items():
        if key == "severity" and isinstance(pred, dict):
            band = _severity_band(pred)
            if band is not None:
                checks.append(band)
        else:
            checks.append(_membership(key, pred if isinstance(pred, list) else [pred]))
    if not checks:
        return match_all
    if len(checks) == 1:
        return checks[0]
    if len(checks) == 2:
        first, second = checks
        return lambda ev: first(ev) and second(ev)
    all_checks = tuple(checks)

    def conjunction(ev: dict) -> bool:
        for check in all_checks:
            if not check(ev):
                return False
        return True

    return conjunction


# Which pinned attribute a subscription is indexed by, most selective first: a session (or an id,
# a run ...) names few events, a capture level or a severity most of them. Extension attributes
# rank between the core identifiers and the broad classifications.
_PIN_RANK: Final = ("session", "id", "cause", "run", "step", "subject", "agent", "source")
_PIN_LAST: Final = ("type", "capture", "severity")


class Pin(NamedTuple):
    """The attribute a filter pins to exact strings: the subscription index's bucket key."""

    attr: str
    values: tuple[str, ...]
    alone: bool  # the filter constrains nothing else: being in the bucket is the match


def _pinned_values(key: str, pred: object) -> tuple[str, ...] | None:
    """The strings C{key} must equal (any of), or None when the predicate is not exact string
    equality (a glob, a severity band, a number or boolean: those are matched by scanning)."""
    values = pred if isinstance(pred, list) else [pred]
    if not all(isinstance(v, str) for v in values):
        return None
    if key == "type" and any(v.endswith(".*") for v in values):  # type: ignore[union-attr]
        return None
    return tuple(dict.fromkeys(values))


def _pin_rank(key: str) -> int:
    if key in _PIN_RANK:
        return _PIN_RANK.index(key)
    if key in _PIN_LAST:
        return len(_PIN_RANK) + 1 + _PIN_LAST.index(key)
    return len(_PIN_RANK)  # an extension attribute


def pin_of(f: dict) -> Pin | None:
    """The most selective attribute valid filter C{f} pins to exact strings, or None (the filter
    must then be tested against every event)."""
    best: tuple[int, str, tuple[str, ...]] | None = None
    for key, pred in f.items():
        values = _pinned_values(key, pred)
        if values is not None and (best is None or _pin_rank(key) < best[0]):
            best = (_pin_rank(key), key, values)
    if best is None:
        return None
    return Pin(best[1], best[2], len(f) == 1)


def index_value(ev: dict, attr: str) -> Any:
    """The value of C{attr} an event is compared with (defaults applied as L{compile_filter}
    does); only a string can equal a pinned value."""
    val = ev.get(attr)
    if val is None:
        val = _DEFAULTS.get(attr)
    return val
