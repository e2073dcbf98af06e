"""Acceptance 5: two relayd processes on one real Redis; the SDK client on A, the page on B."""

from __future__ import annotations

from twisted.trial.unittest import TestCase

from tests.support.mcp import TOKEN, start_mcp_process, until_store_answers
from tests.support.mcp_clients import RemoteRelay, SimulatedPage, run_client
from tests.support.redis import OnCluster, layout_url

SESSION = "acrossab"


class AcrossInstances(TestCase):
    timeout = 120

    async def setUp(self) -> None:  # type: ignore[override]
        url = layout_url(self)
        prefix = f"endpoint{id(self)}:"
        self.a = await start_mcp_process(self, "--redis", url, "--redis-prefix", prefix)
        self.b = await start_mcp_process(self, "--redis", url, "--redis-prefix", prefix)
        for proc in (self.a, self.b):
            await until_store_answers(proc)
        self.url_a = f"http://127.0.0.1:{self.a.port('mcp')}"
        relay_b = RemoteRelay(self, f"http://127.0.0.1:{self.b.port('mcp')}")
        registered = await relay_b.post("/register", b'{"session":"%s","token":"%s"}' % (SESSION.encode(), TOKEN.encode()))
        assert registered.code == 200
        self.page = SimulatedPage(relay_b, SESSION)
        await self.page.start()

    async def test_sdk_client_on_a_page_on_b(self) -> None:
        for mode in ("session", "client"):
            code, out, err = await run_client("sdk_client.py", mode, f"{self.url_a}/{SESSION}/mcp", TOKEN)
            assert code == 0 and out is not None, err[-4000:]
            assert out["tools"] == ["whiteboard_add_sticky"]
            assert out["progress"] == [[1.0, 2.0, "half"]] and out["list_changed"] >= 1
        assert self.page.pings >= 2
        assert self.page.methods().count("notifications/peer_joined") == 2

    async def test_legacy_client_on_a_page_on_b(self) -> None:
        code, out, err = await run_client("sdk_client.py", "sse", f"{self.url_a}/{SESSION}/sse", TOKEN)
        assert code == 0 and out is not None, err[-4000:]
        assert out["progress"] == [[1.0, 2.0, "half"]] and out["list_changed"] >= 1


class AcrossInstancesOnCluster(OnCluster, AcrossInstances):
    """The same on a 3-master Redis Cluster (issue 25)."""
