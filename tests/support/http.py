"""A small treq client for one relay's HTTP listener, and the buffered reply it returns."""

from __future__ import annotations

import json
from typing import Any, Mapping

import treq
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

TIMEOUT = 10.0


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


class HttpClient:
    """Requests to paths below C{base} (no connection reuse: every request is its own exchange);
    its pool is closed at C{case}'s cleanup."""

    def __init__(self, case: TestCase, base: str, timeout: float = TIMEOUT) -> None:
        self.base = base
        self.timeout = timeout
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        case.addCleanup(self.pool.closeCachedConnections)

    @classmethod
    def on_port(cls, case: TestCase, port: int) -> HttpClient:
        """A client for C{http://127.0.0.1:PORT}."""
        return cls(case, f"http://127.0.0.1:{port}")

    async def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
    ) -> Reply:
        """C{method} on C{base + path} (or on C{path} itself when it is a whole URL)."""
        url = path if path.startswith("http") else self.base + path
        d = treq.request(method, url, data=body, headers=dict(headers or {}), pool=self.pool)
        d.addTimeout(self.timeout if timeout is None else timeout, reactor)
        response = await d
        return Reply(response.code, response.headers, await treq.content(response))

    async def post(self, path: str, body: bytes, **headers: str) -> Reply:
        """POST a JSON body (already encoded)."""
        return await self.request("POST", path, body, {"content-type": "application/json", **headers})

    async def get(self, path: str, **headers: str) -> Reply:
        return await self.request("GET", path, None, headers)
