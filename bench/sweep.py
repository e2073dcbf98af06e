"""Performance curves (a benchmark, not a test): bench/aep.py's fan-out scenarios swept across sizes.

Each point starts its own ``twistd -n relayd`` (and redis-server) through bench/aep.py's scenario
code, records server CPU per delivery and the p99 delivery latency with the load average around it,
writes the raw points to docs/perf/<curve>.json and draws docs/perf/<curve>.png (matplotlib: the
``bench`` extra, ``pip install -e '.[bench]'``).

    python bench/sweep.py                        # every curve, three runs per point: about 16 minutes
    python bench/sweep.py subscribers sessions   # a selection
    python bench/sweep.py --plot                 # redraw the PNGs from the JSON already there

Curves:

- subscribers: one WebSocket emitter -> 100, 1 000, 10 000 SSE subscribers to one session, then
  100 000 subscriptions multiplexed 64 to a WebSocket connection (one process cannot hold 100 000
  sockets here: the hard open-file limit is 20 000).
- sessions: 1 000 SSE subscribers spread evenly over 1, 10, 100, 1 000 sessions, events POSTed
  (NDJSON, one POST per 10 ms) round-robin across the sessions.
- redis: --redis, emitter and subscribers on one instance, or emitter on A and subscribers on B,
  at 100, 1 000, 10 000 SSE subscribers (one redis-server started by the bench).

Every point sends each subscriber one event per write (at most 100 events/s to a session, so a
10 ms burst never holds two) and at most 20 000 deliveries/s in all (L{rate_for}): 100 subscribers
get 100 events/s, 1 000 get 20, 10 000 get 2, 100 000 get 0.2, and a point sends for at least 10
events. CPU is the relayd processes' own (user + system from /proc); latency is measured by the 20
subscribers that subscribed last, which each fan-out reaches last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import aep  # bench/ is not a package: its modules import each other from this path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "perf"

# Deliveries/s at most: at one event per write a delivery costs 14-17 µs of server CPU on this shared
# machine, so 20 000/s is a third of a core. More, and the server falls behind, its writes start
# carrying several events each and CPU per delivery drops for that reason alone.
MAX_DELIVERIES = 20_000
MAX_RATE = 100.0  # events/s to one session: the emitter's 10 ms bursts then hold one event each
MIN_EVENTS = 10  # per point, so the slowest (1 event/s) still gives its p99 a few hundred samples
TIMED = 20  # subscribers that time each delivery (the rest are held by a drain process)
WS_PER_CONN = 64  # relayd's default --aep-max-subscriptions
SESSIONS_TOTAL = 1000  # subscribers in the sessions curve
MAX_PER_POST = 1000  # events in one POST of the sessions curve (relayd parses 1 000 lines per turn)
SESSIONS_PER_STREAM = MAX_DELIVERIES / SESSIONS_TOTAL  # events/s each subscriber receives there

Point = dict[str, Any]


def rate_for(subscribers: int) -> float:
    """Events/s to one session of C{subscribers}: one event per write, at most L{MAX_DELIVERIES}/s."""
    return min(MAX_RATE, MAX_DELIVERIES / subscribers)


def seconds_for(rate: float, seconds: float) -> float:
    """A point's sending time: C{seconds}, longer where the rate would send fewer than L{MIN_EVENTS}."""
    return max(seconds, MIN_EVENTS / rate)


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (other work shares the two cores)."""
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


MEDIANS = ("server_cpu_us_per_delivery", "server_cpu_us_per_event", "redis_cpu_us_per_delivery", "p50_ms", "p99_ms",
           "deliveries_per_s", "server_cpu_share")


async def measured(curve: str, x: int, label: str, repeat: int, run: Callable[[], Awaitable[Point]]) -> Point:
    """Run one point C{repeat} times (each run its own server), with the load average before and
    after each run; the point's figures are the medians of its runs (every run is kept)."""
    runs = []
    for _ in range(repeat):
        before, t0 = loadavg(), time.perf_counter()
        result = await run()
        result = {"load_before": before, "load_after": loadavg(), "wall_s": time.perf_counter() - t0, **result}
        runs.append({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})
        print(json.dumps({"curve": curve, "x": x, "label": label, **runs[-1]}), flush=True)
    point: Point = {"curve": curve, "x": x, "label": label,
                    "complete": all(r["deliveries"] == r["expected"] for r in runs)}
    for key in MEDIANS:
        if key in runs[0]:
            point[key] = round(statistics.median(r[key] for r in runs), 3)
    point["runs"] = runs
    return point


