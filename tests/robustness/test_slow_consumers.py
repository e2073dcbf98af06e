"""Consumers that never read cannot grow the server past its bounds (1 MiB soft, 8 MiB hard backlog per
consumer): below-notice events are skipped for them past the soft bound, and past the hard bound they
are cut off (SSE: the connection is aborted; WebSocket: closing frame, close 1013). A consumer that
reads keeps receiving everything meanwhile."""

from __future__ import annotations

import signal

import treq
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.support.aep import event, ndjson
from tests.support.connections import HeldConnection, close_all, memory, open_many, sse_request
from tests.support.metrics import scrape, value
from tests.support.twistd import RelaydProcess
from tests.support.ws import WSClient

SLOW_SSE = 3
SLOW_WS = 2
HARD = 8 * 2**20
BATCHES = 48  # of about 1 MiB each: without bounds every slow consumer would hold all of it
PER_BATCH = 900
PAD = "x" * 1000


class SlowConsumers(TestCase):
    timeout = 120

    async def test_memory_stays_within_the_backlog_bounds(self) -> None:
        proc = await RelaydProcess.start_for(
            self,
            [
                "--aep-listen", "tcp:0:interface=127.0.0.1",
                "--metrics-listen", "tcp:0:interface=127.0.0.1",
                "--aep-buffer", "64",  # keep history small: the test is about consumer queues
                "--no-mcp", "--no-access-log",
            ],
            wait_for=("aep", "metrics"),
        )
        port, pid = proc.port("aep"), proc.transport.pid
        metrics_url = f"http://127.0.0.1:{proc.port('metrics')}/metrics"
        pool = HTTPConnectionPool(reactor, persistent=True)
        self.addCleanup(pool.closeCachedConnections)

        last = f"id: F:0:{BATCHES * PER_BATCH - 1}\n".encode()
        fast = (await open_many(port, 1, lambda: HeldConnection(sse_request(), watch=last)))[0]
        slow = await open_many(port, SLOW_SSE, lambda: HeldConnection(sse_request(), stop_reading=True))
        self.addCleanup(close_all, [fast, *slow])
        sockets = []
        for _ in range(SLOW_WS):
            ws = await WSClient.connect(f"ws://127.0.0.1:{port}/socket")
            await ws.hello(role="consumer")
            ws.send({"type": "subscribe", "id": 1})
            self.assertEqual((await ws.recv())["type"], "subscribed")
            ws.protocol.transport.pauseProducing()  # never reads again
            sockets.append(ws)
        base = memory(pid)["VmRSS"]

        seq = 0
        for batch in range(BATCHES):
            # A quarter of the traffic is info (skippable for a lagging consumer), the rest notice.
            severity = "info" if batch % 4 == 0 else "notice"
            events = [event("F", seq + i, severity=severity, data={"pad": PAD}) for i in range(PER_BATCH)]
            seq += PER_BATCH
            response = await treq.post(
                f"http://127.0.0.1:{port}/events", ndjson(*events), pool=pool,
                headers={"aep-version": "0.1", "content-type": "application/x-ndjson"},
            )
            self.assertEqual(response.code, 202)
            await treq.content(response)
        produced = seq * (len(PAD) + 200)
        await fast.seen.addTimeout(30, reactor)  # the reading consumer got the last event

        peak = memory(pid)["VmHWM"]
        growth = peak - base
        consumers = SLOW_SSE + SLOW_WS
        bound = consumers * HARD * 1.25 + 48 * 2**20
        print(f"\nslow consumers: {consumers} never reading, {produced / 2**20:.0f} MiB produced; server RSS "
              f"{base / 2**20:.0f} MiB -> peak {peak / 2**20:.0f} MiB (+{growth / 2**20:.0f} MiB, bound "
              f"{bound / 2**20:.0f} MiB; unbounded would be +{consumers * produced / 2**20:.0f} MiB)")
        self.assertLess(growth, bound)

        # The relay says what it did: skipped info events, cut the lagging consumers off.
        samples, _ = await scrape(metrics_url, pool)
        while value(samples, "relayd_connections", relay="aep", transport="sse") > 1:
            samples, _ = await scrape(metrics_url, pool)  # an abort completes on a later reactor turn
        self.assertGreater(value(samples, "relayd_events_dropped_total", relay="aep", reason="slow-consumer"), 0)
        self.assertGreater(value(samples, "relayd_events_dropped_total", relay="aep", reason="cut-off"), 0)
        self.assertEqual(value(samples, "relayd_connections", relay="aep", transport="sse"), 1)
        self.assertEqual(value(samples, "relayd_connections", relay="aep", transport="ws"), 0)

        for ws in sockets:
            ws.protocol.transport.resumeProducing()
            code, _ = await ws.closed.addTimeout(30, reactor)
            # 1013 if the close frame is read; 1006 when the relay dropped the connection after its
            # close handshake timed out (the frame sat behind megabytes the client never read).
            self.assertIn(code, (1013, 1006))
        close_all([fast, *slow])
        self.assertEqual(await proc.terminate(signal.SIGTERM), 0)
