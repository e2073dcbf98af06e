"""A real ``twistd -n relayd`` at the edges of its life: a secret that is not UTF-8 and a port in
use stop the start with one line; SIGHUP is logged and survived."""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile

from twisted.internet import threads
from twisted.trial.unittest import TestCase

from tests.support.cases import cases, expand
from tests.support.raw import first_response
from tests.support.twistd import RelaydProcess

RELAYD_COMMAND = [sys.executable, "-m", "relayd"]  # what the `relayd` console script runs (relayd.tap:main)

NOT_UTF8 = "tok\udcffen"  # the byte 0xff, as Python hands a non-UTF-8 environment or argument on


def lines_of(proc: RelaydProcess) -> list[str]:
    return [line for line in proc.log.decode(errors="replace").splitlines() if line.strip()]


@expand
class Start(TestCase):
    timeout = 60

    @cases(
        aep_token_variable=([], {"AEP_TOKEN": NOT_UTF8}, "AEP_TOKEN"),
        aep_token_flag=(["--aep-token", NOT_UTF8], {}, "--aep-token"),
        redis_url_variable=([], {"RELAYD_REDIS": "redis://:" + NOT_UTF8 + "@127.0.0.1:1/0"}, "RELAYD_REDIS"),
    )
    async def test_a_secret_that_is_not_utf8_is_refused_at_start(self, flags: list[str], env: dict[str, str], name: str) -> None:
        proc = await RelaydProcess.start_for(self, flags, env=env, wait_for=())
        started = await proc.wait_for(rb"relayd: error|relayd ready")
        self.assertEqual(started.group(0), b"relayd: error")
        self.assertEqual(await proc.exited, 2)
        self.assertEqual(lines_of(proc), [f"relayd: error: {name}: must be UTF-8 text (the value holds bytes that are not)"])

    async def test_a_port_in_use_is_one_line_and_exit_1(self) -> None:
        taken = socket.socket()
        self.addCleanup(taken.close)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp:{taken.getsockname()[1]}:interface=127.0.0.1"
        proc = await RelaydProcess.start(["--aep-listen", endpoint, "--no-mcp"], wait_for=())
        self.assertEqual(await proc.exited, 1)
        self.assertNotIn(b"Traceback", proc.log)
        self.assertNotIn(b"Unhandled", proc.log)
        refusals = [line for line in lines_of(proc) if "listen" in line]
        self.assertEqual(refusals, [f"relayd: cannot listen on {endpoint}: address already in use"])

    async def test_a_port_out_of_range_is_one_line_and_exit_2(self) -> None:
        proc = await RelaydProcess.start(["--aep-listen", "tcp:99999:interface=127.0.0.1", "--no-mcp"], wait_for=())
        self.assertEqual(await proc.exited, 2)
        self.assertEqual(
            lines_of(proc),
            ["relayd: error: --aep-listen: ['tcp:99999:interface=127.0.0.1'] is not a valid server endpoint "
             "(port 99999 is not in 0-65535)"],
        )

    async def test_an_unknown_flag_under_twistd_is_the_error_and_one_pointer_line(self) -> None:
        proc = await RelaydProcess.start(["--bogus"], wait_for=())
        self.assertEqual(await proc.exited, 1)
        lines = lines_of(proc)
        self.assertEqual(lines[-2:-1], ["Run `relayd --help` (or `twistd -n relayd --help`) for every option."])
        self.assertTrue(lines[-1].endswith(": option --bogus not recognized"), lines)
        self.assertNotIn("--aep-buffer", proc.log.decode())  # not the whole option list
        self.assertLessEqual(len(lines), 3, lines)  # twistd's own "Usage: twistd [options]" line at most


@expand
class Command(TestCase):
    """The C{relayd} console script: C{twistd -n --pidfile= relayd} in one word."""

    timeout = 60

    async def test_relayd_runs_in_the_foreground_and_serves(self) -> None:
        proc = await RelaydProcess.start_for(
            self, ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp"], program=RELAYD_COMMAND
        )
        status, _, _ = await threads.deferToThread(
            first_response, proc.port("aep"), b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
        )
        self.assertEqual(status, 200)
        proc.transport.signalProcess("TERM")
        self.assertEqual(await proc.exited, 0)

    async def test_relayd_reads_a_config_file(self) -> None:
        fd, path = tempfile.mkstemp(prefix="relayd-config-", suffix=".toml")
        self.addCleanup(os.unlink, path)
        with os.fdopen(fd, "w") as f:
            f.write('aep-listen = ["tcp:0:interface=127.0.0.1"]\nno-mcp = true\n')
        proc = await RelaydProcess.start_for(self, ["--config", path], program=RELAYD_COMMAND)
        await proc.wait_for(rb"relayd ready: aep\n")
        status, _, _ = await threads.deferToThread(
            first_response, proc.port("aep"), b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
        )
        self.assertEqual(status, 200)

    async def test_an_unknown_flag_is_two_lines_and_exit_1(self) -> None:
        proc = await RelaydProcess.start(["--bogus"], wait_for=(), program=RELAYD_COMMAND)
        self.assertEqual(await proc.exited, 1)
        self.assertEqual(lines_of(proc), ["relayd: option --bogus not recognized", "Run `relayd --help` for every option."])

    @cases(version=("--version", r"^relayd \d"), help=("--help", r"^Usage: relayd \[options\]"))
    async def test_version_and_help(self, flag: str, first_line: str) -> None:
        proc = await RelaydProcess.start([flag], wait_for=(), program=RELAYD_COMMAND)
        self.assertEqual(await proc.exited, 0)
        self.assertRegex(lines_of(proc)[0], first_line)


class Hangup(TestCase):
    timeout = 60

    async def test_sighup_is_logged_and_relayd_keeps_serving(self) -> None:
        proc = await RelaydProcess.start_for(self, ["--aep-listen", "tcp:0:interface=127.0.0.1", "--no-mcp"])
        await proc.wait_for(rb"relayd ready")
        proc.transport.signalProcess("HUP")
        await proc.wait_for(rb"SIGHUP received: relayd reads its settings only at start")
        request = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        status, _, _ = await threads.deferToThread(first_response, proc.port("aep"), request)
        self.assertEqual(status, 200)
        self.assertEqual(await proc.terminate(signal.SIGTERM), 0)  # and it still drains on SIGTERM
        self.assertNotIn(b"Traceback", proc.log)
