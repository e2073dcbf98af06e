"""MCP tunnel relay benchmark (a benchmark, not a test): round trips, latency, idle memory.

Starts a real ``twistd -n relayd`` per scenario on a free loopback port and drives it from asyncio
clients in this process (raw HTTP/1.1 keep-alive connections, a minimal chunked SSE reader), reading
the server's own CPU time and RSS from /proc. Figures go to docs/performance.md.

    python bench/mcp.py                          # every scenario
    python bench/mcp.py rt-sse rt-poll           # a selection
    python bench/mcp.py --seconds 10 --sessions 100 --rate 1000 latency-sse

Scenarios:
  rt-sse / rt-poll   100 sessions, closed loop: agent POST inbox -> page SSE -> page POST outbox ->
                     agent (over SSE, or over long-poll); round trips/s and p50/p99 latency.
  latency-sse        the same at a fixed offered load (--rate, default 1000 round trips/s in total).
  latency-poll       ditto over long-poll.
  idle-sse           1000 sessions each with one idle SSE subscriber: RSS per subscriber.
  idle-poll          1000 sessions each with one parked poll: RSS per parked poll.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
TOKEN = "bench_token_abcdefghijklmnopqrstuv"


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class Server:
    """A real relayd subprocess with only the MCP wing."""

    def __init__(self, *options: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("PORT", "HOST", "PREFIX", "TTL_MS", "CORS_ALLOW_ORIGIN")}
        env["PYTHONPATH"] = str(ROOT)
        twistd = Path(sys.executable).with_name("twistd")
        argv = [sys.executable, str(twistd)] if twistd.exists() else [
            sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
        argv += ["-n", "--pidfile=", "--logfile=-", "relayd", "--no-aep",
                 "--mcp-listen", "tcp:0:interface=127.0.0.1", *options]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_raise_nofile)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            found = re.search(rb"mcp listening on [^:\s]+:(\d+)", line)
            if found:
                self.port = int(found.group(1))
                break
        else:
            raise RuntimeError("relayd did not start")

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# Minimal HTTP/1.1 clients ---------------------------------------------------------------------


class Conn:
    """One keep-alive connection; one request at a time; responses with content-length."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.lock = asyncio.Lock()

    async def open(self) -> Conn:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        async with self.lock:
            head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            self.writer.write(head + body)
            status_line = await self.reader.readline()
            length = 0
            while True:
                line = await self.reader.readline()
                if line in (b"\r\n", b""):
                    break
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            data = await self.reader.readexactly(length) if length else b""
            return int(status_line.split()[1]), data

    def close(self) -> None:
        self.writer.close()


