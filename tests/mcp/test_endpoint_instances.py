"""The standard endpoint with --redis across three instances: the client POSTs to A, the page reads
on B, the client's GET stream is on C (and its later requests, its DELETE, land on C)."""

from __future__ import annotations

import json
from typing import Any

import treq
from twisted.internet import reactor

from tests.mcp.test_endpoint_http import INIT, _next_message
from tests.mcp.test_multi_instance import SESSION, Instances
from tests.support.http import Reply
from tests.support.mcp import TOKEN
from tests.support.mcp_clients import RemoteRelay, SimulatedPage, compact
from tests.support.sse import SSEClient

HEADERS = {"authorization": f"Bearer {TOKEN}", "accept": "application/json, text/event-stream",
           "content-type": "application/json"}


class EndpointAcrossInstances(Instances):
    timeout = 60

    async def mcp(self, i: int, message: Any, sid: str | None = None, method: str = "POST") -> Reply:
        headers = dict(HEADERS)
        if sid is not None:
            headers["mcp-session-id"] = sid
        d = treq.request(method, f"{self.urls[i]}/{SESSION}/mcp", data=compact(message) if message else None,
                         headers=headers, pool=self.pool)
        d.addTimeout(10, reactor)
        response = await d
        return Reply(response.code, response.headers, await treq.content(response))

    async def test_post_on_a_page_on_b_stream_on_c(self) -> None:
        page = SimulatedPage(RemoteRelay(self, self.urls[1]), SESSION)
        await page.start()
        init = await self.mcp(0, INIT)
        assert init.code == 200, init.body
        sid = init.header("mcp-session-id")
        stream = await SSEClient.connect(f"{self.urls[2]}/{SESSION}/mcp", headers={**HEADERS, "mcp-session-id": sid})
        self.streams.append(stream)
        assert stream.code == 200
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "whiteboard_add_sticky"}}
        answered = await self.mcp(0, call, sid)
        assert answered.code == 200
        body = answered.body.decode()
        # JSON, or an SSE stream (the page reported no progress: no token) ending with the answer.
        assert json.loads(body[body.index("{"):].splitlines()[0])["id"] == 2
        # The page pinged after the call: the client sees it on its GET stream on C and answers on C.
        ping = json.loads((await _next_message(stream)).data)
        assert ping["method"] == "ping"
        assert (await self.mcp(2, {"jsonrpc": "2.0", "id": ping["id"], "result": {}}, sid)).code == 202
        changed = json.loads((await _next_message(stream)).data)
        assert changed["method"] == "notifications/tools/list_changed"
        assert page.pings == 1
        # A request on C is served there (attached to the client session A created).
        on_c = await self.mcp(2, {"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, sid)
        assert on_c.code == 200 and b'"id":3' in on_c.body
        joined = [m for m in page.methods() if m == "notifications/peer_joined"]
        assert len(joined) == 1  # presence once, from the instance that created the client session
        # DELETE on C ends it everywhere; A (which announced it) says peer_left at its next pass.
        assert (await self.mcp(2, None, sid, method="DELETE")).code == 200
        await self.services[0].resource.endpoint.client_sessions._reap()
        seen = len(page.seen)
        while page.seen[-1].get("method") != "notifications/peer_left":
            seen += 1
            await page.next_seen(seen)
        assert (await self.mcp(0, {"jsonrpc": "2.0", "id": 4, "method": "tools/list"}, sid)).code == 404
        assert (await self.mcp(1, {"jsonrpc": "2.0", "id": 4, "method": "tools/list"}, sid)).code == 404

    async def test_unknown_session_id_is_404_on_every_instance(self) -> None:
        for i in range(3):
            reply = await self.mcp(i, {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, "nope")
            assert reply.code == 404 and reply.json()["error"]["code"] == -32600
