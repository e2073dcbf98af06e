"""Run a real ``twistd -n relayd`` subprocess and watch its log.

L{RelaydProcess} lives as long as one test (C{start_for} kills it at the test's cleanup);
L{DetachedRelayd} is the same process for tests that share one relayd across a class (trial
removes every reactor reader after each test, so its output is read by a thread instead).
"""

from __future__ import annotations

import atexit
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol
from twisted.trial.unittest import TestCase

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 15.0

# Passes one listening socket the way systemd does (sd_listen_fds): it is fd 3, LISTEN_FDS says how
# many, LISTEN_FDNAMES names them (FileDescriptorName=; Twisted ignores the sockets without it) and
# LISTEN_PID must be the pid of the process reading them, so it is set after the fork, right before
# exec. Use with C{child_fds={3: sock.fileno()}} and C{--aep-listen systemd:domain=INET:name=relayd-aep}.
SYSTEMD_WRAPPER = [
    sys.executable,
    "-c",
    "import os, sys; os.environ.update(LISTEN_FDS='1', LISTEN_FDNAMES='relayd-aep', LISTEN_PID=str(os.getpid())); "
    "os.execv(sys.argv[1], sys.argv[1:])",
]


# The same for a socket on any descriptor (C{subprocess} keeps a passed descriptor's number): the
# wrapper's first argument is that number, which it moves to fd 3.
_SYSTEMD_DUP_WRAPPER = [
    sys.executable,
    "-c",
    "import os, sys; fd = int(sys.argv[1]); os.dup2(fd, 3) if fd != 3 else None; os.set_inheritable(3, True); "
    "os.environ.update(LISTEN_FDS='1', LISTEN_FDNAMES='relayd-aep', LISTEN_PID=str(os.getpid())); "
    "os.execv(sys.argv[2], sys.argv[2:])",
]


