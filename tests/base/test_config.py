"""Settings resolution: flag > environment > default, one-line errors, exit status 2."""

from __future__ import annotations

import io
import os
import sys
import tempfile
from typing import Any

from twisted.internet.testing import MemoryReactorClock
from twisted.trial.unittest import TestCase

from relayd.base.config import CONFIG_FILE, ConfigError, Setting, is_loopback_endpoint, positive_int, resolve
from relayd.tap import Options, all_settings, main, makeService
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

    @cases(
        too_big=("tcp:99999:interface=127.0.0.1", "port 99999 is not in 0-65535"),
        negative=("tcp:-1", "port -1 is not in 0-65535"),
        keyword=("tcp:port=70000", "port 70000 is not in 0-65535"),
    )
    def test_port_out_of_range_is_a_config_error(self, description: str, why: str) -> None:
        """Refused while parsing, one line and status 2, not by bind() at start with a traceback."""
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        with self.assertRaises(SystemExit) as exit:
            Options(environ={}).parseOptions(["--aep-listen", description])
        assert exit.exception.code == 2
        assert err.getvalue() == f"relayd: error: --aep-listen: [{description!r}] is not a valid server endpoint ({why})\n"

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


FILE_TABLE = [CONFIG_FILE, *TABLE]


@expand
class ConfigFileTests(TestCase):
    """C{--config FILE}: TOML keys are option names; flag > environment > file > default."""

    def write(self, text: str) -> str:
        """A file holding C{text}, removed after the test (not under the working directory)."""
        fd, path = tempfile.mkstemp(prefix="relayd-config-", suffix=".toml")
        self.addCleanup(os.unlink, path)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        return path

    def test_file_values_apply_below_env_and_flags(self) -> None:
        path = self.write('size = 5\nlisten = ["tcp:2", "tcp:3"]\noff = true\ntoken = "t"\n')
        r = resolve(FILE_TABLE, {"config": path}, {})
        assert (r["size"], r["listen"], r["off"], r["token"]) == (5, ["tcp:2", "tcp:3"], True, "t")
        assert r.sources["size"] == f"{path}: size"
        assert resolve(FILE_TABLE, {"config": path}, {"SIZE": "6"})["size"] == 6
        assert resolve(FILE_TABLE, {"config": path, "size": "7"}, {"SIZE": "6"})["size"] == 7
        assert resolve(FILE_TABLE, {}, {"RELAYD_CONFIG": path})["size"] == 5

    def test_a_scalar_for_a_repeatable_option_is_one_item(self) -> None:
        path = self.write('listen = "tcp:2"\n')
        assert resolve(FILE_TABLE, {"config": path}, {})["listen"] == ["tcp:2"]

    @cases(
        unknown_key=("sise = 5\n", "{path}: sise: unknown setting (did you mean 'size'?)"),
        unknown_far=("zzz = 5\n", "{path}: zzz: unknown setting (`relayd --help` lists every option)"),
        invalid_value=("size = -1\n", "{path}: size: '-1' must be a positive integer"),
        list_for_one=("size = [1, 2]\n", "{path}: size: takes one value, not a list"),
        table=("[size]\nx = 1\n", "{path}: size: expected a string, number or boolean, got dict"),
        switch_not_bool=('off = "maybe"\n', "{path}: off: expected true or false, got 'maybe'"),
        not_toml=("size = \n", "{path}: not valid TOML (Invalid value (at line 1, column 8))"),
    )
    def test_a_bad_file_is_one_error_naming_file_and_key(self, text: str, message: str) -> None:
        path = self.write(text)
        with self.assertRaises(ConfigError) as e:
            resolve(FILE_TABLE, {"config": path}, {})
        assert str(e.exception) == message.format(path=path)

    def test_a_missing_file_names_where_it_was_given(self) -> None:
        with self.assertRaises(ConfigError) as e:
            resolve(FILE_TABLE, {}, {"RELAYD_CONFIG": "/nonexistent/relayd.toml"})
        assert str(e.exception) == "RELAYD_CONFIG: '/nonexistent/relayd.toml': No such file or directory"

    def test_every_option_can_come_from_the_file(self) -> None:
        """The real table: a file key for every option resolves like its flag."""
        path = self.write('aep-buffer = 123\nno-mcp = true\naep-listen = ["tcp:0:interface=127.0.0.1"]\n')
        o = Options(environ={})
        o.parseOptions(["--config", path])
        assert (o.settings["aep-buffer"], o.settings["no-mcp"]) == (123, True)

    def test_check_config_prints_what_is_set_and_exits_0(self) -> None:
        path = self.write('aep-buffer = 123\naep-token = "sekrit"\n')
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        with self.assertRaises(SystemExit) as exit:
            Options(environ={"AEP_MAX_BODY": "2048"}).parseOptions(["--config", path, "--check-config"])
        assert exit.exception.code == 0
        assert out.getvalue().splitlines() == [
            "relayd: configuration OK",
            f"  config = {path}  (--config)",
            f"  aep-token = [secret]  ({path}: aep-token)",
            f"  aep-buffer = 123  ({path}: aep-buffer)",
            "  aep-max-body = 2048  (AEP_MAX_BODY)",
        ]
        assert "sekrit" not in out.getvalue()

    @cases(
        mcp_cors_any_and_a_list=(
            {"mcp-cors": ["*", "https://a.example"]},
            "relayd: error: --mcp-cors: * (any origin) cannot be combined with specific origins\n",
        ),
        broker_on_a_public_listener_without_tls=(
            {"broker-nostr-relay": "ws://127.0.0.1:7777", "broker-listen": ["tcp:8790:interface=0.0.0.0"]},
            "relayd: error: --broker-listen: 'tcp:8790:interface=0.0.0.0' is neither loopback nor TLS; the "
            "broker serves bearer credentials only over loopback or TLS\n",
        ),
        allow_host_any_and_a_name=(
            {"allow-host": ["*", "relay.example"]},
            "relayd: error: --allow-host: * (any host) cannot be combined with host names\n",
        ),
    )
    def test_check_config_refuses_what_a_start_refuses_in_the_same_words(self, flags: dict[str, Any], line: str) -> None:
        """Issue 26: each option valid alone, the combination refused: --check-config says what a
        start says (tap.check_combinations runs the wings' own checks: one copy), exit status 2."""
        argv = [arg for name, values in flags.items() for value in ([values] if isinstance(values, str) else values)
                for arg in (f"--{name}", value)]
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        with self.assertRaises(SystemExit) as exit:
            Options(environ={}).parseOptions([*argv, "--check-config"])
        assert (exit.exception.code, err.getvalue()) == (2, line)
        # A start (makeService, through each wing's make_wing) refuses it in the same words.
        options = Options(environ={})
        options.settings = resolve(all_settings(), flags, {})
        err.seek(0)
        err.truncate()
        with self.assertRaises(SystemExit) as start:
            makeService(options, reactor=MemoryReactorClock())  # (what it builds is never started)
        assert (start.exception.code, err.getvalue()) == (2, line)

    def test_relayd_check_config_file_is_check_config_of_that_file(self) -> None:
        path = self.write("aep-buffer = 123\n")
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        with self.assertRaises(SystemExit) as exit:
            main(["check-config", path, "--no-mcp"])
        assert exit.exception.code == 0
        assert out.getvalue().splitlines()[0] == "relayd: configuration OK"
        assert f"  aep-buffer = 123  ({path}: aep-buffer)" in out.getvalue().splitlines()

    def test_check_config_of_a_bad_value_is_the_one_line_error(self) -> None:
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        with self.assertRaises(SystemExit) as exit:
            Options(environ={}).parseOptions(["--aep-buffer", "x", "--check-config"])
        assert exit.exception.code == 2
        assert err.getvalue() == "relayd: error: --aep-buffer: 'x' must be an integer\n"
