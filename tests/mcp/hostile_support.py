"""Helpers for hostile-input tests: a real relayd per test (or per class), a blocking raw HTTP exchange
(for hypothesis, which runs in a worker thread), and a check that the log stayed clean."""

from __future__ import annotations

import itertools
import socket
from typing import Mapping

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.mcp.harness import Reply
from tests.support.twistd import RelaydProcess

TIMEOUT = 10.0
# Lines that must never appear in a relay's log, whatever a client sends.
BAD_LOG_LINES = (b"Traceback", b"Unhandled Error", b"I think I'll eat it", b"internal_error")
# The Node relay's env names apply to the MCP wing; the caller's environment must not leak in.
CLEAN_ENV = {name: "" for name in ("PORT", "HOST", "PREFIX", "TTL_MS", "CORS_ALLOW_ORIGIN")}

_sentinels = itertools.count()


async def start_mcp(
    case: TestCase,
    *flags: str,
    env: Mapping[str, str] | None = None,
    listen: str = "tcp:0:interface=127.0.0.1",
    wait_for: tuple[str, ...] = ("mcp",),
) -> RelaydProcess:
    """C{twistd -n relayd} with only the MCP wing, on a free loopback port; killed at cleanup."""
    proc = await RelaydProcess.start(
        ["--no-aep", "--mcp-listen", listen, *flags],
        env={**CLEAN_ENV, **(env or {})},
        wait_for=wait_for,
    )
    case.addCleanup(proc.kill)
    return proc


class Http:
    """A small treq client for one relay (no connection reuse: every request is its own exchange)."""

    def __init__(self, case: TestCase, port: int) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        case.addCleanup(self.pool.closeCachedConnections)

    async def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Reply:
        d = treq.request(method, self.base + path, data=body, headers=dict(headers or {}), pool=self.pool)
        d.addTimeout(TIMEOUT, reactor)
        response = await d
        return Reply(response.code, response.headers, await treq.content(response))

    async def post(self, path: str, body: bytes, **headers: str) -> Reply:
        return await self.request("POST", path, body, {"content-type": "application/json", **headers})

    async def get(self, path: str, **headers: str) -> Reply:
        return await self.request("GET", path, None, headers)


async def until_store_answers(case: TestCase, http: Http) -> None:
    """Until a relay started with C{--redis} has its pool up (it answers 503 while it connects)."""
    deadline = reactor.seconds() + TIMEOUT
    probe = b'{"session":"ready-probe","token":"ready_probe_token_0123"}'
    while (reply := await http.post("/register", probe)).code != 200:
        case.assertEqual(reply.json(), {"error": "store_unavailable", "store": "mcp"})
        case.assertLess(reactor.seconds(), deadline, "the relay never reached Redis")
        await deferLater(reactor, 0.05, lambda: None)  # polling a connection another process makes


async def assert_clean_log(case: TestCase, proc: RelaydProcess, http: Http) -> None:
    """The log has caught up with every answer so far (a sentinel request's access line is in it),
    and holds no traceback or complaint; the relay still answers its health check."""
    sentinel = f"/log-sentinel-{next(_sentinels)}"
    reply = await http.get(sentinel)
    case.assertEqual(reply.code, 404)
    await proc.wait_for(f'"GET {sentinel}" 404'.encode())
    for line in BAD_LOG_LINES:
        case.assertNotIn(line, proc.log, proc.log.decode("utf-8", "replace")[-4000:])
    health = await http.get("/healthz")
    case.assertEqual(health.code, 200)


def exchange(port: int, request: bytes, timeout: float = TIMEOUT) -> tuple[int, dict[bytes, bytes], bytes]:
    """Send raw C{request} on a new connection; the status, headers and body of the answer.

    Blocking (for a worker thread). An open SSE stream counts as answered once its headers arrive;
    a connection closed (or a timeout) before a status line raises.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                raise AssertionError(f"connection closed without an answer (got {data!r})")
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        headers: dict[bytes, bytes] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        if request.startswith(b"HEAD ") or status in (204, 304):
            return status, headers, b""
        length = headers.get(b"content-length")
        if length is None and headers.get(b"content-type", b"").startswith(b"text/event-stream"):
            return status, headers, b""  # a stream: it answered
        while length is None or len(rest) < int(length):
            chunk = s.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, headers, rest if length is None else rest[: int(length)]


def raw_request(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]] | None = None, body: bytes | None = None
) -> bytes:
    """One HTTP/1.1 request as bytes (C{connection: close}; a content-length when there is a body)."""
    lines = [method + b" " + target + b" HTTP/1.1", b"host: relay", b"connection: close"]
    lines += [name + b": " + value for name, value in headers or []]
    if body is not None:
        lines.append(b"content-length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")
