"""The demo page: served at C{{prefix}/demo} (its routes in memory), it registers a session and hosts MCP tools in a real
headless Chromium tab; the official Python SDK connects to it by URL and token (acceptance 1). The
session lasts: through a reload and a relayd restart (issue 26, acceptance 2).

Skips locally when Chromium, chromedriver or selenium is missing; fails instead under C{CI=true}.
"""

from __future__ import annotations

import json
import time
from typing import Any

from twisted.internet import reactor, threads
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from tests.support.browser import require_browser, start_browser, wait_for
from tests.support.inmemory import InMemoryMcpCase
from tests.support.mcp import McpRelayCase, disconnect
from tests.support.mcp_clients import run_client
from tests.support.sse import SSEClient
from tests.support.wing import Wing


class DemoServed(InMemoryMcpCase):
    def test_demo_page_is_served_on_loopback_by_default(self) -> None:
        reply = self.get("/demo")
        assert reply.code == 200
        assert reply.header("content-type") == "text/html; charset=utf-8"
        assert b"claude mcp add --transport http" in reply.body
        assert self.request("POST", "/demo").code == 405


class DemoOff(InMemoryMcpCase):
    flags = {"no-mcp-demo": True}

    def test_no_mcp_demo_turns_it_off(self) -> None:
        assert self.get("/demo").code == 404
        # The flag is a real setting that did this (not an unknown key that was ignored).
        assert self.wing.service.resource.demo is None


class DemoInChromium(McpRelayCase):
    timeout = 180

    async def setUp(self) -> None:  # type: ignore[override]
        require_browser()
        await super().setUp()
        self.driver = await start_browser(self)

    async def test_python_sdk_uses_the_tabs_whiteboard(self) -> None:
        await threads.deferToThread(self.driver.get, f"{self.base}/demo")
        demo = await threads.deferToThread(
            wait_for, self.driver, "return window.demo && window.demo.ready", "return window.demo"
        )
        assert demo["url"] == f"{self.base}/{demo['session']}/mcp"
        shown = await threads.deferToThread(self.driver.execute_script, "return document.getElementById('cmd-claude').textContent")
        assert shown.startswith(f"claude mcp add --transport http relayd-demo {demo['url']}")
        code, out, err = await run_client("sdk_client.py", "session", demo["url"], demo["token"], "whiteboard_add_note")
        assert code == 0 and out is not None, err[-4000:]
        assert out["version"] == "2025-11-25"
        assert out["tools"] == ["whiteboard_add_note", "whiteboard_list_notes"]
        assert out["result"] == ["Pinned note 1: hello from session"]
        assert out["progress"] == [[1.0, 2.0, "pinning the note"]] and out["list_changed"] == 1
        demo = await threads.deferToThread(wait_for, self.driver, "return window.demo.pongs >= 1", "return window.demo")
        assert demo["notes"] == ["hello from session"] and demo["errors"] == []
        notes = await threads.deferToThread(
            self.driver.execute_script, "return [...document.querySelectorAll('.note')].map(n => n.textContent)"
        )
        assert notes == ["hello from session"]
        # A legacy (2024-11-05) client clears the board: the tool list changes back, it is told.
        sse_url = demo["url"][: -len("/mcp")] + "/sse"
        code, out, err = await run_client("sdk_client.py", "sse", sse_url, demo["token"], "whiteboard_clear")
        assert code == 0 and out is not None, err[-4000:]
        assert out["version"] == "2025-11-25"  # the transport is the 2024-11-05 one; the version the page's choice
        assert out["tools"] == ["whiteboard_add_note", "whiteboard_list_notes", "whiteboard_clear"]
        assert out["result"] == ["The whiteboard is empty."] and out["list_changed"] == 1
        demo = await threads.deferToThread(wait_for, self.driver, "return window.demo.pongs >= 2", "return window.demo")
        assert demo["notes"] == [] and demo["errors"] == []
        # A 2026-07-28 client: stateless requests, the change on its subscriptions/listen stream.
        code, out, err = await run_client("sdk_client.py", "modern", demo["url"], demo["token"], "whiteboard_add_note")
        assert code == 0 and out is not None, err[-4000:]
        assert out["version"] == "2026-07-28"
        assert out["result"] == ["Pinned note 1: hello from modern"]
        assert out["progress"] == [[1.0, 2.0, "pinning the note"]]
        assert out["list_changed"] == 1 and out["event"] == "ToolsListChanged"
        # The SDK's default Client(url): it discovers the page and speaks 2026-07-28 with it.
        code, out, err = await run_client("sdk_client.py", "discover", demo["url"], demo["token"])
        assert code == 0 and out is not None, err[-4000:]
        assert out["version"] == "2026-07-28"
        assert out["tools"] == ["whiteboard_add_note", "whiteboard_list_notes", "whiteboard_clear"], json.dumps(out)
        demo = await threads.deferToThread(wait_for, self.driver, "return window.demo", "return window.demo")
        assert demo["notes"] == ["hello from modern"] and demo["errors"] == []


