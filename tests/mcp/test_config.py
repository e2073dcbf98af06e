"""Settings (mcp-relay.md §9 A1-A15 adapted to relayd's flags), startup line, warnings and exit code 2."""

from __future__ import annotations

import io
import re
import sys
from typing import Any

from twisted.internet import reactor
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage
from twisted.trial import unittest

from relayd import tap
from relayd.base.clock import Timekeeper
from relayd.base.config import ConfigError, Resolved, resolve
from relayd.mcp.config import SETTINGS, cors_policy, listen_endpoints
from relayd.mcp.service import make_service
from tests.support.cases import cases, expand
from tests.support.wing import start_wing


def settings(flags: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Resolved:
    return resolve(SETTINGS, flags or {}, env or {})


@expand
class Settings(unittest.TestCase):
    """A1-A12: defaults, flags, env names, warnings and the errors that name what was wrong."""

    def test_a1_defaults(self) -> None:
        s = settings()
        assert listen_endpoints(s) == ["tcp:8788:interface=127.0.0.1"]
        assert s["mcp-prefix"] == "" and s["mcp-ttl-ms"] == 14_400_000
        assert cors_policy(s).any and s.sources["mcp-cors"] == "default"
        assert s["mcp-max-sessions"] == 10_000 and s["mcp-poll-idle-ms"] == 60_000 and s["no-mcp"] is False
        assert s.warnings == []

    def test_per_address_bounds_default_to_1000_and_0_turns_them_off(self) -> None:
        s = settings()
        assert (s["mcp-max-sessions-per-address"], s["mcp-max-clients-per-address"]) == (1000, 1000)
        off = settings(env={"RELAYD_MCP_MAX_SESSIONS_PER_ADDRESS": "0", "RELAYD_MCP_MAX_CLIENTS_PER_ADDRESS": "0"})
        assert (off["mcp-max-sessions-per-address"], off["mcp-max-clients-per-address"]) == (0, 0)
        with self.assertRaisesRegex(ConfigError, "^--mcp-max-clients-per-address: '-1' "):
            settings({"mcp-max-clients-per-address": "-1"})

    def test_a2_cors_flag_list(self) -> None:
        s = settings({"mcp-cors": ["https://a.example,https://b.example"]})
        assert cors_policy(s).origins == ("https://a.example", "https://b.example")
        assert s.sources["mcp-cors"] == "--mcp-cors"

    def test_a3_repeated_cors_accumulates(self) -> None:
        s = settings({"mcp-cors": ["https://a.example", "https://b.example"]})
        assert cors_policy(s).origins == ("https://a.example", "https://b.example")

    def test_a4_env_applies(self) -> None:
        s = settings(env={"RELAYD_MCP_CORS_ALLOW_ORIGIN": "https://a.example, https://b.example"})
        assert cors_policy(s).origins == ("https://a.example", "https://b.example")
        assert s.sources["mcp-cors"] == "RELAYD_MCP_CORS_ALLOW_ORIGIN"

    def test_a5_flag_beats_env_with_a_warning_naming_both(self) -> None:
        s = settings({"mcp-cors": ["https://a.example"]}, {"RELAYD_MCP_CORS_ALLOW_ORIGIN": "https://b.example"})
        assert cors_policy(s).origins == ("https://a.example",)
        (warning,) = s.warnings
        assert re.search(r"RELAYD_MCP_CORS_ALLOW_ORIGIN.*ignored", warning) and "--mcp-cors" in warning

    @cases(
        flag=({"mcp-request-timeout": "250"}, {}, "--mcp-request-timeout"),
        env=({}, {"RELAYD_MCP_REQUEST_TIMEOUT": "250"}, "RELAYD_MCP_REQUEST_TIMEOUT"),
    )
    def test_the_request_timeouts_old_name_still_works_with_one_warning(
        self, flags: dict[str, Any], env: dict[str, str], origin: str
    ) -> None:
        """Issue 26: --mcp-request-timeout was in milliseconds without saying so; it is now
        --mcp-request-timeout-ms, and the old name a deprecated alias."""
        s = settings(flags, env)
        assert s["mcp-request-timeout-ms"] == 250 and s.sources["mcp-request-timeout-ms"] == origin
        assert s.warnings == [f"{origin} is deprecated: use --mcp-request-timeout-ms (the same value and unit); it will be removed"]

    def test_the_new_name_wins_over_the_old_one(self) -> None:
        s = settings({"mcp-request-timeout-ms": "300"}, {"RELAYD_MCP_REQUEST_TIMEOUT": "250"})
        assert s["mcp-request-timeout-ms"] == 300
        (warning,) = s.warnings
        assert warning.startswith("RELAYD_MCP_REQUEST_TIMEOUT is deprecated and ignored: --mcp-request-timeout-ms is given")

    def test_the_new_name_has_no_warning(self) -> None:
        s = settings({}, {"RELAYD_MCP_REQUEST_TIMEOUT_MS": "300"})
        assert (s["mcp-request-timeout-ms"], s.warnings) == (300, [])

    def test_a6_flag_equal_to_env_no_warning(self) -> None:
        s = settings({"mcp-cors": ["https://a.example"]}, {"RELAYD_MCP_CORS_ALLOW_ORIGIN": "https://a.example"})
        assert s.warnings == []

    def test_a7_empty_env_means_default(self) -> None:
        s = settings(env={"RELAYD_MCP_CORS_ALLOW_ORIGIN": ""})
        assert cors_policy(s).any and s.sources["mcp-cors"] == "default"

    def test_a8_invalid_flag_names_the_flag(self) -> None:
        with self.assertRaisesRegex(ConfigError, "--mcp-cors"):
            settings({"mcp-cors": ["*,https://a.example"]})

    def test_a9_invalid_env_names_the_variable(self) -> None:
        with self.assertRaisesRegex(ConfigError, "RELAYD_MCP_CORS_ALLOW_ORIGIN"):
            settings(env={"RELAYD_MCP_CORS_ALLOW_ORIGIN": "not-an-origin"})

    def test_a10_relayd_env_names_apply(self) -> None:
        s = settings(
            env={
                "RELAYD_MCP_PORT": "9000",
                "RELAYD_MCP_HOST": "0.0.0.0",
                "RELAYD_MCP_PREFIX": "/relay",
                "RELAYD_MCP_TTL_MS": "60000",
            }
        )
        assert listen_endpoints(s) == ["tcp:9000:interface=0.0.0.0"]
        assert s["mcp-prefix"] == "/relay" and s["mcp-ttl-ms"] == 60000
        assert listen_endpoints(settings(env={"RELAYD_MCP_HOST": "::1"})) == [r"tcp:8788:interface=\:\:1"]

    def test_generic_env_names_are_not_read(self) -> None:
        """Other programs set PORT, HOST, PREFIX...: they must not move the MCP relay (PREFIX=/usr/local)."""
        s = settings(
            env={"PORT": "9000", "HOST": "0.0.0.0", "PREFIX": "/usr/local", "TTL_MS": "1", "CORS_ALLOW_ORIGIN": "x"}
        )
        assert listen_endpoints(s) == ["tcp:8788:interface=127.0.0.1"]
        assert s["mcp-prefix"] == "" and s["mcp-ttl-ms"] == 14_400_000
        assert s.warnings == []

    def test_a11_flags_beat_env_with_two_warnings(self) -> None:
        s = settings({"mcp-port": "9001", "mcp-host": "127.0.0.1"}, {"RELAYD_MCP_PORT": "9000", "RELAYD_MCP_HOST": "0.0.0.0"})
        assert listen_endpoints(s) == ["tcp:9001:interface=127.0.0.1"]
        assert len(s.warnings) == 2
        assert "RELAYD_MCP_HOST=0.0.0.0 is ignored: --mcp-host 127.0.0.1 was passed, and a flag wins over its env var." in s.warnings

    def test_cors_override_warns_only_when_the_policy_differs(self) -> None:
        same = settings({"mcp-cors": ["https://b.com", "https://a.com/"]}, {"RELAYD_MCP_CORS_ALLOW_ORIGIN": "https://a.com,https://b.com"})
        assert same.warnings == []
        other = settings({"mcp-cors": ["https://a.com"]}, {"RELAYD_MCP_CORS_ALLOW_ORIGIN": "*"})
        assert other.warnings == [
            "RELAYD_MCP_CORS_ALLOW_ORIGIN=* is ignored: --mcp-cors https://a.com was passed, and a flag wins over its env var."
        ]

    def test_a12_invalid_port(self) -> None:
        with self.assertRaisesRegex(ConfigError, "--mcp-port"):
            settings({"mcp-port": "nope"})
        with self.assertRaisesRegex(ConfigError, "PORT"):
            settings(env={"RELAYD_MCP_PORT": "-1"})
        with self.assertRaisesRegex(ConfigError, "TTL_MS"):
            settings(env={"RELAYD_MCP_TTL_MS": "0"})
        with self.assertRaisesRegex(ConfigError, "--mcp-prefix"):
            settings({"mcp-prefix": "relay"})


@expand
class CommandLine(unittest.TestCase):
    """A13-A15 and exit code 2: what twistd's option parsing and makeService do with the settings."""

    def test_a13_flag_without_value(self) -> None:
        with self.assertRaisesRegex(usage.UsageError, "mcp-cors"):
            tap.Options(environ={}).parseOptions(["--mcp-cors"])

    def test_a14_unknown_flag(self) -> None:
        with self.assertRaisesRegex(usage.UsageError, "nope"):
            tap.Options(environ={}).parseOptions(["--nope"])

    @cases(help="--help")  # -h belongs to tap.Options (not offered there yet)
    def test_a15_help(self, flag: str) -> None:
        out = io.StringIO()
        self.patch(sys, "stdout", out)
        exit_ = self.assertRaises(SystemExit, tap.Options(environ={}).parseOptions, [flag])
        assert exit_.code in (0, None)
        assert "--mcp-cors" in out.getvalue()

    def test_invalid_configuration_exits_2_before_listening(self) -> None:
        exit_ = self.assertRaises(SystemExit, tap.Options(environ={"RELAYD_MCP_CORS_ALLOW_ORIGIN": "null"}).parseOptions, [])
        assert exit_.code == 2
        # A combination (each value valid alone) is refused with the options too (tap.check_combinations).
        options = tap.Options(environ={})
        exit2 = self.assertRaises(SystemExit, options.parseOptions, ["--mcp-cors", "*", "--mcp-cors", "https://a.example", "--no-aep"])
        assert exit2.code == 2

    @cases(
        prefix_flag=({}, ["--mcp-prefix", "/\udcff"], "--mcp-prefix"),
        prefix_env=({"RELAYD_MCP_PREFIX": "/relay\udcfe"}, [], "RELAYD_MCP_PREFIX"),
        host_env=({"RELAYD_MCP_HOST": "\udcff"}, [], "RELAYD_MCP_HOST"),
        cors_flag=({}, ["--mcp-cors", "https://\udce9.example"], "--mcp-cors"),
    )
    def test_non_utf8_setting_exits_2_naming_it(self, environ: dict[str, str], argv: list[str], named: str) -> None:
        # Undecodable argv or environment bytes reach Python as lone surrogates; refused at start with
        # one line instead of a UnicodeEncodeError traceback where the wing encodes the value.
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        exit_ = self.assertRaises(SystemExit, tap.Options(environ=environ).parseOptions, argv)
        assert exit_.code == 2
        assert err.getvalue() == f"relayd: error: {named}: must be UTF-8 text (the value holds bytes that are not)\n"

    def test_no_mcp_switch(self) -> None:
        assert make_service(settings({"no-mcp": True}), reactor, Timekeeper(reactor)) is None


class StartupLogTests(unittest.TestCase):
    async def test_startup_line_names_cors_source_and_non_loopback_warning(self) -> None:
        events: list[dict[str, Any]] = []
        globalLogPublisher.addObserver(events.append)
        self.addCleanup(globalLogPublisher.removeObserver, events.append)
        await start_wing(
            self,
            "mcp",
            {"mcp-listen": ["tcp:0:interface=0.0.0.0"], "mcp-cors": ["https://a.example"], "mcp-prefix": "/p"},
            {"RELAYD_MCP_CORS_ALLOW_ORIGIN": "https://b.example"},
        )
        text = [formatEvent(e) for e in events]
        assert any(
            re.search(r"mcp listening on http://0\.0\.0\.0:\d+/p \(ttl=14400s, cors=https://a.example from --mcp-cors\)", t)
            for t in text
        ), text
        assert any("exposes the MCP relay on non-loopback interfaces" in t for t in text)
