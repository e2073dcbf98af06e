"""README.md's quick tour runs as written, against a real relayd (and a real Nostr relay for the broker).

The tour is read from README.md itself, so the README cannot drift from what relayd does. Under
C{## A quick tour with curl}, every C{sh} block (its first line must be C{# terminal N...}) is run, in
document order: the blocks before the first C{###} heading (starting relayd) and then those of one
C{###} section per test. Within a block:

  - shell lines, up to the next C{# →} line, are one snippet typed into terminal N (a real bash that
    keeps its variables and directory from block to block, as a terminal window does);
  - C{# → TEXT} lines are what the snippet prints: each must match a whole output line, in order (other
    lines may come between), C{…} matching anything;
  - a comment C{# (... go on in terminal M ...)} after a snippet says it does not end by itself (a
    stream, a long-poll): the tour goes on without waiting for it. Its C{# →} lines either follow at
    once (they are awaited at the end of the section, then the terminal is closed) or open that
    terminal's next block (awaited, with the snippet's end, before anything else is typed there);
  - C{relayd ARGS} starts relayd (replacing a running one, as Ctrl-C and a new
    start do) and C{... nostr-relay serve} a Nostr relay: the test runs those itself, on free ports
    (relayd with ARGS and its listeners on port 0; the relay as tests/support/nostr.py's C{NostrRelay}),
    and the README's addresses (C{localhost:8787}, C{ws://127.0.0.1:6969}, ...) are rewritten to them.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from twisted.trial.unittest import TestCase

from tests.support.command import TIMEOUT
from tests.support.nostr import NostrRelay
from tests.support.skips import missing, require_module
from tests.support.terminal import Run, Terminal
from tests.support.twistd import RelaydProcess

README = Path(__file__).resolve().parents[1] / "README.md"
TOUR = "## A quick tour with curl"

# The README's addresses: relayd's default listeners and nostr-relay's default.
DEFAULTS = {"aep": "localhost:8787", "mcp": "localhost:8788", "broker": "localhost:8789"}
NOSTR_DEFAULT = "ws://127.0.0.1:6969"
_ADDRESS = re.compile(r"(?:ws://)?(?:localhost|127\.0\.0\.1):\d+")
_LISTEN = [f"--{wing}-listen" for wing in DEFAULTS]

_HEADER = re.compile(r"# terminal (\d+)\b")
_EXPECT = "# → "
_GOES_ON = re.compile(r"# \(.*\bgo on in terminal \d+\b.*\)$")
_RELAYD = ["relayd"]  # the console script; run here as `python -m relayd` from this checkout
_RELAYD_PROGRAM = [sys.executable, "-m", "relayd"]


@dataclass
class Step:
    """A snippet for one terminal and what it prints (or, with C{resume}, what the terminal's running
    snippet prints)."""

    terminal: int
    line: int  # in README.md, for messages
    code: str = ""
    expect: list[str] = field(default_factory=list)
    goes_on: bool = False
    resume: bool = False

    def where(self) -> str:
        return f"README.md:{self.line} (terminal {self.terminal})"


def _is_code(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def parse_block(first_line: int, lines: list[str]) -> list[Step]:
    """The steps of one C{# terminal N} block (C{lines} without the fences)."""
    header = _HEADER.match(lines[0])
    assert header is not None
    terminal = int(header.group(1))
    steps: list[Step] = []
    pending: list[str] = []
    pending_line = first_line + 1
    current: Step | None = None  # the step that the next expectation lines describe

    def flush() -> Step | None:
        nonlocal pending
        if not any(_is_code(line) for line in pending):
            return None
        step = Step(terminal, pending_line, "\n".join(pending) + "\n")
        steps.append(step)
        pending = []
        return step

    for offset, line in enumerate(lines[1:], start=1):
        if not pending:
            pending_line = first_line + offset
        if line.startswith(_EXPECT) or line == _EXPECT.rstrip():
            current = flush() or current
            if current is None:  # the block opens with what the terminal's running snippet printed
                current = Step(terminal, first_line + offset, resume=True)
                steps.append(current)
            current.expect.append(line[len(_EXPECT) :])
        elif _GOES_ON.match(line):
            current = flush() or current
            assert current is not None and not current.resume, f"README.md:{first_line + offset}: goes on after what?"
            current.goes_on = True
        else:
            if _is_code(line):
                current = None
            pending.append(line)
    flush()
    return steps


def parse_tour(text: str) -> dict[str, list[Step]]:
    """The tour's steps: C{""} for the blocks before the first C{###} section, then one per section."""
    lines = text.splitlines()
    assert TOUR in lines, f"README.md has no '{TOUR}' section"
    begin = lines.index(TOUR)
    sections: dict[str, list[Step]] = {"": []}
    name = ""
    i = begin + 1
    while i < len(lines) and not lines[i].startswith("## "):
        line = lines[i]
        if line.startswith("### "):
            name = line[4:].strip()
            sections[name] = []
        elif line.startswith("```"):
            end = lines.index("```", i + 1)
            block = lines[i + 1 : end]
            if line == "```sh":  # a tour block nobody runs could drift: every one names its terminal
                assert block and _HEADER.match(block[0]), f"README.md:{i + 2}: the block has no '# terminal N' line"
                sections[name] += parse_block(i + 2, block)
            i = end
        i += 1
    return sections


def expectation(patterns: list[str]) -> bytes:
    """One regex (C{re.M}) for lines matching C{patterns} in order, other lines between allowed."""
    parts = []
    for pattern in patterns:
        line = rb"[^\n]*".join(re.escape(piece.encode()) for piece in pattern.split("…"))
        parts.append(rb"^" + line + rb"\r?$")
    return rb"[\s\S]*?".join(parts)


class ReadmeTour(TestCase):
    """Each section of README.md's quick tour, run as a newcomer would run it."""

    timeout = 60

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="relayd-readme-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        # relayd-admin as this checkout's code on this interpreter (as tests/support/command.py runs it).
        bin_dir = os.path.join(self.dir, ".bin")
        os.mkdir(bin_dir)
        shim = os.path.join(bin_dir, "relayd-admin")
        with open(shim, "w") as f:
            f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m relayd.cli.admin "$@"\n')
        os.chmod(shim, 0o755)
        self.env = {"PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
        self.addresses: dict[str, str] = {}
        self.relayd: RelaydProcess | None = None
        self.terminals: dict[int, Terminal] = {}
        self.running: dict[int, tuple[Step, Run]] = {}
        self.addCleanup(self._close)
        for tool in ("bash", "curl"):
            if shutil.which(tool) is None:
                missing(f"the README's tour needs {tool} on PATH")

    async def _close(self) -> None:
        for terminal in self.terminals.values():
            await terminal.close()
        if self.relayd is not None:
            await self.relayd.terminate()

    def tour(self, section: str) -> list[Step]:
        sections = parse_tour(README.read_text(encoding="utf-8"))
        self.assertIn(section, sections, f"README.md's tour has no '### {section}' section")
        steps = sections[""] + sections[section]
        self.assertTrue(sections[section], f"'### {section}' has no '# terminal N' block")
        running: dict[int, Step] = {}
        for step in steps:  # what a block opens with is the output of its terminal's running snippet
            if step.resume:
                self.assertIn(step.terminal, running, f"{step.where()}: output of what? Nothing runs there")
                running.pop(step.terminal).expect += step.expect
            elif step.goes_on:
                running[step.terminal] = step
            else:
                running.pop(step.terminal, None)
        for step in steps:
            if "curl " in step.code or step.goes_on:
                self.assertTrue(step.expect, f"{step.where()}: show what it prints ('# → ...')")
        return steps

    def rewrite(self, step: Step, text: str) -> str:
        unknown = [a for a in _ADDRESS.findall(text) if a not in self.addresses]
        self.assertEqual(unknown, [], f"{step.where()}: an address the test does not run (or not yet)")
        for readme, actual in self.addresses.items():
            text = text.replace(readme, actual)
        return text

    def check(self, step: Step, output: bytes) -> None:
        if not re.search(expectation(step.expect), output, re.M):
            self.fail(f"{step.where()}: {step.code.strip()}\nprinted:\n{output.decode(errors='replace')}\n"
                      "expected lines:\n" + "\n".join(step.expect))

    async def run_tour(self, section: str) -> None:
        for step in self.tour(section):
            if await self.server(step):
                continue
            if step.terminal in self.running:  # a person waits for it before typing there again
                await self.finish(*self.running.pop(step.terminal))
            if step.resume:
                continue
            terminal = self.terminals.get(step.terminal)
            if terminal is None:
                terminal = self.terminals[step.terminal] = await Terminal.open(self.dir, self.env)
            run = terminal.send(self.rewrite(step, step.code))
            if step.goes_on:
                self.running[step.terminal] = (step, run)
            else:
                await self.finish(step, run)
        # What is still running (a stream) must have printed what the README shows.
        for step, run in self.running.values():
            try:
                await run.printed(expectation(step.expect))
            except Exception:
                self.check(step, run.output)
                raise

    async def finish(self, step: Step, run: Run) -> None:
        try:
            status = await run.status(TIMEOUT)
        except Exception as e:
            self.fail(f"{step.where()}: did not end ({e!r}):\n{step.code}\nprinted: {run.output!r}")
        self.assertEqual(status, 0, f"{step.where()}: exit status {status}:\n{step.code}\n{run.output!r}")
        if step.expect:
            self.check(step, run.output)

    async def server(self, step: Step) -> bool:
        """Start what the step starts in the test's own way, if it is relayd or a Nostr relay."""
        code = "\n".join(line for line in step.code.splitlines() if _is_code(line)).replace("\\\n", " ")
        if code == "relayd" or code.startswith(("relayd ", "twistd ")):
            words = shlex.split(code)
            self.assertEqual(words[: len(_RELAYD)], _RELAYD, f"{step.where()}: relayd is started as {_RELAYD}")
            await self.start_relayd(step, words[len(_RELAYD) :])
            return True
        if re.search(r"(?:^|&& )nostr-relay serve$", code):
            self.start_nostr_relay()
            return True
        return False

    async def start_relayd(self, step: Step, args: list[str]) -> None:
        self.assertFalse([a for a in args if a.split("=")[0] in _LISTEN], f"{step.where()}: the test sets listeners")
        if self.relayd is not None:
            await self.relayd.terminate()
        listen = [x for flag in _LISTEN for x in (flag, "tcp:0:interface=127.0.0.1")]
        options = [self.rewrite(step, a) for a in args] + listen
        self.relayd = await RelaydProcess.start(options, wait_for=(), cwd=self.dir, program=_RELAYD_PROGRAM)
        ready = await self.relayd.wait_for(rb"relayd ready: ([a-z, ]+)")
        for address in DEFAULTS.values():  # a wing the new relayd does not serve is gone
            self.addresses.pop(address, None)
        for wing in ready.group(1).decode().split(", "):
            port = (await self.relayd.wait_for(rb'%s listening on https?://[^\s"]+:(\d+)' % wing.encode())).group(1)
            self.addresses[DEFAULTS[wing]] = f"127.0.0.1:{port.decode()}"
        if step.expect:
            self.check(step, self.relayd.log)

    def start_nostr_relay(self) -> None:
        require_module("nostr_relay", "the README's broker tour needs a real Nostr relay")
        os.mkdir(os.path.join(self.dir, ".nostr"))
        relay = NostrRelay(os.path.join(self.dir, ".nostr"))
        relay.start()
        self.addCleanup(relay.stop)
        self.addresses[NOSTR_DEFAULT] = relay.url

    async def test_aep_tour(self) -> None:
        await self.run_tour("AEP relay")

    async def test_mcp_tour(self) -> None:
        await self.run_tour("MCP tunnel relay")

    async def test_broker_tour(self) -> None:
        await self.run_tour("Buzz broker host")