class DemoPageCase(McpRelayCase):
    """The demo page loaded in headless Chromium and ready (C{self.demo}: its C{window.demo})."""

    timeout = 180

    async def setUp(self) -> None:  # type: ignore[override]
        require_browser()
        await super().setUp()
        self.driver = await start_browser(self)
        await threads.deferToThread(self.driver.get, f"{self.base}/demo")
        self.demo = await self.page_state("return window.demo && window.demo.ready")

    async def page_state(self, until: str) -> Any:
        return await threads.deferToThread(wait_for, self.driver, until, "return window.demo")

    async def restart_relay(self) -> None:
        """Stop relayd (its memory store forgets every session) and start it again on the same port."""
        port = self.port
        await self.wing.stop()
        self.wing = await Wing.start("mcp", {"mcp-reap-interval-ms": "0", "mcp-listen": [f"tcp:{port}:interface=127.0.0.1"]})
        self.tunnel = self.wing.service.tunnel
        assert await self.tunnel.store.get_session(self.demo["session"]) is None


class DemoSessionLasts(DemoPageCase):
    """Issue 26, acceptance 2: the page keeps its session (id and token in localStorage) across a
    reload and a relayd restart, re-registering it within 5 s; a client's saved URL and token keep
    working; a call to a session whose page is gone fails within 2 s; copy buttons, an Inspector line."""

    async def test_a_reload_keeps_the_session_url_and_token(self) -> None:
        await threads.deferToThread(self.driver.refresh)
        again = await self.page_state("return window.demo && window.demo.ready")
        assert (again["session"], again["token"], again["url"]) == (self.demo["session"], self.demo["token"], self.demo["url"])
        shown = await threads.deferToThread(self.driver.execute_script, "return document.getElementById('mcp-url').textContent")
        assert shown == self.demo["url"]

    async def test_after_a_relayd_restart_the_page_comes_back_and_the_old_url_works(self) -> None:
        await self.restart_relay()
        started = time.monotonic()
        again = await self.page_state("return window.demo.ready && window.demo.registrations >= 2")
        assert time.monotonic() - started < 5.0, time.monotonic() - started
        assert (again["session"], again["token"]) == (self.demo["session"], self.demo["token"])
        assert await self.tunnel.store.get_session(self.demo["session"]) is not None
        # A client that saved the URL and token before the restart calls a tool with them.
        code, out, err = await run_client("sdk_client.py", "modern", self.demo["url"], self.demo["token"], "whiteboard_add_note")
        assert code == 0 and out is not None, err[-4000:]
        assert out["result"] == ["Pinned note 1: hello from modern"]

    async def test_a_call_to_a_session_whose_page_is_gone_fails_within_2_seconds(self) -> None:
        await threads.deferToThread(self.driver.get, "about:blank")  # the tab leaves the page
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
        started = time.monotonic()
        reply = await self.post(f"/{self.demo['session']}/mcp", init, authorization=f"Bearer {self.demo['token']}",
                                accept="application/json, text/event-stream")
        assert time.monotonic() - started < 2.0, time.monotonic() - started
        error = reply.json()["error"]
        assert error["code"] == -32005 and "no page is hosting this session" in error["message"], reply.body

    async def test_the_new_session_button_ends_the_kept_session_and_keeps_a_new_one(self) -> None:
        await threads.deferToThread(self.driver.execute_script, "document.getElementById('renew').click()")
        renewed = await self.page_state(f"return window.demo.ready && window.demo.session !== {json.dumps(self.demo['session'])}")
        assert renewed["token"] != self.demo["token"]
        while await self.tunnel.store.get_session(self.demo["session"]) is not None:  # (unregistered)
            await deferLater(reactor, 0.02, lambda: None)
        await threads.deferToThread(self.driver.refresh)
        again = await self.page_state("return window.demo && window.demo.ready")
        assert (again["session"], again["token"]) == (renewed["session"], renewed["token"])

    async def test_a_call_refused_while_the_page_was_gone_is_not_run_when_it_comes_back(self) -> None:
        await threads.deferToThread(self.driver.get, "about:blank")
        while await self.tunnel.store.subscribers(self.demo["session"], "inbound"):
            await deferLater(reactor, 0.02, lambda: None)
        reply = await self.add_note("too late")
        assert reply.json()["error"]["code"] == -32005, reply.body
        # The page comes back: the request (held for the first reader) and its cancellation reach it.
        await threads.deferToThread(self.driver.get, f"{self.base}/demo")
        back = await self.page_state("return window.demo && window.demo.ready")
        assert back["session"] == self.demo["session"]
        # A call made now runs after the held one (in order): only it pins a note.
        reply = await self.add_note("in time")
        assert reply.json()["result"]["content"][0]["text"] == "Pinned note 1: in time", reply.body
        back = await self.page_state("return true")
        assert (back["notes"], back["calls"], back["errors"]) == (["in time"], 1, [])

    async def add_note(self, text: str) -> Any:
        """A 2026-07-28 tools/call (one stateless request) of whiteboard_add_note."""
        call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "whiteboard_add_note", "arguments": {"text": text},
                           "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}}}
        headers = {"mcp-protocol-version": "2026-07-28", "mcp-method": "tools/call", "mcp-name": "whiteboard_add_note"}
        return await self.post(f"/{self.demo['session']}/mcp", call, authorization=f"Bearer {self.demo['token']}",
                               accept="application/json", **headers)

    async def test_copy_buttons_and_an_inspector_line(self) -> None:
        inspector = await threads.deferToThread(
            self.driver.execute_script, "return document.getElementById('cmd-inspector').textContent"
        )
        assert inspector == (
            f"npx @modelcontextprotocol/inspector --cli '{self.demo['url']}?token={self.demo['token']}' "
            "--transport http --method tools/list"
        )
        for block in ("mcp-url", "mcp-token", "cmd-claude", "cmd-json", "cmd-python", "cmd-inspector"):
            copied = await threads.deferToThread(
                self.driver.execute_script,
                f"document.getElementById('copy-{block}').click(); "
                f"return [document.getElementById('{block}').textContent];",
            )
            demo = await self.page_state(f"return window.demo.copied === {json.dumps(copied[0])}")
            assert demo["copied"] == copied[0]


