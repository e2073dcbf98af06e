"""Acceptance 4: every status of the standard MCP endpoint, over raw HTTP against a simulated page."""

from __future__ import annotations

import json
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.task import deferLater

from tests.support.http import Reply
from tests.support.mcp import TOKEN, McpRelayCase, disconnect
from tests.support.mcp_clients import MODERN, SimulatedPage, compact
from tests.support.sse import SSEClient

SESSION = "statuses1"
INIT = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
}
AUTH = {"authorization": f"Bearer {TOKEN}", "accept": "application/json, text/event-stream"}


class EndpointCase(McpRelayCase):
    timeout = 60
    silent: frozenset[str] = frozenset()

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        await self.register(SESSION)
        self.page = SimulatedPage(self, SESSION, silent=self.silent)
        await self.page.start()
        self.url = f"/{SESSION}/mcp"

    async def mcp(self, message: Any, sid: str | None = None, **headers: str) -> Reply:
        h = dict(AUTH)
        if sid is not None:
            h["mcp-session-id"] = sid
        h.update(headers)
        return await self.post(self.url, raw=compact(message) if not isinstance(message, bytes) else message, **h)

    async def initialize(self) -> str:
        reply = await self.mcp(INIT)
        assert reply.code == 200, reply.body
        assert reply.json()["result"]["protocolVersion"] == "2025-06-18"
        sid = reply.header("mcp-session-id")
        assert sid is not None and len(sid) >= 22  # at least 128 random bits
        return sid


class Statuses(EndpointCase):
    async def test_missing_token_is_401_with_www_authenticate(self) -> None:
        reply = await self.post(self.url, raw=compact(INIT), accept="application/json")
        assert reply.code == 401
        assert reply.header("www-authenticate").startswith("Bearer")
        assert reply.json()["error"]["code"] == -32600

    async def test_wrong_token_on_live_session_is_401(self) -> None:
        reply = await self.post(self.url, raw=compact(INIT), authorization="Bearer " + "x" * 30)
        assert reply.code == 401
        assert reply.header("www-authenticate").startswith("Bearer")

    async def test_query_token_is_accepted(self) -> None:
        reply = await self.post(f"{self.url}?token={TOKEN}", raw=compact(INIT), accept="application/json")
        assert reply.code == 200 and reply.header("mcp-session-id")

    async def test_gone_session_is_410_with_json_rpc_error(self) -> None:
        reply = await self.post("/nosuchsession/mcp", raw=compact(INIT), authorization=f"Bearer {TOKEN}")
        assert reply.code == 410
        body = reply.json()
        assert body["jsonrpc"] == "2.0" and body["error"]["code"] == -32002

    async def test_unknown_session_id_is_404(self) -> None:
        reply = await self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid="not-a-session-id")
        assert reply.code == 404
        assert reply.json()["jsonrpc"] == "2.0" and reply.json()["error"]["code"] == -32600  # the endpoint's 404

    async def test_ended_session_id_is_404_after_delete(self) -> None:
        sid = await self.initialize()
        deleted = await self.request("DELETE", self.url, headers={**AUTH, "mcp-session-id": sid})
        assert deleted.code == 200
        assert (await self.page.next_seen(3))["method"] == "notifications/peer_left"
        reply = await self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid=sid)
        assert reply.code == 404

    async def test_session_id_of_another_tunnel_session_is_404(self) -> None:
        sid = await self.initialize()
        await self.register("otherpage")
        reply = await self.post("/otherpage/mcp", raw=compact({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
                                **AUTH, **{"mcp-session-id": sid})
        assert reply.code == 404

    async def test_missing_session_id_is_400(self) -> None:
        await self.initialize()
        reply = await self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"})
        assert reply.code == 400

    async def test_unsupported_protocol_version_is_400(self) -> None:
        sid = await self.initialize()
        reply = await self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid=sid,
                               **{"mcp-protocol-version": "1999-01-01"})
        assert reply.code == 400
        ok = await self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid=sid,
                            **{"mcp-protocol-version": "2025-06-18"})
        assert ok.code == 200 and ok.json()["result"]["tools"]

    async def test_not_json_rpc_is_400_parse_error(self) -> None:
        sid = await self.initialize()
        reply = await self.mcp(b"{not json", sid=sid)
        assert reply.code == 400 and reply.json()["error"]["code"] == -32700

    async def test_notification_is_202_and_reaches_the_page(self) -> None:
        sid = await self.initialize()
        reply = await self.mcp({"jsonrpc": "2.0", "method": "notifications/initialized"}, sid=sid)
        assert reply.code == 202 and reply.body == b""
        seen = await self.page.next_seen(3)
        assert seen["method"] == "notifications/initialized"

    async def test_response_to_page_request_is_202_with_the_pages_id(self) -> None:
        sid = await self.initialize()
        stream = await SSEClient.connect(f"{self.base}{self.url}", headers={**AUTH, "mcp-session-id": sid})
        self.streams.append(stream)
        assert stream.code == 200
        await self.page.send({"jsonrpc": "2.0", "id": "elicit-7", "method": "elicitation/create", "params": {}})
        msg = await _next_message(stream)
        asked = json.loads(msg.data)
        assert asked["method"] == "elicitation/create" and msg.id.endswith("-1")  # "<process tag>-<n>"
        reply = await self.mcp({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "decline"}}, sid=sid)
        assert reply.code == 202
        seen = await self.page.next_seen(3)
        assert seen == {"jsonrpc": "2.0", "id": "elicit-7", "result": {"action": "decline"}}

    async def test_any_origin_is_allowed_under_the_default_wildcard(self) -> None:
        reply = await self.post(self.url, raw=compact(INIT), **AUTH, origin="http://evil.example")
        assert reply.code == 200  # --mcp-cors '*' (the default) allows any origin