# The sessions curve: events POSTed across sessions -------------------------------------------


def templates(sessions: int) -> list[bytes]:
    """Per session, an NDJSON line of L{aep.event} with %d for its seq (twice: id and seq) and %f
    for its send time, so the poster formats bytes instead of encoding JSON (its CPU is shared)."""
    out = []
    for k in range(sessions):
        line = json.dumps(aep.event(aep.drain_session(k, sessions), 123456789, t=1111111111.25),
                          separators=(",", ":")).encode()
        out.append(line.replace(b"123456789", b"%d").replace(b"1111111111.25", b"%.6f") + b"\n")
    return out


async def post_across(port: int, rate: float, sessions: int, seconds: float) -> list[int]:
    """POST C{rate} events/s for C{seconds} on one connection, one NDJSON body per 10 ms tick
    holding the events then due, each to the next session in turn; the events sent per session.

    Each event carries the time it was due, not the time it was sent: when the relay answers late
    the poster falls behind (it waits for each 202), and that wait is part of the latency. A body
    holds at most L{MAX_PER_POST} events (relayd's --aep-max-batch is 10 000)."""
    lines = templates(sessions)
    counts = [0] * sessions
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    start, epoch = time.perf_counter(), time.time()
    while (elapsed := time.perf_counter() - start) < seconds:
        due = min(int(elapsed * rate) + 1, sent + MAX_PER_POST)
        if due <= sent:
            await asyncio.sleep(0.01)
            continue
        parts = []
        for n in range(sent, due):
            k = n % sessions
            parts.append(lines[k] % (1000 + counts[k], 1000 + counts[k], epoch + n / rate))
            counts[k] += 1
        sent = due
        body = b"".join(parts)
        writer.write(b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\n%s"
                     b"content-type: application/x-ndjson\r\ncontent-length: %d\r\n\r\n" % (aep.auth(), len(body))
                     + body)
        head = await aep.read_response(reader)
        assert head.startswith(b"HTTP/1.1 202"), head
    writer.close()
    return counts


async def scenario_sessions(total: int, sessions: int, per_stream: float, seconds: float, timed: int) -> Point:
    """C{total} SSE subscribers, C{total // sessions} to each of C{sessions} sessions, each receiving
    C{per_stream} events/s posted across the sessions; C{timed} of them time their deliveries."""
    server = aep.Server("--aep-max-sessions", str(sessions + 100))
    try:
        await aep.wait_ready(server.port)
        drainer = aep.Drainer(server.port, "sse", total - timed, sessions=sessions, first=timed)
        subs: list[aep.SSESubscriber] = []
        tasks = []
        for k in range(timed):
            sub = aep.SSESubscriber(timed=True)
            ready = asyncio.Event()
            flt = json.dumps({"session": aep.drain_session(k, sessions)}, separators=(",", ":"))
            path = "/stream?filter=" + urllib.parse.quote(flt, safe="")
            tasks.append(asyncio.ensure_future(sub.run(server.port, path, ready)))
            await ready.wait()
            subs.append(sub)
        await asyncio.sleep(0.5)
        rate = per_stream * sessions
        cpu0, t0 = server.cpu(), time.perf_counter()
        counts = await post_across(server.port, rate, sessions, seconds)
        wanted = [counts[k % sessions] for k in range(timed)]
        deadline = time.perf_counter() + 10
        while any(s.count < w for s, w in zip(subs, wanted, strict=True)) and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the drain process read the tail
        wall, cpu = time.perf_counter() - t0, server.cpu() - cpu0
        delivered = sum(s.count for s in subs) + drainer.total()
        sent = sum(counts)
        latencies = [x for s in subs for x in s.latencies]
        for t in tasks:
            t.cancel()
        return {"subscribers": total, "sessions": sessions, "events": sent, "rate": rate,
                "deliveries": delivered, "expected": sent * total // sessions,
                "deliveries_per_s": delivered / (wall - 0.5),
                "server_cpu_us_per_delivery": cpu / max(delivered, 1) * 1e6,
                "server_cpu_us_per_event": cpu / max(sent, 1) * 1e6, "server_cpu_share": cpu / wall,
                "p50_ms": aep.pct(latencies, 0.5) * 1000, "p99_ms": aep.pct(latencies, 0.99) * 1000,
                "latency_samples": len(latencies)}
    finally:
        server.stop()


