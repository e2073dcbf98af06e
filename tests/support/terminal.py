"""A terminal window for a test: one real bash fed shell snippets in order, as a person types them.

Variables and the working directory persist from one snippet to the next; a snippet that does not
end (a stream, a long-poll) holds the terminal until it does, as it would on screen. Each snippet's
output (stdout and stderr together) and exit status are delimited by a sentinel line the terminal
prints after it.
"""

from __future__ import annotations

import os
import re
import signal
import sys

from twisted.internet.defer import Deferred

from tests.support.command import TIMEOUT, Command

# bash leads its own process group, so closing the terminal also ends what runs in it (a curl -N).
_BASH = [sys.executable, "-c", "import os; os.setsid(); os.execvp('bash', ['bash', '--noprofile', '--norc'])"]


class Run:
    """One snippet sent to a L{Terminal}: its output so far, and its exit status once it ended."""

    def __init__(self, terminal: Terminal, number: int, start: int) -> None:
        self.terminal = terminal
        self.start = start
        self._sentinel = re.compile(rb"\n@@snippet %d: (\d+)@@\n" % number)

    def _match(self) -> re.Match[bytes] | None:
        return self._sentinel.search(self.terminal.command.stdout, self.start)

    @property
    def ended(self) -> bool:
        return self._match() is not None

    @property
    def output(self) -> bytes:
        """What the snippet printed (up to its sentinel, or so far if it still runs)."""
        out = self.terminal.command.stdout
        match = self._match()
        return out[self.start : match.start() if match else len(out)]

    async def status(self, timeout: float = TIMEOUT) -> int:
        """Wait for the snippet to end; its exit status (that of its last command)."""
        after_start = rb"\A[\s\S]{%d}[\s\S]*?" % self.start
        match = await self.terminal.command.wait_stdout(after_start + self._sentinel.pattern, timeout)
        return int(match.group(1))

    def printed(self, pattern: bytes, timeout: float = TIMEOUT) -> Deferred[re.Match[bytes]]:
        """Fires once the snippet's output matches C{pattern} (a regex with C{re.M} on, searched from
        the snippet's start)."""
        return self.terminal.command.wait_stdout(rb"(?m)\A[\s\S]{%d}[\s\S]*?" % self.start + pattern, timeout)


class Terminal:
    """C{t = await Terminal.open(cwd, env)}; C{run = t.send("curl ...")}; C{await run.status()};
    C{await t.close()}. Like a person, it types the next snippet only once the last one has ended."""

    def __init__(self, command: Command) -> None:
        self.command = command
        self.last: Run | None = None
        self._count = 0

    @classmethod
    async def open(cls, cwd: str, env: dict[str, str] | None = None) -> Terminal:
        """A bash in C{cwd} with the test's environment (see L{Command.start}) plus C{env}."""
        terminal = cls(Command.start(_BASH, env))
        if await terminal.send(f"cd {_quote(cwd)}").status() != 0:
            raise RuntimeError(f"cannot cd to {cwd}: {terminal.command.stdout!r}")
        return terminal

    def send(self, snippet: str) -> Run:
        """Type C{snippet} (its stdin is /dev/null); the previous one must have ended."""
        if self.last is not None and not self.last.ended:
            raise RuntimeError("the terminal is still running the previous snippet")
        self._count += 1
        run = Run(self, self._count, len(self.command.stdout))
        # A brace group, not a subshell: assignments and cd persist. The status is the snippet's.
        wrapped = "{ %s\n} </dev/null 2>&1; printf '\\n@@snippet %d: %%s@@\\n' \"$?\"\n" % (
            snippet.rstrip("\n"),
            self._count,
        )
        self.command.transport.write(wrapped.encode())
        self.last = run
        return run

    async def close(self) -> None:
        """Close the window: end bash and whatever still runs in it."""
        if self.command.transport.pid is not None:  # None once bash is reaped (it exited by itself)
            os.killpg(self.command.transport.pid, signal.SIGKILL)
        await self.command.exited


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"
