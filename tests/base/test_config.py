"""Settings resolution: flag > environment > default, one-line errors, exit status 2."""

from __future__ import annotations

import io
import sys

from twisted.trial.unittest import TestCase

from relayd.base.config import ConfigError, Setting, is_loopback_endpoint, positive_int, resolve
from relayd.tap import Options, all_settings
from tests.support.cases import cases, expand

TABLE = [
    Setting("size", 10, "size", parse=positive_int, env=("SIZE", "OLD_SIZE")),
    Setting("listen", ["tcp:1"], "listen", repeatable=True, env=("LISTEN",)),
    Setting("off", False, "off", switch=True, env=("OFF",)),
    Setting("token", None, "token", env=("TOKEN",), secret=True),
]


@expand
class ConfigTests(TestCase):
    def test_default_when_neither_flag_nor_env(self) -> None:
        r = resolve(TABLE, {}, {})
        assert r.values == {"size": 10, "listen": ["tcp:1"], "off": False, "token": None}
        assert r.sources["size"] == "default"

    def test_env_then_flag_precedence_with_a_warning(self) -> None:
        r = resolve(TABLE, {}, {"SIZE": "5"})
        assert (r["size"], r.sources["size"]) == (5, "SIZE")
        r = resolve(TABLE, {"size": "7"}, {"SIZE": "5"})
        assert r["size"] == 7
        assert r.warnings == ["SIZE=5 is ignored: --size 7 was passed, and a flag wins over its env var."]
        assert resolve(TABLE, {"size": "07"}, {"SIZE": "7"}).warnings == []  # same value: nothing ignored

    def test_first_env_name_wins_and_empty_counts_as_unset(self) -> None:
        assert resolve(TABLE, {}, {"SIZE": "", "OLD_SIZE": "3"})["size"] == 3
        assert resolve(TABLE, {}, {"SIZE": "4", "OLD_SIZE": "3"})["size"] == 4

    def test_secret_values_are_never_echoed(self) -> None:
        r = resolve(TABLE, {"token": "flag-secret"}, {"TOKEN": "env-secret"})
        assert r.warnings == ["TOKEN is ignored: --token was passed, and a flag wins over its env var."]
        assert "secret" not in " ".join(r.warnings)

    def test_every_secret_that_is_not_utf8_is_refused_naming_where_it_came_from(self) -> None:
        secrets = [setting for setting in all_settings() if setting.secret]
        self.assertTrue(secrets)
        for setting in secrets:
            value = "redis://:p\udcff@h:1/0" if setting.name == "redis" else "t\udcff"
            for flags, environ, origin in (({setting.name: value}, {}, f"--{setting.name}"), ({}, {setting.env[0]: value}, setting.env[0])):
                with self.assertRaises(ConfigError) as refused:
                    resolve([setting], flags, environ)
                self.assertEqual(str(refused.exception), f"{origin}: must be UTF-8 text (the value holds bytes that are not)")
            self.assertEqual(resolve([setting], {setting.name: value.replace("\udcff", "\u00ff")}, {}).sources[setting.name],
                             f"--{setting.name}")  # the same text as UTF-8 is a value

    def test_invalid_values_name_the_flag_or_env(self) -> None:
        with self.assertRaises(ConfigError, match=r"^--size: '0' must be a positive integer$"):
            resolve(TABLE, {"size": "0"}, {})
        with self.assertRaises(ConfigError, match=r"^OLD_SIZE: 'x' must be an integer$"):
            resolve(TABLE, {}, {"OLD_SIZE": "x"})
        with self.assertRaises(ConfigError, match="OFF"):
            resolve(TABLE, {}, {"OFF": "maybe"})

    def test_repeatable_and_switch(self) -> None:
        r = resolve(TABLE, {"listen": ["a", "b"], "off": True}, {"LISTEN": "c"})
        assert r["listen"] == ["a", "b"] and r["off"] is True
        assert resolve(TABLE, {}, {"LISTEN": "c", "OFF": "1"}).values["listen"] == ["c"]

    def test_options_parse_aep_flags_and_reference_env_names(self) -> None:
        o = Options(environ={"AEP_BUFFER": "8", "AEP_TOKEN": "t"})
        o.parseOptions(["--aep-max-sessions", "9", "--aep-listen", "tcp:0", "--aep-listen", "tcp:1"])
        s = o.settings
        assert (s["aep-buffer"], s["aep-max-sessions"], s["aep-token"]) == (8, 9, "t")
        assert s["aep-listen"] == ["tcp:0", "tcp:1"]

    def test_options_invalid_value_exits_2_with_one_line(self) -> None:
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        o = Options(environ={})
        with self.assertRaises(SystemExit) as exit:
            o.parseOptions(["--aep-buffer", "-1"])
        assert exit.exception.code == 2
        assert err.getvalue() == "relayd: error: --aep-buffer: '-1' must be a positive integer\n"

    def test_bad_endpoint_is_a_config_error(self) -> None:
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        with self.assertRaises(SystemExit):
            Options(environ={}).parseOptions(["--aep-listen", "nonsense:1:2"])
        assert err.getvalue().startswith("relayd: error: --aep-listen:")

    def test_every_option_is_documented_in_help(self) -> None:
        text = str(Options(environ={}))
        for flag in ("--aep-listen", "--aep-token", "--aep-buffer", "--aep-max-sessions", "--aep-max-body",
                     "--aep-max-batch", "--aep-max-from", "--no-aep"):
            assert flag in text

    @cases(*[
        ("tcp:8787:interface=127.0.0.1", True),
        (r"tcp6:8787:interface=\:\:1", True),
        ("tcp:8787:interface=localhost", True),
        ("tcp:8787", False),
        ("tcp:8787:interface=0.0.0.0", False),
        ("unix:/run/relayd.sock", True),
        ("haproxy:tcp:8787:interface=127.0.0.1", True),
    ])
    def test_loopback_detection(self, description: str, loopback: bool) -> None:
        assert is_loopback_endpoint(description) is loopback
