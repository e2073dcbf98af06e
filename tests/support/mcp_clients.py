"""MCP clients: a page simulated over the tunnel protocol, and real MCP clients run as subprocesses.

The page reads the session's C{inbound} direction over SSE and answers on C{outbox}, as the browser
hook does; it hosts the tools of C{test_interop} and, while serving a call, reports progress, then
announces C{notifications/tools/list_changed} and pings the clients (recording their replies).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.utils import getProcessOutputAndValue

from tests.support.http import HttpClient, Reply
from tests.support.mcp import TOKEN, McpRelayCase, disconnect
from tests.support.sse import SSEClient

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / "tests" / "mcp" / "clients"
MODERN = "2026-07-28"
PAGE_TOOLS = [{"name": "whiteboard_add_sticky", "description": "add a sticky", "inputSchema": {"type": "object"}}]


def page_answer(message: dict[str, Any]) -> dict[str, Any] | None:
    """What the browser-hosted MicroMcpServer answers (None for notifications and presence)."""
    method = message.get("method")
    if "id" not in message:
        return None
    if method == "initialize":
        result: Any = {
            "protocolVersion": message["params"]["protocolVersion"],
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "page", "version": "1"},
        }
    elif method == "tools/list":
        result = {"tools": PAGE_TOOLS}
    elif method == "tools/call":
        result = {"content": [{"type": "text", "text": json.dumps(message["params"])}]}
    else:
        return {"jsonrpc": "2.0", "id": message["id"], "error": {"code": -32601, "message": "no such method"}}
    return {"jsonrpc": "2.0", "id": message["id"], "result": result}


class RemoteRelay:
    """What L{SimulatedPage} needs of a relay it does not run in-process (a C{twistd} child)."""

    def __init__(self, case: Any, base: str) -> None:
        self.case = case
        self.base = base
        self.http = HttpClient(case, base)

    async def events(self, session: str, query: str = "") -> SSEClient:
        stream = await SSEClient.connect(f"{self.base}/{session}/events?token={TOKEN}{query}")
        self.case.addCleanup(disconnect, stream)
        return stream

    async def post(self, path: str, raw: bytes, **headers: str) -> Reply:
        return await self.http.post(path, raw, **headers)


def compact(message: Any) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


class PageScript:
    """What the simulated page answers, apart from how it reads and sends: L{answer} takes one
    message the page has read and returns the messages it sends back, in order (the loopback
    L{SimulatedPage} and the in-memory L{tests.support.inmemory.InMemoryPage} both run this one).

    @ivar seen: every message read, in order. @ivar pings: clients' answers to the page's pings.
    """

    def __init__(self, modern: bool = False, silent: frozenset[str] = frozenset()) -> None:
        self.modern = modern
        self.silent = silent  # methods it never answers
        self.seen: list[dict[str, Any]] = []
        self.pings = 0
        self.listen_id: Any = None

    def answer(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        self.seen.append(message)
        method = message.get("method")
        if method is None and str(message.get("id", "")).startswith("page-ping"):
            # A client answered the ping: now announce the change it waits for before closing.
            self.pings += 1
            return [{"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}]
        if method in self.silent or "id" not in message or method is None:
            return []
        if method == "server/discover" and self.modern:
            return [{"jsonrpc": "2.0", "id": message["id"], "result": {
                "supportedVersions": [MODERN], "capabilities": {"tools": {"listChanged": True}},
                "serverInfo": {"name": "page", "version": "1"}}}]
        if method == "subscriptions/listen":
            self.listen_id = message["id"]
            return [{"jsonrpc": "2.0", "method": "notifications/subscriptions/acknowledged",
                     "params": {"_meta": {"io.modelcontextprotocol/subscriptionId": message["id"]},
                                "notifications": {"toolsListChanged": True}}}]
        if method == "tools/list" and self.modern:
            return [{"jsonrpc": "2.0", "id": message["id"], "result": {
                "tools": [{"name": "whiteboard_add_sticky", "inputSchema": {"type": "object"}}],
                "resultType": "complete", "ttlMs": 0, "cacheScope": "private"}}]
        sent = []
        if method == "tools/call":
            token = ((message.get("params") or {}).get("_meta") or {}).get("progressToken")
            if token is not None:
                sent.append({"jsonrpc": "2.0", "method": "notifications/progress",
                             "params": {"progressToken": token, "progress": 1, "total": 2, "message": "half"}})
        reply = page_answer(message)
        if reply is not None and self.modern and "result" in reply:
            reply["result"]["resultType"] = "complete"
        if reply is not None:
            sent.append(reply)
        if method == "tools/call":
            if self.modern:
                if self.listen_id is not None:
                    sent.append({"jsonrpc": "2.0", "method": "notifications/tools/list_changed",
                                 "params": {"_meta": {"io.modelcontextprotocol/subscriptionId": self.listen_id}}})
            else:
                sent.append({"jsonrpc": "2.0", "id": f"page-ping-{len(self.seen)}", "method": "ping"})
        return sent

    def methods(self) -> list[str]:
        return [m["method"] for m in self.seen if "method" in m]


class SimulatedPage:
    """The page of session C{session}: answers MCP (L{PageScript}) over the tunnel's inbound SSE and
    outbox, on a relay behind a socket."""

    def __init__(self, case: McpRelayCase | RemoteRelay, session: str, modern: bool = False, silent: frozenset[str] = frozenset()) -> None:
        self.case = case
        self.session = session
        self.script = PageScript(modern, silent)
        self.seen = self.script.seen
        self.loop: Deferred[None] | None = None
        self._waiters: list[tuple[int, Deferred[None]]] = []

    @property
    def pings(self) -> int:
        return self.script.pings

    @property
    def listen_id(self) -> Any:
        """The id of the C{subscriptions/listen} request the page acknowledged (C{None} before one)."""
        return self.script.listen_id

    async def start(self) -> None:
        stream = await self.case.events(self.session, "&direction=inbound")
        assert stream.code == 200
        self.stream = stream

        async def run() -> None:
            while True:
                msg = await stream.next(timeout=60)
                if msg is None:
                    return
                if msg.event == "mcp":
                    await self.handle(json.loads(msg.data or ""))

        self.loop = Deferred.fromCoroutine(run()).addErrback(lambda f: None)

    async def send(self, message: dict[str, Any]) -> None:
        reply = await self.case.post(f"/{self.session}/outbox?token={TOKEN}", raw=compact(message))
        assert reply.code == 200, reply.body

    async def handle(self, message: dict[str, Any]) -> None:
        answers = self.script.answer(message)
        for waiter in [w for w in self._waiters if w[0] <= len(self.seen)]:
            self._waiters.remove(waiter)
            waiter[1].callback(None)
        for answer in answers:
            await self.send(answer)

    async def next_seen(self, count: int, timeout: float = 10) -> dict[str, Any]:
        """The page's C{count}-th message, once it has read it."""
        if len(self.seen) < count:
            d: Deferred[None] = Deferred()
            self._waiters.append((count, d))
            d.addTimeout(timeout, reactor)
            await d
        return self.seen[count - 1]

    def methods(self) -> list[str]:
        return self.script.methods()


async def run_client(script: str, *args: str, timeout: float = 60) -> tuple[int, dict[str, Any] | None, str]:
    """Run C{tests/mcp/clients/<script>} with this Python; (exit code, its JSON line, its stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    d = getProcessOutputAndValue(sys.executable, [str(CLIENTS / script), *args], env=env, reactor=reactor)
    d.addTimeout(timeout, reactor)
    out, err, code = await d
    lines = [line for line in out.decode().splitlines() if line.startswith("{")]
    return code, (json.loads(lines[-1]) if lines else None), err.decode(errors="replace")
