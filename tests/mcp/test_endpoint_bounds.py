"""The standard endpoint's bounds at exactly the limit and one over, resumption, idle expiry."""

from __future__ import annotations

import dataclasses
import json

from twisted.internet.defer import Deferred

from tests.mcp.test_endpoint_http import AUTH, INIT, SESSION, EndpointCase, _next_message
from tests.support.mcp import TOKEN
from tests.support.mcp_clients import compact
from tests.support.sse import SSEClient


def call(n: int) -> dict:
    return {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "slow"}}


class Bounds(EndpointCase):
    silent = frozenset({"tools/call"})

    def configure(self, **changes: int) -> None:
        endpoint = self.service.resource.endpoint
        endpoint.config = dataclasses.replace(endpoint.config, **changes)

    async def test_pending_per_client_limit_and_one_over(self) -> None:
        self.configure(pending_per_client=2)
        sid = await self.initialize()
        first = [Deferred.fromCoroutine(self.mcp(call(n), sid=sid)) for n in (1, 2)]
        calls = 0
        n = 2  # peer_joined, initialize
        while calls < 2:
            n += 1
            calls += (await self.page.next_seen(n)).get("method") == "tools/call"
        over = await self.mcp(call(3), sid=sid)
        assert over.code == 429 and over.header("retry-after") == "1"
        assert over.json()["error"]["code"] == -32003 and over.json()["id"] == 3
        for pending, seen_id in zip(first, (1, 2), strict=True):
            await self.page.send({"jsonrpc": "2.0", "id": seen_id, "result": {}})
            assert (await pending).json()["id"] == seen_id
        again = Deferred.fromCoroutine(self.mcp(call(4), sid=sid))  # room again once answered
        message = await self.page.next_seen(n + 1)
        assert message["id"] == 4
        await self.page.send({"jsonrpc": "2.0", "id": 4, "result": {}})
        assert (await again).code == 200

    async def test_same_id_twice_in_one_client_session_is_400(self) -> None:
        sid = await self.initialize()
        pending = Deferred.fromCoroutine(self.mcp(call(5), sid=sid))
        await self.page.next_seen(3)
        twice = await self.mcp(call(5), sid=sid)
        assert twice.code == 400
        await self.page.send({"jsonrpc": "2.0", "id": 5, "result": {}})
        assert (await pending).code == 200

    async def test_clients_per_session_limit_and_one_over(self) -> None:
        self.configure(clients_per_session=2)
        await self.initialize()
        await self.initialize()
        over = await self.mcp(INIT)
        assert over.code == 503 and over.header("retry-after") == "5"
        assert over.header("mcp-session-id") is None

    async def test_at_the_process_bound_the_least_recently_used_idle_client_session_ends(self) -> None:
        self.configure(max_clients=2, clients_per_address=0)
        first, second = await self.initialize(), await self.initialize()
        assert (await self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid=first)).code == 200
        third = await self.initialize()  # one over: the idle one used least recently (second) ends
        assert [(await self.mcp({"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, sid=s)).code
                for s in (first, second, third)] == [200, 404, 200]
        streams = []
        for sid in (first, third):  # busy: an open GET stream
            stream = await SSEClient.connect(f"{self.base}{self.url}", headers={**AUTH, "accept": "text/event-stream",
                                                                               "mcp-session-id": sid})
            self.streams.append(stream)
            streams.append(stream.code)
        assert streams == [200, 200]
        over = await self.mcp(INIT)
        assert over.code == 503 and over.header("retry-after") == "5"

    async def test_an_eviction_is_logged_and_counted(self) -> None:
        from twisted.logger import globalLogPublisher

        from relayd.mcp.metrics import REGISTRY

        self.configure(max_clients=1, clients_per_address=0)
        lines: list[str] = []

        def observe(event: dict) -> None:
            if "to make room" in (event.get("log_format") or ""):
                from twisted.logger import formatEvent

                lines.append(formatEvent(event))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

        def evictions() -> float:
            return REGISTRY.get_sample_value("relayd_mcp_evictions_total", {"kind": "client"}) or 0.0

        before = evictions()
        first = await self.initialize()
        await self.initialize()  # ends the first (idle)
        assert evictions() - before == 1
        assert lines == ["ended 1 idle MCP client session(s) to make room under the client bound (1)"]
        assert first not in lines[0] and TOKEN not in lines[0]

    async def test_last_event_id_replays_from_the_bounded_buffer(self) -> None:
        self.configure(event_buffer_frames=2)
        sid = await self.initialize()
        for n in range(3):
            await self.page.send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"n": n}})
        # Sent in order through one connection: a later ping proves the three are delivered.
        await self.page.send({"jsonrpc": "2.0", "id": "page-1", "method": "ping"})
        stream = await SSEClient.connect(f"{self.base}{self.url}", headers={**AUTH, "mcp-session-id": sid})
        self.streams.append(stream)
        got = [await _next_message(stream) for _ in range(2)]
        # Never delivered before: the buffer's two newest (the oldest two were dropped by the bound).
        tag = got[0].id.split("-")[0]
        assert [m.id for m in got] == [f"{tag}-3", f"{tag}-4"]
        assert json.loads(got[0].data)["params"] == {"n": 2}
        resumed = await SSEClient.connect(
            f"{self.base}{self.url}", headers={**AUTH, "mcp-session-id": sid, "last-event-id": f"{tag}-3"}
        )
        self.streams.append(resumed)
        again = await _next_message(resumed)
        assert again.id == f"{tag}-4" and json.loads(again.data)["method"] == "ping"

    async def test_idle_client_session_expires(self) -> None:
        sid = await self.initialize()
        endpoint = self.service.resource.endpoint
        endpoint.reap()
        assert sid in endpoint.clients  # fresh: kept
        endpoint.clients[sid].last_used -= endpoint.config.client_idle_ms / 1000 + 1  # time passes
        endpoint.reap()
        assert sid not in endpoint.clients
        assert (await self.page.next_seen(3))["method"] == "notifications/peer_left"
        reply = await self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid=sid)
        assert reply.code == 404

    async def test_initialize_refused_leaves_no_client_session(self) -> None:
        endpoint = self.service.resource.endpoint
        self.configure(pending_per_session=0)
        over = await self.mcp(INIT)
        assert over.code == 429
        assert endpoint.clients == {}

    async def test_batch_with_a_request_is_400(self) -> None:
        sid = await self.initialize()
        batch = [call(1), {"jsonrpc": "2.0", "method": "notifications/initialized"}]
        assert (await self.mcp(batch, sid=sid)).code == 400

    async def test_get_without_event_stream_accept_is_406(self) -> None:
        sid = await self.initialize()
        reply = await self.request("GET", self.url, headers={"authorization": f"Bearer {TOKEN}",
                                                             "accept": "application/json", "mcp-session-id": sid})
        assert reply.code == 406


