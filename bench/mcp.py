"""MCP tunnel relay benchmark (a benchmark, not a test): round trips, latency, idle memory.

Starts a real ``twistd -n relayd`` per scenario on a free loopback port (or two sharing a
redis-server with ``--redis``) and drives it from client processes built on raw asyncio protocols
with pre-built requests, so the load generator costs as little as possible. The server's own CPU
time and RSS are read from /proc, so "server CPU per round trip" means the same whether or not the
client was the limit.

    python bench/mcp.py                                   # every scenario
    python bench/mcp.py rt-sse rt-poll                    # a selection
    python bench/mcp.py --seconds 10 --sessions 100 --rate 1000 latency-sse
    python bench/mcp.py --procs 2 rt-sse                  # two client processes
    python bench/mcp.py --profile /tmp/mcp.txt rt-sse     # py-spy the server while it is measured
    python bench/mcp.py --redis rt-sse                    # relayd --redis (real redis-server)
    python bench/mcp.py --redis --instances 2 rt-sse      # the page on one instance, the agent on another
    python bench/mcp.py --callgrind --sessions 10 --count 100 rt-endpoint   # instructions per round trip
    python bench/mcp.py --cprofile /tmp/rt.pstats --sessions 10 --count 500 rt-endpoint  # calls per round trip

Scenarios:
  rt-sse / rt-poll   --sessions sessions, closed loop: agent POST inbox -> page SSE -> page POST
                     outbox -> agent (over SSE, or over long-poll); round trips/s, p50/p99 latency.
  latency-sse        the same, each session paced so the total offered load is --rate round trips/s.
  latency-poll       ditto over long-poll.
  idle-sse           --idle sessions each with one idle SSE subscriber: RSS per subscriber.
  idle-poll          --idle sessions each with one parked poll: RSS per parked poll.
  rt-endpoint        --sessions standard MCP clients (Streamable HTTP, one per session, initialized
                     first), closed loop: client POST {S}/mcp tools/call -> page SSE -> page POST
                     outbox -> the POST's JSON answer; round trips/s, p50/p99 latency.
  latency-endpoint   the same, paced to --rate round trips/s in total.
  idle-endpoint      --idle sessions, each with a page stream and one initialized client session
                     with its GET stream open: RSS growth per client session (pages measured before).

``--count N`` (rt-* scenarios): each session makes N round trips (after 20 to warm up) instead of
running for --seconds, so every round trip measured is a whole one. ``--callgrind`` (with --count)
runs the server under valgrind's callgrind and reports the user-space instructions it executed per
round trip between ``callgrind_control -z`` and ``-d``: a figure the load on a shared machine does
not move (server CPU from /proc does, by tens of percent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import orjson

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")
TOKEN = "bench_token_abcdefghijklmnopqrstuv"
NODE_ENV = ("PORT", "HOST", "PREFIX", "TTL_MS", "CORS_ALLOW_ORIGIN")


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


class Server:
    """A real relayd subprocess with only the MCP wing."""

    def __init__(self, *options: str, callgrind: str | None = None, cprofile: str | None = None) -> None:
        env = {k: v for k, v in os.environ.items() if k not in NODE_ENV and not k.startswith("RELAYD_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("BENCH_EXTRA_PATH"), str(ROOT)]))
        env["RELAYD_MAX_CLIENT_CONNECTIONS"] = "0"  # every benchmark client is one address (bench/relayd_process.py)
        twistd = Path(sys.executable).with_name("twistd")
        argv = [sys.executable, str(twistd)] if twistd.exists() else [
            sys.executable, "-c", "from twisted.scripts.twistd import run; run()"]
        if cprofile is not None:  # (written when the server stops)
            argv += [f"--profile={cprofile}", "--profiler=cprofile", "--savestats"]
        argv += ["-n", "--pidfile=", "--logfile=-", "relayd", "--no-aep",
                 "--mcp-listen", "tcp:0:interface=127.0.0.1", *options]
        self.callgrind = callgrind  # the directory of callgrind's dumps (None: not under valgrind)
        if callgrind is not None:
            argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}/callgrind.out.%p", *argv]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=_raise_nofile)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            found = re.search(rb'mcp listening on https?://[^\s"]+:(\d+)', line)
            if found:
                self.port = int(found.group(1))
                break
        else:
            raise RuntimeError("relayd did not start")
        # Keep draining the log so a chatty server never blocks on a full pipe.
        self._drain = subprocess.Popen(["cat"], stdin=self.proc.stdout, stdout=subprocess.DEVNULL)

    def rss_kb(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))  # type: ignore[union-attr]

    def cpu_seconds(self) -> float:
        return _proc_cpu(self.proc.pid)

    def zero_instructions(self) -> None:
        subprocess.run(["callgrind_control", "-z", str(self.proc.pid)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)

    def instructions(self) -> int:
        """Instructions executed since L{zero_instructions} (a callgrind dump, read back)."""
        assert self.callgrind is not None
        subprocess.run(["callgrind_control", "-d", str(self.proc.pid)], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        dumps = sorted(Path(self.callgrind).glob("callgrind.out.*.*"), key=lambda p: p.stat().st_mtime)
        for line in dumps[-1].read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError("no totals in the callgrind dump")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._drain.wait(5)


class RedisProcess:
    """A throwaway redis-server on a free port (for ``--redis``)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("--redis needs redis-server (apt-get install redis-server)")
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="bench-redis-")
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.02)  # waiting for an external process to listen
        raise RuntimeError("redis-server did not start")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def cpu_seconds(self) -> float:
        return _proc_cpu(self.proc.pid)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)


