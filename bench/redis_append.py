"""redis-server's CPU per event for the AEP append script alone (a benchmark, not a test).

Starts a throwaway redis-server, fills 8 sessions to the buffer (1000 events each), then appends
batches of 100 events of ~500 bytes (the bench/aep.py ingest events) round-robin over the sessions,
a few batches in flight, through this tree's L{RedisEventLog} (with the fan-out publish, as ingest
does). Reports redis-server's CPU per event and this process's (building the batch argument and
reading the reply):

    PYTHONPATH=. python bench/redis_append.py [--batches 2000] [--batch 100]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from typing import Any

from relayd_process import RedisProcess  # bench/ is not a package: its modules import each other from this path

PAD = "x" * 330  # as bench/aep.py (not imported: it selects asyncio for autobahn): each event about 500 bytes


def event(session: str, seq: int) -> dict[str, Any]:
    """bench/aep.py's ingest event."""
    return {"aep": "0.1", "id": f"{session}-{seq}", "type": "progress.status", "time": "2026-11-29T00:00:00Z",
            "source": f"aep://bench/agent/a/session/{session}", "agent": "bench", "session": session,
            "seq": seq, "severity": "notice", "data": {"message": PAD}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=4)
    parser.add_argument("--replays", type=int, default=20, help="paged replays of every session afterwards")
    parser.add_argument("--perf", help="perf record redis-server over the timed batches into this file")
    args = parser.parse_args()

    from twisted.internet import defer, reactor, task

    from relayd.aep.core.event import Event
    from relayd.aep.redis.store import RedisEventLog
    from relayd.base.clock import Timekeeper
    from relayd.storage.redis import Redis

    server = RedisProcess()
    port, proc = server.port, server.proc
    result: dict[str, Any] = {}

    def batches(session: int, first: int, count: int) -> list[list[Event]]:
        out = []
        for b in range(count):
            evs = []
            for i in range(args.batch):
                ev = event(f"s{session}", first + b * args.batch + i)
                evs.append(Event.of(ev, json.dumps(ev, separators=(",", ":")).encode()))
            out.append(evs)
        return out

    async def run() -> None:
        redis = Redis(f"redis://127.0.0.1:{port}/0", Timekeeper(reactor))
        factory = redis._pool._factory
        while factory.size < factory.poolsize:
            await task.deferLater(reactor, 0.01, lambda: None)  # waiting for the pool to connect
        log = RedisEventLog(redis, args.capacity, 64, publisher="bench")
        fill = -(-args.capacity // args.batch)
        per_session = -(-args.batches // args.sessions)
        plan: list[list[Event]] = []
        warm: list[list[Event]] = []
        made = [batches(s, 0, fill + per_session) for s in range(args.sessions)]
        for b in range(fill):
            warm.extend(made[s][b] for s in range(args.sessions))
        for b in range(fill, fill + per_session):
            plan.extend(made[s][b] for s in range(args.sessions))
        plan = plan[: args.batches]

        async def drive(todo: list[list[Event]]) -> None:
            it = iter(todo)

            async def worker() -> None:
                for evs in it:
                    flags = await log.append(evs, publish=True)
                    assert all(flags), "a fresh event was refused"

            await defer.gatherResults([defer.ensureDeferred(worker()) for _ in range(args.in_flight)])

        await drive(warm)
        events = sum(len(b) for b in plan)
        perf = None
        if args.perf:
            # BENCH_CALLGRAPH=dwarf for call chains (redis-server is built without frame pointers).
            graph = os.environ.get("BENCH_CALLGRAPH", "fp")
            perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock:u", "--call-graph", graph, "-o", args.perf,
                                     "-p", str(proc.pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            await task.deferLater(reactor, 0.5, lambda: None)  # perf attaching
        r0, c0, t0 = server.cpu(), time.process_time(), time.perf_counter()
        await drive(plan)
        if perf is not None:
            perf.send_signal(2)
            perf.wait()
        wall = time.perf_counter() - t0
        redis_cpu, client_cpu = server.cpu() - r0, time.process_time() - c0
        result.update(events=events, redis_cpu_us_per_event=round(redis_cpu / events * 1e6, 2),
                      client_cpu_us_per_event=round(client_cpu / events * 1e6, 2),
                      events_per_s=round(events / wall))
        replay = await log.replay("s0", (0, -1))
        result["replayed"] = len(replay.events)
        # Reading it back as relayd does (pages of 512, relayd/aep/core/relay.py), over every session.
        r0, read = server.cpu(), 0
        for _ in range(args.replays):
            for s in range(args.sessions):
                cursor = None
                while True:
                    page = await log.replay(f"s{s}", (0, -1), 512, cursor)
                    read += len(page.events)
                    if page.cursor is None:
                        break
                    cursor = page.cursor
        if read:
            result["replay_redis_cpu_us_per_event"] = round((server.cpu() - r0) / read * 1e6, 2)
        # What the sessions' buffers take in Redis (8 x 1000 events of ~500 bytes by default).
        info = await redis.execute("bench", "INFO", "memory")
        used = re.search(rb"used_memory:(\d+)", info if isinstance(info, bytes) else info.encode())
        result["redis_used_memory_mb"] = round(int(used.group(1)) / 1e6, 1) if used else None
        await redis.close()

    def done(_: Any) -> None:
        reactor.stop()

    def start() -> None:
        defer.ensureDeferred(run()).addErrback(lambda f: (f.printTraceback(), None)[1]).addBoth(done)

    reactor.callWhenRunning(start)
    try:
        reactor.run()
    finally:
        server.stop()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
