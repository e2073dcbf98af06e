"""relayd/process/browsers.py's settings: --allow-host and --allow-origin are refused at start, naming
the flag or variable, when they are not host names / origins or mix * with names."""

from __future__ import annotations

import io
import sys

from twisted.trial.unittest import TestCase

from relayd.base.config import ConfigError, resolve
from relayd.process.browsers import BrowserPolicy
from relayd.process.settings import SETTINGS
from relayd.tap import Options
from relayd.wing import browser_policy
from tests.support.cases import cases, expand


@expand
class Settings(TestCase):
    @cases(
        scheme=("--allow-host", "https://relay.example.com"),
        port=("--allow-host", "relay.example.com:443"),
        path=("--allow-host", "relay.example.com/x"),
        origin_with_a_path=("--allow-origin", "https://dash.example.com/app"),
        origin_null=("--allow-origin", "null"),
        origin_without_a_scheme=("--allow-origin", "dash.example.com"),
    )
    def test_a_bad_entry_exits_2_naming_the_flag(self, flag: str, value: str) -> None:
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        with self.assertRaises(SystemExit) as exit:
            Options(environ={}).parseOptions([flag, value])
        self.assertEqual(exit.exception.code, 2)
        self.assertTrue(err.getvalue().startswith(f"relayd: error: {flag}: "), err.getvalue())
        self.assertEqual(err.getvalue().count("\n"), 1)

    @cases(hosts=("allow-host", "RELAYD_ALLOW_HOST"), origins=("allow-origin", "RELAYD_ALLOW_ORIGIN"))
    def test_star_with_names_across_repeats_is_refused(self, name: str, env: str) -> None:
        value = "relay.example.com" if name == "allow-host" else "https://dash.example.com"
        settings = resolve(SETTINGS, {name: ["*", value]}, {})
        with self.assertRaises(ConfigError) as refused:
            browser_policy(settings)
        self.assertTrue(str(refused.exception).startswith(f"--{name}: "), str(refused.exception))
        with self.assertRaises(ConfigError) as refused:
            browser_policy(resolve(SETTINGS, {}, {env: f"*,{value}"}))  # (refused already when parsed)
        self.assertIn(env, str(refused.exception))

    def test_comma_lists_and_repeats_combine(self) -> None:
        settings = resolve(SETTINGS, {"allow-host": ["a.example, B.example", "[2001:db8::1]"]}, {})
        self.assertEqual(browser_policy(settings).hosts, frozenset({"a.example", "b.example", "2001:db8::1"}))
        self.assertEqual(browser_policy(resolve(SETTINGS, {}, {})), BrowserPolicy())