# Minimal HTTP/1.1 clients on asyncio protocols ----------------------------------------------------


class Http(asyncio.Protocol):
    """One keep-alive connection; requests are queued and answered in order (content-length bodies)."""

    def __init__(self) -> None:
        self.buffer = b""
        self.waiting: list[Callable[[int, bytes], None]] = []
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def send(self, request: bytes, done: Callable[[int, bytes], None]) -> None:
        self.waiting.append(done)
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            i = head.find(b"ontent-Length: ")  # Twisted capitalises header names
            if i < 0:
                i = head.find(b"ontent-length: ")
            if i >= 0:
                eol = head.find(b"\r\n", i)
                length = int(head[i + 15 : eol if eol >= 0 else len(head)])
            else:
                length = 0
            if len(buf) < end + 4 + length:
                break
            body = buf[end + 4 : end + 4 + length]
            buf = buf[end + 4 + length :]
            self.waiting.pop(0)(int(head[9:12]), body)
        self.buffer = buf


class Sse(asyncio.Protocol):
    """A chunked C{text/event-stream} reader calling C{on_event(data)} for each C{event: mcp}."""

    def __init__(self, request: bytes, on_event: Callable[[bytes], None], opened: asyncio.Future[None]) -> None:
        self.request = request
        self.on_event = on_event
        self.opened = opened
        self.buffer = b""
        self.headers_done = False
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buffer + data if self.buffer else data
        if not self.headers_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buffer = buf
                return
            assert buf[9:12] == b"200", buf[:200]
            self.headers_done = True
            buf = buf[end + 4 :]
            self.opened.set_result(None)
        while True:
            line_end = buf.find(b"\r\n")
            if line_end < 0:
                break
            size = int(buf[:line_end], 16)
            if len(buf) < line_end + 4 + size:
                break
            chunk = buf[line_end + 2 : line_end + 2 + size]
            buf = buf[line_end + 4 + size :]
            for block in chunk.split(b"\n\n"):
                if block.startswith(b"event: mcp\ndata: "):
                    self.on_event(block[17:])
        self.buffer = buf


async def _connect(port: int, factory: Callable[[], asyncio.Protocol]) -> Any:
    loop = asyncio.get_running_loop()
    _, protocol = await loop.create_connection(factory, "127.0.0.1", port)
    return protocol


