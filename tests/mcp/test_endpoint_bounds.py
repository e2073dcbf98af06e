"""The standard endpoint's bounds at exactly the limit and one over, resumption, idle expiry: in memory
(time is the wing's clock), but for a GET stream that stops reading (the socket's back-pressure is
the subject)."""

from __future__ import annotations

import dataclasses
import json

from tests.mcp.test_endpoint_http import EndpointCase, _next_message, stream_messages
from tests.support.inmemory import InMemoryEndpointCase
from tests.support.mcp import AUTH, INIT, SESSION, TOKEN
from tests.support.mcp_clients import compact
from tests.support.sse import SSEClient


def call(n: int) -> dict:
    return {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "slow"}}


class Bounds(InMemoryEndpointCase):
    silent = frozenset({"tools/call"})

    def configure(self, **changes: int) -> None:
        endpoint = self.service.resource.endpoint
        endpoint.config = dataclasses.replace(endpoint.config, **changes)

    def test_pending_per_client_limit_and_one_over(self) -> None:
        self.configure(pending_per_client=2)
        sid = self.initialize()
        first = [self.send_mcp(call(n), sid=sid) for n in (1, 2)]
        self.settle()
        assert [m["id"] for m in self.page.seen if m.get("method") == "tools/call"] == [1, 2]
        over = self.mcp(call(3), sid=sid)
        assert over.code == 429 and over.header("retry-after") == "1"
        assert over.json()["error"]["code"] == -32003 and over.json()["id"] == 3
        for pending, seen_id in zip(first, (1, 2), strict=True):
            self.page.send({"jsonrpc": "2.0", "id": seen_id, "result": {}})
            self.settle()
            assert pending.reply().json()["id"] == seen_id
        again = self.send_mcp(call(4), sid=sid)  # room again once answered
        self.settle()
        assert self.page.seen[-1]["id"] == 4
        self.page.send({"jsonrpc": "2.0", "id": 4, "result": {}})
        self.settle()
        assert again.reply().code == 200

    def test_same_id_twice_in_one_client_session_is_400(self) -> None:
        sid = self.initialize()
        pending = self.send_mcp(call(5), sid=sid)
        self.settle()
        assert self.page.seen[2]["method"] == "tools/call"
        twice = self.mcp(call(5), sid=sid)
        assert twice.code == 400
        self.page.send({"jsonrpc": "2.0", "id": 5, "result": {}})
        self.settle()
        assert pending.reply().code == 200

    def test_clients_per_session_limit_and_one_over(self) -> None:
        self.configure(clients_per_session=2)
        self.initialize()
        self.initialize()
        over = self.mcp(INIT)
        assert over.code == 503 and over.header("retry-after") == "5"
        assert over.header("mcp-session-id") is None

    def test_at_the_process_bound_the_least_recently_used_idle_client_session_ends(self) -> None:
        self.configure(max_clients=2, clients_per_address=0)
        first, second = self.initialize(), self.initialize()
        self.wing.advance(1)  # the first is used again later than the second
        assert self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid=first).code == 200
        third = self.initialize()  # one over: the idle one used least recently (second) ends
        assert [self.mcp({"jsonrpc": "2.0", "id": 3, "method": "tools/list"}, sid=s).code
                for s in (first, second, third)] == [200, 404, 200]
        streams = [self.stream(sid, accept="text/event-stream") for sid in (first, third)]  # busy: open GET streams
        assert [stream.status() for stream in streams] == [200, 200]
        over = self.mcp(INIT)
        assert over.code == 503 and over.header("retry-after") == "5"

    def test_an_eviction_is_logged_and_counted(self) -> None:
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
        first = self.initialize()
        self.initialize()  # ends the first (idle)
        assert evictions() - before == 1
        assert lines == ["ended 1 idle MCP client session(s) to make room under the client bound (1)"]
        assert first not in lines[0] and TOKEN not in lines[0]

    def test_last_event_id_replays_from_the_bounded_buffer(self) -> None:
        self.configure(event_buffer_frames=2)
        sid = self.initialize()
        for n in range(3):
            self.page.send({"jsonrpc": "2.0", "method": "notifications/message", "params": {"n": n}})
        self.page.send({"jsonrpc": "2.0", "id": "page-1", "method": "ping"})
        stream = self.stream(sid)
        self.settle()
        got = stream_messages(stream)
        # Never delivered before: the buffer's two newest (the oldest two were dropped by the bound).
        tag = got[0].id.split("-")[0]
        assert [m.id for m in got] == [f"{tag}-3", f"{tag}-4"]
        assert json.loads(got[0].data)["params"] == {"n": 2}
        resumed = self.stream(sid, **{"last-event-id": f"{tag}-3"})
        self.settle()
        (again,) = stream_messages(resumed)
        assert again.id == f"{tag}-4" and json.loads(again.data)["method"] == "ping"

    def test_idle_client_session_expires(self) -> None:
        sid = self.initialize()
        endpoint = self.service.resource.endpoint
        endpoint.reap()
        assert sid in endpoint.clients  # fresh: kept
        self.wing.advance(endpoint.config.client_idle_ms / 1000 + 1)  # time passes
        endpoint.reap()
        assert sid not in endpoint.clients
        self.settle()
        assert self.page.seen[2]["method"] == "notifications/peer_left"
        reply = self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, sid=sid)
        assert reply.code == 404

    def test_initialize_refused_leaves_no_client_session(self) -> None:
        endpoint = self.service.resource.endpoint
        self.configure(pending_per_session=0)
        over = self.mcp(INIT)
        assert over.code == 429
        assert endpoint.clients == {}

    def test_batch_with_a_request_is_400(self) -> None:
        sid = self.initialize()
        batch = [call(1), {"jsonrpc": "2.0", "method": "notifications/initialized"}]
        assert self.mcp(batch, sid=sid).code == 400

    def test_get_without_event_stream_accept_is_406(self) -> None:
        sid = self.initialize()
        reply = self.request("GET", self.url, headers={"authorization": f"Bearer {TOKEN}",
                                                       "accept": "application/json", "mcp-session-id": sid})
        assert reply.code == 406


class LegacyTokenInQuery(InMemoryEndpointCase):
    def test_endpoint_event_carries_quoted_token_only_when_given_in_query(self) -> None:
        odd = "tok/with spaces&x=1\u00e9_padding"
        self.register("legacyq", odd)
        from urllib.parse import quote

        stream = self.wing.open("GET", f"{self.prefix}/legacyq/sse?token={quote(odd, safe='')}")
        self.settle()
        endpoint = stream.events()[0]
        assert endpoint.event == "endpoint"
        assert endpoint.data.endswith("&token=" + quote(odd, safe=""))
        posted = self.post(endpoint.data[len(self.prefix):], raw=compact({"jsonrpc": "2.0", "method": "x"}))
        assert posted.code == 202
        header = self.wing.open("GET", f"{self.prefix}/{SESSION}/sse", None, {"authorization": f"Bearer {TOKEN}"})
        self.settle()
        assert "token=" not in header.events()[0].data


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
