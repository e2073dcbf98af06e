"""Acceptance 3: clients using the same JSON-RPC ids concurrently each get their own answers, and a
legacy (2024-11-05) client shares the tunnel session with them."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, gatherResults

from tests.mcp.test_endpoint_http import SESSION, EndpointCase, _next_message
from tests.support.mcp import TOKEN
from tests.support.mcp_clients import compact, run_client
from tests.support.sse import SSEClient


class SameIds(EndpointCase):
    silent = frozenset({"tools/call"})

    async def test_two_clients_and_a_legacy_client_with_the_same_id(self) -> None:
        a = await self.initialize()
        b = await self.initialize()
        legacy = await SSEClient.connect(f"{self.base}/{SESSION}/sse", headers={"authorization": f"Bearer {TOKEN}"})
        self.streams.append(legacy)
        endpoint = await legacy.next(5)
        assert endpoint is not None and endpoint.event == "endpoint"
        assert endpoint.data.startswith(f"{self.prefix}/{SESSION}/messages?sessionId=")
        seen = len(self.page.seen)

        def call(who: str) -> dict[str, Any]:
            return {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "t", "arguments": {"who": who}}}

        answer_a = Deferred.fromCoroutine(self.mcp(call("a"), sid=a))
        answer_b = Deferred.fromCoroutine(self.mcp(call("b"), sid=b))
        posted = await self.post(endpoint.data[len(self.prefix):], raw=compact(call("legacy")),
                                 authorization=f"Bearer {TOKEN}")
        assert posted.code == 202
        calls: list[dict[str, Any]] = []
        while len(calls) < 3:
            seen += 1
            message = await self.page.next_seen(seen)
            if message.get("method") == "tools/call":
                calls.append(message)
        ids = [c["id"] for c in calls]
        assert len(set(map(json.dumps, ids))) == 3, ids  # made unique on the way to the page
        # The page answers in reverse order, each with the caller's name.
        for c in reversed(calls):
            who = c["params"]["arguments"]["who"]
            await self.page.send({"jsonrpc": "2.0", "id": c["id"], "result": {"content": [{"type": "text", "text": who}]}})
        for d, who in ((answer_a, "a"), (answer_b, "b")):
            reply = await d
            assert reply.code == 200
            assert reply.json() == {"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": who}]}}
        msg = await _next_message(legacy)
        assert json.loads(msg.data) == {"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": "legacy"}]}}


class ThreeSdkClients(EndpointCase):
    timeout = 180

    async def test_sdk_clients_concurrently(self) -> None:
        # Each SDK client numbers its requests from the same start: their ids collide at the page.
        url = f"{self.base}/{SESSION}"
        results = await gatherResults([
            Deferred.fromCoroutine(run_client("sdk_client.py", "session", f"{url}/mcp", TOKEN)),
            Deferred.fromCoroutine(run_client("sdk_client.py", "session", f"{url}/mcp", TOKEN)),
            Deferred.fromCoroutine(run_client("sdk_client.py", "sse", f"{url}/sse", TOKEN)),
        ])
        for code, out, err in results:
            assert code == 0 and out is not None, err[-3000:]
            assert out["progress"] == [[1.0, 2.0, "half"]]
        said = sorted(json.loads(r[1]["result"][0])["arguments"]["text"] for r in results)
        assert said == ["hello from session", "hello from session", "hello from sse"]
        joined = [m for m in self.page.methods() if m == "notifications/peer_joined"]
        assert len(joined) == 3