# The curves ----------------------------------------------------------------------------------


async def curve_subscribers(seconds: float, repeat: int) -> list[Point]:
    points = []
    for n in (100, 1000, 10000):
        rate = rate_for(n)
        points.append(await measured("subscribers", n, "SSE", repeat, lambda n=n, rate=rate: aep.scenario_fanout(
            n, "sse", rate, seconds_for(rate, seconds), TIMED)))
    n, rate = 100_000, rate_for(100_000)
    label = f"WebSocket, {WS_PER_CONN} subscriptions per connection"
    points.append(await measured("subscribers", n, label, repeat, lambda: aep.scenario_fanout(
        n, "ws", rate, seconds_for(rate, seconds), TIMED, per_conn=WS_PER_CONN)))
    return points


async def curve_sessions(seconds: float, repeat: int) -> list[Point]:
    return [await measured("sessions", k, "SSE", repeat, lambda k=k: scenario_sessions(
        SESSIONS_TOTAL, k, SESSIONS_PER_STREAM, seconds, TIMED)) for k in (1, 10, 100, 1000)]


async def curve_redis(seconds: float, repeat: int) -> list[Point]:
    points = []
    for n in (100, 1000, 10000):
        rate = rate_for(n)
        for instances, label in ((1, "Redis, one instance"), (2, "Redis, two instances")):
            points.append(await measured("redis", n, label, repeat, lambda n=n, rate=rate, i=instances:
                                         aep.scenario_cluster_fanout(n, rate, seconds_for(rate, seconds), TIMED, i)))
    return points


CURVES: dict[str, Callable[[float, int], Awaitable[list[Point]]]] = {
    "subscribers": curve_subscribers, "sessions": curve_sessions, "redis": curve_redis}


# Drawing -------------------------------------------------------------------------------------


def spread(group: list[Point], value: Callable[[Point], float]) -> tuple[list[float], list[list[float]]]:
    """Per point, the median of C{value} over its runs and the distance to their min and max
    (matplotlib's errorbar arguments)."""
    medians, below, above = [], [], []
    for p in group:
        values = [value(r) for r in p["runs"]]
        mid = statistics.median(values)
        medians.append(mid)
        below.append(mid - min(values))
        above.append(max(values) - mid)
    return medians, [below, above]


