"""Hostile clients against a real relayd (a benchmark, not a test): health latency under attack, memory after.

Each attack runs against its own ``twistd -n relayd`` (AEP and MCP wings, metrics listener) while a
prober asks ``GET /healthz`` of both HTTP wings every 10 ms over keep-alive connections; the figure is
the probe latency (p50, p99, max) and the server's peak RSS. ``rounds`` runs every attack in turn
against one process, closes every client after each, and prints the RSS left behind (what the
process keeps once nobody is connected). Figures go to docs/performance.md and docs/security.md.

    python bench/hostile.py                 # every attack, then the rounds
    python bench/hostile.py sse-replay      # a selection
    python bench/hostile.py --seconds 10 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relayd_process import RelaydServer

PAD = "x" * 330  # makes each event about 500 bytes
CLIENTS = 1  # attacking clients per attack (--clients); slowloris always holds 1000 per listener
TOKEN = "hostile-bench-token-0123456789"
LISTENERS = ("aep", "mcp", "metrics")
OPTIONS = ("--aep-listen", "tcp:0:interface=127.0.0.1", "--mcp-listen", "tcp:0:interface=127.0.0.1",
           "--metrics-listen", "tcp:0:interface=127.0.0.1", "--no-access-log")


def event(session: str, seq: int, data: Any = PAD) -> bytes:
    return json.dumps({"aep": "0.1", "id": f"{session}-{seq}", "type": "progress.status",
                       "time": "2026-11-29T00:00:00Z", "source": f"aep://bench/agent/a/session/{session}",
                       "agent": "bench", "session": session, "seq": seq, "severity": "notice",
                       "data": {"message": data}}).encode()


def request(method: str, path: str, body: bytes = b"", ctype: str = "application/json", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\n{extra}"
    if body or method == "POST":
        head += f"content-type: {ctype}\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


async def exchange(port: int, data: bytes) -> tuple[int, bytes]:
    """One request on its own connection; the status and the body (read to its length)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        return status, await reader.readexactly(length)
    finally:
        writer.close()


async def fill_session(port: int, session: str, count: int) -> None:
    """Post C{count} events to C{session} in NDJSON batches of 1000."""
    for start in range(0, count, 1000):
        body = b"\n".join(event(session, seq) for seq in range(start, min(count, start + 1000)))
        status, answer = await exchange(port, request("POST", "/events", body, "application/x-ndjson"))
        assert status == 202, (status, answer)


