"""A command Redis holds without answering (paused past the 2 s timeout) is answered as an
unknown outcome where the request may have reached the page, never as "store unavailable, nothing
happened"; a failure before anything was forwarded (the token check) stays "store unavailable"."""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.protocol import ClientCreator

from tests.mcp.test_endpoint_http import AUTH, INIT, SESSION
from tests.support.mcp import TOKEN, McpRelayCase
from tests.support.mcp_clients import SimulatedPage, compact
from tests.support.raw import RawClient, parse_responses
from tests.support.redis import RedisServer

CALL = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "slow"}}


class OutcomeUnknown(McpRelayCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.server = RedisServer.start()  # a private server: pausing it holds every client of it
        self.addCleanup(self.server.cleanup)
        await self.start_relay({"mcp-reap-interval-ms": "0", "redis": self.server.url, "redis-prefix": "unknown:"})
        await self.register(SESSION)
        self.page = SimulatedPage(self, SESSION, silent=frozenset({"tools/call"}))
        await self.page.start()

    async def test_a_forwarded_request_without_an_answer_from_redis_is_outcome_unknown(self) -> None:
        reply = await self.mcp_post(INIT)
        sid = reply.header("mcp-session-id")
        assert reply.code == 200 and sid is not None

        # The headers go first: the token check runs (and is answered) before Redis is paused; the
        # body then comes, and the frame's store command waits in Redis's socket past the timeout.
        check = self.tunnel.check
        started: Deferred[list[Deferred[Any]]] = Deferred()

        def spy(*args: Any) -> Deferred[Any]:
            d = check(*args)
            if not started.called:
                started.callback([d])
            return d

        self.tunnel.check = spy  # type: ignore[method-assign]
        body = compact(CALL)
        head = (f"POST {self.prefix}/{SESSION}/mcp HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
                f"Authorization: Bearer {TOKEN}\r\nAccept: application/json, text/event-stream\r\n"
                f"Mcp-Session-Id: {sid}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        client = RawClient()
        await ClientCreator(reactor, lambda: client).connectTCP("127.0.0.1", self.port)
        client.transport.write(head)
        [checked] = await started
        assert await checked is None  # the token is good
        self.server.pause(self)
        client.transport.write(body)
        await client.closed
        [response], _ = parse_responses(client.received, True)
        assert response.status == 503, client.received
        error = json.loads(response.body)["error"]
        assert error["code"] == -32004
        assert "may have been delivered to the page" in error["message"]
        await self.server.resume()

    async def test_an_inbox_frame_without_an_answer_from_redis_is_outcome_unknown(self) -> None:
        self.server.pause(self)
        reply = await self.post(f"/{SESSION}/inbox?token={TOKEN}", raw=compact({"jsonrpc": "2.0", "method": "x"}))
        assert reply.code == 503
        answer = reply.json()
        assert (answer["error"], answer["store"]) == ("outcome_unknown", "mcp")
        assert "may have taken effect" in answer["detail"]
        await self.server.resume()

    async def test_a_token_check_without_an_answer_is_store_unavailable(self) -> None:
        self.server.pause(self)
        reply = await self.mcp_post(INIT)
        assert reply.code == 503
        error = reply.json()["error"]
        assert error["message"] == "store unavailable"  # nothing was forwarded: a retry is safe
        await self.server.resume()

    async def mcp_post(self, message: Any) -> Any:
        return await self.post(f"/{SESSION}/mcp", raw=compact(message), **AUTH)

