"""The plumbing knows no wing (docs/architecture.md): beyond the import contracts (lint-imports), no
string a plumbing module logs, counts or compares names a wing; a wing declares its own metric series
(relayd/<wing>/metrics.py) and what the logs know of it (relayd.logs.scrub.declare in make_wing)."""

from __future__ import annotations

import ast
import importlib
import re
import tomllib
from pathlib import Path

from twisted.trial.unittest import TestCase

from relayd import tap
from relayd.storage import redis

ROOT = Path(__file__).resolve().parent.parent
# The one known exception: the keyspace check's names of keys relayd kept before keyspace versions.
KNOWN = {"relayd/storage/redis.py": set(redis.UNVERSIONED_MARKERS)}


def plumbing_files() -> list[Path]:
    """The modules of the layers below the wings in pyproject.toml's "layers" contract."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["name"] == "layers"]
    (container,) = contract["containers"]
    layers = [[name.strip() for name in layer.split("|")] for layer in contract["layers"]]
    below = layers[next(i for i, layer in enumerate(layers) if "aep" in layer) + 1 :]
    files: list[Path] = []
    for module in (f"{container}.{name}" for layer in below for name in layer):
        path = ROOT / module.replace(".", "/")
        files.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")])
    return files


def literals(source: str) -> list[tuple[int, str]]:
    """Every string constant in C{source} but docstrings (prose may give a wing as an example)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def wing_names() -> set[str]:
    """Every name a wing goes by: its package (aep, mcp, buzz) and the relay it logs as (broker)."""
    names = set()
    for wing in tap.WINGS:
        names.add(wing.rpartition(".")[2])
        names.add(importlib.import_module(f"{wing}.service").LOGS.relay)
    return names


class PlumbingKnowsNoWing(TestCase):
    def test_the_wing_names(self) -> None:
        assert wing_names() == {"aep", "mcp", "buzz", "broker"}

    def test_no_plumbing_string_names_a_wing(self) -> None:
        files = plumbing_files()
        assert ROOT / "relayd/base/metrics.py" in files and ROOT / "relayd/logs/scrub.py" in files
        assert ROOT / "relayd/web/site.py" in files and ROOT / "relayd/wing.py" in files
        assert ROOT / "relayd/compat/txredisapi.py" in files
        word = re.compile(r"(?i)\b(?:" + "|".join(sorted(wing_names())) + r")\b")
        found = []
        for path in files:
            name = str(path.relative_to(ROOT))
            for line, text in literals(path.read_text()):
                if word.search(text) and text not in KNOWN.get(name, ()):
                    found.append(f"{name}:{line}: {text!r}")
        assert found == [], "\n".join(found)
