"""The operator documentation names every setting relayd has."""

from __future__ import annotations

from pathlib import Path

from twisted.trial.unittest import TestCase

from relayd.tap import all_settings

DOCS = Path(__file__).resolve().parents[1] / "docs"


class DocsTests(TestCase):
    def test_configuration_reference_lists_every_flag_and_env_var(self) -> None:
        text = (DOCS / "configuration.md").read_text()
        missing = [f"--{s.name}" for s in all_settings() if f"`--{s.name}`" not in text]
        missing += [env for s in all_settings() for env in s.env if f"`{env}`" not in text]
        assert missing == []
