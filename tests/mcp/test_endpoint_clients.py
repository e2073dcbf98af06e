"""Acceptance 3: clients using the same JSON-RPC ids concurrently each get their own answers, and a
legacy (2024-11-05) client shares the tunnel session with them."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred, gatherResults

from tests.mcp.test_endpoint_http import EndpointCase
from tests.support.inmemory import InMemoryEndpointCase
from tests.support.mcp import SESSION, TOKEN
from tests.support.mcp_clients import compact, run_client


class SameIds(InMemoryEndpointCase):
    silent = frozenset({"tools/call"})

    def test_two_clients_and_a_legacy_client_with_the_same_id(self) -> None:
        a = self.initialize()
        b = self.initialize()
        legacy = self.wing.open("GET", f"{self.prefix}/{SESSION}/sse", None, {"authorization": f"Bearer {TOKEN}"})
        self.settle()
        endpoint = legacy.events()[0]
        assert endpoint.event == "endpoint"
        assert endpoint.data.startswith(f"{self.prefix}/{SESSION}/messages?sessionId=")
        seen = len(self.page.seen)

        def call(who: str) -> dict[str, Any]:
            return {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "t", "arguments": {"who": who}}}

        answer_a = self.send_mcp(call("a"), sid=a)
        answer_b = self.send_mcp(call("b"), sid=b)
        posted = self.post(endpoint.data[len(self.prefix):], raw=compact(call("legacy")),
                           authorization=f"Bearer {TOKEN}")
        assert posted.code == 202
        self.settle()
        calls = [m for m in self.page.seen[seen:] if m.get("method") == "tools/call"]
        assert len(calls) == 3, self.page.seen[seen:]
        ids = [c["id"] for c in calls]
        assert len(set(map(json.dumps, ids))) == 3, ids  # made unique on the way to the page
        # The page answers in reverse order, each with the caller's name.
        for c in reversed(calls):
            who = c["params"]["arguments"]["who"]
            self.page.send({"jsonrpc": "2.0", "id": c["id"], "result": {"content": [{"type": "text", "text": who}]}})
        self.settle()
        for connection, who in ((answer_a, "a"), (answer_b, "b")):
            reply = connection.reply()
            assert reply.code == 200
            assert reply.json() == {"jsonrpc": "2.0", "id": 7, "result": {"content": [{"type": "text", "text": who}]}}
        (msg,) = [m for m in legacy.events() if m.event == "message"]
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
