"""AEP relay benchmark (a benchmark, not a test): ingest, fan-out, latency, idle memory.

Starts a real ``twistd -n relayd`` per scenario on a free loopback port, drives it from asyncio
clients in this process, and reads the server's own CPU time and RSS from /proc. Figures go to
docs/performance.md.

    python bench/aep.py                      # every scenario
    python bench/aep.py ingest fanout-sse    # a selection
    python bench/aep.py --seconds 10 ...     # longer runs

Scenarios with --redis (two instances, one redis-server started by the bench): cluster-ingest,
cluster-fanout (emitter on A, 100 / 1000 SSE subscribers on B), cluster-latency (1000 events/s
from A to 10 subscribers on B). ``--engine standalone --engine cluster`` runs each of them on one
redis-server and on a fresh 3-master Redis Cluster (no replicas, ``--redis-wait-replicas 0`` on both),
alternated ``--runs`` times, the events spread over ``--sessions`` sessions, and prints the ratios
cluster/standalone (relayd and per-node redis-server CPU per event, events/s, latency)::

    python bench/aep.py cluster-ingest --engine standalone --engine cluster --runs 4 --instances 4

With --engine, cluster-ingest fills every session's buffer before the timed part (each timed batch
trims as many events as it adds, on both engines) and prints what the nodes' own counters say
(commands per event, INFO cpu's user and system CPU per event); --node-tables adds each node's INFO
commandstats and stats, --idle-baseline the same seconds idle as extra columns (docs/performance.md
"Issue 25 target 1: where the cluster's extra redis-server CPU goes").

Scenarios: ingest (NDJSON batches of 100 x ~500 B over 8 connections), single (one JSON event per
POST, 8 connections), fanout-sse (one WS emitter -> 100 and 1000 SSE subscribers), fanout-ws
(-> 100 WebSocket subscribers), latency (1000 SSE subscribers at 100 events/s), idle (1000 and
5000 idle SSE connections), index (the subscription index: N subscriptions, 10 per session,
SSE and WebSocket mixed; server CPU per event posted to one session against the same with only that
session's 10 subscribers, and the longest reactor stall while 1000 events/s go across sessions):

    python bench/aep.py index --subscriptions 100000 --seconds 10 --gc-log

Issue 24's shapes (bench/peers.py runs them against the peers): sdk (a new connection per event,
one JSON event per POST with ``Connection: close``, 8 clients, as the official Python SDK's
``http_sink``), single-xff (single with ``--trust-forwarded-for 1`` and ``X-Forwarded-For``),
single-redis (single on ``--redis``), fanout-single (fanout-post with one event per POST), storm
(5000 SSE streams open at once, each filtered to one of 50 sessions and resuming 5 events back:
wall time until every one has its 5, ``/healthz`` latency meanwhile), storm-backlog511 (the same,
relayd listening with Node's and nginx's backlog of 511 instead of Twisted's 50), storm-ws (the
storm as WebSocket subscriptions: ``--storm-ws N`` connections, default 5000, each ``hello`` then
``subscribe`` with the same filter and ``from``; with it an emitter sends 100 events/s to a
subscriber connected before the storm, whose delivery latency meanwhile is ``live_p99_ms``),
storm-ws-greeted (the same, the connections opened and greeted before: the storm is their
subscribes alone, all sent at once, as when an event makes every open dashboard subscribe).

fanout-post: fan-out from HTTP ingest, 100 events/s in POSTs of 10 to 1000 SSE streams (any AEP
relay takes it: the streams are counted once a warm-up event reached each, whenever the relay sends
its headers).

Against another AEP relay (the scenarios that use only HTTP ingest and count deliveries without
waiting for headers: ingest, single, sdk, fanout-post, fanout-single, storm; idle waits for each
stream's headers, which a relay may send only with its first event; the others need relayd's
WebSocket or options), instead of starting relayd:

    python bench/aep.py ingest --target http://127.0.0.1:8797 --target-pid PID   # started separately
    python bench/aep.py ingest --target-cmd 'cd DIR && AEP_PORT={port} exec node server.cjs'

--target-cmd starts the relay per scenario (``{port}`` is a free port) and measures its process
group's CPU; --target measures the process PID. Give it relayd's settings yourself (ingest runs
relayd with --aep-buffer 1000 --aep-max-sessions 64).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from autobahn.asyncio.websocket import WebSocketClientFactory, WebSocketClientProtocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relayd_process import (
    RedisClusterProcess,
    RedisProcess,
    RelaydServer,
    command_stats,
    group_cpu,
    node_counters,
    process_cpu,
    process_rss_kb,
    raise_nofile,
    redis_store,
)

PAD = "x" * 330  # makes each event about 500 bytes
# What an EventSource sends; nginx + Nchan tells its subscriber types by it (without, 403).
SSE_ACCEPT = b"accept: text/event-stream\r\n"


# The server ----------------------------------------------------------------------------------


class RelaydTarget(RelaydServer):
    """relayd with only the AEP wing, on a free loopback port (C{.port})."""

    def __init__(self, *options: str, backlog: int | None = None) -> None:
        listen = "tcp:0:interface=127.0.0.1" + (f":backlog={backlog}" if backlog is not None else "")
        super().__init__("--no-mcp", "--aep-listen", listen, *options)
        self.port = self.ports["aep"]


class OtherTarget:
    """Another AEP relay: started separately (C{--target URL --target-pid PID}; its CPU is that
    process's) or started per scenario by the bench (C{--target-cmd}, a shell command in which
    C{{port}} is a free port and C{{redis}} the scenario's Redis URL where it has one; its CPU is its
    whole process group's: the shell and what it runs).
    relayd's own options (buffer sizes, limits) do not apply to it: give it the equivalent ones."""

    url: str | None = None
    pid: int | None = None
    cmd: str | None = None
    # The status line of an accepted POST: relayd's 202 (checked exactly); another relay any 2xx
    # (nginx + Nchan answers a publication 201 or 202, by whether it had subscribers).
    accepted = b"HTTP/1.1 202"

    def __init__(self, *options: str, backlog: int | None = None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        if self.cmd is not None:
            self.port = _free_port()
            self.log = tempfile.NamedTemporaryFile(prefix="aep-target-", suffix=".log", delete=False)
            command = self.cmd.replace("{port}", str(self.port))
            if "--redis" in options:  # (a command may take the scenario's Redis: bench/http_floor.py redis)
                command = command.replace("{redis}", options[options.index("--redis") + 1])
            self.proc = subprocess.Popen(command, shell=True,
                                         stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=raise_nofile)
            self._wait_listening()
        else:
            assert self.url is not None and self.pid is not None, "--target needs --target-pid"
            found = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/?", self.url)
            if found is None:
                raise SystemExit("--target must be http://127.0.0.1:PORT (the bench's clients use loopback)")
            self.port = int(found.group(1))

    def _wait_listening(self) -> None:
        import socket

        assert self.proc is not None
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)  # waiting for another process to start listening
        raise RuntimeError("the target did not start:\n" + Path(self.log.name).read_text(errors="replace"))

    def cpu(self) -> float:
        return group_cpu(self.proc.pid) if self.proc is not None else process_cpu(self.pid)  # type: ignore[arg-type]

    def rss_kb(self) -> int:
        return process_rss_kb(self.proc.pid if self.proc is not None else self.pid)  # type: ignore[arg-type]

    def stop(self) -> None:
        if self.proc is None:
            return  # started separately: it keeps running
        import signal

        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.unlink(self.log.name)


def Server(*options: str, backlog: int | None = None) -> Any:
    """The relay a scenario runs against: relayd (with C{options}; C{backlog}: its listener's, Twisted's
    50 by default), or the C{--target} (its own)."""
    if OtherTarget.url is not None or OtherTarget.cmd is not None:
        return OtherTarget(*options)
    return RelaydTarget(*options, backlog=backlog)


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """Read one HTTP response, its body too (sized or chunked, as another relay may send it); its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    lower = head.lower()
    found = re.search(rb"\r\ncontent-length: *(\d+)", lower)
    if found:
        await reader.readexactly(int(found.group(1)))
    elif b"\r\ntransfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    return head


def auth() -> bytes:
    """The authorization header line for C{--token} (the bench's helper processes inherit it)."""
    token = os.environ.get("BENCH_AEP_TOKEN")
    return b"authorization: Bearer %s\r\n" % token.encode() if token else b""


def event(session: str, seq: int, **extra: Any) -> dict[str, Any]:
    return {"aep": "0.1", "id": f"{session}-{seq}", "type": "progress.status", "time": "2026-11-29T00:00:00Z",
            "source": f"aep://bench/agent/a/session/{session}", "agent": "bench", "session": session,
            "seq": seq, "severity": "notice", "data": {"message": PAD, **extra}}


# Clients -------------------------------------------------------------------------------------


async def http_post_loop(port: int, body_for: Any, ctype: str, stop_at: float, counter: list[int], per: int,
                         headers: bytes = b"") -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    n = 0
    while time.perf_counter() < stop_at:
        body = body_for(n)
        writer.write(b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\ncontent-type: %s\r\n%s%s"
                     b"content-length: %d\r\n\r\n" % (ctype.encode(), auth(), headers, len(body)) + body)
        head = await read_response(reader)
        assert head.startswith(OtherTarget.accepted), head
        n += 1
        counter[0] += per
    writer.close()


async def http_close_loop(port: int, body_for: Any, ctype: str, stop_at: float, counter: list[int], per: int,
                          headers: bytes = b"") -> None:
    """The official AEP Python SDK's C{http_sink}: a new connection for every POST, C{Connection: close}
    (urllib's request headers, in its order)."""
    n = 0
    while time.perf_counter() < stop_at:
        body = body_for(n)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /events HTTP/1.1\r\nAccept-Encoding: identity\r\nContent-Length: %d\r\nHost: localhost\r\n"
                     b"User-Agent: Python-urllib/3.11\r\nContent-Type: %s\r\nAep-Version: 0.1\r\n%s%s"
                     b"Connection: close\r\n\r\n" % (len(body), ctype.encode(), auth(), headers) + body)
        head = await read_response(reader)
        assert head.startswith(OtherTarget.accepted), head
        writer.close()
        n += 1
        counter[0] += per


class SSESubscriber:
    """Counts deliveries; when C{timed}, parses each frame's send time for latency."""

    def __init__(self, timed: bool, lazy: bool = False) -> None:
        self.count = 0
        self.timed = timed
        self.lazy = lazy  # do not wait for the headers (a relay may send them with its first event)
        self.latencies: list[float] = []
        self.tail = b""

    async def run(self, port: int, path: str = "/stream", ready: asyncio.Event | None = None) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET %s HTTP/1.1\r\nHost: localhost\r\n%s%s\r\n" % (path.encode(), SSE_ACCEPT, auth()))
        if not self.lazy:
            await reader.readuntil(b"\r\n\r\n")
        if ready is not None:
            ready.set()
        self.writer = writer
        while True:
            chunk = await reader.read(262144)
            if not chunk:
                return
            now = time.time()
            data = self.tail + chunk
            self.count += data.count(b"\nid: ")
            cut = data.rfind(b"\n")
            self.tail = data[cut:] if cut >= 0 else data
            if self.timed:
                for t in re.findall(rb'"t":([0-9.]+)', chunk):
                    self.latencies.append(now - float(t))


class WSBase(WebSocketClientProtocol):
    bench: Any = None

    def onOpen(self) -> None:
        self.bench.opened(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.bench.message(self, payload)


class WSPeer:
    def __init__(self, timed: bool = False) -> None:
        self.count = 0
        self.timed = timed
        self.latencies: list[float] = []
        self.ready = asyncio.get_event_loop().create_future()
        self.proto: Any = None

    def opened(self, proto: Any) -> None:
        self.proto = proto

    def message(self, proto: Any, payload: bytes) -> None:
        if payload.startswith(b'{"type":'):
            if b'"subscribed"' in payload or b'"hello"' in payload:
                if not self.ready.done():
                    self.ready.set_result(None)
            return
        self.count += 1
        if self.timed:
            m = re.search(rb'"t":([0-9.]+)', payload)
            if m:
                self.latencies.append(time.time() - float(m.group(1)))

    async def connect(self, port: int, hello: dict[str, Any], then: dict[str, Any] | None = None) -> None:
        factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/socket")
        peer = self

        class Proto(WSBase):
            bench = peer

        factory.protocol = Proto
        await asyncio.get_event_loop().create_connection(factory, "127.0.0.1", port)
        while self.proto is None:
            await asyncio.sleep(0.001)
        self.proto.sendMessage(json.dumps({"type": "hello", "versions": ["0.1"], **hello}).encode())
        if then is not None:
            await self.ready
            self.ready = asyncio.get_event_loop().create_future()
            self.proto.sendMessage(json.dumps(then).encode())
        await self.ready


async def emit(emitter: WSPeer, rate: float, seconds: float, session: str = "F", sessions: int = 1) -> int:
    """Send C{rate} events/s for C{seconds}, in small bursts every 10 ms; C{sessions} > 1: event n to
    session C{spread_session(n, sessions)} instead of C{session}."""
    sent = 0
    start = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return sent
        due = int(elapsed * rate) + 1
        while sent < due:
            ev = event(spread_session(sent, sessions) if sessions > 1 else session, sent, t=time.time())
            emitter.proto.sendMessage(json.dumps(ev, separators=(",", ":")).encode())
            sent += 1
        await asyncio.sleep(0.01)



# A drain process: holds many subscriber sockets and reads them with plain epoll, so the load
# generator (not asyncio's per-read overhead) never becomes the bottleneck of a fan-out figure.


WS_UPGRADE = (b"GET /socket HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
              b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
"""A WebSocket opening handshake for C{/socket} (a fixed key: the answer is not checked)."""


def _ws_frame(payload: bytes) -> bytes:
    """A masked client text frame (RFC 6455 5.2)."""
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + n.to_bytes(2, "big"))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def stdin_closed() -> threading.Event:
    """Set once the parent closes our standard input (how a helper process is told to stop)."""
    closed = threading.Event()

    def wait() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait, daemon=True).start()
    return closed


def spread_session(n: int, sessions: int) -> str:
    """The session of the C{n}th event spread round-robin over C{sessions} (S0, S1 ...)."""
    return f"S{n % sessions}"


def drain_session(i: int, sessions: int) -> str:
    """The session the C{i}th subscriber follows when C{sessions} share them: F alone, else F0, F1 ..."""
    return "F" if sessions == 1 else f"F{i % sessions}"


def drain_main(port: int, transport: str, count: int, sessions: int = 1, first: int = 0, per_conn: int = 1) -> None:
    """Hold C{count} subscribers to session F and count their deliveries; print the total when
    standard input closes. C{transport} "sse-lazy": do not wait for each stream's headers (a relay
    may send them only with its first event); then each line read on standard input is answered
    with "<streams that received an event> <deliveries so far>" (the bench warms up with it).

    C{sessions} > 1 spreads them over sessions F0, F1 ... (subscriber C{i} follows
    L{drain_session}C{(first + i)}); C{sessions} 0: every subscriber unfiltered (every session); "ws" with C{per_conn} > 1 multiplexes that many subscriptions
    on each connection (the relay allows C{--aep-max-subscriptions}, 64 by default)."""
    import queue
    import select
    import socket
    import urllib.parse

    lazy = transport == "sse-lazy"
    if lazy:
        transport = "sse"
    marker = b"\nid: " if transport == "sse" else b'"aep":"0.1"'
    socks = []
    step = per_conn if transport == "ws" else 1
    for c in range(0, count, step):
        s = socket.create_connection(("127.0.0.1", port))
        if transport == "sse":
            path = "/stream"
            if sessions:
                flt = json.dumps({"session": drain_session(first + c, sessions)}, separators=(",", ":"))
                path += "?filter=" + urllib.parse.quote(flt, safe="")
            s.sendall(b"GET %s HTTP/1.1\r\nHost: localhost\r\n%s" % (path.encode(), SSE_ACCEPT) + auth() + b"\r\n")
        else:
            s.sendall(WS_UPGRADE)
        head = b""
        while not lazy and b"\r\n\r\n" not in head:
            head += s.recv(4096)
        if transport == "ws":
            subs = range(c, min(count, c + step))
            frames = [_ws_frame(json.dumps({"type": "hello", "versions": ["0.1"], "role": "consumer"}).encode())]
            frames += [_ws_frame(json.dumps({"type": "subscribe", "id": f"s{i}", "filter": {
                "session": drain_session(first + i, sessions)} if sessions else {}}).encode()) for i in subs]
            s.sendall(b"".join(frames))
            got = b""
            while got.count(b'"subscribed"') < len(subs):
                got += s.recv(65536)
        s.setblocking(False)
        socks.append(s)
    ep = select.epoll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        ep.register(fd, select.EPOLLIN)
    tails = dict.fromkeys(by_fd, b"")
    seen: set[int] = set()
    total = 0
    print("ready", flush=True)
    buf = bytearray(262144)
    view = memoryview(buf)
    asked: queue.Queue[str] = queue.Queue()
    stop = threading.Event()

    def read_stdin() -> None:
        for line in sys.stdin:
            asked.put(line)
        stop.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    while not stop.is_set():
        for fd, _ in ep.poll(0.05 if lazy else 0.2):
            n = by_fd[fd].recv_into(buf)
            if not n:
                ep.unregister(fd)
                continue
            data = tails[fd] + bytes(view[:n])
            found = data.count(marker)
            if found:
                total += found
                seen.add(fd)
            tails[fd] = data[-(len(marker) - 1):]
        while not asked.empty():
            asked.get()
            print(len(seen), total, flush=True)
    print(total, flush=True)


def _source(i: int) -> str:
    """Loopback source address of the C{i}th held connection: one address has ~28 000 ephemeral
    ports, so every 20 000 connections move to the next (127.0.0.2, 127.0.0.3 ...)."""
    return f"127.0.0.{2 + i // 20000}"


INDEX_SSE_EVERY = 10  # slot 0 of every session is an SSE stream, slots 1..9 WebSocket subscriptions
INDEX_PER_WS = 100  # WebSocket subscriptions per connection (--aep-max-subscriptions is raised to it)


def hold_main(port: int, subscriptions: int) -> None:
    """Hold C{subscriptions} subscriptions, 10 per session C{s<n>} (one SSE stream, nine WebSocket
    subscriptions spread round-robin over connections of L{INDEX_PER_WS}), and drain them."""
    import select
    import socket

    raise_nofile()
    sessions = max(1, subscriptions // INDEX_SSE_EVERY)
    ws_subs = [(f"s{j // INDEX_SSE_EVERY}", j) for j in range(subscriptions) if j % INDEX_SSE_EVERY]
    # At least nine connections, so a session's nine WebSocket subscriptions are on nine
    # connections whether the others are held or not (the same delivery work either way).
    conns = max(min(len(ws_subs), INDEX_SSE_EVERY - 1), -(-len(ws_subs) // INDEX_PER_WS))
    socks: list[socket.socket] = []

    def opened(i: int) -> socket.socket:
        s = socket.socket()
        s.bind((_source(i), 0))
        s.connect(("127.0.0.1", port))
        return s

    def read_until(s: socket.socket, marker: bytes, count: int = 1) -> None:
        got = b""
        while got.count(marker) < count:
            chunk = s.recv(65536)
            if not chunk:
                raise SystemExit(f"relayd closed a held connection: {got[-300:]!r}")
            got += chunk

    # SSE streams a listen backlog's worth at a time (a full accept queue drops SYNs for a second).
    for start in range(0, sessions, 40):
        batch: list[socket.socket] = []
        for n in range(start, min(sessions, start + 40)):
            s = opened(len(socks) + len(batch))
            flt = "%7B%22session%22%3A%22s" + str(n) + "%22%7D"
            s.sendall(b"GET /stream?filter=%s HTTP/1.1\r\nHost: localhost\r\n\r\n" % flt.encode())
            batch.append(s)
        for s in batch:
            read_until(s, b"\r\n\r\n")
        socks.extend(batch)
    by_conn: list[list[str]] = [[] for _ in range(conns)]
    for k, (session, _) in enumerate(ws_subs):
        by_conn[k % conns].append(session)
    for c, subs in enumerate(by_conn):
        s = opened(len(socks))
        s.sendall(WS_UPGRADE)
        read_until(s, b"\r\n\r\n")
        frames = [_ws_frame(json.dumps({"type": "hello", "versions": ["0.1"], "role": "consumer"}).encode())]
        frames += [_ws_frame(json.dumps({"type": "subscribe", "id": f"{c}.{i}", "filter": {"session": session}}).encode())
                   for i, session in enumerate(subs)]
        s.sendall(b"".join(frames))
        read_until(s, b'"subscribed"', len(subs))
        socks.append(s)
    for s in socks:
        s.setblocking(False)
    ep = select.epoll()
    by_fd = {s.fileno(): s for s in socks}
    for fd in by_fd:
        ep.register(fd, select.EPOLLIN)
    print("ready", len(socks), flush=True)
    buf = bytearray(262144)
    stop = stdin_closed()
    while not stop.is_set():
        for fd, _ in ep.poll(0.2):
            if not by_fd[fd].recv_into(buf):
                ep.unregister(fd)
    print("done", flush=True)


def probe_main(port: int, seconds: float) -> None:
    """Ping the relay over a WebSocket every 5 ms for C{seconds}; print the round trips (ms).

    A separate process, so the load generator's own scheduling does not count as a stall."""
    import socket

    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(WS_UPGRADE)
    got = b""
    while b"\r\n\r\n" not in got:
        got += s.recv(4096)
    s.sendall(_ws_frame(json.dumps({"type": "hello", "versions": ["0.1"], "role": "consumer"}).encode()))
    while b'"hello"' not in got:
        got += s.recv(4096)
    print("ready", flush=True)
    sys.stdin.readline()  # go
    rtts = []
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
        tag = b'"p%d"' % n
        t0 = time.perf_counter()
        s.sendall(_ws_frame(b'{"type":"ping","t":%s}' % tag))
        got = b""
        while tag not in got:
            got += s.recv(65536)
        rtts.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.005)
    print(json.dumps(rtts), flush=True)


# What a storm's client sends per stream and counts: an SSE stream's request and its events' `id:`
# lines; a WebSocket's upgrade, then (once it is answered) `hello` and `subscribe` in one write, and
# its events' type. Either subscribes with the same filter and resume position.
STORM_SSE_MARK = b"\nid: "
STORM_WS_MARK = b'"type":"progress.status"'
STORM_WS_HELLO = _ws_frame(b'{"type":"hello","versions":["0.1"],"role":"consumer"}')


def storm_openings(transport: str, count: int, sessions: int, replay: int) -> tuple[list[bytes], list[bytes], bytes]:
    """Per stream of a storm: what is sent once connected, what once the response head is in (empty
    for SSE; a WebSocket's hello, then its subscribe: the second is L{STORM_WS_HELLO}'s length on),
    and the mark each event it is sent carries. Stream C{i} is filtered to session
    C{s<i % sessions>} and resumes after position 0:C{(held - replay - 1)} (C{from}); the bytes are
    built once per session, before the storm, so the client's own cost per stream is a few system
    calls."""
    import urllib.parse

    first, then = [], []
    for k in range(sessions):
        session = f"s{k}"
        flt = {"session": session}
        position = [{"session": session, "epoch": 0, "seq": STORM_HELD - replay - 1}]
        if transport == "sse":
            flt_q, from_q = (urllib.parse.quote(json.dumps(v, separators=(",", ":")), safe="") for v in (flt, position))
            query = f"filter={flt_q}&from={from_q}"
            first.append(b"GET /stream?%s HTTP/1.1\r\nHost: localhost\r\n%s%s\r\n" % (query.encode(), SSE_ACCEPT, auth()))
            then.append(b"")
        else:
            first.append(WS_UPGRADE)
            then.append(STORM_WS_HELLO + _ws_frame(json.dumps({"type": "subscribe", "id": "s", "filter": flt, "from": position},
                                               separators=(",", ":")).encode()))
    mark = STORM_SSE_MARK if transport == "sse" else STORM_WS_MARK
    return [first[i % sessions] for i in range(count)], [then[i % sessions] for i in range(count)], mark


def storm_main(port: int, count: int, sessions: int, replay: int, transport: str = "sse") -> None:
    """Open C{count} subscriptions at once (non-blocking connects, then one request each as its
    connection is up; a WebSocket's C{hello} and C{subscribe} as its upgrade is answered), as
    L{storm_openings} says; print, as JSON, the wall time until every stream has its C{replay}
    events (primed) and the percentiles of each stream's own time. C{transport} "ws-greeted": the
    WebSockets are opened and greeted first (then "ready" is printed), and the storm is their
    subscribes alone, every one sent at once.

    Written as one epoll loop over plain sockets, so the client's own cost per stream is a few
    system calls; the streams are left open until standard input closes."""
    import errno
    import select
    import socket

    greeted = transport == "ws-greeted"
    requests, follow_ups, mark = storm_openings("ws" if greeted else transport, count, sessions, replay)
    ep = select.epoll()
    if greeted:
        opened = greet_all(port, count)
        print("ready", flush=True)
    sys.stdin.readline()  # go
    socks: dict[int, socket.socket] = {}
    which: dict[int, int] = {}
    seen = [0] * count
    tails = [b""] * count
    heads = [False] * count  # whether the response head is in (a WebSocket then says hello)
    primed_at = [0.0] * count
    reconnects = 0

    def open_stream(i: int) -> None:
        s = socket.socket()
        s.setblocking(False)
        err = s.connect_ex(("127.0.0.1", port))
        if err not in (0, errno.EINPROGRESS):
            raise SystemExit(f"connect: {os.strerror(err)}")
        socks[s.fileno()] = s
        which[s.fileno()] = i
        seen[i], tails[i], heads[i] = 0, b"", not follow_ups[i]
        ep.register(s.fileno(), select.EPOLLOUT)

    def reopen(fd: int) -> None:
        # Reset or closed before it was primed: reconnect, as an EventSource does.
        nonlocal reconnects
        reconnects += 1
        ep.unregister(fd)
        socks.pop(fd).close()
        open_stream(which.pop(fd))

    t0 = time.perf_counter()
    if greeted:
        for i, s in enumerate(opened):
            s.setblocking(False)
            socks[s.fileno()], which[s.fileno()], heads[i] = s, i, True
            s.send(follow_ups[i][len(STORM_WS_HELLO):])  # its subscribe, into an empty send buffer
            ep.register(s.fileno(), select.EPOLLIN)
    else:
        for i in range(count):
            open_stream(i)
    left = count
    buf = bytearray(65536)
    deadline = t0 + 60
    while left and time.perf_counter() < deadline:
        for fd, mask in ep.poll(0.5):
            s, i = socks[fd], which[fd]
            if mask & select.EPOLLOUT:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    reopen(fd)
                    continue
                s.send(requests[i])  # a few hundred bytes into an empty send buffer: all of it
                ep.modify(fd, select.EPOLLIN)
                continue
            try:
                n = s.recv_into(buf)
            except OSError:
                n = 0
            if not n:
                if primed_at[i]:
                    ep.unregister(fd)  # closed after it was primed: the server's business
                else:
                    reopen(fd)
                continue
            data = tails[i] + bytes(buf[:n])
            if not heads[i] and b"\r\n\r\n" in data:
                heads[i] = True
                s.send(follow_ups[i])
            seen[i] += data.count(mark)
            tails[i] = data[-(len(mark) - 1):]
            if seen[i] >= replay and not primed_at[i]:
                primed_at[i] = time.perf_counter() - t0
                left -= 1
    wall = time.perf_counter() - t0
    times = [t for t in primed_at if t]
    print(json.dumps({"wall_s": wall, "primed": len(times), "stream_p50_s": pct(times, 0.5),
                      "stream_p99_s": pct(times, 0.99), "reconnects": reconnects}), flush=True)
    sys.stdin.read()
    for s in socks.values():
        s.close()


def greet_all(port: int, count: int) -> list[Any]:
    """C{count} WebSockets, upgraded and greeted (consumers), a few hundred at a time."""
    import socket

    opened = []
    for start in range(0, count, 200):
        batch = [socket.create_connection(("127.0.0.1", port)) for _ in range(start, min(count, start + 200))]
        for s in batch:
            s.sendall(WS_UPGRADE)
        for reply, follow_up in ((b"\r\n\r\n", STORM_WS_HELLO), (b'"hello"', b"")):
            for s in batch:
                got = b""
                while reply not in got:
                    chunk = s.recv(4096)
                    if not chunk:
                        raise SystemExit(f"relayd closed a connection being greeted: {got[-300:]!r}")
                    got += chunk
                if follow_up:
                    s.sendall(follow_up)
        opened.extend(batch)
    return opened


def healthz_main(port: int, interval: float) -> None:
    """C{GET /healthz} every C{interval} seconds over a keep-alive connection (a new one when the
    server closes it) until standard input closes; print the latencies (ms) as JSON. A separate
    process, so the storm's client does not delay the probe."""
    import socket

    def connected() -> socket.socket:
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(60)
        return s

    s = connected()
    stop = stdin_closed()
    print("ready", flush=True)
    latencies = []
    reconnects = 0
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    raise ConnectionError
                got += chunk
            head, _, body = got.partition(b"\r\n\r\n")
            found = re.search(rb"\r\ncontent-length: *(\d+)", head.lower())
            want = int(found.group(1)) if found else 0
            while len(body) < want:
                body += s.recv(4096)
            if b"connection: close" in head.lower():
                s.close()
                s = connected()
        except (ConnectionError, OSError):
            s.close()
            s = connected()  # the server closed a kept-alive connection: the new one is timed too
            reconnects += 1
        latencies.append((time.perf_counter() - t0) * 1000)
        time.sleep(interval)
    print(json.dumps({"latencies": latencies, "reconnects": reconnects}), flush=True)


class Holder:
    """The subscriptions of the index scenario, held and drained by a child process."""

    def __init__(self, port: int, subscriptions: int) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--hold", str(port), str(subscriptions)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=raise_nofile)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith(b"ready"), line
        self.connections = int(line.split()[1])

    def stop(self) -> None:
        self.proc.communicate(b"", timeout=60)


class Drainer:
    """C{count} subscribers held by a child process; C{.total()} ends it and returns deliveries."""

    def __init__(self, port: int, transport: str, count: int, sessions: int = 1, first: int = 0,
                 per_conn: int = 1) -> None:
        argv = [sys.executable, __file__, "--drain", str(port), transport, str(count), str(sessions), str(first),
                str(per_conn)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=raise_nofile)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.strip() == b"ready", line

    def progress(self) -> tuple[int, int]:
        """(streams that received an event, deliveries so far); for transport "sse-lazy"."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"?\n")
        self.proc.stdin.flush()
        seen, total = self.proc.stdout.readline().split()
        return int(seen), int(total)

    def total(self) -> int:
        out, _ = self.proc.communicate(b"", timeout=30)
        return int(out.split()[-1])


# Scenarios -----------------------------------------------------------------------------------


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * p))]


async def scenario_ingest(seconds: float, batch: int, extra: tuple[str, ...] = (),
                          redis: RedisProcess | None = None, close: bool = False,
                          headers: bytes = b"") -> dict[str, Any]:
    """C{batch} events per POST over 8 keep-alive connections, or with C{close} 8 clients that open
    a connection per POST (L{http_close_loop}); C{headers} go with every POST. Server CPU per event."""
    server = Server("--aep-buffer", "1000", "--aep-max-sessions", "64", *extra)
    spy = None
    try:
        await wait_ready(server.port)
        counter = [0]
        ctype = "application/x-ndjson" if batch > 1 else "application/json"

        def body_for_conn(c: int) -> Any:
            # Pre-serialised template: the client must not spend the CPU the server is measured on.
            line = json.dumps(event(f"s{c}", 123456789), separators=(",", ":")).encode()
            template = line.replace(b"123456789", b"%d")
            return lambda n: b"".join(template % (n * batch + i, n * batch + i) + b"\n" for i in range(batch))

        if os.environ.get("BENCH_PROFILE"):  # py-spy raw profile of the server into this file
            spy = subprocess.Popen(["py-spy", "record", "-r", "500", "-p", str(server.proc.pid), "-f", "raw", "-o",
                                    os.environ["BENCH_PROFILE"], "-d", str(int(seconds) + 2)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cpu0, t0 = server.cpu(), time.perf_counter()
        redis0 = redis.cpu() if redis is not None else 0.0
        stop_at = t0 + seconds
        loop = http_close_loop if close else http_post_loop
        await asyncio.gather(*(loop(server.port, body_for_conn(c), ctype, stop_at, counter, batch, headers)
                               for c in range(8)))
        wall, cpu = time.perf_counter() - t0, server.cpu() - cpu0
        result = {"events": counter[0], "events_per_s": counter[0] / wall,
                  "server_cpu_us_per_event": cpu / counter[0] * 1e6, "server_cpu_share": cpu / wall}
        if redis is not None:
            # The instance's own ceiling: events/s if it had a core to itself (redis-server on the other).
            result["redis_cpu_us_per_event"] = (redis.cpu() - redis0) / counter[0] * 1e6
            result["events_per_s_per_core"] = 1e6 / result["server_cpu_us_per_event"]
        return result
    finally:
        if spy is not None:
            spy.wait()
        server.stop()


def subscriber_flags(subscribers: int) -> tuple[str, ...]:
    """relayd's options for C{subscribers} at once (beyond its default limit of 10 000)."""
    return ("--aep-max-subscribers", str(subscribers + 100)) if subscribers + 100 > 10000 else ()


async def scenario_fanout(subscribers: int, transport: str, rate: float, seconds: float, timed: int,
                          per_conn: int = 1) -> dict[str, Any]:
    """One WS emitter at C{rate} events/s; C{timed} subscribers measure latency, a drain process
    holds the rest (WebSocket: C{per_conn} subscriptions to each of its connections)."""
    server = Server(*subscriber_flags(subscribers))
    try:
        drainer = Drainer(server.port, transport, subscribers - timed, per_conn=per_conn) if subscribers > timed else None
        subs: list[Any] = []
        tasks = []
        for _ in range(timed):
            sub: SSESubscriber | WSPeer
            if transport == "sse":
                sub = SSESubscriber(timed=True)
                ready = asyncio.Event()
                tasks.append(asyncio.ensure_future(sub.run(server.port, '/stream?filter={"session":"F"}'.replace('"', "%22"), ready)))
                await ready.wait()
            else:
                sub = WSPeer(timed=True)
                await sub.connect(server.port, {"role": "consumer"}, {"type": "subscribe", "id": "s", "filter": {"session": "F"}})
            subs.append(sub)
        emitter = WSPeer()
        await emitter.connect(server.port, {"role": "emitter", "identity": {"agent": "bench"}})
        await asyncio.sleep(0.5)
        cpu0, t0 = server.cpu(), time.perf_counter()
        sent = await emit(emitter, rate, seconds)
        deadline = time.perf_counter() + 10
        while sum(s.count for s in subs) < sent * timed and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the drain process read the tail
        wall, cpu = time.perf_counter() - t0, server.cpu() - cpu0
        delivered = sum(s.count for s in subs) + (drainer.total() if drainer else 0)
        latencies = [x for s in subs for x in s.latencies]
        for t in tasks:
            t.cancel()
        return {"subscribers": subscribers, "transport": transport, "events": sent, "rate": rate,
                "deliveries": delivered, "expected": sent * subscribers,
                "deliveries_per_s": delivered / (wall - 0.5),
                "server_cpu_us_per_delivery": cpu / max(delivered, 1) * 1e6,
                "server_cpu_share": cpu / wall,
                "p50_ms": pct(latencies, 0.5) * 1000, "p99_ms": pct(latencies, 0.99) * 1000}
    finally:
        server.stop()


async def post_emit(port: int, rate: float, per: int, seconds: float, session: str = "F", first: int = 0) -> int:
    """POST C{rate} events/s as NDJSON bodies of C{per} on one connection (each body made when it
    is due, so its events carry their send time); the events sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        delay = start + sent / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if per == 1:  # one event, as agents post it
            body, ctype = json.dumps(event(session, first + sent, t=time.time()), separators=(",", ":")).encode(), b"json"
        else:
            body, ctype = ndjson_of([event(session, first + sent + i, t=time.time()) for i in range(per)]), b"x-ndjson"
        writer.write(b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\n%s"
                     b"content-type: application/%s\r\ncontent-length: %d\r\n\r\n" % (auth(), ctype, len(body)) + body)
        head = await read_response(reader)
        assert head.startswith(OtherTarget.accepted), head
        sent += per
    writer.close()
    return sent


async def scenario_fanout_post(subscribers: int, rate: float, per: int, seconds: float, timed: int) -> dict[str, Any]:
    """Fan-out from HTTP ingest (any AEP relay takes it): C{rate} events/s in POSTs of C{per} to
    C{subscribers} SSE streams; C{timed} of them measure latency, a drain process holds the rest."""
    server = Server()
    try:
        await wait_ready(server.port)
        drained = subscribers - timed
        drainer = Drainer(server.port, "sse-lazy", drained)
        subs = []
        tasks = []
        for _ in range(timed):
            sub = SSESubscriber(timed=True, lazy=True)
            ready = asyncio.Event()
            tasks.append(asyncio.ensure_future(sub.run(server.port, "/stream?filter=%7B%22session%22%3A%22F%22%7D", ready)))
            await ready.wait()
            subs.append(sub)
        # Warm-up events to session F until every subscriber has one: then all are subscribed
        # (and have their headers), whenever the relay sends them.
        warm = 0
        while True:
            await post_emit(server.port, 10, 1, 0.001, session="F", first=warm)
            warm += 1
            seen, base = await asyncio.get_running_loop().run_in_executor(None, drainer.progress)
            if seen == drained and all(s.count for s in subs):
                break
            if warm > 200:
                raise RuntimeError(f"only {seen} of {drained} streams got the warm-up events")
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
        timed_base = sum(s.count for s in subs)
        base = drainer.progress()[1] + timed_base
        for s in subs:
            s.latencies.clear()
        cpu0, t0 = server.cpu(), time.perf_counter()
        sent = await post_emit(server.port, rate, per, seconds, first=1000)
        deadline = time.perf_counter() + 10
        while sum(s.count for s in subs) < timed_base + sent * timed and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # let the drain process read the tail
        wall, cpu = time.perf_counter() - t0, server.cpu() - cpu0
        delivered = sum(s.count for s in subs) + drainer.total() - base
        latencies = [x for s in subs for x in s.latencies]
        for t in tasks:
            t.cancel()
        return {"subscribers": subscribers, "events": sent, "rate": rate, "per_post": per,
                "deliveries": delivered, "expected": sent * subscribers,
                "server_cpu_us_per_delivery": cpu / max(delivered, 1) * 1e6, "server_cpu_share": cpu / wall,
                "p50_ms": pct(latencies, 0.5) * 1000, "p99_ms": pct(latencies, 0.99) * 1000}
    finally:
        server.stop()


async def scenario_idle(connections: int) -> dict[str, Any]:
    """RSS per idle SSE stream. relayd's streams are counted once their headers arrived; another
    relay may send its headers only with a first event or heartbeat (the Node reference's come after
    25 s), so against it the bench waits until its RSS holds still instead."""
    server = Server()
    lazy = isinstance(server, OtherTarget)
    try:
        await asyncio.sleep(0.5)
        base = server.rss_kb()
        writers = []
        for i in range(connections):
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /stream HTTP/1.1\r\nHost: localhost\r\n%s\r\n" % SSE_ACCEPT)
            writers.append((reader, writer))
            if i % 200 == 199 and not lazy:
                await asyncio.gather(*(r.readuntil(b"\r\n\r\n") for r, _ in writers[-200:]))
            elif i % 200 == 199:
                await asyncio.sleep(0.05)  # a listen backlog's worth at a time
        if lazy:
            rss = server.rss_kb()
            for _ in range(60):  # until two readings a second apart are within 1 %
                await asyncio.sleep(1.0)
                rss, before = server.rss_kb(), rss
                if abs(rss - before) <= before / 100:
                    break
        else:
            await asyncio.gather(*(r.readuntil(b"\r\n\r\n") for r, _ in writers[(connections // 200) * 200:]))
        await asyncio.sleep(1.0)
        rss = server.rss_kb()
        for _, w in writers:
            w.close()
        return {"connections": connections, "baseline_rss_mb": base / 1024, "rss_mb": rss / 1024,
                "kb_per_connection": (rss - base) / connections}
    finally:
        server.stop()


async def post_batches(port: int, batches: list[bytes], rate_per_s: float | None, ctype: bytes = b"x-ndjson") -> None:
    """POST each NDJSON body in turn on one connection (at C{rate_per_s} bodies/s, or at once)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    start = time.perf_counter()
    for n, body in enumerate(batches):
        if rate_per_s is not None:
            delay = start + n / rate_per_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        writer.write(b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\n%s"
                     b"content-type: application/%s\r\ncontent-length: %d\r\n\r\n" % (auth(), ctype, len(body)) + body)
        head = await read_response(reader)
        assert head.startswith(OtherTarget.accepted), head
    writer.close()


def ndjson_of(events: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in events)


async def one_session_cpu(server: Any, events: int) -> tuple[float, float]:
    """Server CPU seconds per event posted to session s0 in batches of 100, less what the same
    wall time costs idle (heartbeats of the held connections): (per event, idle share).

    After a warm-up of 2000 events, the median of three runs of C{events} (CPU time is read in
    clock ticks, and other processes share the machine)."""
    seq = 0

    def batches(count: int) -> list[bytes]:
        nonlocal seq
        out = [ndjson_of([event("s0", n) for n in range(b, b + 100)]) for b in range(seq, seq + count, 100)]
        seq += count
        return out

    await post_batches(server.port, batches(2000), None)
    await asyncio.sleep(1.0)
    cpu0, t0 = server.cpu(), time.perf_counter()
    await asyncio.sleep(3.0)
    idle = (server.cpu() - cpu0) / (time.perf_counter() - t0)
    runs = []
    for _ in range(3):
        posted = batches(events)
        cpu0, t0 = server.cpu(), time.perf_counter()
        await post_batches(server.port, posted, None)
        await asyncio.sleep(0.5)  # the writes of the last batch
        wall, cpu = time.perf_counter() - t0, server.cpu() - cpu0
        runs.append((cpu - idle * wall) / events)
    return sorted(runs)[1], idle


# With --gc-log the servers load this hook (a sitecustomize on their path): every collector pass
# over 5 ms of wall time is logged with its CPU time, to tell its pauses from the machine's load.
GC_HOOK = """
import gc, os, sys, time
if "relayd" in " ".join(sys.argv) and os.environ.get("BENCH_GC_DIR"):
    _t = [0.0, 0.0]
    _out = open(os.path.join(os.environ["BENCH_GC_DIR"], f"{os.getpid()}.log"), "a", buffering=1)
    def _pass(phase, info):
        if phase == "start":
            _t[0], _t[1] = time.perf_counter(), time.thread_time()
        elif time.perf_counter() - _t[0] > 0.005:
            wall, cpu = time.perf_counter() - _t[0], time.thread_time() - _t[1]
            _out.write(f"{time.time():.3f} {info['generation']} {wall * 1000:.1f} {cpu * 1000:.1f}\\n")
    gc.callbacks.append(_pass)
"""


def gc_log(keep: bool) -> None:
    """Install L{GC_HOOK} for the servers started from now on."""
    if not keep:
        return
    where = tempfile.mkdtemp(prefix="relayd-bench-gc-")
    Path(where, "sitecustomize.py").write_text(GC_HOOK)
    os.environ["BENCH_GC_DIR"] = where
    os.environ["BENCH_EXTRA_PATH"] = os.pathsep.join(filter(None, [os.environ.get("BENCH_EXTRA_PATH"), where]))


def gc_passes(server: Any, start: float, end: float) -> dict[str, float]:
    """The longest collector pass of C{server} between two wall times (ms of wall and of CPU)."""
    where = os.environ.get("BENCH_GC_DIR")
    if not where:
        return {}
    path = Path(where, f"{server.proc.pid}.log")
    lines = [line.split() for line in (path.read_text().splitlines() if path.exists() else [])]
    passes = [(float(w), float(c)) for t, _, w, c in lines if start <= float(t) <= end]
    return {"gc_max_wall_ms": max((w for w, _ in passes), default=0.0),
            "gc_max_cpu_ms": max((c for _, c in passes), default=0.0),
            "gc_passes_over_50ms": sum(1 for w, _ in passes if w > 50)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fanout_over(metrics_port: int, seconds: float) -> tuple[int, int]:
    """(batches, batches whose fan-out took over C{seconds}) from relayd_fanout_seconds."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    buckets = dict(re.findall(r'relayd_fanout_seconds_bucket\{le="([^"]+)",relay="aep"\} ([0-9.e+]+)', text))
    total = float(buckets["+Inf"])
    return int(total), int(total - float(buckets[repr(seconds)]))


async def across_sessions(server: Any, sessions: int, seconds: float) -> dict[str, float]:
    """1000 events/s across every session (10 events per 10 ms, each to another session) while a
    probe process pings the relay every 5 ms: the round trips, the server's CPU share, and how
    many batches' fan-out took over 10 / 50 ms (server-side, from relayd_fanout_seconds)."""
    probe = subprocess.Popen([sys.executable, __file__, "--probe", str(server.port), str(seconds)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert probe.stdout is not None and probe.stdin is not None
    assert probe.stdout.readline().strip() == b"ready"
    seqs = [1_000_000] * sessions  # above what one_session_cpu posted to s0
    batches = []
    for n in range(int(seconds * 100)):
        batch = []
        for k in range(10):
            session = (n * 10 + k) * 7919 % sessions
            batch.append(event(f"s{session}", seqs[session]))
            seqs[session] += 1
        batches.append(ndjson_of(batch))
    before10, before50 = fanout_over(server.metrics, 0.01)[1], fanout_over(server.metrics, 0.05)[1]
    probe.stdin.write(b"go\n")
    probe.stdin.flush()
    cpu0, t0, began = server.cpu(), time.perf_counter(), time.time()
    await post_batches(server.port, batches, 100)
    wall, cpu = time.perf_counter() - t0, server.cpu() - cpu0
    out, _ = probe.communicate(timeout=seconds + 30)
    rtts = json.loads(out)
    return {"events_per_s": len(batches) * 10 / wall, "cpu_share": cpu / wall,
            "probe_rtt_p50_ms": pct(rtts, 0.5), "probe_rtt_p99_ms": pct(rtts, 0.99), "probe_rtt_max_ms": max(rtts),
            "fanout_over_10ms": fanout_over(server.metrics, 0.01)[1] - before10,
            "fanout_over_50ms": fanout_over(server.metrics, 0.05)[1] - before50,
            **gc_passes(server, began, time.time())}


async def scenario_index(subscriptions: int, seconds: float, events: int = 10000) -> dict[str, Any]:
    """The subscription index at scale (see the module docstring)."""
    sessions = max(1, subscriptions // INDEX_SSE_EVERY)
    flags = ("--aep-max-subscribers", str(subscriptions + 100), "--aep-max-subscriptions", str(INDEX_PER_WS))
    result: dict[str, Any] = {"subscriptions": subscriptions, "sessions": sessions}
    # Only session s0's own 10 subscribers (the same shape: one SSE stream, nine WebSocket
    # subscriptions on nine connections), then all of them.
    for label, held in (("alone", INDEX_SSE_EVERY), ("all", subscriptions)):
        metrics = _free_port()
        server = Server(*flags, "--metrics-listen", f"tcp:{metrics}:interface=127.0.0.1")
        server.metrics = metrics
        try:
            t0 = time.perf_counter()
            holder = Holder(server.port, held)
            result[f"{label}_setup_s"] = time.perf_counter() - t0
            setup_done = time.time()
            result[f"{label}_connections"] = holder.connections
            result[f"{label}_rss_mb"] = server.rss_kb() / 1024
            per_event, idle = await one_session_cpu(server, events)
            result[f"{label}_idle_cpu_share"] = idle
            result[f"{label}_one_session_us_per_event"] = per_event * 1e6
            for name, value in (await across_sessions(server, sessions, seconds)).items():
                result[f"{label}_across_{name}"] = value
            # Every pass since the subscriptions were in place (not only the across window), and
            # over the server's whole life (its subscribers arriving while events flow, too).
            for name, value in gc_passes(server, setup_done, time.time()).items():
                result[f"{label}_since_setup_{name}"] = value
            for name, value in gc_passes(server, 0, time.time()).items():
                result[f"{label}_lifetime_{name}"] = value
            holder.stop()
        finally:
            server.stop()
    result["ratio"] = result["all_one_session_us_per_event"] / result["alone_one_session_us_per_event"]
    return result


STORM_HELD = 10  # events held per session before a storm


async def scenario_storm(subscribers: int, sessions: int, replay: int, backlog: int | None = None,
                         transport: str = "sse", live_rate: float = 0.0) -> dict[str, Any]:
    """A subscriber storm: C{sessions} sessions hold L{STORM_HELD} events each (one event per POST);
    then C{subscribers} SSE streams (C{transport} "ws": WebSocket subscriptions) open at once, each
    filtered to a session and resuming from a position C{replay} events back (L{storm_main}). The
    wall time until every stream has its replay (at most 60 s: C{primed} says how many had it),
    server CPU per stream, and C{GET /healthz} latency meanwhile (one probe every 10 ms). C{backlog}:
    relayd's listen backlog (Node's and nginx's is 511). C{live_rate} > 0: a WebSocket emitter sends
    that many events/s to session C{F} throughout, and the delivery latency to one WebSocket
    subscriber of C{F} connected before the storm is reported (what the storm costs the subscribers
    already connected)."""
    server = Server(*subscriber_flags(subscribers + 1), backlog=backlog)
    probe = storm = live = None
    try:
        await wait_ready(server.port)
        for k in range(sessions):
            await post_batches(server.port, [json.dumps(event(f"s{k}", n), separators=(",", ":")).encode()
                                             for n in range(STORM_HELD)], None, ctype=b"json")
        if live_rate:
            subscriber = WSPeer(timed=True)
            await subscriber.connect(server.port, {"role": "consumer"},
                                     {"type": "subscribe", "id": "live", "filter": {"session": "F"}})
            emitter = WSPeer()
            await emitter.connect(server.port, {"role": "emitter", "identity": {"agent": "bench"}})
        storm = subprocess.Popen([sys.executable, __file__, "--storm", str(server.port), str(subscribers),
                                  str(sessions), str(replay), transport], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, preexec_fn=raise_nofile)
        probe = subprocess.Popen([sys.executable, __file__, "--healthz", str(server.port), "0.01"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert probe.stdin is not None and probe.stdout is not None
        assert storm.stdin is not None and storm.stdout is not None
        assert probe.stdout.readline().strip() == b"ready"
        if transport == "ws-greeted":
            line = await asyncio.get_running_loop().run_in_executor(None, storm.stdout.readline)
            assert line.strip() == b"ready", line
        if live_rate:
            live = asyncio.ensure_future(emit(emitter, live_rate, 600, session="F"))
        await asyncio.sleep(0.5)  # a few probes (and live events) before
        if live_rate:
            subscriber.latencies.clear()
        rss0, cpu0 = server.rss_kb(), server.cpu()
        storm.stdin.write(b"go\n")
        storm.stdin.flush()
        line = await asyncio.get_running_loop().run_in_executor(None, storm.stdout.readline)
        cpu = server.cpu() - cpu0
        rss = server.rss_kb()
        live_latencies = subscriber.latencies[:] if live_rate else []
        out, _ = probe.communicate(b"", timeout=60)
        probe = None
        if not line:
            raise RuntimeError("the storm's client failed (its error is above)")
        result = json.loads(line)
        storm.communicate(b"", timeout=60)
        storm = None
        probed = json.loads(out)
        latencies = probed["latencies"]
        live_figures = {"live_rate": live_rate, "live_deliveries": len(live_latencies),
                        "live_p50_ms": pct(live_latencies, 0.5) * 1000, "live_p99_ms": pct(live_latencies, 0.99) * 1000,
                        "live_max_ms": max(live_latencies, default=float("nan")) * 1000} if live_rate else {}
        return {"subscribers": subscribers, "transport": transport, "sessions": sessions, "replay": replay, **result,
                "server_cpu_us_per_stream": cpu / subscribers * 1e6, "kb_per_stream": (rss - rss0) / subscribers,
                "healthz_probes": len(latencies), "healthz_p50_ms": pct(latencies, 0.5),
                "healthz_p99_ms": pct(latencies, 0.99), "healthz_max_ms": max(latencies, default=float("nan")),
                "healthz_reconnects": probed["reconnects"], **live_figures}
    finally:
        if live is not None:
            live.cancel()
        for child in (probe, storm):
            if child is not None:
                child.kill()
                child.wait()
        server.stop()


async def wait_ready(port: int) -> None:
    """Until the instance accepts an event (with --redis it answers 503 until Redis is connected)."""
    body = json.dumps(event("ready", 0), separators=(",", ":")).encode()
    for _ in range(200):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\ncontent-type: application/json\r\n%s"
                     b"content-length: %d\r\nconnection: close\r\n\r\n" % (auth(), len(body)) + body)
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        if head.startswith(OtherTarget.accepted):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("relayd never became ready")


Store = RedisProcess | RedisClusterProcess


def store_cpu(store: Store, node0: list[float], events: int) -> dict[str, Any]:
    """redis-server's CPU per event summed over the nodes since C{node0} (each node's CPU then), and
    each node's share of it (the hottest's share should be near 1 / nodes)."""
    used = [now - then for now, then in zip(store.node_cpus(), node0, strict=True)]
    total = sum(used)
    shares = [u / total if total else 0.0 for u in used]
    return {"redis_nodes": len(used), "redis_cpu_us_per_event": total / max(events, 1) * 1e6,
            "redis_node_shares": [round(x, 3) for x in shares], "redis_hottest_share": max(shares)}


def node_readings(store: Store) -> list[tuple[dict[str, tuple[int, int]], dict[str, float]]]:
    """Each node's C{INFO commandstats} and L{node_counters} now."""
    return [(command_stats(port), node_counters(port)) for port in store.node_ports]


def nodes_cpu(store: Store) -> float:
    """Every node's CPU seconds so far as C{INFO cpu} reads it (to the microsecond)."""
    return sum(c["used_cpu_user"] + c["used_cpu_sys"] for c in (node_counters(p) for p in store.node_ports))


def node_figures(before: list[Any], after: list[Any], events: int, tables: bool) -> dict[str, Any]:
    """What the nodes' own counters say of a run, over every node: commands per event (a script's
    own calls counted too, as Redis 7 counts them), the microseconds Redis timed running the scripts
    per event (C{INFO commandstats}' usec of EVALSHA and EVAL, which include their calls: execution
    only, not reading, parsing or writing, but wall time, so a node preempted mid-script counts the
    wait), and redis-server's CPU per event as C{INFO cpu} reads it (user and system apart, to the
    microsecond). The bench's own C{INFO} calls are left out. With C{tables}, each node's commands
    (calls, usec) and counters."""
    per = max(events, 1)
    calls = usec = 0
    user = system = 0.0
    nodes = []
    for (stats0, counters0), (stats1, counters1) in zip(before, after, strict=True):
        commands = {}
        for name, (c1, u1) in sorted(stats1.items()):
            c0, u0 = stats0.get(name, (0, 0))
            if c1 != c0 and name != "info":
                commands[name] = (c1 - c0, u1 - u0)
                calls += c1 - c0
                if name in ("evalsha", "eval"):
                    usec += u1 - u0
        counters = {name: round(counters1[name] - counters0.get(name, 0), 3) for name in counters1}
        user += counters.get("used_cpu_user", 0.0)
        system += counters.get("used_cpu_sys", 0.0)
        nodes.append({"commands": commands, **counters})
    figures: dict[str, Any] = {"redis_calls_per_event": calls / per, "redis_script_us_per_event": usec / per,
                               "redis_info_cpu_us_per_event": (user + system) / per * 1e6,
                               "redis_info_user_us_per_event": user / per * 1e6,
                               "redis_info_sys_us_per_event": system / per * 1e6}
    if tables:
        figures["redis_node_tables"] = nodes
    return figures


async def scenario_cluster_ingest(seconds: float, engine: str = "standalone", instances: int = 1,
                                  sessions: int = 8, masters: int = 3, node_tables: bool = False,
                                  idle_baseline: bool = False, fill: bool = False) -> dict[str, Any]:
    """Batched ingest (100 events per POST, 8 keep-alive connections per instance) on C{instances}
    relayd instances sharing one store: one redis-server (C{engine} "standalone") or a Redis Cluster
    of C{masters} masters ("cluster"), fresh per run, neither with replicas (C{--redis-wait-replicas
    0}). The POSTs go round-robin over C{sessions} sessions (8: the connection's own session, the
    shape before engines). relayd CPU per event over all instances; redis-server CPU per event summed
    over the nodes and each node's share, and what the nodes' own counters say (L{node_figures}).
    C{idle_baseline}: first the same seconds with every instance connected and no traffic, whose
    CPU (each instance's, every node's) is printed as per event of the run that follows, beside the
    run's figures (which still count it: an extra column, not a new definition). C{fill}: every
    session's buffer filled before the timed part (the engines compared at the same work per event)."""
    store = redis_store(engine, masters)
    servers: list[Any] = []
    try:
        for _ in range(instances):
            servers.append(Server("--aep-buffer", "1000",
                                  # A quota per bucket: room for every session, none evicted.
                                  "--aep-max-sessions", str(max(64, 8 * sessions)), *store.relayd_options))
        for server in servers:
            await wait_ready(server.port)
        connections = 8 * instances
        batch = 100
        capacity = 1000  # --aep-buffer
        if fill:
            # Every session's buffer full before the timed part, so that every timed batch trims as
            # many events as it adds: the work per event is the same however many events a run gets
            # through (without, a faster run trims on a larger share of its batches).
            def fill_body(k: int, j: int) -> bytes:
                return ndjson_of([{**event(f"s{k}", j * batch + i), "id": f"fill-s{k}-{j * batch + i}"}
                                  for i in range(batch)])

            # (A session's batches in order on one connection: each after every held event.)
            await asyncio.gather(*(post_batches(servers[c % instances].port,
                                                [fill_body(k, j) for j in range(capacity // batch)
                                                 for k in range(c, sessions, connections)], None)
                                   for c in range(connections)))

        def body_for_conn(c: int) -> Any:
            # Pre-serialised templates: the client must not spend the CPU the server is measured on.
            # Every event id is unique ((connection, POST) numbers the batch), whichever session it goes to.
            templates = []
            for k in range(sessions):
                line = json.dumps(event(f"s{k}", 123456789), separators=(",", ":")).encode()
                templates.append(line.replace(b"123456789", b"%d"))

            def body(n: int) -> bytes:
                template = templates[(c + connections * n) % sessions]
                first = (n * connections + c) * batch
                # (After the fill's positions, 0 to capacity - 1: each batch after every held event.)
                return b"".join(template % (first + i, first + i + capacity) + b"\n" for i in range(batch))

            return body

        idle: tuple[float, float, float] | None = None
        if idle_baseline:
            # (The nodes' CPU as INFO cpu reads it: idle, a few milliseconds, under /proc's 10 ms tick.)
            idle_cpu0, idle_node0, idle_t0 = sum(s.cpu() for s in servers), nodes_cpu(store), time.perf_counter()
            await asyncio.sleep(seconds)  # the idle background, timed against the same seconds as the run
            idle = (sum(s.cpu() for s in servers) - idle_cpu0, nodes_cpu(store) - idle_node0,
                    time.perf_counter() - idle_t0)
        counter = [0]
        readings0 = node_readings(store)
        cpu0, node0, t0 = [s.cpu() for s in servers], store.node_cpus(), time.perf_counter()
        stop_at = t0 + seconds
        await asyncio.gather(*(http_post_loop(servers[c % instances].port, body_for_conn(c), "application/x-ndjson",
                                              stop_at, counter, batch) for c in range(connections)))
        wall = time.perf_counter() - t0
        cpu = sum(s.cpu() for s in servers) - sum(cpu0)
        events = counter[0]
        result = {"engine": store.engine, "instances": instances, "sessions": sessions, "events": events,
                  "events_per_s": events / wall, "server_cpu_us_per_event": cpu / max(events, 1) * 1e6,
                  "server_cpu_share": cpu / wall,
                  # An instance's own ceiling: events/s if it had a core to itself.
                  "events_per_s_per_core": events / max(cpu, 1e-9), **store_cpu(store, node0, events)}
        result.update(node_figures(readings0, node_readings(store), events, node_tables))
        if idle is not None:
            relayd_idle, redis_idle, idle_wall = idle
            scale = wall / idle_wall / max(events, 1) * 1e6  # idle seconds as if as long as the run, per event
            result.update({"redis_idle_cpu_us_per_event": redis_idle * scale,
                           "redis_cpu_us_per_event_less_idle": result["redis_cpu_us_per_event"] - redis_idle * scale,
                           "server_idle_cpu_us_per_event": relayd_idle * scale,
                           "server_cpu_us_per_event_less_idle": result["server_cpu_us_per_event"] - relayd_idle * scale})
        return result
    finally:
        for server in servers:
            server.stop()
        store.stop()


async def scenario_single_redis(seconds: float) -> dict[str, Any]:
    """One event per POST on 8 keep-alive connections to an instance on Redis."""
    redis = RedisProcess()
    try:
        return await scenario_ingest(seconds, 1, ("--redis", redis.url), redis)
    finally:
        redis.stop()


async def scenario_cluster_fanout(subscribers: int, rate: float, seconds: float, timed: int,
                                  instances: int = 2, engine: str = "standalone", sessions: int = 1,
                                  masters: int = 3) -> dict[str, Any]:
    """Emitter on instance A, subscribers on instance B, one store (C{engine}: one redis-server or a
    Redis Cluster of C{masters} masters, fresh per run, neither with replicas); CPU is A's plus B's.
    C{instances=1}: emitter and subscribers on the one instance A (on Redis all the same).
    C{sessions} 1: every event to session F, every subscriber filtered to it; more: the events go
    round-robin over that many sessions and the subscribers take every session (unfiltered), so
    the latency is over events from every bucket (every shard of a cluster)."""
    store = redis_store(engine, masters)
    flags = (*store.relayd_options, *subscriber_flags(subscribers))
    a = Server(*flags)
    b = Server(*flags) if instances == 2 else a
    servers = [a, b] if instances == 2 else [a]
    path = "/stream" if sessions > 1 else '/stream?filter={"session":"F"}'.replace('"', "%22")
    try:
        for server in servers:
            await wait_ready(server.port)
        drainer = (Drainer(b.port, "sse", subscribers - timed, 0 if sessions > 1 else 1)
                   if subscribers > timed else None)
        subs = []
        tasks = []
        for _ in range(timed):
            sub = SSESubscriber(timed=True)
            ready = asyncio.Event()
            tasks.append(asyncio.ensure_future(sub.run(b.port, path, ready)))
            await ready.wait()
            subs.append(sub)
        emitter = WSPeer()
        await emitter.connect(a.port, {"role": "emitter", "identity": {"agent": "bench"}})
        await asyncio.sleep(0.5)
        cpu0, node0 = sum(s.cpu() for s in servers), store.node_cpus()
        sent = await emit(emitter, rate, seconds, sessions=sessions)
        deadline = time.perf_counter() + 10
        while sum(s.count for s in subs) < sent * timed and time.perf_counter() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        cpu = sum(s.cpu() for s in servers) - cpu0
        delivered = sum(s.count for s in subs) + (drainer.total() if drainer else 0)
        redis = store_cpu(store, node0, delivered)
        latencies = [x for s in subs for x in s.latencies]
        for t in tasks:
            t.cancel()
        return {"engine": store.engine, "subscribers": subscribers, "sessions": sessions, "events": sent,
                "rate": rate, "events_per_s": sent / seconds, "deliveries": delivered,
                "expected": sent * subscribers, "server_cpu_us_per_delivery": cpu / max(delivered, 1) * 1e6,
                "server_cpu_us_per_event": cpu / max(sent, 1) * 1e6,
                "redis_cpu_us_per_delivery": redis.pop("redis_cpu_us_per_event"), **redis,
                "instances": instances, "p50_ms": pct(latencies, 0.5) * 1000, "p99_ms": pct(latencies, 0.99) * 1000}
    finally:
        for server in servers:
            server.stop()
        store.stop()


# What the cluster/standalone ratios compare (medians of each engine's runs).
RATIO_KEYS = ("events_per_s", "server_cpu_us_per_event", "server_cpu_us_per_delivery", "redis_cpu_us_per_event",
              "redis_cpu_us_per_delivery", "p50_ms", "p99_ms", "redis_calls_per_event", "redis_script_us_per_event",
              "redis_info_cpu_us_per_event", "redis_info_user_us_per_event", "redis_info_sys_us_per_event",
              "redis_cpu_us_per_event_less_idle", "server_cpu_us_per_event_less_idle")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def engine_ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    """cluster / standalone of each L{RATIO_KEYS} figure, over the medians of each engine's runs, and
    the cluster's median hottest-node share times its nodes."""
    ratios = {}
    for key in RATIO_KEYS:
        by_engine = {engine: [r[key] for r in results if r["engine"] == engine and key in r]
                     for engine in ("standalone", "cluster")}
        if by_engine["standalone"] and by_engine["cluster"] and median(by_engine["standalone"]):
            ratios[key] = median(by_engine["cluster"]) / median(by_engine["standalone"])
    cluster = [r for r in results if r["engine"] == "cluster"]
    if ratios and cluster:
        # Not a ratio: how much hotter than an even split the hottest node was (1: even; target <= 1.3).
        ratios["cluster_hottest_share_x_nodes"] = median([r["redis_hottest_share"] for r in cluster]) * cluster[0][
            "redis_nodes"]
    return ratios


def printed(name: str, result: dict[str, Any]) -> None:
    print(json.dumps({"scenario": name, **{k: round(v, 2) if isinstance(v, float) else v
                                            for k, v in result.items()}}), flush=True)


async def main(selected: list[str], seconds: float, subscriptions: int, events: int, gc: bool,
               engines: list[str] | None = None, runs_per_engine: int = 1, instances: int = 1, sessions: int = 128,
               masters: int = 3, storm_ws: int = 5000, node_tables: bool = False,
               idle_baseline: bool = False) -> None:
    raise_nofile()
    gc_log(gc)
    runs: list[tuple[str, Any]] = [
        ("ingest", lambda: scenario_ingest(seconds, 100)),
        ("single", lambda: scenario_ingest(seconds, 1)),
        ("fanout-sse", lambda: scenario_fanout(100, "sse", 1000, seconds, 10)),
        ("fanout-sse", lambda: scenario_fanout(1000, "sse", 100, seconds, 20)),
        # Throughput: several events per 10 ms burst share one write per subscriber.
        ("fanout-sse", lambda: scenario_fanout(1000, "sse", 500, seconds, 10)),
        ("fanout-ws", lambda: scenario_fanout(100, "ws", 1000, seconds, 2)),
        ("fanout-post", lambda: scenario_fanout_post(1000, 100, 10, seconds, 20)),
        ("sdk", lambda: scenario_ingest(seconds, 1, close=True)),
        ("single-xff", lambda: scenario_ingest(seconds, 1, ("--trust-forwarded-for", "1"),
                                               headers=b"x-forwarded-for: 203.0.113.7\r\n")),
        ("single-redis", lambda: scenario_single_redis(seconds)),
        ("fanout-single", lambda: scenario_fanout_post(1000, 100, 1, seconds, 20)),
        ("storm", lambda: scenario_storm(5000, 50, 5)),
        ("storm-backlog511", lambda: scenario_storm(5000, 50, 5, backlog=511)),
        ("storm-ws", lambda: scenario_storm(storm_ws, 50, 5, transport="ws", live_rate=100)),
        ("storm-ws-greeted", lambda: scenario_storm(storm_ws, 50, 5, transport="ws-greeted", live_rate=100)),
        ("latency", lambda: scenario_fanout(1000, "sse", 100, seconds, 50)),
        ("idle", lambda: scenario_idle(1000)),
        ("idle", lambda: scenario_idle(5000)),
        ("index", lambda: scenario_index(subscriptions, seconds, events)),
    ]
    for name, run in runs:
        if selected and name not in selected:
            continue
        printed(name, await run())
    # The store scenarios: without --engine as before (one redis-server, the shape the figures in
    # docs/performance.md were taken with); with it, each engine per run, alternating, fresh servers
    # each time, and the ratios cluster/standalone when both engines ran.
    spread = sessions if engines else 1
    store_runs: list[tuple[str, Any]] = [
        ("cluster-ingest", lambda engine: scenario_cluster_ingest(seconds, engine, instances, sessions if engines else 8,
                                                                  masters, node_tables, idle_baseline,
                                                                  fill=bool(engines))),
        ("cluster-fanout", lambda engine: scenario_cluster_fanout(100, 1000, seconds, 10, engine=engine,
                                                                  sessions=spread, masters=masters)),
        ("cluster-fanout", lambda engine: scenario_cluster_fanout(1000, 100, seconds, 20, engine=engine,
                                                                  sessions=spread, masters=masters)),
        ("cluster-latency", lambda engine: scenario_cluster_fanout(10, 1000, seconds, 10, engine=engine,
                                                                   sessions=spread, masters=masters)),
    ]
    for name, store_run in store_runs:
        if selected and name not in selected:
            continue
        results = []
        for _ in range(runs_per_engine):
            for engine in engines or ["standalone"]:
                results.append(await store_run(engine))
                printed(name, results[-1])
        ratios = engine_ratios(results)
        if ratios:
            printed(name, {"ratios": "cluster/standalone", "runs_per_engine": runs_per_engine, **ratios})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--drain":
        drain_main(int(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:]))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--hold":
        hold_main(int(sys.argv[2]), int(sys.argv[3]))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--storm":
        raise_nofile()
        port, count, sessions, replay = map(int, sys.argv[2:6])
        storm_main(port, count, sessions, replay, *sys.argv[6:7])
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--healthz":
        healthz_main(int(sys.argv[2]), float(sys.argv[3]))
        sys.exit(0)
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        probe_main(int(sys.argv[2]), float(sys.argv[3]))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--subscriptions", type=int, default=10000, help="for the index scenario")
    parser.add_argument("--events", type=int, default=10000, help="per CPU run of the index scenario")
    parser.add_argument("--gc-log", action="store_true", help="report the servers' longest collector pass (index)")
    parser.add_argument("--target", metavar="URL", help="run against another AEP relay already listening "
                        "at http://127.0.0.1:PORT (with --target-pid) instead of starting relayd")
    parser.add_argument("--target-pid", type=int, metavar="PID", help="the process whose CPU is measured")
    parser.add_argument("--target-cmd", metavar="CMD", help="a shell command that starts another AEP relay "
                        "per scenario, listening on 127.0.0.1:{port}; its process group's CPU is measured")
    parser.add_argument("--token", help="bearer token for the relay's HTTP requests")
    parser.add_argument("--engine", action="append", choices=["standalone", "cluster"],
                        help="the store of the cluster-* scenarios: one redis-server or a Redis Cluster, neither "
                        "with replicas (--redis-wait-replicas 0); repeat it for both, alternated per run, with "
                        "the ratios cluster/standalone; with it the events go over --sessions sessions")
    parser.add_argument("--runs", type=int, default=1, help="runs per engine of each cluster-* scenario")
    parser.add_argument("--instances", type=int, default=1, help="relayd instances of cluster-ingest")
    parser.add_argument("--sessions", type=int, default=128,
                        help="sessions the cluster-* events go over with --engine (64 or more spread the buckets)")
    parser.add_argument("--masters", type=int, default=3, help="masters of the cluster engine")
    parser.add_argument("--storm-ws", type=int, default=5000, metavar="N",
                        help="WebSocket subscriptions of storm-ws (each holds a socket on both ends: the open-file "
                        "limit may ask for fewer)")
    parser.add_argument("--node-tables", action="store_true",
                        help="cluster-ingest: print each node's INFO commandstats (calls, usec) and stats over the run")
    parser.add_argument("--idle-baseline", action="store_true",
                        help="cluster-ingest: first as many seconds idle (relayd connected, no traffic); prints "
                        "that background CPU per event of the run, and the run's figures less it, as extra columns")
    args = parser.parse_args()
    # Stopped (bench/peers.py's time limit, a kill): unwind, so each scenario's finally stops the
    # relay it started (a --target-cmd relay runs in its own session and would outlive the bench).
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    OtherTarget.url, OtherTarget.pid, OtherTarget.cmd = args.target, args.target_pid, args.target_cmd
    if args.target is not None or args.target_cmd is not None:
        OtherTarget.accepted = b"HTTP/1.1 20"
    if args.target is not None and args.target_pid is None:
        parser.error("--target needs --target-pid (the process whose CPU is measured)")
    if args.token:
        os.environ["BENCH_AEP_TOKEN"] = args.token
    if args.engine and (args.target is not None or args.target_cmd is not None):
        parser.error("--engine runs relayd on a store it starts: not with --target or --target-cmd")
    for option in ("runs", "instances", "sessions", "masters"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    asyncio.run(main(args.scenarios, args.seconds, args.subscriptions, args.events, args.gc_log,
                     list(dict.fromkeys(args.engine or [])), args.runs, args.instances, args.sessions, args.masters,
                     args.storm_ws, args.node_tables, args.idle_baseline))