class DemoCountsConnectedClients(McpRelayCase):
    """Issue 26: the page's "clients connected" counts a 2026-07-28 client (the Python SDK's default)
    while it calls tools, and no longer counts a client that exited without ending its session (as
    the Inspector does): the clients that answer its pings, and 2026-07-28 clients active lately."""

    timeout = 180

    async def setUp(self) -> None:  # type: ignore[override]
        require_browser()
        await super().setUp()
        self.driver = await start_browser(self)
        await threads.deferToThread(self.driver.get, f"{self.base}/demo")
        self.demo = await self.shown("window.demo && window.demo.ready")
        await threads.deferToThread(self.driver.execute_script, "window.demo.pingEvery = 300")

    async def shown(self, until: str) -> Any:
        return await threads.deferToThread(wait_for, self.driver, f"return {until}", "return window.demo")

    async def counter(self) -> str:
        text: str = await threads.deferToThread(
            self.driver.execute_script, "return document.getElementById('clients').textContent"
        )
        return text

    async def test_a_2026_07_28_client_counts_while_it_calls_tools(self) -> None:
        code, out, err = await run_client("sdk_client.py", "modern", self.demo["url"], self.demo["token"], "whiteboard_add_note")
        assert code == 0 and out is not None, err[-4000:]
        assert await self.counter() == "1"

    async def test_a_client_that_exits_without_ending_its_session_stops_counting(self) -> None:
        session, token = self.demo["session"], self.demo["token"]
        auth = {"authorization": f"Bearer {token}", "accept": "application/json, text/event-stream"}
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
        reply = await self.post(f"/{session}/mcp", init, **auth)
        sid = reply.header("mcp-session-id")
        assert reply.code == 200 and sid, reply.body
        stream = await SSEClient.connect(f"{self.base}/{session}/mcp", headers={**auth, "mcp-session-id": sid})
        self.streams.append(stream)

        async def answer_pings() -> None:  # what every MCP client does on its stream
            while (msg := await stream.next(30)) is not None:
                message = json.loads(msg.data or "null") if msg.event == "message" else None
                if isinstance(message, dict) and message.get("method") == "ping":
                    await self.post(f"/{session}/mcp", {"jsonrpc": "2.0", "id": message["id"], "result": {}},
                                    **auth, **{"mcp-session-id": sid})

        answering = Deferred.fromCoroutine(answer_pings()).addErrback(lambda f: None)
        await self.shown("document.getElementById('clients').textContent === '1'")
        await disconnect(stream)  # the client exits: its stream closes, its session is never DELETEd
        await answering
        await self.shown("document.getElementById('clients').textContent === '0'")


class DemoTabs(DemoPageCase):
    """One tab hosts the kept session; a second one hosts its own (two pages answering one session
    would both act on every call), and a stranger cannot register the kept session's id."""

    async def test_a_second_tab_hosts_a_session_of_its_own(self) -> None:
        first = await threads.deferToThread(lambda: self.driver.current_window_handle)
        await threads.deferToThread(self.driver.switch_to.new_window, "tab")
        await threads.deferToThread(self.driver.get, f"{self.base}/demo")
        second = await self.page_state("return window.demo && window.demo.ready")
        assert second["session"] != self.demo["session"] and second["kept"] is False
        # The first tab keeps the kept pair: reloaded, it is the same session.
        await threads.deferToThread(self.driver.close)
        await threads.deferToThread(self.driver.switch_to.window, first)
        await threads.deferToThread(self.driver.refresh)
        again = await self.page_state("return window.demo && window.demo.ready")
        assert (again["session"], again["token"], again["kept"]) == (self.demo["session"], self.demo["token"], True)

    async def test_a_stranger_cannot_register_the_session_by_its_id(self) -> None:
        reply = await self.post("/register", {"session": self.demo["session"], "token": "a-strangers-token-0123456789"})
        assert (reply.code, reply.json()) == (401, {"error": "session_taken"})
