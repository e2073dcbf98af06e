"""Checks on a decoded JSON tree as a whole: nulls, repeated keys, lone surrogates, non-finite
numbers and nesting depth, with error messages that never grow with the payload."""

from __future__ import annotations

from typing import Any

from relayd.buzz.core.contract.errors import ContractError
from relayd.buzz.core.contract.vocabulary import MAX_DEPTH, MAX_ECHO


def quote(name: str) -> str:
    """A member name as an error message names it: quoted, escaped, at most L{MAX_ECHO} characters."""
    if len(name) <= MAX_ECHO:
        return repr(name)
    return repr(name[:MAX_ECHO]) + f"\u2026 ({len(name)} characters)"


def check_tree(value: Any, path: str = "$") -> None:
    """Reject a null, a repeated key, a string with a lone surrogate, a non-finite number, or
    containers nested more than L{MAX_DEPTH} deep, anywhere in C{value}."""
    # The common case (a sound tree) is walked without building a path per member; only a tree
    # with a fault is walked again to name where it is. Both stop at MAX_DEPTH, so neither can
    # exhaust the stack on a deeply nested payload.
    if not _tree_sound(value, 1):
        _check_tree(value, path, 1)


def _text_sound(s: str) -> bool:
    if s.isascii():  # O(1) in CPython: an ASCII string holds no surrogate
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _tree_sound(value: Any, depth: int) -> bool:
    t = type(value)
    if t is str:
        return _text_sound(value)
    if t is int or t is bool:
        return True
    if value is None:
        return False
    if isinstance(value, dict):
        if depth > MAX_DEPTH or getattr(value, "dups", None):
            return False
        for k, v in value.items():
            if not _text_sound(k) or not _tree_sound(v, depth + 1):
                return False
        return True
    if t is list:
        if depth > MAX_DEPTH:
            return False
        for v in value:
            if not _tree_sound(v, depth + 1):
                return False
        return True
    if t is float:
        return value == value and value not in (float("inf"), float("-inf"))
    return True


def _check_tree(value: Any, path: str, depth: int) -> None:
    if value is None:
        raise ContractError(f"{path} is null")
    t = type(value)
    if t is str:
        _check_scalar_text(value, path)
    elif isinstance(value, dict):
        if depth > MAX_DEPTH:
            raise ContractError(f"{path} nests deeper than {MAX_DEPTH} levels")
        dups = getattr(value, "dups", None)
        if dups:
            raise ContractError(f"{path} repeats key {quote(sorted(dups)[0])}")
        for k, v in value.items():
            _check_scalar_text(k, path)
            _check_tree(v, _member_path(path, k), depth + 1)
    elif t is list:
        if depth > MAX_DEPTH:
            raise ContractError(f"{path} nests deeper than {MAX_DEPTH} levels")
        for i, v in enumerate(value):
            _check_tree(v, f"{path}[{i}]", depth + 1)
    elif t is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise ContractError(f"{path} is not a finite number")


def _member_path(path: str, key: str) -> str:
    """C{path.key} for a plain short key, C{path['odd key']} (bounded by L{quote}) for any other."""
    if len(key) <= MAX_ECHO and key.isidentifier() and key.isascii():
        return f"{path}.{key}"
    return f"{path}[{quote(key)}]"


def _check_scalar_text(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ContractError(f"{path} holds a lone surrogate") from None
