"""Acceptance 3: the relay driven exactly as its real clients drive it (mcp-relay.md §10).

Agents: the single-file clients (connect.py & co., §10.3: SSE outbound, 1 s pause, initialize,
notifications/initialized, tools/list, tools/call) and the npx long-poll CLI (§10.2: a first poll with
wait=0, then wait=20000 with the adopted subscriber). Pages: a browser page simulated over inbound SSE
(EventSource) and over inbound poll (fancy-cf-relay's long-poll mode, §10.4).
"""

from __future__ import annotations

import json
import re
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredQueue
from twisted.internet.task import deferLater

from tests.support.mcp import TOKEN, McpRelayCase
from tests.support.mcp_clients import PAGE_TOOLS, page_answer

SESSION = "Ab3_x9Zq"  # 8-char base64url, as useCoBrowseSession mints


class InteropCase(McpRelayCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        # Registered before the relay's own cleanup, so it runs after it: the relay's drain answers the
        # parked polls, and then every client loop is waited for (no request outlives the test).
        self.loops: list[Deferred[None]] = []
        self.addCleanup(self._await_loops)
        await super().setUp()
        await self.register(SESSION)
        self.page_seen: list[dict[str, Any]] = []
        self.stopped = False

    async def _await_loops(self) -> None:
        self.stopped = True
        for loop in self.loops:
            await loop

    def _spawn(self, coro: Any) -> None:
        self.loops.append(Deferred.fromCoroutine(coro).addErrback(lambda f: None))

    # pages ---------------------------------------------------------------------------------------

    async def _answer(self, raw: str) -> None:
        message = json.loads(raw)
        self.page_seen.append(message)
        reply = page_answer(message)
        if reply is not None:
            # fancy-cf-relay / SseRelayTransport: POST outbox with content-type JSON.
            r = await self.post(f"/{SESSION}/outbox?token={TOKEN}", raw=json.dumps(reply, separators=(",", ":")).encode())
            assert r.code == 200

    async def page_over_sse(self) -> None:
        stream = await self.events(SESSION, "&direction=inbound")
        assert stream.code == 200

        async def run() -> None:
            while True:
                msg = await stream.next(timeout=60)
                if msg is None:
                    return
                if msg.event == "mcp":
                    await self._answer(msg.data or "")

        self._spawn(run())

    async def page_over_poll(self) -> None:
        first = await self.get(f"/{SESSION}/poll?token={TOKEN}&direction=inbound&wait=0")
        assert first.code == 200
        subscriber = first.json()["subscriber"]

        async def run() -> None:
            sub = subscriber
            while not self.stopped:
                reply = await self.request(
                    "GET", f"/{SESSION}/poll?token={TOKEN}&direction=inbound&wait=20000&subscriber={sub}",
                    headers={"cache-control": "no-store"},
                )
                if reply.code != 200:
                    return
                sub = reply.json()["subscriber"]
                for raw in reply.json()["frames"]:
                    await self._answer(raw)

        self._spawn(run())

    # agents --------------------------------------------------------------------------------------

    def _script(self, client_name: str) -> list[dict[str, Any]]:
        init = {
            "jsonrpc": "2.0",
            "id": 1,
            "method": "initialize",
            "params": {
                "protocolVersion": "2025-06-18",
                "capabilities": {},
                "clientInfo": {"name": client_name, "version": "1" if client_name.startswith("connect") else "0.1.0"},
            },
        }
        return [
            init,
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
            {"jsonrpc": "2.0", "id": 3, "method": "tools/call",
             "params": {"name": "whiteboard_add_sticky", "arguments": {"x": 300, "y": 200, "text": "hi"}}},
        ]

    async def _send(self, frame: dict[str, Any]) -> None:
        body = json.dumps(frame, separators=(",", ":")).encode()  # compact, as every client sends
        await self.post(f"/{SESSION}/inbox?token={TOKEN}", raw=body)

    async def agent_over_sse(self) -> dict[int, Any]:
        """connect.py: open events outbound, sleep 1 s, then the handshake; match ids on data: lines."""
        stream = await self.events(SESSION, "&direction=outbound")
        assert stream.code == 200
        await deferLater(reactor, 1.0, lambda: None)  # the client's own pause, part of its behaviour
        answers: dict[int, Any] = {}
        for frame in self._script("connect.py"):
            await self._send(frame)
            if "id" not in frame:
                continue
            while frame["id"] not in answers:
                msg = await stream.next(timeout=15)
                assert msg is not None, "stream ended"
                if msg.event == "mcp":
                    data = json.loads(msg.data or "")
                    if "id" in data:
                        answers[data["id"]] = data
        # connect.sh greps the raw text for "id":N without spaces: frames must pass compact.
        assert re.search(rb'"id":1[,}]', stream.received) and re.search(rb'"id":3[,}]', stream.received)
        return answers

    async def agent_over_poll(self) -> dict[int, Any]:
        """The npx CLI: poll wait=0 (no subscriber) first, then wait=20000 adopting the subscriber."""
        headers = {"accept": "application/json", "cache-control": "no-cache"}
        first = await self.request("GET", f"/{SESSION}/poll?token={TOKEN}&direction=outbound&wait=0", headers=headers)
        assert first.code == 200
        state = {"sub": first.json()["subscriber"]}
        inbox: DeferredQueue[dict[str, Any]] = DeferredQueue()
        for raw in first.json()["frames"]:
            inbox.put(json.loads(raw) if isinstance(raw, str) else raw)

        async def receive() -> None:
            while not self.stopped:
                url = f"/{SESSION}/poll?token={TOKEN}&direction=outbound&wait=20000&subscriber={state['sub']}"
                reply = await self.request("GET", url, headers=headers)
                if reply.code != 200:
                    return
                state["sub"] = reply.json()["subscriber"]
                for raw in reply.json()["frames"]:
                    inbox.put(json.loads(raw) if isinstance(raw, str) else raw)

        self._spawn(receive())
        answers: dict[int, Any] = {}
        for frame in self._script("mcp-relay-client"):
            await self._send(frame)
            if "id" not in frame:
                continue
            while frame["id"] not in answers:
                d = inbox.get()
                d.addTimeout(15, reactor)
                data = await d
                if "id" in data:
                    answers[data["id"]] = data
        assert state["sub"] == first.json()["subscriber"]  # the adopted subscriber stayed the same
        return answers

    def check(self, answers: dict[int, Any], client_name: str) -> None:
        self.stopped = True
        assert answers[1]["result"]["protocolVersion"] == "2025-06-18"
        assert answers[2]["result"]["tools"] == PAGE_TOOLS
        text = json.loads(answers[3]["result"]["content"][0]["text"])
        assert text == {"name": "whiteboard_add_sticky", "arguments": {"x": 300, "y": 200, "text": "hi"}}
        methods = [m.get("method") for m in self.page_seen]
        assert methods[0] == "notifications/peer_joined"
        assert methods[1:] == ["initialize", "notifications/initialized", "tools/list", "tools/call"]
        assert self.page_seen[1]["params"]["clientInfo"]["name"] == client_name


class SseAgentSsePage(InteropCase):
    async def test_connect_py_against_sse_page(self) -> None:
        await self.page_over_sse()
        self.check(await self.agent_over_sse(), "connect.py")


class SseAgentPollPage(InteropCase):
    async def test_connect_py_against_polling_page(self) -> None:
        await self.page_over_poll()
        self.check(await self.agent_over_sse(), "connect.py")


class PollAgentSsePage(InteropCase):
    async def test_npx_cli_against_sse_page(self) -> None:
        await self.page_over_sse()
        self.check(await self.agent_over_poll(), "mcp-relay-client")


class PollAgentPollPage(InteropCase):
    async def test_npx_cli_against_polling_page(self) -> None:
        await self.page_over_poll()
        self.check(await self.agent_over_poll(), "mcp-relay-client")
