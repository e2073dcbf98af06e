"""How the fence tells, at import, whether an installed release still works the way a shortcut assumes."""

from __future__ import annotations

from typing import Any


def code_uses(function: Any, *names: str) -> bool:
    """Whether C{function}'s code refers to every one of C{names} (as attributes or globals)."""
    code = getattr(function, "__code__", None)
    return code is not None and set(names) <= set(code.co_names)
