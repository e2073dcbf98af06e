"""sd_notify over a real unix datagram socket, the open-file limit, and the process-wide settings."""

from __future__ import annotations

import io
import os
import resource
import socket
import sys
import tempfile

from twisted.trial.unittest import TestCase

from relayd.process import host
from relayd.process.host import increase_rlimits
from relayd.tap import Options, all_settings
from tests.support.cases import cases, expand


def _datagram_socket(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    return sock


@expand
class NotifyTests(TestCase):
    def test_notify_sends_the_state_to_notify_socket(self) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "notify")
            with _datagram_socket(path) as sock:
                assert host.notify("READY=1", {"NOTIFY_SOCKET": path})
                assert sock.recv(4096) == b"READY=1"

    def test_notify_abstract_socket(self) -> None:
        name = f"relayd-test-{os.getpid()}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind("\0" + name)
            sock.settimeout(5)
            assert host.notify("STOPPING=1", {"NOTIFY_SOCKET": "@" + name})
            assert sock.recv(4096) == b"STOPPING=1"

    def test_notify_without_socket_or_with_a_dead_one(self) -> None:
        assert not host.notify("READY=1", {})
        with tempfile.TemporaryDirectory() as tmp:
            assert not host.notify("READY=1", {"NOTIFY_SOCKET": os.path.join(tmp, "nobody")})

    def test_increase_rlimits_raises_the_soft_limit_to_the_hard_limit(self) -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard != resource.RLIM_INFINITY and hard <= 256:
            self.skipTest("hard open-file limit too low to lower the soft one for the test")
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
            raised = increase_rlimits()
            now, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
            assert now == raised and now > 256
            if hard != resource.RLIM_INFINITY:
                assert now == hard
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[0]), hard))


def _options(*argv: str, environ: dict[str, str] | None = None) -> Options:
    options = Options(environ or {})
    options.parseOptions(list(argv))
    return options


@expand
class ProcessDefaults(TestCase):
    def test_process_wide_defaults_and_overrides(self) -> None:
        names = [s.name for s in all_settings()]
        for name in ("metrics-listen", "trust-forwarded-for", "header-timeout", "body-timeout", "idle-timeout",
                     "shutdown-grace", "no-access-log"):
            assert name in names
        values = _options().settings.values
        assert (values["metrics-listen"], values["trust-forwarded-for"], values["no-access-log"]) == ([], 0, False)
        assert (values["header-timeout"], values["body-timeout"], values["idle-timeout"]) == (20.0, 60.0, 60.0)
        assert values["shutdown-grace"] == 5.0
        values = _options(
            "--metrics-listen", "tcp:0:interface=127.0.0.1", "--metrics-listen", "unix:/tmp/m.sock",
            "--trust-forwarded-for", "2", "--header-timeout", "0.5", "--no-access-log",
            environ={"RELAYD_SHUTDOWN_GRACE": "9"},
        ).settings.values
        assert values["metrics-listen"] == ["tcp:0:interface=127.0.0.1", "unix:/tmp/m.sock"]
        assert (values["trust-forwarded-for"], values["header-timeout"], values["shutdown-grace"]) == (2, 0.5, 9.0)
        assert values["no-access-log"] is True

    @cases(*[
        (["--header-timeout", "0"], "--header-timeout: '0' must be a positive number of seconds"),
        (["--shutdown-grace", "soon"], "--shutdown-grace: 'soon' must be a number of seconds"),
        (["--trust-forwarded-for", "-1"], "--trust-forwarded-for: '-1' must be a non-negative integer"),
        (["--metrics-listen", "nonsense:1"], "--metrics-listen: ['nonsense:1'] is not a valid server endpoint"),
    ])
    def test_process_wide_errors(self, argv: list[str], message: str) -> None:
        err = io.StringIO()
        self.patch(sys, "stderr", err)
        with self.assertRaises(SystemExit) as e:
            _options(*argv)
        assert e.exception.code == 2
        assert err.getvalue().startswith(f"relayd: error: {message}")
