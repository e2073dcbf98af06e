"""Buzz broker benchmark: host CPU per action, message.post actions/s, replayed verdicts/s.

Starts PyPI nostr-relay (NIP-42 on) on a free loopback port and an in-process broker pointed at it
(with C{--redis}, also a private redis-server, and the broker keeps its receipts there).

 - host CPU per action: C{BrokerHost.handle} called directly (no HTTP), sequentially; CPU time of
   this process (user + system, every thread: reactor and SQLite worker) divided by actions. The
   relay runs in its own process, so its time is excluded; the broker's side of the relay
   connection (framing, parsing, sending) is included. Reported as the median of C{--rounds}
   rounds, because other processes on a 2-core machine inflate some rounds.
 - end to end: C{POST /v1/action} over loopback HTTP. message.post with N concurrent in-process
   clients (their CPU is ours, so the figure is pessimistic); replays from C{--clients} separate
   client processes on keep-alive connections, each sending its next request when the previous
   answer arrived (raw sockets, so the load generator's own CPU stays small); the server's CPU per
   replayed verdict over HTTP is this process's CPU during that phase.

 - state directory size (C{--mix N}, instead of the figures above): N actions of a realistic mix
   (see L{MIX}) through C{BrokerHost.handle} against the real relay, the receipts' clock spread
   over C{--spread-days} with C{--retention-days} of retention, swept as relayd sweeps; reports the
   directory's size (database + WAL) and the receipts held, at 10% steps.

usage: PYTHONPATH=. python bench/broker.py [--posts 500] [--reads 100] [--replays 5000]
       [--concurrency 16] [--clients 2] [--rounds 5] [--redis]
       PYTHONPATH=. python bench/broker.py --mix 100000 [--retention-days 30] [--spread-days 60] [--max-receipts N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import defer, task

from relayd.buzz.core import contract
from tests.buzz.harness import BrokerUnderTest
from tests.support.nostr import NostrRelay


def _body(action: str, args: dict[str, Any], rid: str | None = None) -> bytes:
    return contract.freeze(contract.build_request(action, args, rid or uuid.uuid4().hex))


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _cpu_per_action(host: Any, auth: list[bytes], bodies: list[bytes], rounds: int = 1) -> tuple[float, float]:
    """(median host CPU µs per action over rounds, wall ms per action) for sequential direct calls."""
    per_round = max(1, len(bodies) // rounds)
    cpu: list[float] = []
    w0 = time.perf_counter()
    for r in range(rounds):
        chunk = bodies[r * per_round : (r + 1) * per_round]
        c0 = time.process_time()
        for b in chunk:
            status, data = await host.handle(auth, b)
            assert status == 200 and b'"succeeded"' in data, data[:200]
        cpu.append((time.process_time() - c0) / len(chunk) * 1e6)
    wall = (time.perf_counter() - w0) / (per_round * rounds) * 1e3
    return statistics.median(cpu), wall


async def _http_rate(broker: BrokerUnderTest, cred: str, bodies: list[bytes], concurrency: int, expect: bytes) -> float:
    it = iter(bodies)

    async def worker() -> None:
        for b in it:
            status, data = await broker.post(b, cred)
            assert status == 200 and expect in data, data[:200]

    t0 = time.perf_counter()
    await defer.gatherResults([defer.ensureDeferred(worker()) for _ in range(concurrency)])
    return len(bodies) / (time.perf_counter() - t0)


# A keep-alive HTTP/1.1 client on a raw socket: one request in flight, the next sent when the
# answer is complete. http.client spent more CPU per request than the server it measured.
_CLIENT = r"""
import socket, sys, time
port, n, auth, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
body = open(path, "rb").read()
req = (b"POST /v1/action HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + auth.encode()
       + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf = b""
t0 = time.perf_counter()
for _ in range(n):
    s.sendall(req)
    while True:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            head = buf[:end]
            i = head.lower().find(b"content-length:")
            length = int(head[i + 15:].split(b"\r\n", 1)[0])
            if len(buf) >= end + 4 + length:
                break
        data = s.recv(65536)
        assert data, "connection closed"
        buf += data
    assert head.startswith(b"HTTP/1.1 200"), head
    answer, buf = buf[end + 4:end + 4 + length], buf[end + 4 + length:]
    assert b'"replayed":true' in answer, answer
print(n / (time.perf_counter() - t0))
"""


async def _replays_from_processes(reactor: Any, port: int, cred: str, body: bytes, n: int, procs: int) -> tuple[float, float]:
    """(replayed verdicts/s, server CPU µs per verdict) from separate client processes."""
    from twisted.internet import utils

    path = os.path.join(tempfile.mkdtemp(), "body.json")
    with open(path, "wb") as f:
        f.write(body)
    c0 = _cpu()
    t0 = time.perf_counter()
    outs = await defer.gatherResults(
        [
            utils.getProcessOutputAndValue(
                sys.executable, ["-c", _CLIENT, str(port), str(n), "Bearer " + cred, path], env=os.environ, reactor=reactor
            )
            for _ in range(procs)
        ]
    )
    elapsed = time.perf_counter() - t0
    cpu = _cpu() - c0
    for _out, err, code in outs:
        assert code == 0, err
    return procs * n / elapsed, cpu / (procs * n) * 1e6


# A day of a busy agent, in proportion: mostly posts and reads, some replies and reactions, the
# occasional profile change, retries of the same bytes, and requests the contract refuses.
MIX = (
    ("message.post", 40),
    ("channel.read", 25),
    ("message.reply", 10),
    ("reaction.add", 8),
    ("replay", 10),
    ("invalid", 5),
    ("profile.set", 2),
)


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


async def run_mix(reactor: Any, args: argparse.Namespace) -> None:
    """The state directory's size over C{args.mix} actions with retention on."""
    import random

    work = tempfile.mkdtemp(prefix="relayd-bench-")
    relay = NostrRelay(work)
    relay.start()
    retention = int(args.retention_days * 86400)
    step = args.spread_days * 86400 / args.mix  # simulated seconds between two actions
    start = time.time()
    sim = [start]
    broker = BrokerUnderTest(os.path.join(work, "state"), relay.url, receipt_retention=retention)
    await broker.start()
    service = broker.service
    assert service is not None
    service.db.now = lambda: sim[0]  # receipts are stamped with the simulated time
    if args.max_receipts:
        service.db.max_receipts = args.max_receipts  # --broker-max-receipts
    rng = random.Random(7)
    names = [name for name, _ in MIX]
    weights = [w for _, w in MIX]
    results: dict[str, Any] = {
        "actions": args.mix,
        "retention days": args.retention_days,
        "max receipts per agent": args.max_receipts or "default",
        "actions spread over days": args.spread_days,
        "mix (percent)": dict(MIX),
    }
    steps: list[dict[str, Any]] = []
    try:
        ch = str(uuid.uuid4())
        cred = broker.issue("bench", "--channel", ch)["credential"]
        host = service.host
        auth = [b"Bearer " + cred.encode()]
        recent: list[str] = []
        done: list[bytes] = []
        spent: dict[str, float] = {}
        counts: dict[str, int] = {}
        t0 = time.perf_counter()
        last_sweep = [start]
        indices = iter(range(args.mix))

        async def one(i: int) -> None:
            nonlocal recent, done
            sim[0] = max(sim[0], start + i * step)
            kind = rng.choices(names, weights)[0]
            if kind in ("message.reply", "reaction.add") and not recent:
                kind = "message.post"
            if kind == "replay" and not done:
                kind = "message.post"
            if kind == "message.post":
                body = _body("message.post", {"channelId": ch, "content": f"post {i} " + "x" * rng.randint(20, 600)})
            elif kind == "channel.read":
                body = _body("channel.read", {"channelId": ch, "limit": 20})
            elif kind == "message.reply":
                body = _body("message.reply", {"channelId": ch, "replyToEventId": rng.choice(recent), "content": f"reply {i}"})
            elif kind == "reaction.add":
                body = _body("reaction.add", {"channelId": ch, "targetEventId": rng.choice(recent), "reaction": "+"})
            elif kind == "profile.set":
                body = _body("profile.set", {"about": f"about {i}"})
            elif kind == "invalid":
                body = _body("channel.read", {"channelId": ch}).replace(b'"args":{', b'"args":{"limit":0,', 1)
            else:
                body = rng.choice(done)
            a0 = time.perf_counter()
            status, data = await host.handle(auth, body)
            spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - a0
            counts[kind] = counts.get(kind, 0) + 1
            assert status == 200, data[:200]
            if kind == "message.post" and b'"succeeded"' in data:
                recent.append(json.loads(data)["outcome"]["eventId"])
                recent = recent[-200:]
            if kind != "replay":
                done.append(body)
                if len(done) > 1000:
                    done = done[-1000:]
            if sim[0] - last_sweep[0] >= 3600:  # relayd sweeps each minute; hourly in simulated time is plenty
                last_sweep[0] = sim[0]
                await service.state.prune(int(sim[0]), retention)
            if (i + 1) % (args.mix // 10) == 0:
                receipts = service.db.conn.execute("SELECT COUNT(*) FROM receipts").fetchone()[0]
                steps.append(
                    {
                        "actions": i + 1,
                        "simulated day": round((sim[0] - start) / 86400, 1),
                        "state dir MiB": round(_dir_bytes(broker.state_dir) / 2**20, 2),
                        "receipts held": receipts,
                        "wall s": round(time.perf_counter() - t0),
                    }
                )
                print(json.dumps(steps[-1]), flush=True)

        async def worker() -> None:
            for i in indices:
                await one(i)

        # Several agents' worth of requests in flight: the relay's answer time, not the host, sets the pace.
        await defer.gatherResults([defer.ensureDeferred(worker()) for _ in range(args.concurrency)])
        results["concurrent requests"] = args.concurrency
        results["actions/s"] = round(args.mix / (time.perf_counter() - t0))
        await service.state.prune(int(sim[0]), retention)
        service.db.scrub_wal()
        results["after a final sweep and WAL truncate, state dir MiB"] = round(_dir_bytes(broker.state_dir) / 2**20, 2)
        results["steps"] = steps
        results["wall ms per action by kind"] = {k: round(spent[k] / counts[k] * 1e3, 2) for k in spent}
    finally:
        await broker.stop()
        relay.stop()
    results["cpus"] = os.cpu_count()
    print(json.dumps(results, indent=2))


async def run(reactor: Any, args: argparse.Namespace) -> None:
    if args.mix:
        await run_mix(reactor, args)
        return
    work = tempfile.mkdtemp(prefix="relayd-bench-")
    relay = NostrRelay(work)
    relay.start()
    redis_server = None
    kw: dict[str, Any] = {}
    if args.redis:
        from tests.support.redis import RedisServer

        redis_server = RedisServer.start()
        kw["redis_url"] = redis_server.url
    # Posts get one second each so reads page across seconds (a burst inside one second costs
    # reads in proportion to the burst: the relay cannot page inside a second, see operations.py).
    # The relay accepts AUTH events within 10 minutes of its clock: start 400 s back.
    clock = iter(range(int(time.time()) - 400, 2**40))
    broker = BrokerUnderTest(os.path.join(work, "state"), relay.url, now=lambda: next(clock), **kw)
    broker.pool = __import__("twisted.web.client", fromlist=["HTTPConnectionPool"]).HTTPConnectionPool(reactor, persistent=True)
    broker.pool.maxPersistentPerHost = args.concurrency
    await broker.start()
    results: dict[str, Any] = {"mode": "redis receipts" if args.redis else "sqlite receipts"}
    try:
        if args.redis:
            service = broker.service
            assert service is not None and service.redis is not None
            for _ in range(500):
                if service.redis.connected:
                    break
                await task.deferLater(reactor, 0.01, lambda: None)
        ch = str(uuid.uuid4())
        cred = broker.issue("bench", "--channel", ch)["credential"]
        host = broker.service.host  # type: ignore[union-attr]
        auth = [b"Bearer " + cred.encode()]
        # warm up: connection to the relay, AUTH, caches; enough history for full read pages
        for i in range(120):
            await host.handle(auth, _body("message.post", {"channelId": ch, "content": f"warm {i}"}))

        posts = [_body("message.post", {"channelId": ch, "content": f"bench message {i} " + "x" * 200}) for i in range(args.posts)]
        cpu_us, wall_ms = await _cpu_per_action(host, auth, posts, args.rounds)
        results["message.post host CPU us/action (sequential, direct, median of rounds)"] = round(cpu_us, 1)
        results["message.post wall ms/action incl. relay OK (sequential)"] = round(wall_ms, 2)

        reads = [_body("channel.read", {"channelId": ch, "limit": 100}) for _ in range(args.reads)]
        cpu_us, wall_ms = await _cpu_per_action(host, auth, reads, args.rounds)
        results["channel.read limit 100 host CPU us/action (direct, median of rounds)"] = round(cpu_us, 1)
        results["channel.read limit 100 wall ms/action incl. relay"] = round(wall_ms, 2)

        replay_body = posts[0]
        replays = [replay_body] * args.replays
        cpu_us, _ = await _cpu_per_action(host, auth, replays[: min(2000, args.replays)], args.rounds)
        results["replayed verdict host CPU us/action (direct)"] = round(cpu_us, 1)

        http_posts = [_body("message.post", {"channelId": ch, "content": f"http {i}"}) for i in range(args.posts)]
        rate = await _http_rate(broker, cred, http_posts, args.concurrency, b'"succeeded"')
        results[f"message.post actions/s end to end (HTTP, {args.concurrency} concurrent, in-process client)"] = round(rate)
        rate, server_us = await _replays_from_processes(reactor, broker.port, cred, replay_body, args.replays // args.clients, args.clients)
        results[f"replayed verdicts/s end to end (HTTP keep-alive, {args.clients} client processes)"] = round(rate)
        results["replayed verdict server CPU us over HTTP (whole server: HTTP, host)"] = round(server_us, 1)
    finally:
        await broker.pool.closeCachedConnections()
        await broker.stop()
        relay.stop()
        if redis_server is not None:
            redis_server.cleanup()
    results["cpus"] = os.cpu_count()
    print(json.dumps(results, indent=2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--posts", type=int, default=500)
    p.add_argument("--reads", type=int, default=100)
    p.add_argument("--replays", type=int, default=10000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--clients", type=int, default=2, help="replay client processes")
    p.add_argument("--rounds", type=int, default=5, help="CPU figures are the median of this many rounds")
    p.add_argument("--redis", action="store_true", help="receipts on a private redis-server (needs redis-server)")
    p.add_argument("--mix", type=int, default=0, help="measure the state directory over this many mixed actions")
    p.add_argument("--retention-days", type=float, default=30.0, help="receipt retention for --mix")
    p.add_argument("--spread-days", type=float, default=60.0, help="simulated days the --mix actions span")
    p.add_argument("--max-receipts", type=int, default=0, help="--broker-max-receipts for --mix (default: relayd's)")
    args = p.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(run(reactor, args)))


if __name__ == "__main__":
    main()
