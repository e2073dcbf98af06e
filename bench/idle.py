"""Idle connections benchmark (a benchmark, not a test): what held streams cost one relayd process.

    python bench/idle.py aep --connections 10000            # issue 14 target 2, one step
    python bench/idle.py aep --connections 10000 --connections 19500
    python bench/idle.py mcp-sse mcp-poll --connections 10000   # issue 14 target 6
    python bench/idle.py aep --connections 10000 --tracemalloc   # where the memory goes (top entries)

aep: N idle SSE streams (``GET /stream`` filtered to one session each, ``--per-session`` streams per
session ``s<k>``) held by ``--workers`` client processes, each from its own loopback source address
(127.0.0.2, 127.0.0.3 ...: one address has ~28 000 ephemeral ports). Measured: relayd's RSS growth
per stream (``VmRSS`` before and after, divided by N); ``GET /healthz`` latency from a separate
process (``--probe-rate`` per second over one keep-alive connection) while the streams are held; then
the delivery phase: ``--rate`` events/s to each session (NDJSON POSTs every 10 ms, each event carrying
its send time), delivery latency p50/p99 measured by the client processes on receipt.

mcp-sse / mcp-poll: N sessions registered first (in the baseline), then per session one idle outbound
SSE stream (``GET /{S}/events``) or one parked long-poll (``GET /{S}/poll?wait=25000``); RSS growth
divided by N.

The client processes are plain sockets and epoll: no object per connection beyond the socket, a read
buffer shared by all, timestamps found with ``bytes.find``. relayd is a real ``twistd -n relayd``
(bench/relayd_process.py) started with the bench's open-file limit, which the bench raises to its hard
limit; a step larger than that limit allows is refused with the figures (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import array
import json
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relayd_process import RelaydServer, raise_nofile

TOKEN = "idle_bench_token_abcdefghijklmnopqrstuv"
RESERVED_FDS = 300  # relayd's own descriptors (listeners, log, epoll, wakers) and the probe/poster


def pct(values: Any, p: float) -> float:
    if not len(values):
        return float("nan")
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(len(ordered) * p))])


def summary(values: Any) -> dict[str, float]:
    return {"n": len(values), "p50": round(pct(values, 0.5), 2), "p99": round(pct(values, 0.99), 2),
            "max": round(max(values) if len(values) else float("nan"), 2)}


# Client processes -------------------------------------------------------------------------------


def _read_head(s: socket.socket) -> bytes:
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = s.recv(65536)
        if not chunk:
            raise SystemExit(f"relayd closed a connection: {got[-300:]!r}")
        got += chunk
    return got


def _http(s: socket.socket, request: bytes) -> tuple[int, bytes]:
    """One request on a keep-alive connection; the answer's status and body (content-length framed)."""
    s.sendall(request)
    got = _read_head(s)
    head, _, body = got.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += s.recv(65536)
    return int(head[9:12]), body