class OriginPolicy(EndpointCase):
    flags = {"mcp-cors": ["http://good.example"]}

    async def test_origin_not_allowed_is_403(self) -> None:
        reply = await self.post(self.url, raw=compact(INIT), **AUTH, origin="http://evil.example")
        assert reply.code == 403
        good = await self.post(self.url, raw=compact(INIT), **AUTH, origin="http://good.example")
        assert good.code == 200


class Timeout(EndpointCase):
    flags = {"mcp-request-timeout-ms": "300"}
    silent = frozenset({"tools/call"})

    async def test_unanswered_request_gets_json_rpc_error_and_page_is_told(self) -> None:
        sid = await self.initialize()
        reply = await self.mcp({"jsonrpc": "2.0", "id": 5, "method": "tools/call", "params": {"name": "x"}}, sid=sid)
        assert reply.code == 200
        body = reply.json()
        assert body["id"] == 5 and body["error"]["code"] == -32001
        call = await self.page.next_seen(3)
        cancelled = await self.page.next_seen(4)
        assert cancelled["method"] == "notifications/cancelled"
        assert cancelled["params"]["requestId"] == call["id"]


class PageGone(EndpointCase):
    """Issue 26: a call to a session whose page has gone (its tab closed: the inbound stream dropped
    and not back) is answered within 2 s with an error saying so, not after the request time-out."""

    async def page_leaves(self) -> None:
        await disconnect(self.page.stream)
        # The relay has seen the stream end once it no longer lists an inbound reader.
        while await self.tunnel.store.subscribers(SESSION, "inbound"):
            await deferLater(reactor, 0.01, lambda: None)

    async def test_a_call_without_a_page_fails_at_once_with_a_clear_error(self) -> None:
        sid = await self.initialize()
        await self.page_leaves()
        started = time.monotonic()
        reply = await self.mcp({"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "x"}}, sid=sid)
        elapsed = time.monotonic() - started
        assert reply.code == 200, reply.body
        error = reply.json()["error"]
        assert reply.json()["id"] == 7 and error["code"] == -32005, reply.body
        assert "no page is hosting this session" in error["message"]
        assert elapsed < 2.0, elapsed
        # A new client's initialize is answered the same way.
        reply = await self.mcp(INIT)
        assert reply.json()["error"]["code"] == -32005, reply.body

    async def test_a_pending_call_fails_within_2_seconds_when_the_page_goes(self) -> None:
        self.page.silent = frozenset({"tools/call"})
        sid = await self.initialize()
        call = Deferred.fromCoroutine(
            self.mcp({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "x"}}, sid=sid)
        )
        await self.page.next_seen(3)  # (initialize, notifications/initialized, then the call)
        started = time.monotonic()
        await disconnect(self.page.stream)  # the tab closes with the call in its hands
        reply = await call
        assert time.monotonic() - started < 2.0, time.monotonic() - started
        assert reply.json()["id"] == 9 and reply.json()["error"]["code"] == -32005, reply.body

    async def test_a_page_that_comes_back_within_the_grace_answers(self) -> None:
        sid = await self.initialize()
        await self.page_leaves()
        call = Deferred.fromCoroutine(
            self.mcp({"jsonrpc": "2.0", "id": 8, "method": "tools/call", "params": {"name": "x"}}, sid=sid)
        )
        await deferLater(reactor, 0.2, lambda: None)
        assert not call.called
        self.page = SimulatedPage(self, SESSION, silent=frozenset({"tools/call"}))
        await self.page.start()  # (the call waited in the backlog for the first reader)
        asked = await self.page.next_seen(1)
        assert asked["method"] == "tools/call"
        await self.page.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"content": []}})
        reply = await call
        assert reply.json() == {"jsonrpc": "2.0", "id": 8, "result": {"content": []}}, reply.body