async def _request(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    conn: Http = await _connect(port, Http)
    done: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
    conn.send(_build(method, path, body), lambda status, data: done.set_result((status, data)))
    result = await done
    conn.transport.close()
    return result


async def _register(port: int, name: str) -> None:
    """Register a session; a relay on Redis answers 503 until its pool has connected, so retry."""
    deadline = time.monotonic() + 10
    while True:
        status, body = await _request(port, "POST", "/register", json.dumps({"session": name, "token": TOKEN}).encode())
        if status == 200:
            return
        assert status == 503 and time.monotonic() < deadline, (status, body)
        await asyncio.sleep(0.05)


INIT = b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{},"clientInfo":{"name":"bench","version":"1"}}}'


async def _initialize(port: int, name: str) -> str:
    """Open a standard MCP client session on C{name} (its page must be reading); its Mcp-Session-Id."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write((f"POST /{name}/mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nauthorization: Bearer {TOKEN}\r\n"
                  f"accept: application/json\r\ncontent-type: application/json\r\n"
                  f"content-length: {len(INIT)}\r\nconnection: close\r\n\r\n").encode() + INIT)
    response = await reader.read()
    writer.close()
    found = re.search(rb"(?i)\r\nmcp-session-id: ([^\r]+)", response)
    assert response[9:12] == b"200" and found, response[:300]
    return found.group(1).decode()


async def _open_get(port: int, name: str, sid: str) -> Any:
    """A client session's GET stream (held open, never read)."""
    loop = asyncio.get_running_loop()
    opened = loop.create_future()
    request = (f"GET /{name}/mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nauthorization: Bearer {TOKEN}\r\n"
               f"mcp-session-id: {sid}\r\naccept: text/event-stream\r\n\r\n").encode()
    conn = await _connect(port, lambda: Sse(request, lambda d: None, opened))
    await opened
    return conn


def _build(method: str, path: str, body: bytes = b"") -> bytes:
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def _sse_request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\naccept: text/event-stream\r\n\r\n".encode()


# Round trips --------------------------------------------------------------------------------------