def draw(curve: str, out: Path) -> Path:
    """docs/perf/<curve>.png from docs/perf/<curve>.json (and, for redis, subscribers.json's SSE
    points as the in-memory reference): CPU per delivery left, p99 latency right, log-scale x;
    the median of each point's runs, with their range as a bar."""
    import matplotlib

    matplotlib.use("Agg")  # no display; a PNG only
    import matplotlib.pyplot as plt

    run = json.loads((out / f"{curve}.json").read_text())
    points: list[Point] = run["points"]
    series: dict[str, list[Point]] = {}
    for p in points:
        series.setdefault(p["label"], []).append(p)
    if curve == "redis" and (out / "subscribers.json").exists():
        memory = [p for p in json.loads((out / "subscribers.json").read_text())["points"] if p["label"] == "SSE"]
        series = {"in memory, one instance": memory, **series}
    fig, (cpu_ax, lat_ax) = plt.subplots(1, 2, figsize=(8, 5), dpi=100)
    for i, (label, group) in enumerate(series.items()):
        # Series sharing an x are nudged apart so their bars (the runs' range) stay readable.
        xs = [p["x"] * 1.08 ** (i - (len(series) - 1) / 2) for p in group]
        style = {"marker": "o", "capsize": 3} if len(group) > 1 else {
            "marker": "s", "linestyle": "none", "markersize": 8, "capsize": 3}
        drawn = cpu_ax.errorbar(xs, *spread(group, lambda r: r["server_cpu_us_per_delivery"]), label=label, **style)
        color = drawn.lines[0].get_color()
        if curve == "redis" and label.startswith("Redis"):
            # relayd's CPU alone flatters Redis: redis-server's share, dashed, is part of the cost.
            cpu_ax.errorbar(xs, *spread(group, lambda r: r["server_cpu_us_per_delivery"] + r["redis_cpu_us_per_delivery"]),
                            linestyle="--", marker=".", capsize=2, color=color, label=f"{label} + redis-server")
        lat_ax.errorbar(xs, *spread(group, lambda r: r["p99_ms"]), label=label, color=color, **style)
    xlabel = {"subscribers": "subscribers to one session", "sessions": f"sessions ({SESSIONS_TOTAL:,} subscribers in all)",
              "redis": "SSE subscribers to one session"}[curve]
    for ax, ylabel in ((cpu_ax, "server CPU per delivery (µs)"), (lat_ax, "p99 delivery latency (ms)")):
        ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({p["x"] for g in series.values() for p in g}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.grid(True, which="major", alpha=0.3)
    cpu_ax.set_ylim(bottom=0)
    lat_ax.set_yscale("log")
    cpu_ax.legend(fontsize=7, loc="best")
    loads = [x for p in points for r in p["runs"] for x in (r["load_before"][0], r["load_after"][0])]
    title = {"subscribers": "Fan-out against subscribers", "sessions": "Fan-out against sessions",
             "redis": "Fan-out on Redis: one instance, two instances"}[curve]
    fig.suptitle(f"{title}\n{run['date']}, 2 cores shared, 1-min load average {min(loads):.1f}-{max(loads):.1f}",
                 fontsize=10)
    fig.tight_layout()
    path = out / f"{curve}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def main(selected: list[str], seconds: float, repeat: int, out: Path, command: str) -> None:
    aep.raise_nofile()
    out.mkdir(parents=True, exist_ok=True)
    for name in selected:
        points = await CURVES[name](seconds, repeat)
        run = {"curve": name, "command": command, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "machine": {"cpus": os.cpu_count(), "python": platform.python_version()}, "points": points}
        (out / f"{name}.json").write_text(json.dumps(run, indent=1) + "\n")
        print(draw(name, out), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("curves", nargs="*", help=f"of {', '.join(CURVES)} (default: all of them)")
    parser.add_argument("--seconds", type=float, default=5.0, help="sending time per point (longer at 1 event/s)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per point (the median is drawn, the range as a bar)")
    parser.add_argument("--out", type=Path, default=OUT, help="where the JSON and PNG files go")
    parser.add_argument("--plot", action="store_true", help="only redraw the PNGs from the JSON files")
    args = parser.parse_args()
    curves = args.curves or list(CURVES)
    if set(curves) - set(CURVES):
        parser.error(f"unknown curve: {', '.join(sorted(set(curves) - set(CURVES)))}")
    if args.plot:
        for name in curves:
            print(draw(name, args.out))
    else:
        asyncio.run(main(curves, args.seconds, args.repeat, args.out, " ".join(["python", "bench/sweep.py", *sys.argv[1:]])))
