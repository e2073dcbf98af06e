"""One message's latency on a Redis Cluster, without relayd: classic pub/sub across the cluster bus
against sharded pub/sub on the channel's master (docs/performance.md "Redis Cluster against one
primary (issue 25)").

Starts a fresh 3-master cluster as the tests do (tests/support/redis.py RedisCluster), then, alternated
``--runs`` times: ``PUBLISH`` on the channel's master heard by a ``SUBSCRIBE`` on another master (the
cluster forwards it over its node-to-node bus), and ``SPUBLISH`` on the channel's master heard by an
``SSUBSCRIBE`` there. One message at a time, ``--messages`` of them ``--gap`` seconds apart, raw RESP
over blocking sockets (TCP_NODELAY); prints one JSON line per run (p50, p99, max in ms)::

    python bench/cluster_pubsub_hop.py --runs 2
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.redis import RedisCluster, RedisServer

CHANNEL = b"{hop}:fanout"


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _owner(masters: list[RedisServer]) -> RedisServer:
    """The master that takes an SPUBLISH of the channel (the others answer MOVED)."""
    for node in masters:
        with _connect(node.port) as s:
            s.sendall(_command(b"SPUBLISH", CHANNEL, b"probe"))
            if s.recv(100).startswith(b":"):
                return node
    raise RuntimeError("no master owns the channel's slot")


def run(masters: list[RedisServer], sharded: bool, messages: int, gap: float) -> dict[str, object]:
    owner = _owner(masters)
    heard_on = owner if sharded else next(node for node in masters if node is not owner)
    with _connect(heard_on.port) as sub, _connect(owner.port) as pub:
        sub.sendall(_command(b"SSUBSCRIBE" if sharded else b"SUBSCRIBE", CHANNEL))
        sub.recv(1000)
        publish = b"SPUBLISH" if sharded else b"PUBLISH"
        latencies = []
        for n in range(messages):
            marker = b"m%d\r\n" % n
            started = time.perf_counter()
            pub.sendall(_command(publish, CHANNEL, marker[:-2]))
            data = b""
            while marker not in data:
                data += sub.recv(1000)
            latencies.append((time.perf_counter() - started) * 1000)
            pub.recv(100)
            time.sleep(gap)  # the rate: one message at a time
    latencies.sort()
    return {
        "pubsub": "sharded, SPUBLISH and SSUBSCRIBE on the slot's master" if sharded else
                  "classic, PUBLISH on the slot's master, SUBSCRIBE on another",
        "messages": messages,
        "p50_ms": round(statistics.median(latencies), 2),
        "p99_ms": round(latencies[int(0.99 * len(latencies)) - 1], 2),
        "max_ms": round(latencies[-1], 2),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--gap", type=float, default=0.01, help="seconds between two messages")
    args = parser.parse_args()
    cluster = RedisCluster.start()
    try:
        for _ in range(args.runs):
            for sharded in (False, True):
                print(json.dumps(run(cluster.nodes[: cluster.masters], sharded, args.messages, args.gap)), flush=True)
    finally:
        cluster.cleanup()


if __name__ == "__main__":
    main()