class NeverReads(asyncio.Protocol):
    """Sends its request, then stops reading: the server's bytes for it pile up on the server."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.data)
        transport.pause_reading()


async def never_reading(port: int, data: bytes) -> NeverReads:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(lambda: NeverReads(data), "127.0.0.1", port)
    return protocol


def ws_upgrade(path: str = "/socket") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (f"GET {path} HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()


def ws_frame(payload: bytes) -> bytes:
    """A masked client text frame (RFC 6455 5.2); a zero mask keeps the payload as it is."""
    n = len(payload)
    if n < 126:
        head = bytes([0x81, 0x80 | n])
    elif n < 65536:
        head = bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x81, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


def ws_message(message: dict[str, Any]) -> bytes:
    return ws_frame(json.dumps(message).encode())


HELLO = ws_message({"type": "hello", "versions": ["0.1"], "role": "consumer"})


# The attacks: each runs until `stop` is set and returns what it holds open (closed by the caller).


async def attack_sse_replay(ports: dict[str, int], stop: asyncio.Event) -> list[Any]:
    """A full session (10 000 events) named 200 times in `from`, to clients that never read."""
    await fill_session(ports["aep"], "R", 10000)
    query = quote(json.dumps([{"session": "R"}] * 200))
    held = []
    for _ in range(CLIENTS):
        held.append(await never_reading(ports["aep"], request("GET", f"/stream?live=0&from={query}")))
    return held


async def attack_ws_replies(ports: dict[str, int], stop: asyncio.Event) -> list[Any]:
    """Small requests (`roster`) sent nonstop by clients that never read the replies."""
    held = [await never_reading(ports["aep"], ws_upgrade() + HELLO) for _ in range(CLIENTS)]
    roster = ws_message({"type": "roster", "id": 1}) * 100
    while not stop.is_set():
        for protocol in held:
            if protocol.transport.get_write_buffer_size() < 1 << 20:  # our own side stays bounded
                protocol.transport.write(roster)
        await asyncio.sleep(0.01)  # paces the attacker, not a synchronisation
    return held


async def attack_ws_subscriptions(ports: dict[str, int], stop: asyncio.Event) -> list[Any]:
    """As many subscriptions as one connection may open (20 000 asked), matching nothing, while
    1000-event batches are posted."""
    subscribe = b"".join(ws_message({"type": "subscribe", "id": i, "filter": {"session": f"none-{i}"}})
                         for i in range(20000))
    held = [await never_reading(ports["aep"], ws_upgrade() + HELLO + subscribe)]
    body = b"\n".join(event("S", seq) for seq in range(1000))
    while not stop.is_set():
        await exchange(ports["aep"], request("POST", "/events", body, "application/x-ndjson"))
    return held


async def attack_mcp_backlog(ports: dict[str, int], stop: asyncio.Event) -> list[Any]:
    """Unauthenticated registers, each session's first-frame backlog filled with 250 KB frames."""
    frame = json.dumps({"jsonrpc": "2.0", "method": "x", "params": {"p": "x" * 250_000}}).encode()
    n = 0
    while not stop.is_set() and n < 64:
        name = f"hostile-{n:04d}"
        await exchange(ports["mcp"], request("POST", "/register",
                                             json.dumps({"session": name, "token": TOKEN}).encode()))
        for _ in range(64):
            if stop.is_set():
                break
            await exchange(ports["mcp"], request("POST", f"/{name}/inbox?token={TOKEN}", frame))
        n += 1
    for i in range(n):  # the page leaves: what its session held must be returned
        await exchange(ports["mcp"], request("POST", f"/hostile-{i:04d}/unregister?token={TOKEN}"))
    return []


async def attack_big_batches(ports: dict[str, int], stop: asyncio.Event) -> list[Any]:
    """The largest batch the defaults allow (10 000 small events), posted back to back."""
    body = b"\n".join(event(f"B{seq % 50}", seq, "y") for seq in range(10000))

    async def loop() -> None:
        while not stop.is_set():
            await exchange(ports["aep"], request("POST", "/events", body, "application/x-ndjson"))

    await asyncio.gather(*(loop() for _ in range(CLIENTS)))
    return []


async def attack_slowloris(ports: dict[str, int], stop: asyncio.Event) -> list[Any]:
    """2000 connections that send one header byte a second."""
    held = []
    for port in (ports["aep"], ports["mcp"]):
        for _ in range(1000):
            held.append(await never_reading(port, b"GET /healthz HTTP/1.1\r\nX: "))
    while not stop.is_set():
        for protocol in held:
            if not protocol.transport.is_closing():
                protocol.transport.write(b"a")
        await asyncio.sleep(1)  # paces the attacker
    return held


async def attack_bignum(ports: dict[str, int], stop: asyncio.Event) -> list[Any]:
    """5000-digit numbers wherever a number is read: event bodies, filters, resume positions."""
    huge = "9" * 5000
    bodies = [
        request("POST", "/events", event("N", 0, 0).replace(b'"seq": 0', b'"seq": ' + huge.encode())),
        request("POST", "/events", event("N", 1, 0).replace(b'"message": 0', b'"message": ' + huge.encode())),
        request("GET", "/stream?live=0&filter=" + quote(json.dumps({"severity": {"gte": 0}}).replace("0", huge))),
        request("GET", "/stream?live=0&from=" + quote(f'[{{"session":"N","epoch":{huge},"seq":{huge}}}]')),
    ]
    while not stop.is_set():
        for body in bodies:
            await exchange(ports["aep"], body)
    return []


