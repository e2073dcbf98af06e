"""Slowloris-style partial requests are timed out, and oversize headers and bodies answer 4xx, on every
listener of a real relayd (AEP, MCP, metrics). The trickling clients keep sending a byte every 0.2 s,
which would reset an idle timer forever; the header and body deadlines (1 s here) end them."""

from __future__ import annotations

import re
import signal
import time

from twisted.internet import reactor
from twisted.internet.defer import Deferred, gatherResults
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.internet.task import LoopingCall
from twisted.trial.unittest import TestCase

from tests.support.raw import RawClient
from tests.support.twistd import RelaydProcess

DEADLINE = 1.0


async def _connect(port: int) -> RawClient:
    client = RawClient()
    await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", port), client)
    return client


async def trickle(port: int, head: bytes) -> tuple[bytes, float]:
    """Send C{head}, then one more byte every 0.2 s until the server closes; (answer, seconds)."""
    client = await _connect(port)
    started = time.monotonic()
    client.transport.write(head)
    loop = LoopingCall(lambda: client.transport.write(b"x"))
    loop.clock = reactor
    loop.start(0.2, now=False)
    try:
        await client.closed.addTimeout(15, reactor)
    finally:
        if loop.running:
            loop.stop()
    return client.received, time.monotonic() - started


async def exchange(port: int, data: bytes) -> bytes:
    """Send C{data} and return everything the server answers before it closes."""
    client = await _connect(port)
    client.transport.write(data)
    await client.closed.addTimeout(15, reactor)
    return client.received


class SlowAndOversize(TestCase):
    timeout = 60

    async def test_every_listener(self) -> None:
        proc = await RelaydProcess.start_for(
            self,
            [
                "--aep-listen", "tcp:0:interface=127.0.0.1",
                "--mcp-listen", "tcp:0:interface=127.0.0.1",
                "--metrics-listen", "tcp:0:interface=127.0.0.1",
                "--header-timeout", str(DEADLINE), "--body-timeout", str(DEADLINE),
                "--aep-max-body", "65536",
            ],
            wait_for=("aep", "mcp", "metrics"),
        )
        ports = {relay: proc.port(relay) for relay in ("aep", "mcp", "metrics")}

        # Slowloris: headers trickled on every listener, and a body trickled on the AEP one.
        slow = [trickle(port, b"GET /healthz HTTP/1.1\r\nX-Slow: ") for port in ports.values()]
        slow.append(trickle(ports["aep"], b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\n"
                            b"content-type: application/x-ndjson\r\ncontent-length: 5000\r\n\r\n"))
        results = await gatherResults([Deferred.fromCoroutine(c) for c in slow])
        for answer, seconds in results:
            self.assertTrue(answer.startswith(b"HTTP/1.1 408 "), answer[:80])
            self.assertGreaterEqual(seconds, DEADLINE * 0.9)
            self.assertLess(seconds, DEADLINE + 3)

        # Oversize request lines and header blocks: 431 everywhere.
        long_header = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
        for port in ports.values():
            self.assertTrue((await exchange(port, long_header)).startswith(b"HTTP/1.1 431 "))
        many_headers = b"GET /healthz HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 60) for i in range(400))
        many_headers += b"\r\n"
        self.assertTrue((await exchange(ports["aep"], many_headers)).startswith(b"HTTP/1.1 431 "))

        # Oversize bodies: 413, answered without reading the whole upload.
        def post(path: bytes, size: int, extra: bytes = b"") -> bytes:
            return (b"POST " + path + b" HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n" + extra
                    + b"content-length: %d\r\n\r\n" % size + b"{" * min(size, 1024))

        aep = await exchange(ports["aep"], post(b"/events", 10 * 2**20, b"aep-version: 0.1\r\n"))
        self.assertTrue(aep.startswith(b"HTTP/1.1 413 "), aep[:80])
        self.assertIn(b'"payload-too-large"', aep)
        mcp = await exchange(ports["mcp"], post(b"/sess/inbox?token=t", 10 * 2**20))
        self.assertTrue(mcp.startswith(b"HTTP/1.1 413 "), mcp[:80])
        metrics = await exchange(ports["metrics"], post(b"/metrics", 10 * 2**20))
        self.assertTrue(metrics.startswith(b"HTTP/1.1 413 "), metrics[:80])

        self.assertEqual(await proc.terminate(signal.SIGTERM), 0)
        statuses = re.findall(rb'"(?:GET|POST|-) [^"]*" (\d{3})', proc.log)
        self.assertEqual(statuses.count(b"408"), 4)
        self.assertNotIn(b"Traceback", proc.log)
