"""Acceptance 1: the official Python MCP SDK connects to a tunnel session by URL and token alone."""

from __future__ import annotations

from tests.support.mcp import TOKEN, McpRelayCase
from tests.support.mcp_clients import SimulatedPage, run_client

SESSION = "sdkpage1"


class PythonSdkCase(McpRelayCase):
    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        await self.register(SESSION)
        self.page = SimulatedPage(self, SESSION)
        await self.page.start()

    async def run_mode(self, mode: str, route: str = "mcp") -> dict:
        code, out, err = await run_client("sdk_client.py", mode, f"{self.base}/{SESSION}/{route}", TOKEN)
        assert code == 0 and out is not None, err[-4000:]
        assert out["tools"] == ["whiteboard_add_sticky"]
        assert "hello from " + mode in out["result"][0]
        assert out["progress"] == [[1.0, 2.0, "half"]], out
        assert out["list_changed"] >= 1
        return out

    def check_page(self) -> None:
        methods = [m for m in self.page.methods() if m != "server/discover"]
        assert methods[0] == "notifications/peer_joined", methods
        assert "initialize" in methods and "tools/list" in methods and "tools/call" in methods
        assert self.page.pings >= 1, self.page.seen  # the client answered the page's ping
        assert methods[-1] == "notifications/peer_left", methods


class DefaultClient(PythonSdkCase):
    async def test_client_url_probes_discover_then_initializes(self) -> None:
        out = await self.run_mode("client")
        assert out["version"] == "2025-11-25"
        assert self.page.methods()[:2] == ["server/discover", "notifications/peer_joined"]
        self.check_page()


class StreamableSession(PythonSdkCase):
    async def test_client_session_over_streamable_http(self) -> None:
        out = await self.run_mode("session")
        assert out["version"] == "2025-11-25"
        self.check_page()


class LegacySse(PythonSdkCase):
    async def test_client_session_over_legacy_sse(self) -> None:
        await self.run_mode("sse", route="sse")
        self.check_page()


class ModernPage(PythonSdkCase):
    """A page that speaks 2026-07-28: the SDK's default client discovers it and stays stateless."""

    async def setUp(self) -> None:  # type: ignore[override]
        await McpRelayCase.setUp(self)
        await self.register(SESSION)
        self.page = SimulatedPage(self, SESSION, modern=True)
        await self.page.start()

    async def test_pinned_2026_client_with_listen_stream(self) -> None:
        code, out, err = await run_client("sdk_client.py", "modern", f"{self.base}/{SESSION}/mcp", TOKEN)
        assert code == 0 and out is not None, err[-4000:]
        assert out["version"] == "2026-07-28"
        assert out["tools"] == ["whiteboard_add_sticky"]
        assert out["progress"] == [[1.0, 2.0, "half"]], out
        assert out["list_changed"] == 1 and out["event"] == "ToolsListChanged", out
        methods = self.page.methods()
        assert "initialize" not in methods and "notifications/peer_joined" not in methods
        assert methods[:3] == ["subscriptions/listen", "tools/list", "tools/call"], methods
        # Closing the listen stream is its cancellation: the page is told, with the id it saw.
        cancelled = await self.page.next_seen(4)
        assert cancelled["method"] == "notifications/cancelled"
        assert cancelled["params"]["requestId"] == self.page.listen_id

    async def test_default_client_discovers_a_modern_page(self) -> None:
        code, out, err = await run_client("sdk_client.py", "discover", f"{self.base}/{SESSION}/mcp", TOKEN)
        assert code == 0 and out is not None, err[-4000:]
        assert out["version"] == "2026-07-28"
        assert self.page.methods()[0] == "server/discover"
        assert "initialize" not in self.page.methods()
