"""MONITOR on a real redis-server: every command it runs, in order, with those run by Lua scripts."""

from __future__ import annotations

import re
from dataclasses import dataclass

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.protocols.basic import LineReceiver

_LINE = re.compile(rb"^\+?[0-9.]+ \[\d+ ([^\]]+)\] (.*)$")
_ESCAPES = {b"n": b"\n", b"r": b"\r", b"t": b"\t", b"a": b"\a", b"b": b"\b", b'"': b'"', b"\\": b"\\"}


@dataclass
class Command:
    """One command as MONITOR shows it: its arguments, and whether a Lua script ran it."""

    args: list[bytes]
    lua: bool

    @property
    def name(self) -> str:
        return self.args[0].decode().upper()


def parse_arguments(text: bytes) -> list[bytes]:
    """The quoted, escaped arguments of a MONITOR line (Redis's C{sdscatrepr} form)."""
    args: list[bytes] = []
    i = 0
    while i < len(text):
        if text[i : i + 1] == b" ":
            i += 1
            continue
        assert text[i : i + 1] == b'"', text[i:]
        i += 1
        out = bytearray()
        while text[i : i + 1] != b'"':
            c = text[i : i + 1]
            if c == b"\\":
                nxt = text[i + 1 : i + 2]
                if nxt == b"x":
                    out += bytes([int(text[i + 2 : i + 4], 16)])
                    i += 4
                    continue
                out += _ESCAPES[nxt]
                i += 2
                continue
            out += c
            i += 1
        args.append(bytes(out))
        i += 1
    return args


class _Monitor(LineReceiver):
    MAX_LENGTH = 10_000_000

    def __init__(self) -> None:
        self.commands: list[Command] = []
        self.waiting: list[tuple[bytes, Deferred[None]]] = []
        self.started: Deferred[None] = Deferred()

    def connectionMade(self) -> None:
        self.sendLine(b"MONITOR")

    def lineReceived(self, line: bytes) -> None:
        if line == b"+OK":
            self.started.callback(None)
            return
        found = _LINE.match(line)
        if found is None:
            return
        command = Command(parse_arguments(found.group(2)), found.group(1) == b"lua")
        self.commands.append(command)
        for marker, d in list(self.waiting):
            if command.args[:2] == [b"ECHO", marker] or command.args[:2] == [b"echo", marker]:
                self.waiting.remove((marker, d))
                d.callback(None)


class RedisMonitor:
    """C{await RedisMonitor.start(port)}; C{await mark(redis, name)}; C{between(a, b)}."""

    def __init__(self, protocol: _Monitor) -> None:
        self._protocol = protocol

    @classmethod
    async def start(cls, port: int) -> RedisMonitor:
        protocol = _Monitor()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), protocol)
        await protocol.started
        return cls(protocol)

    async def mark(self, redis: object, name: bytes) -> None:
        """Run C{ECHO name} and wait until MONITOR has shown it: every command before it is seen."""
        d: Deferred[None] = Deferred()
        self._protocol.waiting.append((name, d))
        await redis.execute("test", "ECHO", name)  # type: ignore[attr-defined]
        await d

    def between(self, start: bytes, end: bytes) -> list[Command]:
        """The commands after the marker C{start} and before C{end}."""
        commands = self._protocol.commands
        names = [c.args[:2] for c in commands]
        first = next(i for i, n in enumerate(names) if n[0].upper() == b"ECHO" and n[1] == start)
        last = next(i for i, n in enumerate(names) if n[0].upper() == b"ECHO" and n[1] == end)
        return commands[first + 1 : last]

    def stop(self) -> None:
        self._protocol.transport.loseConnection()  # type: ignore[union-attr]