class UnregisterWhilePending(EndpointCase):
    silent = frozenset({"tools/call"})

    async def test_pending_request_answered_at_once_and_stream_ends(self) -> None:
        sid = await self.initialize()
        stream = await SSEClient.connect(f"{self.base}{self.url}", headers={**AUTH, "mcp-session-id": sid})
        self.streams.append(stream)
        pending = Deferred.fromCoroutine(
            self.mcp({"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "x"}}, sid=sid)
        )
        await self.page.next_seen(3)
        gone = await self.post(f"/{SESSION}/unregister", raw=b"", authorization=f"Bearer {TOKEN}")
        assert gone.code == 200
        reply = await pending
        assert reply.json()["id"] == 9 and reply.json()["error"]["code"] == -32002
        end = stream.ended
        end.addTimeout(5, reactor)
        await end
        after = await self.mcp({"jsonrpc": "2.0", "id": 10, "method": "tools/list"}, sid=sid)
        assert after.code == 410
        assert self.tunnel.store.clients == {}  # nothing of the client session is left behind


class Modern(EndpointCase):
    async def test_header_mismatch_is_400_minus_32020(self) -> None:
        message = {"jsonrpc": "2.0", "id": 3, "method": "tools/list",
                   "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}}
        reply = await self.mcp(message, **{"mcp-protocol-version": MODERN, "mcp-method": "tools/call"})
        assert reply.code == 400 and reply.json()["error"]["code"] == -32020 and reply.json()["id"] == 3
        message["id"] = 4
        ok = await self.mcp(message, **{"mcp-protocol-version": MODERN, "mcp-method": "tools/list"})
        assert ok.code == 200
        assert (await self.page.next_seen(1))["id"] == 4  # the mismatched request never reached the page

    async def test_stateless_request_needs_no_session_id(self) -> None:
        message = {"jsonrpc": "2.0", "id": 3, "method": "tools/list",
                   "params": {"_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}}
        reply = await self.mcp(message, **{"mcp-protocol-version": MODERN, "mcp-method": "tools/list"})
        assert reply.code == 200 and reply.json()["id"] == 3
        forwarded = await self.page.next_seen(1)  # one exchange: no presence
        assert forwarded["params"]["_meta"] == message["params"]["_meta"]  # _meta intact

    async def test_get_and_delete_do_not_exist_in_2026(self) -> None:
        reply = await self.request("GET", self.url, headers={**AUTH, "mcp-protocol-version": MODERN})
        assert reply.code == 405


async def _next_message(stream: SSEClient) -> Any:
    while True:
        msg = await stream.next(5)
        assert msg is not None, "stream ended"
        if msg.event in (None, "message") and msg.data:
            return msg