ATTACKS: dict[str, Callable[[dict[str, int], asyncio.Event], Awaitable[list[Any]]]] = {
    "sse-replay": attack_sse_replay,
    "ws-replies": attack_ws_replies,
    "ws-subscriptions": attack_ws_subscriptions,
    "mcp-backlog": attack_mcp_backlog,
    "big-batches": attack_big_batches,
    "slowloris": attack_slowloris,
    "bignum": attack_bignum,
}


# The prober and the runs.


async def probe(port: int, stop: asyncio.Event, latencies: list[float]) -> None:
    """GET /healthz every 10 ms on one keep-alive connection; a timeout of 5 s counts as 5 s."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    ask = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
    while not stop.is_set():
        began = time.perf_counter()
        writer.write(ask)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:")))
            await reader.readexactly(length)
        except TimeoutError:
            latencies.append(5.0)
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            continue
        latencies.append(time.perf_counter() - began)
        await asyncio.sleep(0.01)  # the probe interval
    writer.close()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p))] if ordered else float("nan")


def close(held: list[Any]) -> None:
    for protocol in held:
        if protocol.transport is not None:
            protocol.transport.abort()


async def under_attack(name: str, seconds: float) -> dict[str, Any]:
    server = RelaydServer(*OPTIONS, wait_for=LISTENERS)
    try:
        stop = asyncio.Event()
        latencies: list[float] = []
        base = server.rss_kb()
        probes = [asyncio.ensure_future(probe(server.ports[w], stop, latencies)) for w in ("aep", "mcp")]
        attack = asyncio.ensure_future(ATTACKS[name](server.ports, stop))
        peak = base
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # sampling interval for RSS
            peak = max(peak, server.rss_kb())
        stop.set()
        held = await asyncio.wait_for(attack, 60)
        await asyncio.gather(*probes)
        close(held)
        crashed = "Traceback" in server.log_text() or "Unhandled Error" in server.log_text()
        return {"attack": name, "probes": len(latencies), "p50_ms": round(pct(latencies, 0.5) * 1000, 1),
                "p99_ms": round(pct(latencies, 0.99) * 1000, 1), "max_ms": round(max(latencies) * 1000, 1),
                "rss_base_mib": round(base / 1024, 1), "rss_peak_mib": round(peak / 1024, 1),
                "traceback_in_log": crashed}
    finally:
        server.stop()


async def rounds(seconds: float, count: int) -> dict[str, Any]:
    """Every attack in turn against one process, all clients closed after each; RSS left behind."""
    server = RelaydServer(*OPTIONS, wait_for=LISTENERS)
    try:
        after: list[dict[str, Any]] = [{"after": "start", "rss_mib": round(server.rss_kb() / 1024, 1)}]
        for n in range(count):
            for name, attack in ATTACKS.items():
                stop = asyncio.Event()
                task = asyncio.ensure_future(attack(server.ports, stop))
                await asyncio.sleep(seconds)  # the attack's duration
                stop.set()
                close(await asyncio.wait_for(task, 120))
                await asyncio.sleep(2)  # lets the server notice the closed connections
                after.append({"after": f"{name} #{n + 1}", "rss_mib": round(server.rss_kb() / 1024, 1)})
        return {"rounds": after}
    finally:
        server.stop()


async def main(selected: list[str], seconds: float, count: int) -> None:
    for name in selected:
        if name == "rounds":
            result = await rounds(seconds, count)
        else:
            result = await under_attack(name, seconds)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # No default list here: argparse checks a list default against choices as one value and refuses it.
    parser.add_argument("scenarios", nargs="*", choices=[*ATTACKS, "rounds"], help="default: every attack, then rounds")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each attack (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="how often `rounds` repeats the attacks (default 3)")
    parser.add_argument("--clients", type=int, default=1, help="attacking clients per attack (default 1)")
    args = parser.parse_args()
    CLIENTS = args.clients
    asyncio.run(main(args.scenarios or [*ATTACKS, "rounds"], args.seconds, args.rounds))
