"""The operator documentation names every setting relayd has, with the default --help shows."""

from __future__ import annotations

import re
from pathlib import Path

from twisted.trial.unittest import TestCase

from relayd.base.config import shown_default
from relayd.tap import all_settings

DOCS = Path(__file__).resolve().parents[1] / "docs"
# | `--flag` (repeatable) | environment | default | meaning |
ROW = re.compile(r"^\| `--([a-z0-9-]+)`[^|]*\|[^|]*\|([^|]*)\|", re.MULTILINE)


class DocsTests(TestCase):
    def test_configuration_reference_lists_every_flag_and_env_var(self) -> None:
        text = (DOCS / "configuration.md").read_text()
        missing = [f"--{s.name}" for s in all_settings() if f"`--{s.name}`" not in text]
        missing += [env for s in all_settings() for env in s.env if f"`{env}`" not in text]
        assert missing == []

    def test_configuration_reference_shows_the_defaults_help_shows(self) -> None:
        """Issue 11: the table's default column says what `twistd relayd --help` prints after [default:."""
        documented = {name: cell.strip() for name, cell in ROW.findall((DOCS / "configuration.md").read_text())}
        wrong = []
        for s in all_settings():
            cell = documented.get(s.name)
            shown = shown_default(s)
            if cell is None:
                wrong.append(f"--{s.name}: no row in a settings table")
            elif shown is None and not cell.startswith("—"):
                wrong.append(f"--{s.name}: documented default {cell!r}, but --help shows none")
            elif shown is not None and cell.replace("`", "") != shown:
                wrong.append(f"--{s.name}: documented default {cell!r}, --help shows {shown!r}")
        self.assertEqual(wrong, [])