def _connect(source: str, port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((source, 0))  # before connect: the source address picks the ephemeral port space
    s.connect(("127.0.0.1", port))
    return s


def worker_main(kind: str, port: int, source: str, lo: int, hi: int, per_session: int, out: str) -> None:
    """Hold connections C{lo}..C{hi} of a step; read them until stdin closes.

    stdin lines: C{go} (open the streams, after the sessions are registered for MCP), C{report}
    (write the delivery latencies seen so far, ms as float32, to C{out}, and reset them)."""
    raise_nofile()
    socks: list[socket.socket] = []
    names = [f"idle{i:05d}" for i in range(lo, hi)]
    if kind.startswith("mcp"):
        reg = _connect(source, port)
        for name in names:
            body = json.dumps({"session": name, "token": TOKEN}).encode()
            status, answer = _http(reg, b"POST /register HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
                                        b"content-length: %d\r\n\r\n%s" % (len(body), body))
            assert status == 200, (status, answer)
        reg.close()
    print("registered", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    batch = 200  # opened before their answers are read: well under the listen backlog per worker
    for start in range(0, hi - lo, batch):
        opened = []
        for i in range(lo + start, min(hi, lo + start + batch)):
            s = _connect(source, port)
            if kind == "aep":
                flt = "%7B%22session%22%3A%22s" + str(i // per_session) + "%22%7D"
                s.sendall(b"GET /stream?filter=%s HTTP/1.1\r\nHost: localhost\r\nauthorization: Bearer %s\r\n"
                          b"accept: text/event-stream\r\n\r\n" % (flt.encode(), TOKEN.encode()))
            elif kind == "mcp-sse":
                s.sendall(b"GET /idle%05d/events?token=%s&direction=outbound HTTP/1.1\r\nHost: localhost\r\n"
                          b"accept: text/event-stream\r\n\r\n" % (i, TOKEN.encode()))
            else:  # a parked poll: no answer comes before the wait runs out
                s.sendall(b"GET /idle%05d/poll?token=%s&direction=outbound&wait=25000 HTTP/1.1\r\nHost: localhost\r\n\r\n"
                          % (i, TOKEN.encode()))
            opened.append(s)
        if kind != "mcp-poll":
            for s in opened:
                head = _read_head(s)
                assert head.startswith(b"HTTP/1.1 200"), head[:300]
        socks.extend(opened)
    ep = select.epoll()
    by_fd: dict[int, socket.socket] = {}
    session_of: dict[int, int] = {}
    for i, s in enumerate(socks, lo):
        s.setblocking(False)
        by_fd[s.fileno()] = s
        session_of[s.fileno()] = i
        ep.register(s.fileno(), select.EPOLLIN)
    stdin = sys.stdin.fileno()
    ep.register(stdin, select.EPOLLIN)
    print("ready", len(socks), flush=True)
    buf = bytearray(262144)
    view = memoryview(buf)
    lat = array.array("f")
    received = [0, 0]  # events, connections closed by relayd
    marker = b'"t":'
    now = time.time
    while True:
        for fd, _ in ep.poll(1.0):
            if fd == stdin:
                line = sys.stdin.readline()
                if not line:
                    return
                if line.strip() == "report":
                    Path(out).write_bytes(lat.tobytes())
                    print(json.dumps({"events": received[0], "closed": received[1]}), flush=True)
                    lat = array.array("f")
                    received[0] = 0
                continue
            n = by_fd[fd].recv_into(buf)
            if not n:
                ep.unregister(fd)
                received[1] += 1
                continue
            data = bytes(view[:n])
            if kind == "mcp-poll":
                # a poll answered (its wait ran out): park it again at once, as the same subscriber
                at = data.find(b'"subscriber":"')
                if at >= 0:
                    sub = data[at + 14:data.find(b'"', at + 14)]
                    by_fd[fd].sendall(b"GET /idle%05d/poll?token=%s&direction=outbound&wait=25000&subscriber=%s "
                                      b"HTTP/1.1\r\nHost: localhost\r\n\r\n" % (session_of[fd], TOKEN.encode(), sub))
                continue
            at = data.find(marker)
            if at < 0:
                continue
            t = now()
            while at >= 0:
                end = data.find(b"}", at)
                try:
                    lat.append((t - float(data[at + 4:end])) * 1000.0)
                    received[0] += 1
                except ValueError:
                    pass  # an event split across two reads: not timed
                at = data.find(marker, end)


def probe_main(port: int, seconds: float, rate: float) -> None:
    """C{GET /healthz} C{rate} times a second over one keep-alive connection; print the latencies (ms)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
    out = []
    start = time.perf_counter()
    n = 0
    while time.perf_counter() < start + seconds:
        delay = start + n / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # pacing the probe, not synchronisation
        n += 1
        t0 = time.perf_counter()
        status, _ = _http(s, request)
        out.append((time.perf_counter() - t0) * 1000)
        assert status == 200, status
    print(json.dumps(out), flush=True)


def post_main(port: int, sessions: int, rate: float, seconds: float) -> None:
    """POST C{rate} events/s to each of C{sessions} sessions for C{seconds}: every 10 ms an NDJSON batch
    of the next sessions' events, each carrying its send time in C{data.t}; print the count and lag."""
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    per_tick = sessions * rate / 100.0
    line = ('{"aep":"0.1","id":"s%d-%d","type":"progress.status","time":"2026-12-01T00:00:00Z",'
            '"source":"aep://bench/agent/a/session/s%d","agent":"bench","session":"s%d","seq":%d,'
            '"severity":"notice","data":{"t":%.6f}}\n')
    seq = [0] * sessions
    cursor = 0.0
    sent = 0
    late = 0
    answers = 0
    start = time.perf_counter()
    tick = 0
    while True:
        at = start + tick * 0.01
        if at >= start + seconds:
            break
        delay = at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # pacing the load, not synchronisation
        elif delay < -0.01:
            late += 1
        tick += 1
        count = int(cursor + per_tick) - int(cursor)
        first = int(cursor)
        cursor += per_tick
        t = time.time()
        lines = []
        for k in range(first, first + count):
            session = k % sessions
            seq[session] += 1
            lines.append(line % (session, seq[session], session, session, seq[session], t))
        body = "".join(lines).encode()
        s.sendall(b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\n"
                  b"authorization: Bearer %s\r\ncontent-type: application/x-ndjson\r\n"
                  b"content-length: %d\r\n\r\n%s" % (TOKEN.encode(), len(body), body))
        sent += count
        answers += _answers(s, False)
    elapsed = time.perf_counter() - start
    while answers < tick:
        answers += _answers(s, True)
    print(json.dumps({"events": sent, "late_ticks": late, "ticks": tick, "seconds": round(elapsed, 2),
                      "answered_after_s": round(time.perf_counter() - start, 2)}), flush=True)


def _answers(s: socket.socket, wait: bool) -> int:
    """Count the C{202} answers that arrived (open loop: the poster does not wait for them)."""
    s.setblocking(wait)
    try:
        data = s.recv(1 << 20)
    except BlockingIOError:
        return 0
    assert data, "relayd closed the posting connection"
    _answers.tail += data  # type: ignore[attr-defined]
    count = _answers.tail.count(b"\r\n\r\n")  # type: ignore[attr-defined]
    assert _answers.tail.count(b"HTTP/1.1 ") == _answers.tail.count(b"HTTP/1.1 202"), _answers.tail[:300]  # type: ignore[attr-defined]
    _answers.tail = _answers.tail[_answers.tail.rfind(b"\r\n\r\n") + 4:] if count else _answers.tail  # type: ignore[attr-defined]
    return count


_answers.tail = b""  # type: ignore[attr-defined]


# The orchestrator -------------------------------------------------------------------------------


class Workers:
    """C{count} client processes holding C{n} connections of C{kind} between them."""

    def __init__(self, kind: str, port: int, n: int, count: int, per_session: int) -> None:
        self.procs = []
        self.outs = []
        share = -(-n // count)
        for w in range(count):
            lo, hi = w * share, min(n, (w + 1) * share)
            out = tempfile.NamedTemporaryFile(prefix="idle-bench-lat-", delete=False).name
            self.outs.append(out)
            self.procs.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", kind, str(port), f"127.0.0.{2 + w}", str(lo), str(hi),
                 str(per_session), out], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                preexec_fn=raise_nofile))
        for p in self.procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            assert line.strip() == "registered", line

    def open(self) -> int:
        for p in self.procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        held = 0
        for p in self.procs:
            line = p.stdout.readline()  # type: ignore[union-attr]
            assert line.startswith("ready"), line
            held += int(line.split()[1])
        return held

    def report(self) -> tuple[array.array, int, int]:
        lat = array.array("f")
        events = closed = 0
        for p in self.procs:
            p.stdin.write("report\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        for p, out in zip(self.procs, self.outs, strict=True):
            got = json.loads(p.stdout.readline())  # type: ignore[union-attr]
            events += got["events"]
            closed += got["closed"]
            lat.frombytes(Path(out).read_bytes())
        return lat, events, closed

    def stop(self) -> None:
        for p in self.procs:
            try:
                p.stdin.close()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass
        for p, out in zip(self.procs, self.outs, strict=True):
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
            os.unlink(out)


def probe(port: int, seconds: float, rate: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--probe", str(port), str(seconds), str(rate)],
                            stdout=subprocess.PIPE, text=True)


HOOK = '''
import os, signal, tracemalloc
tracemalloc.start(int(os.environ.get("IDLE_BENCH_FRAMES", "1")))
def _dump(signum, frame):
    tracemalloc.take_snapshot().dump(os.environ["IDLE_BENCH_SNAPSHOT"] + ".%d" % _dump.n)
    _dump.n += 1
_dump.n = 0
signal.signal(signal.SIGUSR2, _dump)
'''


def tracemalloc_server(options: tuple[str, ...], wait_for: tuple[str, ...]) -> tuple[RelaydServer, str]:
    """relayd with tracemalloc on and a SIGUSR2 handler dumping snapshots (a sitecustomize in a temp dir)."""
    hook = tempfile.mkdtemp(prefix="idle-bench-hook-")
    Path(hook, "sitecustomize.py").write_text(HOOK)
    prefix = os.path.join(hook, "snap")
    os.environ["BENCH_EXTRA_PATH"] = hook
    server = RelaydServer(*options, wait_for=wait_for, env={"IDLE_BENCH_SNAPSHOT": prefix})
    return server, prefix


def snapshot(server: RelaydServer, prefix: str, n: int) -> Any:
    import tracemalloc

    server.proc.send_signal(signal.SIGUSR2)
    path = f"{prefix}.{n}"
    deadline = time.monotonic() + 120
    size = -1
    while time.monotonic() < deadline:  # the dump is written by another process: wait for it to settle
        if os.path.exists(path) and os.path.getsize(path) == size and size > 0:
            return tracemalloc.Snapshot.load(path)
        size = os.path.getsize(path) if os.path.exists(path) else -1
        time.sleep(0.5)
    raise RuntimeError("no tracemalloc snapshot from relayd")


def fd_room() -> int:
    """Connections relayd can hold: it inherits this process's (raised) open-file limit."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0] - RESERVED_FDS


def run_step(kind: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    if kind == "aep":
        options: tuple[str, ...] = (
            "--no-mcp", "--aep-listen", "tcp:0:interface=127.0.0.1:backlog=4096", "--aep-token", TOKEN,
            "--aep-max-subscribers", str(n + 100))
        wait_for: tuple[str, ...] = ("aep",)
    else:
        options = ("--no-aep", "--mcp-listen", "tcp:0:interface=127.0.0.1:backlog=4096",
                   "--mcp-max-sessions", str(n + 100), "--mcp-max-sessions-per-address", "0")  # all from loopback
        wait_for = ("mcp",)
    options += tuple(args.relayd)
    prefix = ""
    if args.tracemalloc:
        server, prefix = tracemalloc_server(options, wait_for)
    else:
        server = RelaydServer(*options, wait_for=wait_for)
    port = server.ports[wait_for[0]]
    result: dict[str, Any] = {"scenario": kind, "connections": n, "workers": args.workers,
                              "loadavg_start": os.getloadavg()[0]}
    workers = None
    try:
        # each worker holds under its own open-file limit and one source address's ephemeral ports
        count = max(args.workers, -(-n // (fd_room() - 100)))
        result["workers"] = count
        workers = Workers(kind, port, n, count, args.per_session)  # MCP: registers the sessions
        time.sleep(1.0)  # let the server settle before the baseline (a measurement pause)
        base = server.rss_kb()
        before = snapshot(server, prefix, 0) if args.tracemalloc else None
        t0 = time.perf_counter()
        held = workers.open()
        result["open_seconds"] = round(time.perf_counter() - t0, 1)
        # Settled once the server has nothing left to do (a parked poll has no answer to wait for).
        for _ in range(30):
            cpu0 = server.cpu()
            time.sleep(1.0)  # a measurement pause
            if server.cpu() - cpu0 < 0.05:
                break
        result["settled_seconds"] = round(time.perf_counter() - t0 - result["open_seconds"], 1)
        rss = server.rss_kb()
        result.update(held=held, rss_base_mb=round(base / 1024, 1), rss_mb=round(rss / 1024, 1),
                      kb_per_connection=round((rss - base) / held, 2))
        if before is not None:
            after = snapshot(server, prefix, 1)
            result["tracemalloc_top"] = [
                f"{stat.size_diff / held:.0f} B/conn {stat.count_diff / held:.2f} blocks/conn "
                f"{stat.traceback[0].filename.split('site-packages/')[-1]}:{stat.traceback[0].lineno}"
                for stat in after.compare_to(before, "lineno")[:args.top]]
            result["tracemalloc_files"] = [
                f"{stat.size_diff / held:.0f} B/conn {stat.traceback[0].filename.split('site-packages/')[-1]}"
                for stat in after.compare_to(before, "filename")[:args.top]]
            result["tracemalloc_total_per_conn"] = round(
                sum(s.size_diff for s in after.compare_to(before, "lineno")) / held, 0)
        if kind == "aep" and not args.tracemalloc:
            cpu0, t0 = server.cpu(), time.perf_counter()
            p = probe(port, args.probe_seconds, args.probe_rate)
            healthz = json.loads(p.communicate(timeout=args.probe_seconds + 60)[0])
            idle_share = (server.cpu() - cpu0) / (time.perf_counter() - t0)
            result["healthz_ms"] = summary(healthz)
            result["server_cpu_share_held"] = round(idle_share, 3)
            result["loadavg_held"] = os.getloadavg()[0]
            if args.deliver_seconds > 0:
                sessions = -(-n // args.per_session)
                cpu0, t0 = server.cpu(), time.perf_counter()
                p = probe(port, args.deliver_seconds, args.probe_rate)
                post = subprocess.Popen([sys.executable, __file__, "--post", str(port), str(sessions),
                                         str(args.rate), str(args.deliver_seconds)], stdout=subprocess.PIPE, text=True)
                posted = json.loads(post.communicate(timeout=args.deliver_seconds + 120)[0])
                healthz2 = json.loads(p.communicate(timeout=60)[0])
                time.sleep(2.0)  # what is in flight arrives (a measurement pause)
                lat, events, closed = workers.report()
                # less what holding the streams costs anyway (heartbeats, the probe)
                cpu = server.cpu() - cpu0 - idle_share * (time.perf_counter() - t0)
                result["delivery"] = {
                    "sessions": sessions, "subscribers_per_session": args.per_session,
                    "events_per_s_per_session": args.rate, "posted": posted,
                    "deliveries_expected": posted["events"] * args.per_session, "deliveries_timed": events,
                    "streams_closed_by_relayd": closed, "latency_ms": summary(lat),
                    "server_cpu_s": round(cpu, 2),
                    "server_cpu_us_per_delivery": round(cpu / max(1, events) * 1e6, 2),
                    "healthz_ms_during": summary(healthz2), "loadavg": os.getloadavg()[0]}
        result["rss_end_mb"] = round(server.rss_kb() / 1024, 1)
    finally:
        if workers is not None:
            workers.stop()
        server.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="+", choices=("aep", "mcp-sse", "mcp-poll"))
    parser.add_argument("--connections", type=int, action="append", help="N (repeatable: one step each)")
    parser.add_argument("--workers", type=int, default=4, help="client processes (one source address each)")
    parser.add_argument("--per-session", type=int, default=100, help="aep: streams per session")
    parser.add_argument("--rate", type=float, default=10.0, help="aep: events/s to each session")
    parser.add_argument("--deliver-seconds", type=float, default=10.0, help="aep: delivery phase (0: none)")
    parser.add_argument("--probe-seconds", type=float, default=30.0,
                        help="/healthz probing while the streams are held (30 s: one heartbeat falls inside)")
    parser.add_argument("--probe-rate", type=float, default=20.0, help="/healthz probes per second")
    parser.add_argument("--relayd", action="append", default=[], metavar="OPTION",
                        help="one more relayd option (repeatable), e.g. --relayd=--aep-heartbeat=3600")
    parser.add_argument("--tracemalloc", action="store_true", help="tracemalloc top entries instead of timings")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    raise_nofile()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(json.dumps({"nofile": [soft, hard], "nr_open": int(Path("/proc/sys/fs/nr_open").read_text()),
                      "cpus": os.cpu_count(), "loadavg": os.getloadavg()}), flush=True)
    for kind in args.scenarios:
        for n in args.connections or [10000]:
            if n > fd_room():
                print(json.dumps({"scenario": kind, "connections": n, "refused": (
                    f"relayd inherits an open-file limit of {soft} (hard {hard}; raising the hard limit "
                    f"needs CAP_SYS_RESOURCE): at most {fd_room()} connections")}), flush=True)
                continue
            print(json.dumps(run_step(kind, n, args)), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        a = sys.argv[2:]
        worker_main(a[0], int(a[1]), a[2], int(a[3]), int(a[4]), int(a[5]), a[6])
    elif len(sys.argv) > 1 and sys.argv[1] == "--probe":
        probe_main(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "--post":
        post_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
    else:
        main()