class Session:
    """One session's page and agent, driven by callbacks (no task per message)."""

    def __init__(self, name: str, page_port: int, agent_port: int, mode: str, interval: float,
                 latencies: list[float]) -> None:
        self.name = name
        self.page_port = page_port
        self.agent_port = agent_port
        self.mode = mode
        self.interval = interval
        self.latencies = latencies
        self.n = 0
        self.sent_at = 0.0
        self.next_at = 0.0
        self.running = False
        self.loop = asyncio.get_running_loop()
        t = TOKEN
        self.inbox_head = (f"POST /{name}/inbox?token={t} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                           "content-type: application/json\r\ncontent-length: ").encode()
        self.outbox_head = (f"POST /{name}/outbox?token={t} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                            "content-type: application/json\r\ncontent-length: ").encode()
        self.poll_request = b""
        self.mcp_head = b""

    async def open(self) -> None:
        name, t = self.name, TOKEN
        await _register(self.page_port, name)
        loop = self.loop
        if self.mode != "page":
            # (An idle page answers on a connection of its own per answer: a keep-alive connection
            # opened long before its first request would get relayd's 408 header timeout.)
            self.page_out: Http = await _connect(self.page_port, Http)
            self.agent_in: Http = await _connect(self.agent_port, Http)
        opened = loop.create_future()
        await _connect(self.page_port, lambda: Sse(
            _sse_request(f"/{name}/events?token={t}&direction=inbound"), self.page_event, opened))
        await opened
        if self.mode == "endpoint":
            sid = await _initialize(self.agent_port, name)
            self.mcp_head = (f"POST /{name}/mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nauthorization: Bearer {t}\r\n"
                             f"mcp-session-id: {sid}\r\naccept: application/json, text/event-stream\r\n"
                             "content-type: application/json\r\ncontent-length: ").encode()
        elif self.mode == "sse":
            opened = loop.create_future()
            await _connect(self.agent_port, lambda: Sse(
                _sse_request(f"/{name}/events?token={t}&direction=outbound"), self.agent_event, opened))
            await opened
        elif self.mode == "page":
            return  # only the page (idle-endpoint's clients are opened by the measurement)
        else:
            _status, body = await _request(self.agent_port, "GET",
                                          f"/{name}/poll?token={t}&direction=outbound&wait=0")
            sub = orjson.loads(body)["subscriber"]
            self.poll_request = _build(
                "GET", f"/{name}/poll?token={t}&direction=outbound&wait=20000&subscriber={sub}")
            self.poller: Http = await _connect(self.agent_port, Http)
            self.poller.send(self.poll_request, self.polled)

    @staticmethod
    def _ignore(status: int, body: bytes) -> None:
        assert status == 200, (status, body)

    def page_event(self, data: bytes) -> None:
        if b'"method":"tools/call"' not in data and b'"method":"initialize"' not in data:
            return  # presence notifications
        frame_id = orjson.loads(data)["id"]
        body = b'{"jsonrpc":"2.0","id":%b,"result":{"ok":true}}' % orjson.dumps(frame_id)
        if self.mode == "page":
            self.loop.create_task(self._answer_once(body))
            return
        self.page_out.send(self.outbox_head + b"%d\r\n\r\n" % len(body) + body, self._ignore)

    async def _answer_once(self, body: bytes) -> None:
        status, answer = await _request(self.page_port, "POST", f"/{self.name}/outbox?token={TOKEN}", body)
        self._ignore(status, answer)

    def agent_event(self, data: bytes) -> None:
        if orjson.loads(data).get("id") == self.n:
            self.replied()

    def polled(self, status: int, body: bytes) -> None:
        assert status == 200, (status, body)
        frames = orjson.loads(body)["frames"]
        self.poller.send(self.poll_request, self.polled)
        for frame in frames:
            if orjson.loads(frame).get("id") == self.n:
                self.replied()

    def start(self, stop_at: float, count: int = 0) -> None:
        """Send until C{stop_at}, or (C{count}) until C{count} more round trips are answered."""
        self.stop_at = stop_at
        self.limit = self.n + count if count else 0
        self.running = True
        self.next_at = time.monotonic()
        self.send()

    def send(self) -> None:
        if self.n >= self.limit if self.limit else time.monotonic() >= self.stop_at:
            self.running = False
            return
        self.n += 1
        body = b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"t"}}' % self.n
        self.sent_at = time.monotonic()
        if self.mcp_head:
            self.agent_in.send(self.mcp_head + b"%d\r\n\r\n" % len(body) + body, self.answered)
            return
        self.agent_in.send(self.inbox_head + b"%d\r\n\r\n" % len(body) + body, self._ignore)

    def answered(self, status: int, body: bytes) -> None:
        """The standard endpoint's answer to a tools/call POST (the page's reply, as JSON)."""
        assert status == 200 and orjson.loads(body).get("id") == self.n, (status, body)
        self.replied()

    def replied(self) -> None:
        now = time.monotonic()
        self.latencies.append(now - self.sent_at)
        if not self.interval:
            self.send()
            return
        self.next_at += self.interval
        delay = self.next_at - now
        if delay > 0:
            self.loop.call_later(delay, self.send)
        else:
            self.send()


WARM_UP = 20  # round trips per session before a --count measurement


