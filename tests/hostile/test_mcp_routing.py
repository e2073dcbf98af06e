"""Another holder of a session's token tries to receive a standard-endpoint client's replies.

A standard (Streamable HTTP) client's replies are routed by a label the relay issues: no tunnel
agent can name it with C{client=}, and the progress tokens the page and every outbound reader see
do not carry it.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet.defer import Deferred

from tests.support.http import Reply
from tests.support.mcp import TOKEN, McpRelayCase, next_mcp
from tests.support.mcp_clients import compact
from tests.support.sse import SSEClient

SESSION = "routing1"
AUTH = {"authorization": f"Bearer {TOKEN}", "accept": "application/json, text/event-stream"}
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "victim", "version": "1"}}}
CALL = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
        "params": {"name": "secret", "arguments": {}, "_meta": {"progressToken": "p1"}}}
DONE = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": "info", "data": "done"}}


class ReplyRoutingAgainstTokenHolders(McpRelayCase):
    timeout = 30

    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        await self.register(SESSION)
        self.page = await self.events(SESSION, "&direction=inbound")
        self.assertEqual(self.page.code, 200)

    async def page_reads(self, method: str) -> dict[str, Any]:
        while (message := (await next_mcp(self.page)).json()).get("method") != method:
            pass
        return message

    async def page_sends(self, message: dict[str, Any]) -> None:
        reply = await self.post(f"/{SESSION}/outbox?token={TOKEN}", raw=compact(message))
        self.assertEqual(reply.code, 200, reply.body)

    async def mcp(self, message: dict[str, Any], sid: str | None = None) -> Reply:
        headers = dict(AUTH, **({"mcp-session-id": sid} if sid else {}))
        return await self.post(f"/{SESSION}/mcp", raw=compact(message), **headers)

    async def victim_calls(self) -> tuple[Deferred[Reply], dict[str, Any]]:
        """A standard client initializes and calls a tool; what the page saw of the call."""
        initialized = Deferred.fromCoroutine(self.mcp(INIT))
        init = await self.page_reads("initialize")
        await self.page_sends({"jsonrpc": "2.0", "id": init["id"], "result": {"protocolVersion": "2025-06-18",
                               "capabilities": {}, "serverInfo": {"name": "page", "version": "1"}}})
        sid = (await initialized).header("mcp-session-id")
        assert sid is not None
        call = Deferred.fromCoroutine(self.mcp(CALL, sid))
        return call, await self.page_reads("tools/call")

    async def answer(self, call: dict[str, Any]) -> None:
        """The page reports progress, answers the call, then tells everyone it is done."""
        token = call["params"]["_meta"]["progressToken"]
        await self.page_sends({"jsonrpc": "2.0", "method": "notifications/progress",
                               "params": {"progressToken": token, "progress": 1, "total": 2}})
        await self.page_sends({"jsonrpc": "2.0", "id": call["id"], "result": {"content": [], "secret": 42}})
        await self.page_sends(DONE)

    async def assert_only_the_victim_is_answered(self, victim: Deferred[Reply], thief: SSEClient) -> None:
        # Frames reach one stream in order: the broadcast after the reply comes first if the reply did
        # not (the progress notification goes to every reader).
        while (message := (await next_mcp(thief)).json()).get("method") == "notifications/progress":
            pass
        self.assertEqual(message, DONE)
        reply = await victim
        self.assertEqual(reply.code, 200, reply.body)
        self.assertIn(b'"secret":42', reply.body)

    async def test_progress_tokens_do_not_reveal_what_routes_a_clients_replies(self) -> None:
        observer = await self.events(SESSION, "&direction=outbound")  # an unlabelled reader sees broadcasts
        victim, call = await self.victim_calls()
        token = call["params"]["_meta"]["progressToken"]
        self.assertIsInstance(token, str)
        await self.page_sends({"jsonrpc": "2.0", "method": "notifications/progress",
                               "params": {"progressToken": token, "progress": 0, "total": 2}})
        seen = (await next_mcp(observer)).json()["params"]["progressToken"]
        # Whatever the token holds, a label the thief takes from it routes it nothing.
        parts = seen.split(":")
        thieves = [await self.events(SESSION, f"&direction=outbound&client={part}") for part in {*parts, seen}]
        await self.answer(call)
        for thief in thieves:
            await self.assert_only_the_victim_is_answered(victim, thief)
        for client in self.service.resource.endpoint.clients.values():
            self.assertNotIn(client.label, json.dumps(seen))

    async def test_client_labels_cannot_name_a_standard_clients_label(self) -> None:
        victim, call = await self.victim_calls()
        (client,) = self.service.resource.endpoint.clients.values()
        # Even a thief that knows the relay's label for the victim (it never leaves the relay).
        thief = await self.events(SESSION, f"&direction=outbound&client={client.label}")
        await self.answer(call)
        await self.assert_only_the_victim_is_answered(victim, thief)
