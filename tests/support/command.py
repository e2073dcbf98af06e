"""Run a command-line tool as a real subprocess from a trial test: stdout and stderr kept apart,
waits on what they print, stdin fed from the test."""

from __future__ import annotations

import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.error import ProcessDone, ProcessTerminated
from twisted.internet.protocol import ProcessProtocol

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 15.0


class Command(ProcessProtocol):
    """C{Command.start(argv)}; C{await .wait_stdout(pattern)}; C{await .exited}."""

    def __init__(self) -> None:
        self.stdout = b""
        self.stderr = b""
        self.status: int | None = None
        self.exited: Deferred[int] = Deferred()
        self._waiters: list[tuple[str, re.Pattern[bytes], Deferred[re.Match[bytes]]]] = []

    @classmethod
    def start(cls, argv: list[str], env: dict[str, str] | None = None, stdin: bytes | None = None) -> Command:
        """Start C{argv}; C{stdin} is written and closed at once (else stdin stays open)."""
        proc = cls()
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("AEP_", "RELAYD_", "MCP_"))}
        environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
        environ.update(env or {})
        reactor.spawnProcess(proc, argv[0], argv, env=environ, path=str(ROOT))
        if stdin is not None:
            proc.transport.write(stdin)
            proc.transport.closeStdin()
        return proc

    @classmethod
    def admin(cls, *args: str, env: dict[str, str] | None = None, stdin: bytes | None = None) -> Command:
        """C{relayd-admin ARGS...} (as C{python -m relayd.cli.admin}, this checkout's code)."""
        return cls.start([sys.executable, "-m", "relayd.cli.admin", *args], env, stdin)

    def outReceived(self, data: bytes) -> None:
        self.stdout += data
        self._check()

    def errReceived(self, data: bytes) -> None:
        self.stderr += data
        self._check()

    def _check(self) -> None:
        for stream, pattern, d in list(self._waiters):
            match = pattern.search(self.stdout if stream == "out" else self.stderr)
            if match:
                self._waiters.remove((stream, pattern, d))
                d.callback(match)

    def processEnded(self, reason: Any) -> None:
        value = reason.value
        if isinstance(value, ProcessDone):
            self.status = 0
        elif isinstance(value, ProcessTerminated):
            self.status = value.exitCode if value.exitCode is not None else -(value.signal or 0)
        for _, _, d in self._waiters:
            d.errback(RuntimeError(f"exited {self.status}:\n{self.stdout!r}\n{self.stderr!r}"))
        self._waiters = []
        self.exited.callback(self.status)

    def _wait(self, stream: str, pattern: bytes, timeout: float) -> Deferred[re.Match[bytes]]:
        compiled = re.compile(pattern)
        d: Deferred[re.Match[bytes]] = Deferred()
        match = compiled.search(self.stdout if stream == "out" else self.stderr)
        if match:
            d.callback(match)
        elif self.exited.called:
            d.errback(RuntimeError(f"exited {self.status}:\n{self.stdout!r}\n{self.stderr!r}"))
        else:
            self._waiters.append((stream, compiled, d))
            d.addTimeout(timeout, reactor)
        return d

    def wait_stdout(self, pattern: bytes, timeout: float = TIMEOUT) -> Deferred[re.Match[bytes]]:
        """Fires when stdout matches C{pattern}."""
        return self._wait("out", pattern, timeout)

    def wait_stderr(self, pattern: bytes, timeout: float = TIMEOUT) -> Deferred[re.Match[bytes]]:
        """Fires when stderr matches C{pattern}."""
        return self._wait("err", pattern, timeout)

    async def finished(self, timeout: float = TIMEOUT) -> int:
        """The exit status, once the process has ended by itself."""
        d = self.exited
        if not d.called:
            d.addTimeout(timeout, reactor)
        return await d

    async def stop(self, sig: int = signal.SIGTERM) -> int:
        if not self.exited.called:
            self.transport.signalProcess({signal.SIGTERM: "TERM", signal.SIGINT: "INT", signal.SIGKILL: "KILL"}[sig])
        return await self.finished()
