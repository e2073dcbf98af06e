"""The layers contract (pyproject.toml; docs/architecture.md "Layers") catches what it is there for.

On a copy of the package: an import that runs back up a layer (the wing contract importing web, the
knot issue 23 untied), an import between independent siblings (logs and storage: a cycle waiting to
happen) and a module in no layer each break it, so CI (.ci/run runs lint-imports) fails on them; the
package as it is keeps it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from twisted.trial.unittest import TestCase

from tests.support.cases import cases, expand
from tests.support.skips import require_module

ROOT = Path(__file__).resolve().parent.parent
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


@expand
class LayersContract(TestCase):
    timeout = 120

    def setUp(self) -> None:
        require_module("importlinter", "the layers contract is checked by import-linter (the lint extra)")
        self.tree = Path(tempfile.mkdtemp(prefix="relayd-layers-"))
        self.addCleanup(shutil.rmtree, self.tree, True)
        shutil.copytree(ROOT / "relayd", self.tree / "relayd", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy(ROOT / "pyproject.toml", self.tree / "pyproject.toml")

    def lint(self) -> tuple[int, str]:
        """lint-imports on the copy, the layers contract only: its exit status and its report."""
        done = subprocess.run(
            [sys.executable, "-c", LINT, "--no-cache", "--no-logo", "--contract", "layers", "pyproject.toml"],
            cwd=self.tree,
            env={**os.environ, "PYTHONPATH": str(self.tree)},  # the copy, not the installed package
            capture_output=True,
            text=True,
            timeout=100,
        )
        return done.returncode, done.stdout + done.stderr

    def test_the_package_keeps_its_layers(self) -> None:
        status, report = self.lint()
        self.assertEqual(status, 0, report)
        self.assertIn("layers KEPT", report)

    @cases(
        upward=("relayd/wing.py", "import relayd.web.site\n", "relayd.wing -> relayd.web.site"),
        base_up=("relayd/base/clock.py", "import relayd.logs.scrub\n", "relayd.base.clock -> relayd.logs.scrub"),
        siblings=("relayd/logs/scrub.py", "import relayd.storage.redis\n", "relayd.logs.scrub -> relayd.storage.redis"),
        wings=("relayd/aep/config.py", "import relayd.mcp.config\n", "relayd.aep.config -> relayd.mcp.config"),
        outside=("relayd/stray.py", "X = 1\n", "relayd.stray"),
    )
    def test_a_wrong_arrow_breaks_the_contract(self, path: str, line: str, named: str) -> None:
        with open(self.tree / path, "a") as f:
            f.write(line)
        status, report = self.lint()
        self.assertNotEqual(status, 0, report)
        self.assertIn("layers BROKEN", report)
        self.assertIn(named, report)
