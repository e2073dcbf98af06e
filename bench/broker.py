"""Buzz broker benchmark: host CPU per action, message.post actions/s, replayed verdicts/s.

Starts PyPI nostr-relay (NIP-42 on) on a free loopback port and an in-process broker pointed at it.

 - host CPU per action: C{BrokerHost.handle} called directly (no HTTP), sequentially; CPU time of
   this process (reactor thread + SQLite thread) divided by actions. The relay runs in its own
   process, so its time is excluded.
 - end to end: C{POST /v1/action} over loopback HTTP with N concurrent clients (the client shares
   this process, so the figure is pessimistic).

usage: PYTHONPATH=. python bench/broker.py [--posts 500] [--replays 5000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from twisted.internet import defer, task  # noqa: E402

from relayd.buzz import contract  # noqa: E402
from tests.buzz.conftest import NostrRelay  # noqa: E402
from tests.buzz.harness import BrokerUnderTest  # noqa: E402


def _body(action: str, args: dict[str, Any], rid: str | None = None) -> bytes:
    return contract.freeze(contract.build_request(action, args, rid or uuid.uuid4().hex))


async def _cpu_per_action(host: Any, auth: list[bytes], bodies: list[bytes]) -> tuple[float, float]:
    """(host CPU µs per action, wall ms per action) for sequential direct calls."""
    c0, w0 = time.process_time(), time.perf_counter()
    for b in bodies:
        status, data = await host.handle(auth, b)
        assert status == 200 and b'"succeeded"' in data, data[:200]
    c1, w1 = time.process_time(), time.perf_counter()
    n = len(bodies)
    return (c1 - c0) / n * 1e6, (w1 - w0) / n * 1e3


async def _http_rate(broker: BrokerUnderTest, cred: str, bodies: list[bytes], concurrency: int, expect: bytes) -> float:
    it = iter(bodies)

    async def worker() -> None:
        for b in it:
            status, data = await broker.post(b, cred)
            assert status == 200 and expect in data, data[:200]

    t0 = time.perf_counter()
    await defer.gatherResults([defer.ensureDeferred(worker()) for _ in range(concurrency)])
    return len(bodies) / (time.perf_counter() - t0)


_CLIENT = r"""
import http.client, sys, time
port, n, auth, body = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], BODY
c = http.client.HTTPConnection("127.0.0.1", port)
h = {"Authorization": auth, "Content-Type": "application/json"}
t0 = time.perf_counter()
for _ in range(n):
    c.request("POST", "/v1/action", body, h)
    r = c.getresponse(); data = r.read()
    assert r.status == 200 and b'"replayed":true' in data, data
print(n / (time.perf_counter() - t0))
"""


async def _replays_from_processes(reactor: Any, port: int, cred: str, body: bytes, n: int, procs: int) -> float:
    """Replayed verdicts/s from separate client processes (keep-alive), so the client's CPU is not ours."""
    from twisted.internet import utils

    path = os.path.join(tempfile.mkdtemp(), "body.json")
    with open(path, "wb") as f:
        f.write(body)
    script = _CLIENT.replace("BODY", f"open({path!r}, 'rb').read()")
    t0 = time.perf_counter()
    outs = await defer.gatherResults(
        [
            utils.getProcessOutputAndValue(sys.executable, ["-c", script, str(port), str(n), "Bearer " + cred], env=os.environ, reactor=reactor)
            for _ in range(procs)
        ]
    )
    elapsed = time.perf_counter() - t0
    for out, err, code in outs:
        assert code == 0, err
    return procs * n / elapsed


async def run(reactor: Any, args: argparse.Namespace) -> None:
    work = tempfile.mkdtemp(prefix="relayd-bench-")
    relay = NostrRelay(work)
    relay.start()
    # Posts get one second each so reads page across seconds (a burst inside one second costs
    # reads in proportion to the burst: the relay cannot page inside a second, see operations.py).
    clock = iter(range(int(time.time()) - 400, 2**40))
    broker = BrokerUnderTest(os.path.join(work, "state"), relay.url, now=lambda: next(clock))
    broker.pool = __import__("twisted.web.client", fromlist=["HTTPConnectionPool"]).HTTPConnectionPool(reactor, persistent=True)
    broker.pool.maxPersistentPerHost = args.concurrency
    await broker.start()
    results: dict[str, Any] = {}
    try:
        ch = str(uuid.uuid4())
        cred = broker.issue("bench", "--channel", ch)["credential"]
        host = broker.service.host  # type: ignore[union-attr]
        auth = [b"Bearer " + cred.encode()]
        # warm up: connection to the relay, AUTH, caches
        for i in range(20):
            await host.handle(auth, _body("message.post", {"channelId": ch, "content": f"warm {i}"}))

        posts = [_body("message.post", {"channelId": ch, "content": f"bench message {i} " + "x" * 200}) for i in range(args.posts)]
        cpu_us, wall_ms = await _cpu_per_action(host, auth, posts)
        results["message.post host CPU us/action (sequential, direct)"] = round(cpu_us, 1)
        results["message.post wall ms/action incl. relay OK (sequential)"] = round(wall_ms, 2)

        reads = [_body("channel.read", {"channelId": ch, "limit": 100}) for _ in range(args.reads)]
        cpu_us, wall_ms = await _cpu_per_action(host, auth, reads)
        results["channel.read limit 100 host CPU us/action (direct)"] = round(cpu_us, 1)
        results["channel.read limit 100 wall ms/action incl. relay"] = round(wall_ms, 2)

        replay_body = posts[0]
        replays = [replay_body] * args.replays
        cpu_us, _ = await _cpu_per_action(host, auth, replays[: min(2000, args.replays)])
        results["replayed verdict host CPU us/action (direct)"] = round(cpu_us, 1)

        http_posts = [_body("message.post", {"channelId": ch, "content": f"http {i}"}) for i in range(args.posts)]
        rate = await _http_rate(broker, cred, http_posts, args.concurrency, b'"succeeded"')
        results[f"message.post actions/s end to end (HTTP, {args.concurrency} concurrent, in-process client)"] = round(rate)
        rate = await _http_rate(broker, cred, replays, args.concurrency, b'"replayed":true')
        results[f"replayed verdicts/s end to end (HTTP, {args.concurrency} concurrent, in-process client)"] = round(rate)
        rate = await _replays_from_processes(reactor, broker.port, cred, replay_body, args.replays // 2, 2)
        results["replayed verdicts/s end to end (HTTP keep-alive, 2 client processes)"] = round(rate)
    finally:
        await broker.pool.closeCachedConnections()
        await broker.stop()
        relay.stop()
    results["cpus"] = os.cpu_count()
    print(json.dumps(results, indent=2))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--posts", type=int, default=500)
    p.add_argument("--reads", type=int, default=100)
    p.add_argument("--replays", type=int, default=5000)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    task.react(lambda reactor: defer.ensureDeferred(run(reactor, args)))


if __name__ == "__main__":
    main()
