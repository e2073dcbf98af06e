"""What one SSE delivery of a fan-out costs relayd, beside what any Python fan-out must pay (a
benchmark tool, not a test; issue 24 target 3, docs/performance.md "SSE fan-out per delivery").

    python bench/fanout_floor.py floor                      # the floor: CPU per delivery, user and system
    python bench/fanout_floor.py relayd                     # relayd: the same, one event per POST
    python bench/fanout_floor.py floor --callgrind          # user-space instructions per delivery
    python bench/fanout_floor.py floor --by descriptor      # os.write on the descriptor, not sock.send
    python bench/fanout_floor.py relayd --callgrind --events 50

Both run a server process that C{--subscribers} SSE streams (held by bench/aep.py's drain process,
which counts what it reads) are connected to, then send C{--events} events, each to every stream:

- C{floor}: a bare Python server that accepts the streams, answers their requests with the SSE
  headers, and per event runs C{for sock in socks: sock.send(chunk)} (C{--by descriptor}: C{for fd
  in fds: os.write(fd, chunk)}), the chunk an HTTP chunk of a 500-byte SSE frame (what relayd sends
  for bench/aep.py's events). Nothing any Python fan-out over sockets could leave out.
- C{relayd}: C{twistd -n relayd} (its heartbeat set beyond the run), the events POSTed one per
  POST as bench/aep.py's C{fanout-single} does.

The events go at C{--rate} per second; each event's deliveries are waited for before the next one
is sent, so no two events share a reactor turn (under valgrind the server runs about 50 times
slower). The figures are the server's user and system CPU (/proc/PID/stat) per delivery and, with
C{--callgrind} (the server under valgrind's callgrind), the user-space instructions it executed per
delivery between C{callgrind_control -z} and C{-d}: repeatable on a loaded machine, but blind to
the kernel (the send's system call is the system CPU's share).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from relayd_process import TICK, RelaydServer, _stat, raise_nofile  # noqa: E402

SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


def floor_frame(seq: int) -> bytes:
    """An HTTP chunk of a 500-byte SSE frame with an C{id:} line (what the drain process counts)."""
    frame = b"event: progress.status\ndata: {\"seq\":%d,\"pad\":\"%s\"}\nid: F-%d\n\n" % (seq, b"x" * 420, seq)
    return b"%x\r\n%b\r\n" % (len(frame), frame)


def floor_main(port_file: str, by: str) -> None:
    """The floor server: accept the streams until told how many, then send an event per line of
    standard input ("<seq>"), each to every stream with one C{sock.send} (C{by} "socket", as
    relayd.compat.tcp.write_now sends) or one C{os.write} on its descriptor ("descriptor")."""
    raise_nofile()
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    Path(port_file).write_text(str(listener.getsockname()[1]))
    count = int(sys.stdin.readline())
    socks = []
    for _ in range(count):
        sock, _addr = listener.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(4096)
        sock.sendall(SSE_HEAD)
        sock.setblocking(False)
        socks.append(sock)
    print("ready", flush=True)
    fds = [sock.fileno() for sock in socks]
    write = os.write
    for line in sys.stdin:
        chunk = floor_frame(int(line))
        if by == "socket":
            for sock in socks:  # the floor: one send per delivery, nothing else
                sock.send(chunk)
        else:
            for fd in fds:
                write(fd, chunk)
        print("sent", flush=True)


class FloorServer:
    def __init__(self, subscribers: int, prefix: tuple[str, ...], by: str = "socket") -> None:
        port_file = tempfile.NamedTemporaryFile(prefix="fanout-floor-", delete=False).name
        Path(port_file).unlink()
        self.proc = subprocess.Popen([*prefix, sys.executable, __file__, "--floor-server", port_file, by],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, preexec_fn=raise_nofile)
        while not Path(port_file).exists() or not Path(port_file).read_text():
            time.sleep(0.05)  # waiting for another process to start listening
        self.port = int(Path(port_file).read_text())
        Path(port_file).unlink()
        self.subscribers = subscribers
        self._send(b"%d\n" % subscribers)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def started(self) -> None:
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == b"ready"

    def emit(self, seq: int) -> None:
        assert self.proc.stdout is not None
        self._send(b"%d\n" % seq)
        assert self.proc.stdout.readline().strip() == b"sent"

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(60)


class RelaydFanout:
    def __init__(self, subscribers: int, prefix: tuple[str, ...]) -> None:
        # (No heartbeat within the run: under valgrind one round to every stream would land in it.)
        self.server = RelaydServer("--no-mcp", "--aep-listen", "tcp:0:interface=127.0.0.1", "--aep-heartbeat", "3600",
                                   prefix=prefix, start_timeout=300)
        self.port = self.server.ports["aep"]
        self.conn: socket.socket | None = None

    @property
    def pid(self) -> int:
        return self.server.pid

    def started(self) -> None:
        pass

    def emit(self, seq: int) -> None:
        if self.conn is None:
            self.conn = socket.create_connection(("127.0.0.1", self.port))
        body = json.dumps({"aep": "0.1", "id": f"F-{seq}", "type": "progress.status",
                           "time": "2026-11-29T00:00:00Z", "source": "aep://bench/agent/a/session/F",
                           "agent": "bench", "session": "F", "seq": seq, "severity": "notice",
                           "data": {"message": "x" * 330}}, separators=(",", ":")).encode()
        self.conn.sendall(b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\n"
                          b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (len(body), body))
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.conn.recv(4096)
        assert head.startswith(b"HTTP/1.1 202"), head

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.stop()


class Drain:
    """bench/aep.py's drain process: C{count} SSE streams to session F, counting the frames read."""

    def __init__(self, port: int, count: int) -> None:
        self.proc = subprocess.Popen([sys.executable, str(BENCH / "aep.py"), "--drain", str(port), "sse-lazy",
                                      str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     preexec_fn=raise_nofile)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == b"ready"

    def progress(self) -> tuple[int, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"?\n")
        self.proc.stdin.flush()
        seen, total = self.proc.stdout.readline().split()
        return int(seen), int(total)

    def wait_for(self, total: int, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while True:
            got = self.progress()[1]
            if got >= total or time.monotonic() > deadline:
                return got
            time.sleep(0.005)  # polling another process's count

    def stop(self) -> int:
        out, _ = self.proc.communicate(b"", timeout=60)
        return int(out.split()[-1])


def cpu_split(pid: int) -> tuple[float, float]:
    fields = _stat(pid)
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def instructions(pid: int, directory: str, zero: bool = False) -> int:
    """Zero callgrind's counters of C{pid} (C{zero}), or dump them and read the total back."""
    subprocess.run(["callgrind_control", "-z" if zero else "-d", str(pid)], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    if zero:
        return 0
    dumps = sorted(Path(directory).glob("callgrind.out.*.*"), key=lambda p: p.stat().st_mtime)
    for line in dumps[-1].read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError("no totals in the callgrind dump")


def run(kind: str, subscribers: int, events: int, rate: float, callgrind: bool, by: str) -> dict[str, object]:
    directory = tempfile.mkdtemp(prefix="fanout-callgrind-") if callgrind else ""
    prefix = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={directory}/callgrind.out.%p") if callgrind else ()
    server = FloorServer(subscribers, prefix, by) if kind == "floor" else RelaydFanout(subscribers, prefix)
    try:
        drain = Drain(server.port, subscribers)
        server.started()
        seq = 0
        while drain.progress()[0] < subscribers:  # warm-up: every stream subscribed and read once
            server.emit(seq)
            seq += 1
            time.sleep(0.1)  # pacing the warm-up events
        time.sleep(0.5)
        base = drain.progress()[1]
        if callgrind:
            instructions(server.pid, directory, zero=True)
        user0, system0 = cpu_split(server.pid)
        start = time.perf_counter()
        for i in range(events):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # pacing: --rate events per second
            server.emit(1000 + i)
            drain.wait_for(base + (i + 1) * subscribers)
        user1, system1 = cpu_split(server.pid)
        counted = instructions(server.pid, directory) if callgrind else None
        delivered = drain.stop() - base
    finally:
        server.stop()
    result: dict[str, object] = {
        "server": kind if kind == "relayd" else f"floor by {by}", "subscribers": subscribers, "events": events, "deliveries": delivered,
        "expected": events * subscribers,
        "user_us_per_delivery": round((user1 - user0) / delivered * 1e6, 3),
        "system_us_per_delivery": round((system1 - system0) / delivered * 1e6, 3),
        "cpu_us_per_delivery": round((user1 - user0 + system1 - system0) / delivered * 1e6, 3),
    }
    if counted is not None:
        result["instructions_per_delivery"] = round(counted / delivered)
        result["callgrind_out"] = directory
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("server", choices=("floor", "relayd"))
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--callgrind", action="store_true", help="user-space instructions per delivery")
    parser.add_argument("--by", choices=("socket", "descriptor"), default="socket",
                        help="the floor's send: sock.send (as relayd) or os.write on the descriptor")
    args = parser.parse_args()
    if args.callgrind:
        args.rate = min(args.rate, 5.0)  # (it waits for each event's deliveries anyway)
    print(json.dumps(run(args.server, args.subscribers, args.events, args.rate, args.callgrind, args.by)))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--floor-server":
        floor_main(sys.argv[2], sys.argv[3])
        sys.exit(0)
    main()
