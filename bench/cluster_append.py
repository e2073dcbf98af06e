"""relayd's AEP append on one redis-server against a Redis Cluster, side by side (a benchmark, not a test).

Starts a fresh redis-server and a fresh 3-master Redis Cluster (bench/relayd_process.py, as
bench/aep.py cluster-ingest does; no replicas, no C{WAIT}), one relayd Redis client and
L{RedisEventLog} on each in this process, fills every session's buffer, then appends batches of 100
events of ~500 bytes (bench/aep.py's) with the fan-out publish, a few in flight, in rounds that
alternate between the two stores: the machine's other load falls on both alike, and each round
gives a pair of figures. Reports, per store, this process's CPU per event (relayd's Redis path
alone: the batch argument, the routing, the writes and the replies; no HTTP, no JSON) and
redis-server's (summed over the nodes), and the median over rounds of cluster / standalone:

    PYTHONPATH=. python bench/cluster_append.py [--rounds 10] [--batches 300] [--mix 1]

C{--mix N} deals each timed batch's events round-robin over N sessions (1: one session per batch,
what an HTTP POST of one session is, and what cluster-ingest sends; more: a batch over several
buckets, one append per bucket; the buffers are filled one session per batch). C{--no-publish}
appends without the fan-out message; C{--poolsize S C} gives each master's pool S (one primary) and
C{C} (each cluster master) connections. To compare two trees, run this file with the other tree
first on the path (C{PYTHONPATH=/path/to/other/checkout}): it measures whichever relayd it imports.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from redis_append import event  # bench/ is not a package: its modules import each other from this path
from relayd_process import redis_store


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--batches", type=int, default=300, help="batches per store per round")
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--sessions", type=int, default=128)
    parser.add_argument("--mix", type=int, default=1, help="sessions per batch (its events dealt round-robin)")
    parser.add_argument("--capacity", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=8, help="batches in flight (cluster-ingest: 8 connections)")
    parser.add_argument(
        "--poolsize", type=int, nargs=2, default=(4, 4), help="connections per master: standalone, cluster"
    )
    parser.add_argument("--no-publish", action="store_true", help="append without the fan-out message")
    args = parser.parse_args()

    from twisted.internet import defer, reactor, task

    from relayd.aep.core.event import Event
    from relayd.aep.redis.store import RedisEventLog
    from relayd.base.clock import Timekeeper
    from relayd.storage.cluster import redis_client

    engines = ("standalone", "cluster")
    stores = {engine: redis_store(engine) for engine in engines}
    figures: dict[str, dict[str, list[float]]] = {e: {"client": [], "redis": []} for e in engines}
    counters = {e: [0] * args.sessions for e in engines}

    def plan_of(engine: str, count: int, start: int, mix: int) -> list[list[Event]]:
        """C{count} batches from the C{start}th: batch j takes sessions j*mix... (round-robin), each
        event the next of its session."""
        out, seqs = [], counters[engine]
        for j in range(start, start + count):
            evs = []
            for i in range(args.batch):
                s = (j * mix + i % mix) % args.sessions
                ev = event(f"s{s}", seqs[s])
                seqs[s] += 1
                evs.append(Event(ev, json.dumps(ev, separators=(",", ":")).encode()))
            out.append(evs)
        return out

    async def drive(log: RedisEventLog, todo: list[list[Event]]) -> None:
        it = iter(todo)

        async def worker() -> None:
            for evs in it:
                flags = await log.append(evs, publish=not args.no_publish)
                assert all(flags), "a fresh event was refused"

        await defer.gatherResults([defer.ensureDeferred(worker()) for _ in range(args.in_flight)])

    async def run() -> None:
        logs, clients = {}, []
        for engine in engines:
            # (A long timeout: the figure is CPU, and the machine may be busy.)
            redis = redis_client(
                stores[engine].url,
                Timekeeper(reactor),
                wait_replicas=0,
                timeout=30,
                poolsize=args.poolsize[engines.index(engine)],
            )
            clients.append(redis)
            while not redis.connected:
                await task.deferLater(reactor, 0.01, lambda: None)  # waiting for the pool (the slot map)
            # A quota of every session per bucket: none evicted.
            logs[engine] = RedisEventLog(redis, args.capacity, 64 * args.sessions, publisher="bench")
        await task.deferLater(reactor, 0.5, lambda: None)  # every connection of every pool up
        fill = -(-args.capacity * args.sessions // args.batch)  # every session's buffer full
        for engine in engines:
            await drive(logs[engine], plan_of(engine, fill, 0, 1))
        start = fill
        for _ in range(args.rounds):
            for engine in engines:
                plan = plan_of(engine, args.batches, start, args.mix)
                events = sum(len(b) for b in plan)
                r0, c0 = stores[engine].cpu(), time.process_time()
                await drive(logs[engine], plan)
                figures[engine]["client"].append((time.process_time() - c0) / events * 1e6)
                figures[engine]["redis"].append((stores[engine].cpu() - r0) / events * 1e6)
            start += args.batches
        for redis in clients:
            await redis.close()

    def done(_: Any) -> None:
        reactor.stop()

    def start() -> None:
        defer.ensureDeferred(run()).addErrback(lambda f: (f.printTraceback(), None)[1]).addBoth(done)

    reactor.callWhenRunning(start)
    try:
        reactor.run()
    finally:
        for store in stores.values():
            store.stop()
    out: dict[str, Any] = {"mix": args.mix, "publish": not args.no_publish, "rounds": args.rounds}
    for what in ("client", "redis"):
        for engine in engines:
            out[f"{engine}_{what}_cpu_us_per_event"] = round(statistics.median(figures[engine][what]), 2)
        pairs = [c / s for c, s in zip(figures["cluster"][what], figures["standalone"][what], strict=True) if s]
        out[f"{what}_ratio_median"] = round(statistics.median(pairs), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
