"""What one SSE delivery of a fan-out costs relayd, beside what any Python fan-out must pay (a
benchmark tool, not a test; issue 24 target 3, docs/performance.md "SSE fan-out per delivery").

    python bench/fanout_floor.py floor                      # the floor: CPU per delivery, user and system
    python bench/fanout_floor.py relayd                     # relayd: the same, one event per POST
    python bench/fanout_floor.py floor --callgrind          # user-space instructions per delivery
    python bench/fanout_floor.py floor --by descriptor      # os.write on the descriptor, not sock.send
    python bench/fanout_floor.py relayd --callgrind --events 50
    python bench/fanout_floor.py nchan                      # nginx + Nchan, configured as bench/peers.py does
    python bench/fanout_floor.py floor --paced-only --nagle # as fanout-single paces, the streams with Nagle on
    python bench/fanout_floor.py nchan --nodelay            # Nchan's streams with TCP_NODELAY, as relayd's

Each runs a server process that C{--subscribers} SSE streams (held by bench/aep.py's drain process,
which counts what it reads) are connected to, then send C{--events} events, each to every stream:

- C{floor}: a bare Python server that accepts the streams, answers their requests with the SSE
  headers, and per event runs C{for sock in socks: sock.send(chunk)} (C{--by descriptor}: C{for fd
  in fds: os.write(fd, chunk)}), the chunk an HTTP chunk of a 500-byte SSE frame (what relayd sends
  for bench/aep.py's events). Nothing any Python fan-out over sockets could leave out.
  Its streams have C{TCP_NODELAY}, as relayd's; C{--nagle}: not, as Nchan's.
- C{relayd}: C{twistd -n relayd} (its heartbeat set beyond the run), the events POSTed one per
  POST as bench/aep.py's C{fanout-single} does.
- C{nchan}: nginx with the Nchan module, one process, bench/peers.py's configuration; the same
  events POSTed one per POST to its publisher location. Its streams keep Nagle on (nginx sets
  C{TCP_NODELAY} only on keep-alive and TLS connections); C{--nodelay}: with it, as relayd's.

The events go at C{--rate} per second; each event's deliveries are waited for before the next one
is sent, so no two events share a reactor turn and no stream has two events in flight (under
valgrind the server runs about 50 times slower). C{--paced-only} does not wait (as fanout-single):
a stream may then still owe the ACK of one event when the next is sent, which with Nagle on holds
the next in the kernel and sends both in one segment. The figures are the server's user and system
CPU (/proc/PID/stat) per delivery, the drain process's CPU per delivery (on loopback a segment's
receiving side runs in the softirq of whatever sent it: an immediate send charges it to the server;
a segment Nagle held leaves with the ACK, from the drain's read or its delayed-ACK timer, charged to
whichever process runs then), and from C{ss -ti} on the server's connections (the publisher's
included: 0.001 per delivery) its data segments, the segments it received (ACKs) and the bytes it
sent per delivery. With
C{--callgrind} (the server under valgrind's callgrind), the user-space instructions it executed per
delivery between C{callgrind_control -z} and C{-d}: repeatable on a loaded machine, but blind to
the kernel (the send's system call is the system CPU's share).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from relayd_process import TICK, RelaydServer, _stat, raise_nofile, wait_listening  # noqa: E402

SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


def floor_frame(seq: int) -> bytes:
    """An HTTP chunk of a 500-byte SSE frame with an C{id:} line (what the drain process counts)."""
    frame = b"event: progress.status\ndata: {\"seq\":%d,\"pad\":\"%s\"}\nid: F-%d\n\n" % (seq, b"x" * 420, seq)
    return b"%x\r\n%b\r\n" % (len(frame), frame)


def floor_main(port_file: str, by: str, nagle: bool) -> None:
    """The floor server: accept the streams until told how many, then send an event per line of
    standard input ("<seq>"), each to every stream with one C{sock.send} (C{by} "socket", as
    relayd.compat.tcp.write_now sends) or one C{os.write} on its descriptor ("descriptor"); the
    streams with C{TCP_NODELAY}, unless C{nagle}."""
    raise_nofile()
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)
    Path(port_file).write_text(str(listener.getsockname()[1]))
    count = int(sys.stdin.readline())
    socks = []
    for _ in range(count):
        sock, _addr = listener.accept()
        if not nagle:  # as relayd's streams (Twisted's HTTPChannel sets it on every connection)
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
    def __init__(self, subscribers: int, prefix: tuple[str, ...], by: str = "socket", nagle: bool = False) -> None:
        port_file = tempfile.NamedTemporaryFile(prefix="fanout-floor-", delete=False).name
        Path(port_file).unlink()
        self.proc = subprocess.Popen([*prefix, sys.executable, __file__, "--floor-server", port_file, by,
                                      "nagle" if nagle else "nodelay"],
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


def event_body(seq: int) -> bytes:
    """The JSON body of the C{seq}th event POSTed (relayd's SSE frame of it is about 500 bytes)."""
    return json.dumps({"aep": "0.1", "id": f"F-{seq}", "type": "progress.status",
                       "time": "2026-11-29T00:00:00Z", "source": "aep://bench/agent/a/session/F",
                       "agent": "bench", "session": "F", "seq": seq, "severity": "notice",
                       "data": {"message": "x" * 330}}, separators=(",", ":")).encode()


def post_event(conn: socket.socket | None, port: int, seq: int, headers: bytes = b"") -> socket.socket:
    """POST the C{seq}th event on C{conn} (made to C{port} when C{None}) and read its answer, sized
    and accepted (C{201} or C{202}); the connection, kept for the next."""
    if conn is None:
        conn = socket.create_connection(("127.0.0.1", port))
    body = event_body(seq)
    conn.sendall(b"POST /events HTTP/1.1\r\nHost: localhost\r\n%bcontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%b" % (headers, len(body), body))
    got = b""
    while b"\r\n\r\n" not in got:
        got += conn.recv(4096)
    head, rest = got.split(b"\r\n\r\n", 1)
    assert head.startswith((b"HTTP/1.1 201", b"HTTP/1.1 202")), head
    length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
    while len(rest) < length:
        rest += conn.recv(4096)
    return conn


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
        self.conn = post_event(self.conn, self.port, seq, b"aep-version: 0.1\r\n")

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.server.stop()


# nginx sets TCP_NODELAY only on a connection going keep-alive, on TLS and on unbuffered or upgraded
# proxying: an Nchan stream over plain HTTP keeps Nagle on. Preloaded, this gives every connection
# nginx accepts TCP_NODELAY, as relayd's have (Twisted sets it on every HTTP connection).
NODELAY_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    static int (*real)(int, struct sockaddr *, socklen_t *, int);
    if (!real) real = (int (*)(int, struct sockaddr *, socklen_t *, int))dlsym(RTLD_NEXT, "accept4");
    int s = real(fd, addr, len, flags);
    if (s >= 0) { int one = 1; setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one); }
    return s;
}
"""


def nodelay_shim() -> str:
    """Build L{NODELAY_SHIM} with the system's C compiler; the shared object's path (for LD_PRELOAD)."""
    directory = Path(tempfile.mkdtemp(prefix="fanout-shim-"))
    (directory / "nodelay.c").write_text(NODELAY_SHIM)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", str(directory / "nodelay.so"), str(directory / "nodelay.c"),
                    "-ldl"], check=True)
    return str(directory / "nodelay.so")


class NchanFanout:
    """nginx + Nchan as bench/peers.py configures it (one process: C{master_process off}), the events
    POSTed one per POST to its publisher location, each the body relayd's events carry."""

    def __init__(self, subscribers: int, prefix: tuple[str, ...], nodelay: bool = False) -> None:
        from peers import NCHAN_MODULE, NGINX_CONF

        self.dir = Path(tempfile.mkdtemp(prefix="fanout-nchan-"))
        probe = socket.create_server(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        conf = NGINX_CONF.replace("@MODULE@", str(NCHAN_MODULE)).replace("@DIR@", str(self.dir))
        (self.dir / "nginx.conf").write_text(conf.replace("@PORT@", str(self.port)))
        env = {**os.environ, "LD_PRELOAD": nodelay_shim()} if nodelay else None
        self.proc = subprocess.Popen([*prefix, "nginx", "-p", str(self.dir), "-c", str(self.dir / "nginx.conf"),
                                      "-e", str(self.dir / "error.log")], preexec_fn=raise_nofile, env=env)
        wait_listening(self.port, 20)
        self.conn: socket.socket | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def started(self) -> None:
        pass

    def emit(self, seq: int) -> None:
        self.conn = post_event(self.conn, self.port, seq)

    def stop(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


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


def segments(port: int) -> tuple[int, int, int]:
    """Over the server's established connections on C{port} (C{ss -ti}): the data segments it sent,
    the segments it received (the subscribers' ACKs, mostly) and the bytes it sent."""
    out = subprocess.run(["ss", "-tinH", "state", "established", f"( sport = :{port} )"], check=True,
                         capture_output=True, text=True).stdout
    sent = received = sent_bytes = 0
    for field in out.split():
        key, _, value = field.partition(":")
        if key == "data_segs_out":
            sent += int(value)
        elif key == "segs_in":
            received += int(value)
        elif key == "bytes_sent":
            sent_bytes += int(value)
    return sent, received, sent_bytes


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


def run(kind: str, subscribers: int, events: int, rate: float, callgrind: bool, by: str,
        paced_only: bool = False, nagle: bool = False, nodelay: bool = False) -> dict[str, object]:
    directory = tempfile.mkdtemp(prefix="fanout-callgrind-") if callgrind else ""
    prefix = ("valgrind", "--tool=callgrind", f"--callgrind-out-file={directory}/callgrind.out.%p") if callgrind else ()
    server: FloorServer | RelaydFanout | NchanFanout
    if kind == "floor":
        server = FloorServer(subscribers, prefix, by, nagle)
    elif kind == "nchan":
        server = NchanFanout(subscribers, prefix, nodelay)
    else:
        server = RelaydFanout(subscribers, prefix)
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
        drain0 = sum(cpu_split(drain.proc.pid))
        segs0 = segments(server.port)
        start = time.perf_counter()
        for i in range(events):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)  # pacing: --rate events per second
            server.emit(1000 + i)
            if not paced_only:
                drain.wait_for(base + (i + 1) * subscribers)
        drain.wait_for(base + events * subscribers)
        user1, system1 = cpu_split(server.pid)
        drain1 = sum(cpu_split(drain.proc.pid))
        segs1 = segments(server.port)
        wall = time.perf_counter() - start
        counted = instructions(server.pid, directory) if callgrind else None
        delivered = drain.stop() - base
    finally:
        server.stop()
    result: dict[str, object] = {
        "server": f"floor by {by}" + (" with Nagle" if nagle else "") if kind == "floor"
        else kind + (" with TCP_NODELAY" if nodelay else ""), "subscribers": subscribers, "events": events, "deliveries": delivered,
        "expected": events * subscribers,
        "user_us_per_delivery": round((user1 - user0) / delivered * 1e6, 3),
        "system_us_per_delivery": round((system1 - system0) / delivered * 1e6, 3),
        "cpu_us_per_delivery": round((user1 - user0 + system1 - system0) / delivered * 1e6, 3),
        "drain_cpu_us_per_delivery": round((drain1 - drain0) / delivered * 1e6, 3),
        "data_segments_per_delivery": round((segs1[0] - segs0[0]) / delivered, 3),
        "segments_in_per_delivery": round((segs1[1] - segs0[1]) / delivered, 3),
        "bytes_per_delivery": round((segs1[2] - segs0[2]) / delivered, 1),
        "wall_s": round(wall, 2),
    }
    if counted is not None:
        result["instructions_per_delivery"] = round(counted / delivered)
        result["callgrind_out"] = directory
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("server", choices=("floor", "relayd", "nchan"), nargs="?", default="floor")
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--events", type=int, default=500)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--callgrind", action="store_true", help="user-space instructions per delivery")
    parser.add_argument("--by", choices=("socket", "descriptor"), default="socket",
                        help="the floor's send: sock.send (as relayd) or os.write on the descriptor")
    parser.add_argument("--nagle", action="store_true",
                        help="the floor's streams without TCP_NODELAY (as nginx leaves a streaming response)")
    parser.add_argument("--nodelay", action="store_true",
                        help="nchan's connections with TCP_NODELAY (a preloaded accept4 that sets it; needs cc)")
    parser.add_argument("--nodelay-shim", action="store_true",
                        help="build that preload, print its path and exit (LD_PRELOAD=... bench/peers.py --sides nchan)")
    parser.add_argument("--paced-only", action="store_true",
                        help="do not wait for an event's deliveries before the next (as bench/aep.py fanout-single)")
    args = parser.parse_args()
    if args.nodelay_shim:
        print(nodelay_shim())
        return
    if args.callgrind:
        args.rate = min(args.rate, 5.0)  # (it waits for each event's deliveries anyway)
    print(json.dumps(run(args.server, args.subscribers, args.events, args.rate, args.callgrind, args.by, args.paced_only,
                         args.nagle, args.nodelay)))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--floor-server":
        floor_main(sys.argv[2], sys.argv[3], sys.argv[4] == "nagle")
        sys.exit(0)
    main()
