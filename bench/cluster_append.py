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

C{--masters M} makes the cluster of M masters (1: what cluster mode itself costs, on as many processes
as one primary). C{--callgrind DIR} runs every redis-server under callgrind and reports each node's
instructions per event over the timed batches (they do not move with the machine's load, CPU time
does; use one round).

Each node's C{INFO commandstats} (calls, usec), C{INFO stats} and C{INFO cpu} over the timed batches
are printed per event too (C{*_nodes_per_event}).

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
import os
import statistics
import subprocess
import time
from typing import Any

import relayd_process
from redis_append import event  # bench/ is not a package: its modules import each other from this path
from relayd_process import command_stats, node_counters, process_switches, redis_store


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
    parser.add_argument("--masters", type=int, default=3, help="masters of the cluster (1: cluster mode on one "
                        "process, against the same one process without it)")
    parser.add_argument("--callgrind", metavar="DIR", help="run every redis-server under callgrind (its output in "
                        "DIR) and report each node's instructions per event over the timed batches (one round "
                        "per store: the count does not move with the machine's load)")
    args = parser.parse_args()
    if args.callgrind:
        os.makedirs(args.callgrind, exist_ok=True)
        relayd_process.REDIS_WRAPPER[:] = ["valgrind", "--tool=callgrind",
                                           f"--callgrind-out-file={os.path.abspath(args.callgrind)}/callgrind.out.%p"]

    from twisted.internet import defer, reactor, task

    from relayd.aep.core.event import Event
    from relayd.aep.redis.store import RedisEventLog
    from relayd.base.clock import Timekeeper
    from relayd.storage.cluster import redis_client

    engines = ("standalone", "cluster")
    stores = {engine: redis_store(engine, args.masters) for engine in engines}
    figures: dict[str, dict[str, list[float]]] = {e: {"client": [], "redis": []} for e in engines}
    # Per engine, over its rounds: each node's commandstats and counters before and after, and
    # (--callgrind) its instructions.
    nodes: dict[str, list[Any]] = {e: [] for e in engines}
    instructions: dict[str, list[int]] = {e: [] for e in engines}
    timed_events: dict[str, int] = dict.fromkeys(engines, 0)
    timed_seconds: dict[str, float] = dict.fromkeys(engines, 0.0)
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
                evs.append(Event.of(ev, json.dumps(ev, separators=(",", ":")).encode()))
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
                before = node_reading(stores[engine])
                if args.callgrind:
                    for pid in stores[engine].node_pids:
                        subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
                r0, c0, w0 = stores[engine].cpu(), time.process_time(), time.perf_counter()
                await drive(logs[engine], plan)
                timed_seconds[engine] += time.perf_counter() - w0
                figures[engine]["client"].append((time.process_time() - c0) / events * 1e6)
                figures[engine]["redis"].append((stores[engine].cpu() - r0) / events * 1e6)
                if args.callgrind:
                    counts = [callgrind_total(pid, args.callgrind) for pid in stores[engine].node_pids]
                    instructions[engine] = [a + b for a, b in zip(counts, instructions[engine] or [0] * len(counts),
                                                                  strict=True)]
                nodes[engine].append((before, node_reading(stores[engine])))
                timed_events[engine] += events
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
    for engine in engines:
        per = timed_events[engine]
        # Summed over the rounds: each node's commands (calls, usec) and counters, per event.
        tables = []
        for node in range(len(nodes[engine][0][0])):
            commands: dict[str, list[int]] = {}
            sums: dict[str, float] = {}
            for before, after in nodes[engine]:
                (s0, k0), (s1, k1) = before[node], after[node]
                for name, (c1, u1) in s1.items():
                    c0, u0 = s0.get(name, (0, 0))
                    if c1 != c0 and name != "info":
                        total = commands.setdefault(name, [0, 0])
                        total[0] += c1 - c0
                        total[1] += u1 - u0
                for name in k1:
                    sums[name] = sums.get(name, 0.0) + k1[name] - k0.get(name, 0.0)
            tables.append({"commands": dict(sorted(commands.items())),
                           **{name + ("_us" if name.startswith("used_cpu") else ""):
                              round(value / per * (1e6 if name.startswith("used_cpu") else 1), 4)
                              for name, value in sums.items()}})
        out[f"{engine}_timed_events"] = per
        out[f"{engine}_timed_seconds"] = round(timed_seconds[engine], 2)  # (a node's idle background runs as long)
        out[f"{engine}_nodes_per_event"] = tables  # (the counters per event; INFO cpu's in µs)
        if args.callgrind:
            out[f"{engine}_instructions_per_event"] = [round(n / per) for n in instructions[engine]]
            out[f"{engine}_instructions_per_event_total"] = round(sum(instructions[engine]) / per)
    if args.callgrind:
        out["instructions_ratio"] = round(out["cluster_instructions_per_event_total"]
                                          / out["standalone_instructions_per_event_total"], 3)
    print(json.dumps(out))


def node_reading(store: Any) -> list[Any]:
    """Each node's commandstats and counters now, with its context switches (how often it slept
    and woke, and how often it was preempted)."""
    return [(command_stats(port), {**node_counters(port), **dict(zip(
        ("voluntary_switches", "involuntary_switches"), process_switches(pid), strict=True))})
        for port, pid in zip(store.node_ports, store.node_pids, strict=True)]


def callgrind_total(pid: int, directory: str) -> int:
    """The instructions callgrind counted in process C{pid} since its counters were last zeroed
    (C{callgrind_control -d}: the totals of the dump it writes in C{directory})."""
    before = set(os.listdir(directory))
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    fresh = [name for name in os.listdir(directory) if name not in before and f".{pid}." in name]
    total = 0
    for name in fresh:
        with open(os.path.join(directory, name)) as dump:
            for line in dump:
                if line.startswith("totals:") or line.startswith("summary:"):
                    total = max(total, int(line.split()[1]))
    return total


if __name__ == "__main__":
    main()