def _client(names: list[str], ports: tuple[int, int], mode: str, interval: float, pipe: Any, count: int = 0) -> None:
    """One client process: open its sessions, report ready, run when told, send back latencies."""
    try:
        import uvloop  # optional: a cheaper event loop leaves more CPU to the server

        uvloop.install()
    except ImportError:
        pass

    async def counted(sessions: list[Session], n: int) -> None:
        for s in sessions:
            s.start(0.0, n)
        while any(s.running for s in sessions):
            await asyncio.sleep(0.01)  # polling the sessions' state, not synchronising with the server

    async def run() -> None:
        latencies: list[float] = []
        sessions = [Session(n, ports[0], ports[1], mode, interval, latencies) for n in names]
        for s in sessions:
            await s.open()
        loop = asyncio.get_running_loop()
        if count:
            await counted(sessions, WARM_UP)
            latencies.clear()
        pipe.send("ready")
        seconds = await loop.run_in_executor(None, pipe.recv)
        cpu0 = time.process_time()
        if count:
            await counted(sessions, count)
            pipe.send((latencies, time.process_time() - cpu0))
            return
        stop_at = time.monotonic() + seconds
        for i, s in enumerate(sessions):
            # Spread the paced sessions' first sends over one interval (no thundering herd).
            loop.call_later(interval * i / len(sessions) if interval else 0, s.start, stop_at)
        while time.monotonic() < stop_at + 0.05:
            await asyncio.sleep(0.05)
        # Round trips still in flight at the end are not counted (they would skew latency).
        pipe.send((latencies, time.process_time() - cpu0))

    asyncio.run(run())


