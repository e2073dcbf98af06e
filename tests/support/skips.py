"""Skips that both runners honour: a missing service or tool skips locally and fails under CI=true."""

from __future__ import annotations

import importlib.util
import os
from typing import NoReturn
from unittest import SkipTest


def missing(message: str) -> NoReturn:
    """Skip with C{message}; under CI=true (where every service is installed) fail instead."""
    if os.environ.get("CI") == "true":
        raise AssertionError(message + " (required under CI=true)")
    raise SkipTest(message)


def require_module(name: str, why: str) -> None:
    """Skip (or, under CI=true, fail) when an optional test dependency is missing."""
    if importlib.util.find_spec(name) is None:
        missing(f"{why}: PyPI package providing {name!r} is not installed")