class SSE:
    """An SSE reader: yields the C{data:} of each C{event: mcp} from a chunked response."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def open(self, path: str) -> SSE:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        self.writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n".encode())
        status = await self.reader.readline()
        assert b" 200 " in status, status
        while (await self.reader.readline()) not in (b"\r\n", b""):
            pass
        self.buffer = b""
        return self

    async def next_data(self) -> bytes:
        while True:
            end = self.buffer.find(b"\n\n")
            if end >= 0:
                block, self.buffer = self.buffer[:end], self.buffer[end + 2:]
                if block.startswith(b"event: mcp\n"):
                    return block[len(b"event: mcp\ndata: "):]
                continue
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            self.buffer += chunk[:-2]

    def close(self) -> None:
        self.writer.close()


# Round trips ----------------------------------------------------------------------------------


async def session_setup(port: int, name: str) -> None:
    conn = await Conn(port).open()
    status, body = await conn.request("POST", "/register", json.dumps({"session": name, "token": TOKEN}).encode())
    assert status == 200, body
    conn.close()


async def page_loop(port: int, name: str, ready: asyncio.Event) -> None:
    """The page: reads inbound SSE and answers every request on outbox."""
    sse = await SSE(port).open(f"/{name}/events?token={TOKEN}&direction=inbound")
    out = await Conn(port).open()
    ready.set()
    try:
        while True:
            data = json.loads(await sse.next_data())
            if "id" in data and "method" in data:
                reply = b'{"jsonrpc":"2.0","id":%d,"result":{"ok":true}}' % data["id"]
                await out.request("POST", f"/{name}/outbox?token={TOKEN}", reply)
    finally:
        sse.close()
        out.close()


async def agent_loop(port: int, name: str, mode: str, stop: float, interval: float, latencies: list[float]) -> None:
    inbox = await Conn(port).open()
    if mode == "sse":
        sse = await SSE(port).open(f"/{name}/events?token={TOKEN}&direction=outbound")

        async def receive() -> Any:
            while True:
                data = json.loads(await sse.next_data())
                if "id" in data:
                    return data
    else:
        poller = await Conn(port).open()
        status, body = await poller.request("GET", f"/{name}/poll?token={TOKEN}&direction=outbound&wait=0")
        sub = json.loads(body)["subscriber"]
        pending: list[Any] = []

        async def receive() -> Any:
            while True:
                while pending:
                    frame = pending.pop(0)
                    if "id" in frame:
                        return frame
                _, body = await poller.request(
                    "GET", f"/{name}/poll?token={TOKEN}&direction=outbound&wait=20000&subscriber={sub}")
                pending.extend(json.loads(f) for f in json.loads(body)["frames"])

    n = 0
    next_send = time.monotonic()
    while time.monotonic() < stop:
        n += 1
        started = time.monotonic()
        frame = b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"t"}}' % n
        await inbox.request("POST", f"/{name}/inbox?token={TOKEN}", frame)
        reply = await receive()
        assert reply["id"] == n, reply
        latencies.append(time.monotonic() - started)
        if interval:
            next_send += interval
            delay = next_send - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
    inbox.close()


async def round_trips(server: Server, mode: str, sessions: int, seconds: float, rate: float | None) -> dict[str, Any]:
    names = [f"bench{i:05d}" for i in range(sessions)]
    for name in names:
        await session_setup(server.port, name)
    readies = [asyncio.Event() for _ in names]
    pages = [asyncio.create_task(page_loop(server.port, n, r)) for n, r in zip(names, readies)]
    for r in readies:
        await r.wait()
    latencies: list[float] = []
    interval = sessions / rate if rate else 0.0
    cpu0, t0 = server.cpu_seconds(), time.monotonic()
    stop = t0 + seconds
    await asyncio.gather(*(agent_loop(server.port, n, mode, stop, interval, latencies) for n in names))
    elapsed = time.monotonic() - t0
    cpu = server.cpu_seconds() - cpu0
    for p in pages:
        p.cancel()
    await asyncio.gather(*pages, return_exceptions=True)
    latencies.sort()
    return {
        "mode": mode,
        "sessions": sessions,
        "offered_rate": rate,
        "round_trips": len(latencies),
        "round_trips_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2),
        "server_cpu_per_rt_us": round(cpu / max(1, len(latencies)) * 1e6, 1),
    }


# Idle memory ----------------------------------------------------------------------------------


async def idle(server: Server, mode: str, sessions: int) -> dict[str, Any]:
    names = [f"idle{i:05d}" for i in range(sessions)]
    for name in names:
        await session_setup(server.port, name)
    await asyncio.sleep(1.0)
    before = server.rss_kb()
    held: list[Any] = []
    for name in names:
        if mode == "sse":
            held.append(await SSE(server.port).open(f"/{name}/events?token={TOKEN}&direction=outbound"))
        else:
            conn = await Conn(server.port).open()
            conn.writer.write(
                f"GET /{name}/poll?token={TOKEN}&direction=outbound&wait=25000 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            held.append(conn)
    await asyncio.sleep(1.0)  # let the server settle (not synchronisation: a measurement pause)
    after = server.rss_kb()
    for h in held:
        h.close() if hasattr(h, "close") else None
    return {"mode": mode, "subscribers": sessions, "rss_before_kb": before, "rss_after_kb": after,
            "kb_per_subscriber": round((after - before) / sessions, 2)}


SCENARIOS = ("rt-sse", "rt-poll", "latency-sse", "latency-poll", "idle-sse", "idle-poll")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--rate", type=float, default=1000.0, help="offered round trips/s for latency-*")
    parser.add_argument("--idle", type=int, default=1000)
    args = parser.parse_args()
    _raise_nofile()
    for scenario in args.scenarios:
        server = Server("--mcp-max-sessions", str(max(args.idle, args.sessions) + 10))
        try:
            kind, mode = scenario.split("-")
            if kind == "rt":
                result = asyncio.run(round_trips(server, mode, args.sessions, args.seconds, None))
            elif kind == "latency":
                result = asyncio.run(round_trips(server, mode, args.sessions, args.seconds, args.rate))
            else:
                result = asyncio.run(idle(server, mode, args.idle))
            print(json.dumps({"scenario": scenario, **result}), flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
