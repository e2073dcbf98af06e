"""What an idle MCP standard-endpoint GET stream holds on the Python heap (docs/performance.md,
"Memory per idle stream"): real loopback connections, measured with tracemalloc."""

from __future__ import annotations

import socket

from tests.mcp.test_endpoint_http import TOKEN, EndpointCase
from tests.support.aep import wait_until
from tests.support.memory import heap_bytes_per

WARM = 8  # streams opened before measuring: the endpoint's tables grow to their working size
STREAMS = 56  # with WARM, the default clients per session (64)
# Python-heap bytes per idle GET stream (the session's own state not counted), this test's client
# sockets included (~250 B). Measured 2.39 KB once a held stream leaves twisted.web
# (relayd/web/streams/held.py); 3.29-3.32 KB when it stayed there but dropped its spent headers and its
# notifyFinish Deferred and shared its local address, request-line words and timeout scheduler
# (relayd/compat/web.py); 5.15-5.19 KB with only the request's and channel's dicts right-sized, 7.9 KB
# before that.
MAX_BYTES_PER_STREAM = 2700


class IdleGetStreamMemory(EndpointCase):
    async def test_idle_get_stream_heap(self) -> None:
        endpoint = self.service.resource.endpoint
        socks: list[socket.socket] = []

        def close_all() -> None:
            for sock in socks:
                sock.close()

        self.addCleanup(close_all)

        def streaming() -> int:
            return sum(1 for client in endpoint.clients.values() if client.stream is not None)

        async def open_streams(sids: list[str]) -> None:
            for sid in sids:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                sock.sendall((f"GET {self.url} HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n"
                              f"Authorization: Bearer {TOKEN}\r\nMcp-Session-Id: {sid}\r\n\r\n").encode())
                sock.setblocking(False)  # and reads nothing: an idle client
                socks.append(sock)
                opened = len(socks)
                await wait_until(lambda opened=opened: streaming() == opened)

        await open_streams([await self.initialize() for _ in range(WARM)])
        sids = [await self.initialize() for _ in range(STREAMS)]
        per_stream = await heap_bytes_per(STREAMS, lambda: open_streams(sids))
        self.assertLess(per_stream, MAX_BYTES_PER_STREAM)
