"""The demo page: served at C{{prefix}/demo} (its routes in memory), it registers a session and hosts MCP tools in a real
headless Chromium tab; the official Python SDK connects to it by URL and token (acceptance 1).

Skips locally when Chromium, chromedriver or selenium is missing; fails instead under C{CI=true}.
"""

from __future__ import annotations

import json

from twisted.internet import threads

from tests.support.browser import require_browser, start_browser, wait_for
from tests.support.inmemory import InMemoryMcpCase
from tests.support.mcp import McpRelayCase
from tests.support.mcp_clients import run_client


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
