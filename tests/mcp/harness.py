"""A real MCP relay on 127.0.0.1 port 0 (built by C{make_service}) and a small treq client."""

from __future__ import annotations

import itertools
import json
import os
from typing import Any, Mapping

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial import unittest
from twisted.web.client import HTTPConnectionPool

from relayd.clock import Clock
from relayd.config import resolve
from relayd.mcp.config import SETTINGS
from relayd.mcp.redis_bus import RedisMcpBus
from relayd.mcp.service import McpService, make_service
from relayd.redis_config import SETTINGS as REDIS_SETTINGS
from tests.support.redis import shared_redis
from tests.support.sse import SSEClient

TOKEN = "tok_abcdefghijklmnopqrstuvwxyz01"
TIMEOUT = 5.0


class Reply:
    """A buffered HTTP response."""

    def __init__(self, code: int, headers: Any, body: bytes) -> None:
        self.code = code
        self.headers = headers
        self.body = body

    def header(self, name: str) -> str | None:
        values = self.headers.getRawHeaders(name)
        return values[0] if values else None

    def json(self) -> Any:
        return json.loads(self.body)


class RelayTestCase(unittest.TestCase):
    """Starts the MCP wing per test; C{flags}/C{environ} configure it like the command line would."""

    flags: Mapping[str, Any] = {}
    environ: Mapping[str, str] = {}
    timeout = 30
    # Set by the Redis variants: run the wing with --redis on the test run's redis-server.
    with_redis = False

    async def start_relay(self, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> None:
        given = {"mcp-listen": ["tcp:0:interface=127.0.0.1"], "mcp-reap-interval-ms": "0"}
        given.update(self.flags if flags is None else flags)
        if self.with_redis:
            given.update(redis_flags(shared_redis().url))
        settings = resolve(REDIS_SETTINGS + SETTINGS, given, self.environ if environ is None else environ)
        self.clock = Clock(reactor)
        service = make_service(settings, reactor, self.clock)
        assert isinstance(service, McpService)
        self.service = service
        self.broker = service.broker
        service.startService()
        await wait_ready(service)
        (port,) = await service.ports()
        self.port = port.getHost().port
        self.prefix = settings["mcp-prefix"]
        self.base = f"http://127.0.0.1:{self.port}{self.prefix}"
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.streams: list[SSEClient] = []
        self.addCleanup(self._stop)

    async def _stop(self) -> None:
        # Stopping drains: every stream is ended by the relay, which is what lets the clients finish.
        if self.service.running:
            await self.service.stopService()
        for stream in self.streams:
            await disconnect(stream)
            await stream.pool.closeCachedConnections()
        await self.pool.closeCachedConnections()
        await close_redis(self.service)
        self.clock.shutdown()

    async def setUp(self) -> None:  # type: ignore[override]
        await self.start_relay()

    # client helpers

    async def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Reply:
        url = path if path.startswith("http") else self.base + path
        d = treq.request(method, url, data=body, headers=dict(headers or {}), pool=self.pool)
        d.addTimeout(TIMEOUT, reactor)
        response = await d
        content = await treq.content(response)
        return Reply(response.code, response.headers, content)

    async def post(self, path: str, payload: Any = None, raw: bytes | None = None, **headers: str) -> Reply:
        body = raw if raw is not None else json.dumps(payload).encode()
        return await self.request("POST", path, body, {"content-type": "application/json", **headers})

    async def get(self, path: str, **headers: str) -> Reply:
        return await self.request("GET", path, None, headers)

    async def register(self, session: str = "sess", token: str = TOKEN) -> None:
        reply = await self.post("/register", {"session": session, "token": token})
        assert reply.code == 200, reply.body

    async def events(self, session: str = "sess", query: str = "", token: str = TOKEN, **headers: str) -> SSEClient:
        stream = await SSEClient.connect(f"{self.base}/{session}/events?token={token}{query}", headers=headers)
        self.streams.append(stream)
        return stream

    async def poll(self, session: str = "sess", query: str = "", token: str = TOKEN) -> Reply:
        return await self.get(f"/{session}/poll?token={token}{query}")


_prefixes = itertools.count()


def redis_flags(url: str, prefix: str | None = None) -> dict[str, str]:
    """The flags of a wing on Redis; a fresh key prefix isolates each test (or each test's instances)."""
    return {"redis": url, "redis-prefix": prefix or f"t{os.getpid()}-{next(_prefixes)}:"}


async def wait_ready(service: McpService, timeout: float = TIMEOUT) -> None:
    """With Redis: until the pool is connected and the bus subscribed (a fresh process's startup)."""
    bus = service.broker.bus
    if not isinstance(bus, RedisMcpBus):
        return
    waited = 0.0
    while not bus.redis.connected:
        if waited > timeout:
            raise AssertionError("Redis pool did not connect")
        await deferLater(reactor, 0.01, lambda: None)  # polling a connection that is being made
        waited += 0.01
    await bus.ready


async def close_redis(service: McpService) -> None:
    """Close the wing's Redis client (the process's root service would, at stop)."""
    bus = service.broker.bus
    if isinstance(bus, RedisMcpBus):
        await bus.stop()
        await bus.redis.close()


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