def round_trips(ports: tuple[int, int], servers: list[Any], mode: str, sessions: int, seconds: float,
                rate: float | None, procs: int, redis: RedisProcess | None = None, count: int = 0,
                callgrind: bool = False) -> dict[str, Any]:
    names = [f"b{i:05d}" for i in range(sessions)]
    interval = sessions / rate if rate else 0.0
    ctx = multiprocessing.get_context("fork")
    pipes, workers = [], []
    for k in range(procs):
        parent, child = ctx.Pipe()
        w = ctx.Process(target=_client, args=(names[k::procs], ports, mode, interval, child, count))
        w.start()
        pipes.append(parent)
        workers.append(w)
    for p in pipes:
        assert p.recv() == "ready"
    if callgrind:
        for s in servers:
            s.zero_instructions()
    cpu0 = [s.cpu_seconds() for s in servers]
    redis0 = redis.cpu_seconds() if redis is not None else 0.0
    t0 = time.monotonic()
    for p in pipes:
        p.send(seconds)
    latencies: list[float] = []
    client_cpu = 0.0
    for p in pipes:
        lat, cpu = p.recv()
        latencies += lat
        client_cpu += cpu
    elapsed = time.monotonic() - t0
    cpu = [s.cpu_seconds() - c for s, c in zip(servers, cpu0, strict=True)]
    instructions = [s.instructions() for s in servers] if callgrind else None
    redis_cpu = redis.cpu_seconds() - redis0 if redis is not None else None
    for w in workers:
        w.join(10)
    latencies.sort()
    n = max(1, len(latencies))
    extra: dict[str, Any] = {} if redis_cpu is None else {"redis_cpu_per_rt_us": round(redis_cpu / n * 1e6, 1)}
    if instructions is not None:
        extra["instructions_per_rt"] = [i // n for i in instructions]
    return {
        "mode": mode,
        "sessions": sessions,
        "offered_rate": rate,
        "client_procs": procs,
        "round_trips": len(latencies),
        "round_trips_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(latencies[len(latencies) // 2] * 1000, 2),
        "p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2),
        "server_cpu_per_rt_us": [round(c / n * 1e6, 1) for c in cpu],
        "server_cpu_util": [round(c / elapsed, 2) for c in cpu],
        "client_cpu_per_rt_us": round(client_cpu / n * 1e6, 1),
        **extra,
    }


# Idle memory --------------------------------------------------------------------------------------


async def _idle(port: int, mode: str, count: int, rss: Callable[[], int]) -> dict[str, Any]:
    names = [f"idle{i:05d}" for i in range(count)]
    pages: dict[str, Session] = {}
    for name in names:
        if mode == "endpoint":
            # The page (it answers initialize) is there before the measurement starts.
            page = Session(name, port, port, "page", 0.0, [])
            await page.open()
            pages[name] = page
        else:
            await _register(port, name)
    await asyncio.sleep(1.0)  # a measurement pause, not synchronisation
    before = rss()
    held: list[Any] = []
    loop = asyncio.get_running_loop()
    for name in names:
        if mode == "endpoint":
            sid = await _initialize(port, name)
            held.append(await _open_get(port, name, sid))
        elif mode == "sse":
            opened = loop.create_future()
            request = _sse_request(f"/{name}/events?token={TOKEN}&direction=outbound")
            held.append(await _connect(port, lambda request=request, opened=opened: Sse(request, lambda d: None, opened)))
            await opened
        else:
            conn: Http = await _connect(port, Http)
            conn.send(_build("GET", f"/{name}/poll?token={TOKEN}&direction=outbound&wait=25000"), lambda s, b: None)
            held.append(conn)
    await asyncio.sleep(1.0)  # let the server settle (a measurement pause)
    after = rss()
    for h in held:
        h.transport.close()
    return {"mode": mode, "subscribers": count, "rss_before_kb": before, "rss_after_kb": after,
            "kb_per_subscriber": round((after - before) / count, 2)}


SCENARIOS = ("rt-sse", "rt-poll", "latency-sse", "latency-poll", "idle-sse", "idle-poll",
             "rt-endpoint", "latency-endpoint", "idle-endpoint")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--rate", type=float, default=1000.0, help="offered round trips/s for latency-*")
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--procs", type=int, default=1, help="client processes")
    parser.add_argument("--redis", action="store_true", help="run relayd with --redis on a fresh redis-server")
    parser.add_argument("--instances", type=int, default=1, choices=(1, 2),
                        help="with 2 (needs --redis): pages on instance A, agents on instance B")
    parser.add_argument("--no-access-log", action="store_true", help="run relayd with --no-access-log")
    parser.add_argument("--profile", help="py-spy record the (first) server into this file (raw format)")
    parser.add_argument("--count", type=int, default=0, help="rt-*: round trips per session instead of --seconds")
    parser.add_argument("--callgrind", action="store_true", help="with --count: instructions per round trip")
    parser.add_argument("--cprofile", help="cProfile the (first) server's whole run into this file (pstats)")
    args = parser.parse_args()
    _raise_nofile()
    if args.instances == 2 and not args.redis:
        parser.error("--instances 2 needs --redis")
    if args.callgrind and not args.count:
        parser.error("--callgrind needs --count")
    for scenario in args.scenarios:
        redis = RedisProcess() if args.redis else None
        options = (["--no-access-log"] if args.no_access_log else []) + ["--mcp-max-sessions", str(max(args.idle, args.sessions) + 10)]
        # Every client is on loopback: one address, which the per-address bounds would hold to 1000.
        options += ["--mcp-max-sessions-per-address", "0", "--mcp-max-clients-per-address", "0"]
        if redis is not None:
            options += ["--redis", redis.url]
        grind = tempfile.mkdtemp(prefix="bench-mcp-callgrind-") if args.callgrind else None
        servers = [Server(*options, callgrind=grind, cprofile=args.cprofile if i == 0 else None)
                   for i in range(args.instances)]
        spy = None
        try:
            kind, mode = scenario.split("-")
            if kind == "idle":
                result = asyncio.run(_idle(servers[0].port, mode, args.idle, servers[0].rss_kb))
            else:
                ports = (servers[0].port, servers[-1].port)
                if args.profile:
                    spy = subprocess.Popen(["py-spy", "record", "-p", str(servers[0].proc.pid), "-f", "raw",
                                            "-o", args.profile, "-d", str(int(args.seconds) + 3)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                rate = args.rate if kind == "latency" else None
                result = round_trips(ports, servers, mode, args.sessions, args.seconds, rate, args.procs, redis,
                                     args.count, args.callgrind)
            if redis is not None:
                result["redis"] = True
                result["instances"] = args.instances
            print(json.dumps({"scenario": scenario, **result}), flush=True)
        finally:
            if spy is not None:
                spy.wait()
            for s in servers:
                s.stop()
            if redis is not None:
                redis.stop()
            if grind is not None:
                shutil.rmtree(grind, ignore_errors=True)


if __name__ == "__main__":
    main()
