"""Acceptance 2: the official TypeScript SDK (over Streamable HTTP and legacy SSE) and the MCP
Inspector's CLI mode list and call tools through relayd's standard endpoint.

The npm packages are installed by C{.ci/install-node.sh} into C{tests/mcp/clients/node_modules}
(pinned by its package-lock.json). Skips locally without them; fails instead under C{CI=true}.
"""

from __future__ import annotations

import json
import os
import shutil

from twisted.internet import reactor
from twisted.internet.utils import getProcessOutputAndValue

from tests.support.mcp import TOKEN, McpRelayCase
from tests.support.mcp_clients import CLIENTS, SimulatedPage
from tests.support.skips import missing

SESSION = "nodepage"
NODE = shutil.which("node") or "/usr/bin/node"
MODULES = CLIENTS / "node_modules"
INSPECTOR = MODULES / "@modelcontextprotocol" / "inspector"


def _missing() -> str | None:
    if not os.path.exists(NODE):
        return "node is not installed"
    if not (MODULES / "@modelcontextprotocol" / "sdk").is_dir() or not INSPECTOR.is_dir():
        return "npm packages not installed (bash .ci/install-node.sh)"
    return None


async def run_node(*args: str, timeout: float = 60) -> tuple[int, str, str]:
    d = getProcessOutputAndValue(NODE, list(args), env=dict(os.environ), path=str(CLIENTS), reactor=reactor)
    d.addTimeout(timeout, reactor)
    out, err, code = await d
    return code, out.decode(errors="replace"), err.decode(errors="replace")


class NodeCase(McpRelayCase):
    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]
        absent = _missing()
        if absent is not None:
            missing(absent)
        await super().setUp()
        await self.register(SESSION)
        self.page = SimulatedPage(self, SESSION)
        await self.page.start()

    async def ts_client(self, mode: str, route: str) -> dict:
        code, out, err = await run_node(str(CLIENTS / "ts_client.mjs"), mode, f"{self.base}/{SESSION}/{route}", TOKEN)
        assert code == 0, err[-4000:] + out[-2000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["tools"] == ["whiteboard_add_sticky"]
        assert json.loads(result["result"][0])["arguments"] == {"text": f"hello from ts {mode}"}
        if mode == "sse":
            # The TS SDK dispatches a notification a microtask after it reads it, a response at once:
            # when both arrive in one read (a loaded machine), it drops the progress as "unknown
            # token" (its own race, not the relay's: the relay wrote them in order, in two writes).
            assert result["progress"] in ([], [[1, 2, "half"]]), result
        else:
            assert result["progress"] == [[1, 2, "half"]], result
        assert result["list_changed"] >= 1
        assert self.page.pings >= 1
        return result


class TypeScriptSdk(NodeCase):
    async def test_streamable_http(self) -> None:
        await self.ts_client("http", "mcp")
        assert self.page.methods()[-1] == "notifications/peer_left"  # terminateSession is DELETE

    async def test_legacy_sse(self) -> None:
        await self.ts_client("sse", "sse")


class InspectorCli(NodeCase):
    async def inspector(self, route: str, *method: str) -> str:
        cli = str(MODULES / ".bin" / "mcp-inspector")
        code, out, err = await run_node(
            cli, "--cli", f"{self.base}/{SESSION}/{route}", "--header", f"Authorization: Bearer {TOKEN}", *method
        )
        assert code == 0, err[-4000:] + out[-2000:]
        return out

    async def test_list_and_call_over_http_and_sse(self) -> None:
        for route in ("mcp", "sse"):
            listed = await self.inspector(route, "--method", "tools/list")
            assert "whiteboard_add_sticky" in listed
            called = await self.inspector(
                route, "--method", "tools/call", "--tool-name", "whiteboard_add_sticky", "--tool-arg", "text=inspected"
            )
            assert "inspected" in called, called