class LegacyTokenInQuery(EndpointCase):
    async def test_endpoint_event_carries_quoted_token_only_when_given_in_query(self) -> None:
        odd = "tok/with spaces&x=1\u00e9_padding"
        await self.register("legacyq", odd)
        from urllib.parse import quote

        stream = await SSEClient.connect(f"{self.base}/legacyq/sse?token={quote(odd, safe='')}")
        self.streams.append(stream)
        endpoint = await stream.next(5)
        assert endpoint.event == "endpoint"
        assert endpoint.data.endswith("&token=" + quote(odd, safe=""))
        posted = await self.post(endpoint.data[len(self.prefix):], raw=compact({"jsonrpc": "2.0", "method": "x"}))
        assert posted.code == 202
        header = await SSEClient.connect(f"{self.base}/{SESSION}/sse", headers={"authorization": f"Bearer {TOKEN}"})
        self.streams.append(header)
        assert "token=" not in (await header.next(5)).data


class SlowGetStream(EndpointCase):
    flags = {"mcp-queue-bytes": "65536"}

    async def test_get_stream_that_stops_reading_is_cut_and_session_goes_on(self) -> None:
        from twisted.internet import reactor

        from tests.support.connections import HeldConnection, SingleUseFactory

        sid = await self.initialize()
        request = (f"GET /{SESSION}/mcp HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n"
                   f"Authorization: Bearer {TOKEN}\r\nMcp-Session-Id: {sid}\r\n\r\n").encode()
        held = HeldConnection(request, stop_reading=True)
        reactor.connectTCP("127.0.0.1", self.port, SingleUseFactory(held))
        status = await held.ready
        assert status.startswith(b"HTTP/1.1 200")
        big = {"jsonrpc": "2.0", "method": "notifications/message", "params": {"data": "x" * 200_000}}
        client = self.service.resource.endpoint.clients[sid]
        stream = client.stream
        assert stream is not None
        posts = 0
        # Socket buffers take up to ~4 MB (tcp_wmem's maximum) before the server holds anything;
        # beyond that, 64 KiB more cut it. 35 posts are 7 MB: short of the 8 MiB default bound.
        while not stream.closed:
            assert posts < 35, "the stream was not cut at --mcp-queue-bytes"
            await self.page.send(big)
            posts += 1
        # Once it reads again it finds the end of a short stream.
        held.transport.resumeProducing()
        await held.lost.addTimeout(10, reactor)
        assert held.received < posts * 200_000, held.received
        # The client session itself goes on: it reconnects with the last event id it read and
        # resumes from the bounded buffer (1 MiB: the last few of these big events).
        tag = self.service.resource.endpoint.tag.decode()
        resumed = await SSEClient.connect(
            f"{self.base}{self.url}", headers={**AUTH, "mcp-session-id": sid, "last-event-id": f"{tag}-1"}
        )
        self.streams.append(resumed)
        assert resumed.code == 200
        again = await _next_message(resumed)
        assert json.loads(again.data)["method"] == "notifications/message"
        assert int(again.id.split("-")[1]) > posts - 6
