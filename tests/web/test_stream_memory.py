"""What an idle long-lived stream holds on the Python heap (docs/performance.md, "Memory per idle
stream"): real loopback connections, measured with tracemalloc."""

from __future__ import annotations

import socket
import sys
from typing import Any

from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.http_headers import Headers

from relayd.compat.web import SENT, compact, slim_stream, spent_headers
from tests.support.aep import AEPRelay, wait_until
from tests.support.memory import heap_bytes_per

WARM = 50  # opened before measuring: the hub's and the relay's tables grow to their working size
STREAMS = 200
BATCH = 20
# Python-heap bytes per idle AEP SSE stream, this test's client sockets included (~250 B).
# Measured 2.86 KB once a held stream leaves twisted.web (relayd/web/streams/held.py); 3.63 KB when it
# stayed there but dropped its spent headers and its notifyFinish Deferred and shared its local
# address, request-line words and timeout scheduler (relayd/compat/web.py); 5.1-5.7 KB with only the
# request's and channel's dicts right-sized, 7.5 KB before that.
MAX_BYTES_PER_STREAM = 3200


def _open_stream(host: str, port: int, session: int) -> socket.socket:
    """A raw client that asks for a live stream and then reads nothing: an idle subscriber."""
    sock = socket.create_connection((host, port), timeout=5)
    sock.sendall(b"GET /stream?session=S%d HTTP/1.1\r\nHost: localhost\r\n\r\n" % session)
    sock.setblocking(False)
    return sock


class IdleStreamMemory(TestCase):
    async def test_idle_aep_sse_stream_heap(self) -> None:
        relay = await AEPRelay.start()
        self.addCleanup(relay.stop)
        hub: Any = relay.service.site.resource.hub
        host, port = relay.url.split("//")[1].split(":")
        socks: list[socket.socket] = []

        def close_all() -> None:
            for sock in socks:
                sock.close()

        self.addCleanup(close_all)

        async def open_streams(count: int) -> None:
            # In batches smaller than the listen backlog: the reactor accepts between them.
            for i in range(count):
                socks.append(_open_stream(host, int(port), i % 100))
                if len(socks) % BATCH == 0 or i == count - 1:
                    opened = len(socks)
                    await wait_until(lambda opened=opened: len(hub.streams) == opened)

        await open_streams(WARM)
        per_stream = await heap_bytes_per(STREAMS, lambda: open_streams(STREAMS))
        self.assertLess(per_stream, MAX_BYTES_PER_STREAM)
        # Held: each has left twisted.web (relayd/web/streams/held.py), its request and channel freed.
        self.assertEqual([stream.request for stream in hub.streams], [None] * len(hub.streams))
        close_all()
        await wait_until(lambda: not hub.streams)


class _Thing:
    shared = 0
    name = b""

    def __init__(self) -> None:
        for i in range(40):  # more keys than CPython's shared-key dicts hold: a combined dict
            setattr(self, f"a{i}", i)
        self.shared = 0
        self.name = b""
        self.own = [1]


class Compact(SynchronousTestCase):
    def test_entries_repeating_the_class_value_are_left_out(self) -> None:
        thing = _Thing()
        size = sys.getsizeof(thing.__dict__)
        compact(thing, drop=tuple(f"a{i}" for i in range(30)))
        self.assertEqual(sorted(vars(thing)), sorted(["own"] + [f"a{i}" for i in range(30, 40)]))
        self.assertEqual((thing.shared, thing.name, thing.own, vars(thing)["a35"]), (0, b"", [1], 35))
        self.assertLess(sys.getsizeof(thing.__dict__), size / 2)

    def test_a_request_whose_headers_are_not_written_is_left_alone(self) -> None:
        thing = _Thing()
        thing.startedWriting = 0  # type: ignore[attr-defined]
        thing.content = object()  # type: ignore[attr-defined]
        before = dict(vars(thing))
        slim_stream(thing)
        self.assertEqual(vars(thing), before)


class SpentHeaders(SynchronousTestCase):
    def test_only_what_the_access_line_reads_is_kept(self) -> None:
        request = _Thing()
        request.requestHeaders = Headers(  # type: ignore[attr-defined]
            {b"host": [b"x"], b"authorization": [b"Bearer t"], b"x-forwarded-for": [b"198.51.100.1"]}
        )
        request.responseHeaders = Headers({b"content-type": [b"text/event-stream"]})  # type: ignore[attr-defined]
        spent_headers(request)
        self.assertEqual(list(request.requestHeaders.getAllRawHeaders()), [(b"X-Forwarded-For", [b"198.51.100.1"])])
        self.assertIs(request.responseHeaders, SENT)
        request.requestHeaders = Headers({b"host": [b"x"]})  # type: ignore[attr-defined]
        spent_headers(request)
        self.assertIs(request.requestHeaders, SENT)

    def test_what_is_set_on_sent_headers_is_dropped(self) -> None:
        SENT.setRawHeaders(b"x-late", [b"1"])
        SENT.addRawHeader(b"x-late", b"2")
        SENT.removeHeader(b"x-late")
        self.assertEqual(list(SENT.getAllRawHeaders()), [])
