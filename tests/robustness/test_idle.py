"""5000 idle SSE streams and 1000 idle WebSockets held by one real relayd with bounded memory.

The figures (server RSS per connection) are printed and recorded in docs/scaling.md (measured: about
9 KiB per SSE stream and 14 KiB per WebSocket); the bounds here are a little over twice that, so a
regression that doubles per-connection memory fails.
"""

from __future__ import annotations

import json
import signal

import treq
from twisted.internet import reactor
from twisted.internet.defer import DeferredList
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.support.aep import event, ndjson
from tests.support.connections import (
    HeldConnection,
    close_all,
    memory,
    open_many,
    require_open_files,
    sse_request,
    ws_request,
)
from tests.support.twistd import RelaydProcess

SSE = 5000
WS = 1000
WARM = 200  # connections opened before the baseline, so one-off allocations are not billed per connection
SSE_BOUND = 20 * 1024  # bytes of server RSS per idle SSE stream
WS_BOUND = 32 * 1024  # bytes of server RSS per idle WebSocket


class IdleConnections(TestCase):
    timeout = 180

    async def test_5000_sse_and_1000_ws_with_bounded_memory(self) -> None:
        require_open_files(SSE + WS + 2 * WARM + 512)
        # A backlog above the default 50: thousands of connects in a burst would otherwise wait for SYN retries.
        proc = await RelaydProcess.start_for(
            self,
            ["--aep-listen", "tcp:0:interface=127.0.0.1:backlog=1024", "--no-mcp", "--no-access-log",
             "--max-client-connections", "0",  # (every connection is from 127.0.0.1)
             # The WebSockets stay idle before their hello: opening 6000 connections on a loaded machine
             # takes longer than the default 10 s, which would close the first ones before they are counted.
             "--aep-hello-timeout", "600"]
        )
        port, pid = proc.port("aep"), proc.transport.pid
        held: list[HeldConnection] = []
        self.addCleanup(close_all, held)

        sse = lambda: HeldConnection(sse_request(), watch=b"id: W:0:0")  # noqa: E731
        ws = lambda: HeldConnection(ws_request())  # noqa: E731
        held += await open_many(port, WARM, sse)
        held += await open_many(port, WARM, ws)
        base = memory(pid)["VmRSS"]
        held += await open_many(port, SSE - WARM, sse)
        after_sse = memory(pid)["VmRSS"]
        held += await open_many(port, WS - WARM, ws)
        after_ws = memory(pid)["VmRSS"]
        per_sse = (after_sse - base) / (SSE - WARM)
        per_ws = (after_ws - after_sse) / (WS - WARM)
        print(f"\nidle connections: baseline RSS {base / 2**20:.1f} MiB; "
              f"{SSE} SSE + {WS} WS: RSS {after_ws / 2**20:.1f} MiB; "
              f"{per_sse / 1024:.1f} KiB per SSE stream, {per_ws / 1024:.1f} KiB per WebSocket")
        self.assertTrue(all(self.successResultOf(p.ready).startswith(b"HTTP/1.1 200") for p in held[:WARM]))
        self.assertTrue(all(self.successResultOf(p.ready).startswith(b"HTTP/1.1 101") for p in held[WARM : 2 * WARM]))
        self.assertLess(per_sse, SSE_BOUND)
        self.assertLess(per_ws, WS_BOUND)

        # Held, not just accepted: the relay counts them and one event reaches every stream.
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        health = json.loads(await treq.content(await treq.get(f"http://127.0.0.1:{port}/healthz", pool=pool)))
        self.assertEqual((health["subscribers"], health["connections"]), (SSE, WS))
        posted = await treq.post(
            f"http://127.0.0.1:{port}/events", ndjson(event("W", 0)), pool=pool,
            headers={"aep-version": "0.1", "content-type": "application/x-ndjson"},
        )
        self.assertEqual(posted.code, 202)
        streams = [p for p in held if p.watch is not None]
        await DeferredList([p.seen.addTimeout(30, reactor) for p in streams], fireOnOneErrback=True)

        close_all(held)
        self.assertEqual(await proc.terminate(signal.SIGTERM), 0)
