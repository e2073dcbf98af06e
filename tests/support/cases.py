"""Parametrized trial tests: one generated method per case, so both pytest and trial run (and name) each case.

    @expand
    class T(TestCase):
        @cases(small=(1, 2), big=(10**9, 10**9 + 1))
        def test_succ(self, n: int, m: int) -> None: ...

gives ``T.test_succ_small`` and ``T.test_succ_big``. A case is a tuple of positional arguments (a single
non-tuple value is one argument). Cases given positionally are named by their index.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any, Callable, TypeVar

C = TypeVar("C", bound=type)
F = TypeVar("F", bound=Callable[..., Any])


def cases(*positional: Any, **named: Any) -> Callable[[F], F]:
    """Mark a test method to be expanded by L{expand} into one method per case."""
    table = {str(i): value for i, value in enumerate(positional)}
    table.update(named)

    def mark(f: F) -> F:
        f.__cases__ = table  # type: ignore[attr-defined]
        return f

    return mark


def _method(f: Callable[..., Any], args: tuple[Any, ...]) -> Callable[..., Any]:
    if inspect.iscoroutinefunction(f):

        @functools.wraps(f)
        async def run_async(self: Any) -> Any:
            return await f(self, *args)

        return run_async

    @functools.wraps(f)
    def run(self: Any) -> Any:
        return f(self, *args)

    return run


def expand(cls: C) -> C:
    """Replace every L{cases}-marked method of C{cls} by one method per case, named C{<method>_<case>}."""
    for name, f in list(vars(cls).items()):
        table = getattr(f, "__cases__", None)
        if table is None:
            continue
        delattr(cls, name)
        for case, value in table.items():
            args = value if isinstance(value, tuple) else (value,)
            method = _method(f, args)
            method.__name__ = method.__qualname__ = f"{name}_{re.sub(r'[^0-9A-Za-z_]', '_', case)}"
            del method.__wrapped__  # type: ignore[attr-defined]  # pytest must not see the original signature
            del method.__cases__  # type: ignore[attr-defined]
            assert not hasattr(cls, method.__name__), f"duplicate case name {method.__name__}"
            setattr(cls, method.__name__, method)
    return cls