def twistd_argv() -> list[str]:
    """The operator's command: the installed C{twistd} script next to this interpreter if any."""
    script = Path(sys.executable).with_name("twistd")
    if script.exists():
        return [sys.executable, str(script)]
    return [sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; sys.argv[0]='twistd'; run()"]


def inherited_environment() -> dict[str, str]:
    """This process's environment without anything relayd would read as configuration: the
    C{AEP_}/C{RELAYD_} names and every other name a setting reads (the MCP wing's C{PORT},
    C{HOST}, ... of the Node relay), so a developer's shell cannot change what a test runs."""
    from relayd.tap import all_settings

    read = {name for setting in all_settings() for name in setting.env}
    return {k: v for k, v in os.environ.items() if not k.startswith(("AEP_", "RELAYD_")) and k not in read}


def command(
    options: list[str],
    env: dict[str, str] | None = None,
    wrapper: list[str] | None = None,
    twistd_options: list[str] | None = None,
    program: list[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of C{twistd -n relayd OPTIONS} (or of C{PROGRAM OPTIONS}) run from
    this checkout (no configuration inherited, see L{inherited_environment}; the worktree first on
    C{PYTHONPATH})."""
    environ = inherited_environment()
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    environ.update(env or {})
    if program is not None:
        return program + options, environ
    twistd = ["-n", "--pidfile=", "--logfile=-", *(twistd_options or [])]
    return (wrapper or []) + twistd_argv() + [*twistd, "relayd", *options], environ


class _Watch(ProcessProtocol):
    def __init__(self, proc: RelaydProcess) -> None:
        self.proc = proc

    def outReceived(self, data: bytes) -> None:
        self.proc._output(data)

    def errReceived(self, data: bytes) -> None:
        self.proc._output(data)

    def processEnded(self, reason: Any) -> None:
        value = reason.value
        if isinstance(value, ProcessDone):
            self.proc.status = 0
        elif isinstance(value, ProcessTerminated):
            self.proc.status = value.exitCode if value.exitCode is not None else -(value.signal or 0)
        self.proc._ended()


class RelaydProcess:
    """C{await RelaydProcess.start([...relayd options...])}; C{.port("aep")}; C{await .terminate()}."""

    def __init__(self) -> None:
        self.log = b""
        self.status: int | None = None
        self.exited: Deferred[int] = Deferred()
        self._waiters: list[tuple[re.Pattern[bytes], int, Deferred[re.Match[bytes]]]] = []
        self.transport: Any = None
        self.ports: dict[str, int] = {}

    @classmethod
    async def start(
        cls,
        options: list[str],
        env: dict[str, str] | None = None,
        wait_for: tuple[str, ...] = ("aep",),
        cwd: str | None = None,
        wrapper: list[str] | None = None,
        child_fds: dict[int, Any] | None = None,
        twistd_options: list[str] | None = None,
        program: list[str] | None = None,
    ) -> RelaydProcess:
        """Start relayd; C{wrapper} is an argv prefix that ends by exec-ing the rest (as systemd's
        socket passing needs), C{child_fds} extra descriptors for the child (C{{3: fd}}),
        C{twistd_options} options for twistd itself (C{--logger=...}), C{program} an argv that
        replaces C{twistd -n relayd} (the C{relayd} command)."""
        proc = cls()
        argv, environ = command(options, env, wrapper, twistd_options, program)
        fds: dict[int, Any] = {0: "w", 1: "r", 2: "r", **(child_fds or {})}
        proc.transport = reactor.spawnProcess(
            _Watch(proc), argv[0], argv, env=environ, path=cwd or str(ROOT), usePTY=False, childFDs=fds
        )
        await proc.discover_ports(wait_for)
        return proc

    @classmethod
    async def start_for(cls, case: TestCase, options: list[str], **kw: Any) -> RelaydProcess:
        """L{start}, killed at C{case}'s cleanup."""
        proc = await cls.start(options, **kw)
        case.addCleanup(proc.kill)
        return proc

    async def discover_ports(self, relays: tuple[str, ...]) -> None:
        """Wait for each relay's "listening on" line and record its port."""
        for relay in relays:
            match = await self.wait_for(rb'%s listening on https?://[^\s"]+:(\d+)' % relay.encode())
            self.ports[relay] = int(match.group(1))

    def port(self, relay: str) -> int:
        return self.ports[relay]

    def _output(self, data: bytes) -> None:
        self.log += data
        self._check()

    def _check(self) -> None:
        """Fire the waiters whose pattern the log now matches."""
        for pattern, since, d in list(self._waiters):
            match = pattern.search(self.log, since)
            if match:
                self._waiters.remove((pattern, since, d))
                d.callback(match)

    def _ended(self) -> None:
        for _, _, d in self._waiters:
            d.errback(RuntimeError("relayd exited:\n" + self.log.decode(errors="replace")))
        self._waiters = []
        self.exited.callback(self.status)

    def wait_for(self, pattern: bytes, timeout: float = TIMEOUT, since: int = 0) -> Deferred[re.Match[bytes]]:
        """Fires when the log from offset C{since} on matches C{pattern} (at once if it already does).

        relayd writes its log once per reactor turn (docs/configuration.md): the access line of a
        request can come just after its answer, so a test that has an answer waits for its line."""
        compiled = re.compile(pattern)
        match = compiled.search(self.log, since)
        d: Deferred[re.Match[bytes]] = Deferred()
        if match:
            d.callback(match)
        elif self.exited.called:
            d.errback(RuntimeError("relayd exited:\n" + self.log.decode(errors="replace")))
        else:
            self._waiters.append((compiled, since, d))
            d.addTimeout(timeout, reactor)
        return d

    async def terminate(self, sig: int = signal.SIGTERM, timeout: float = TIMEOUT) -> int:
        """Send C{sig} and wait for the exit status."""
        if not self.exited.called:
            self.transport.signalProcess({signal.SIGTERM: "TERM", signal.SIGINT: "INT", signal.SIGKILL: "KILL"}[sig])
        d = self.exited
        if not d.called:
            d.addTimeout(timeout, reactor)
        return await d

    async def kill(self) -> None:
        if not self.exited.called:
            self.transport.signalProcess("KILL")
            await self.exited


class _PopenTransport:
    """The part of a process transport L{RelaydProcess} uses (signals), for a C{Popen}."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen

    def signalProcess(self, name: str) -> None:
        if self.popen.returncode is None:
            self.popen.send_signal(getattr(signal, "SIG" + name))


class DetachedRelayd(RelaydProcess):
    """A L{RelaydProcess} that outlives one trial test: a C{Popen} whose output a thread reads
    (C{wait_for}, C{terminate} and C{kill} work as usual); killed at interpreter exit if nothing
    stopped it before.

    Reading C{log} first takes in whatever relayd has written so far (as reading a log file would);
    relayd writes an access line at the end of the turn that answered, so a test that has seen an
    answer waits for its line (L{wait_for})."""

    popen: subprocess.Popen[bytes]
    _fd: int
    _lock: threading.Lock
    _text = b""
    _eof = False

    @property  # type: ignore[override]
    def log(self) -> bytes:
        self._drain()
        return self._text

    @log.setter
    def log(self, value: bytes) -> None:  # (RelaydProcess.__init__ sets it empty)
        self._text = value

    @classmethod
    async def launch(
        cls, options: list[str], wait_for: tuple[str, ...] = ("aep",), systemd_socket: socket.socket | None = None
    ) -> DetachedRelayd:
        """Start relayd; with C{systemd_socket} (bound and listening), relayd gets it as systemd
        passes one (use C{--aep-listen systemd:domain=INET:name=relayd-aep}): its port is known at
        once and connections wait in its backlog until relayd accepts them."""
        proc = cls()
        wrapper, keep = None, ()
        if systemd_socket is not None:
            wrapper, keep = [*_SYSTEMD_DUP_WRAPPER, str(systemd_socket.fileno())], (systemd_socket.fileno(),)
        argv, environ = command(options, wrapper=wrapper)
        proc.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=environ,
            cwd=str(ROOT), pass_fds=keep,
        )  # fmt: skip
        proc.transport = _PopenTransport(proc.popen)
        assert proc.popen.stdout is not None
        proc._fd = proc.popen.stdout.fileno()
        os.set_blocking(proc._fd, False)
        proc._lock = threading.Lock()
        atexit.register(proc.stop_now, graceful=False)
        threading.Thread(target=proc._read, name="relayd-log", daemon=True).start()
        await proc.discover_ports(wait_for)
        return proc

    def _read(self) -> None:
        # Waits for output, takes it in and has the reactor thread check the waiters on it.
        while not self._eof:
            select.select([self._fd], [], [])
            self._drain()
            reactor.callFromThread(self._check)
        status = self.popen.wait()
        reactor.callFromThread(self._exit, status)

    def _drain(self) -> None:
        """Append what the pipe holds now (from this thread or the reader's, one at a time)."""
        with self._lock:
            while not self._eof:
                try:
                    chunk = os.read(self._fd, 65536)
                except BlockingIOError:
                    return
                if not chunk:
                    self._eof = True
                self._text += chunk

    def _exit(self, status: int) -> None:
        self.status = status  # negative: killed by that signal, as RelaydProcess reports it
        self._ended()

    def stop_now(self, graceful: bool = True, timeout: float = TIMEOUT) -> None:
        """Blocking (outside the reactor: C{tearDownClass}, exit): SIGTERM and wait, else SIGKILL."""
        if self.popen.poll() is not None:
            return
        if graceful:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
                return
            except subprocess.TimeoutExpired:
                pass
        self.popen.kill()
        self.popen.wait(timeout)
