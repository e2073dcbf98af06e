"""The MCP wing under test: in-process per test (L{McpRelayCase}, on L{tests.support.wing}) or as a
real C{twistd -n relayd} with only the MCP wing (L{start_mcp_process}, on L{tests.support.twistd}),
and what tests need around it (reading C{event: mcp} messages, ending streams, a clean log)."""

from __future__ import annotations

import itertools
import json
from typing import Any, Mapping

from twisted.trial import unittest
from twisted.trial.unittest import TestCase

from relayd.mcp.core.frames import Frame
from tests.support.http import HttpClient, Reply
from tests.support.redis import redis_flags
from tests.support.sse import SSEClient
from tests.support.twistd import RelaydProcess
from tests.support.wing import Wing

TOKEN = "tok_abcdefghijklmnopqrstuvwxyz01"
# The standard endpoint's tests: their tunnel session, first request and headers.
SESSION = "statuses1"
INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
}
AUTH = {"authorization": f"Bearer {TOKEN}", "accept": "application/json, text/event-stream"}


def initialized(reply: Any) -> str:
    """The client session id of the answer to L{INIT} (a L{Reply} of either kind), once it is shown
    to be the session's start: 200, the version asked, an id of at least 128 random bits."""
    assert reply.code == 200, reply.body
    assert reply.json()["result"]["protocolVersion"] == "2025-06-18"
    sid = reply.header("mcp-session-id")
    assert sid is not None and len(sid) >= 22
    return str(sid)
TIMEOUT = 5.0
# Lines that must never appear in a relay's log, whatever a client sends.
BAD_LOG_LINES = (b"Traceback", b"Unhandled Error", b"I think I'll eat it", b"internal_error")


class McpRelayCase(unittest.TestCase):
    """Starts the MCP wing in-process per test; C{flags}/C{environ} configure it like the command
    line would. C{self.base} is its URL with the prefix; C{post}/C{get}/C{events}/C{poll} drive it."""

    flags: Mapping[str, Any] = {}
    environ: Mapping[str, str] = {}
    timeout = 30
    # Set by the Redis variants: run the wing with --redis on the test run's redis-server.
    with_redis = False

    async def start_relay(self, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> None:
        given = {"mcp-reap-interval-ms": "0", **(self.flags if flags is None else flags)}
        if self.with_redis:
            given.update(redis_flags())
        self.wing = await Wing.start("mcp", given, self.environ if environ is None else environ)
        self.service = self.wing.service
        self.tunnel = self.service.tunnel
        self.clock = self.wing.clock
        self.port = self.wing.port
        self.prefix = self.wing.settings["mcp-prefix"]
        self.base = self.wing.url + self.prefix
        self.http = HttpClient(self, self.base, timeout=TIMEOUT)
        self.pool = self.http.pool
        self.streams: list[SSEClient] = []
        self.addCleanup(self._stop)  # before the pool's cleanup (last in, first out)

    async def _stop(self) -> None:
        # Stopping drains: every stream is ended by the relay, which is what lets the clients finish.
        await self.wing.stop()
        for stream in self.streams:
            await disconnect(stream)
            await stream.pool.closeCachedConnections()

    async def setUp(self) -> None:  # type: ignore[override]
        await self.start_relay()

    # client helpers

    async def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Reply:
        return await self.http.request(method, path, body, headers)

    async def post(self, path: str, payload: Any = None, raw: bytes | None = None, **headers: str) -> Reply:
        body = raw if raw is not None else json.dumps(payload).encode()
        return await self.http.post(path, body, **headers)

    async def get(self, path: str, **headers: str) -> Reply:
        return await self.http.get(path, **headers)

    async def register(self, session: str = "sess", token: str = TOKEN) -> None:
        reply = await self.post("/register", {"session": session, "token": token})
        assert reply.code == 200, reply.body

    async def events(self, session: str = "sess", query: str = "", token: str = TOKEN, **headers: str) -> SSEClient:
        stream = await SSEClient.connect(f"{self.base}/{session}/events?token={token}{query}", headers=headers)
        self.streams.append(stream)
        return stream

    async def poll(self, session: str = "sess", query: str = "", token: str = TOKEN) -> Reply:
        return await self.get(f"/{session}/poll?token={token}{query}")


async def next_mcp(stream: SSEClient, timeout: float = TIMEOUT) -> Any:
    """The next C{event: mcp} message, skipping comments and the C{retry:} preamble."""
    while True:
        msg = await stream.next(timeout)
        assert msg is not None, "stream ended"
        if msg.event == "mcp":
            return msg


async def disconnect(stream: SSEClient) -> None:
    """Drop an SSE client's connection and wait until its stream has ended.

    (C{SSEClient.close} looks for C{_transport} on treq's wrapper, which does not proxy it.)
    """
    response = stream.response
    transport = getattr(getattr(response, "original", response), "_transport", None)
    if transport is not None and not stream.ended.called:
        transport.stopProducing()
    if response is not None and response.code == 200 and not stream.ended.called:
        await stream.ended


# A real process


async def start_mcp_process(
    case: TestCase,
    *flags: str,
    env: Mapping[str, str] | None = None,
    listen: str = "tcp:0:interface=127.0.0.1",
    wait_for: tuple[str, ...] = ("mcp",),
) -> RelaydProcess:
    """C{twistd -n relayd} with only the MCP wing, on a free loopback port; killed at cleanup."""
    return await RelaydProcess.start_for(case, ["--no-aep", "--mcp-listen", listen, *flags], env=dict(env or {}), wait_for=wait_for)


async def until_store_answers(proc: RelaydProcess) -> None:
    """Until a relay started with C{--redis} has its pool up (it answers 503 while it connects):
    relayd logs when its first pool connection has passed the handshake."""
    await proc.wait_for(rb"connected to Redis at ")


_sentinels = itertools.count()


async def assert_clean_log(case: TestCase, proc: RelaydProcess, http: HttpClient) -> None:
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


class RecordingSink:
    """A tunnel sink that keeps the SSE event of each frame it is given."""

    def __init__(self, accept: bool = True) -> None:
        self.events: list[bytes] = []
        self.ended = False
        self.accept = accept

    def deliver(self, frame: Frame) -> bool:
        self.events.append(frame.sse)
        return self.accept

    def end(self) -> None:
        self.ended = True

    def messages(self) -> list[Any]:
        """The JSON of each C{event: mcp} event."""
        out = []
        for event in self.events:
            assert event.startswith(b"event: mcp\ndata: ") and event.endswith(b"\n\n"), event
            out.append(json.loads(event[len(b"event: mcp\ndata: ") : -2]))
        return out
