"""What one plain AEP ingest request costs the server (a benchmark tool, not a test; issue 24):
server CPU per request, or instructions per request under callgrind, which the load on a shared
machine does not change.

    python bench/request_cost.py sdk                       # a connection per event, Connection: close
    python bench/request_cost.py single --callgrind        # keep-alive, instructions per request
    python bench/request_cost.py ndjson --callgrind        # keep-alive, 100 NDJSON events per request
    python bench/request_cost.py sdk-xff --callgrind -- --trust-forwarded-for 1
    python bench/request_cost.py sdk --floor               # bench/http_floor.py's bare protocol (--floor shortcuts: with relayd's write shortcuts)
    python bench/request_cost.py sdk --tree /tmp/base      # another checkout (git archive of a commit)

Shapes (8 client threads, each request one JSON event of about 500 bytes as the AEP SDK's
``http_sink`` posts it: urllib's headers, ``application/json``): ``sdk`` (a new connection per event,
``Connection: close``), ``http10`` (a new connection per event, HTTP/1.0), ``sdk-xff`` (``sdk`` with
an ``X-Forwarded-For``), ``single`` (one event per POST on 8 keep-alive connections), ``ndjson``
(100 such events per POST as ``application/x-ndjson`` on 8 keep-alive connections, as bench/aep.py's
``ingest`` scenario posts them: its ``http_post_loop`` headers, head and body in one write),
``stream`` (an SSE stream opened as a subscriber of ``bench/aep.py storm`` opens it: filtered to its
thread's session, which holds 10 events, resuming 5 back; read until its 5 events arrive, then
closed). A fresh
server per run (``twistd -n relayd`` with the ingest scenario's settings and the flags after
``--``), 200 requests to warm it, then ``--requests`` measured: its CPU from /proc, or with
``--callgrind`` the instructions callgrind counts between ``callgrind_control -z`` and ``-d``.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relayd_process import process_cpu

REPO = Path(__file__).resolve().parent.parent
SHAPES = ("sdk", "http10", "sdk-xff", "single", "ndjson", "stream")
STREAM_HELD = 10  # events each thread's session holds for the stream shape
STREAM_REPLAY = 5
KEEP_ALIVE = ("single", "ndjson")
BATCH = 100  # events per ndjson POST
WARM = 200  # requests before the measured ones
THREADS = 8
PAD = "x" * 330


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def event(thread: int, seq: int) -> bytes:
    return json.dumps(
        {
            "aep": "0.1",
            "id": f"s{thread}-{seq}",
            "type": "progress.status",
            "time": "2026-11-29T00:00:00Z",
            "source": f"aep://bench/agent/a/session/s{thread}",
            "agent": "bench",
            "session": f"s{thread}",
            "seq": seq,
            "severity": "notice",
            "data": {"message": PAD},
        },
        separators=(",", ":"),
    ).encode()


def request(shape: str, port: int, thread: int, n: int) -> bytes:
    if shape == "ndjson":
        # (sequence numbers from 1 << 20 on: after the warm-up's single events of the same sessions)
        first = (1 << 20) + n * BATCH
        body = b"".join([event(thread, seq) + b"\n" for seq in range(first, first + BATCH)])
        return (
            b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\ncontent-type: application/x-ndjson\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
    body = event(thread, n)
    extra = {
        "sdk": b"Connection: close\r\n",
        "sdk-xff": b"X-Forwarded-For: 10.0.0.%d\r\nConnection: close\r\n" % (thread + 1),
    }.get(shape, b"")
    return (
        b"POST /events %s\r\nAccept-Encoding: identity\r\nContent-Length: %d\r\nHost: 127.0.0.1:%d\r\n"
        b"User-Agent: Python-urllib/3.11\r\nContent-Type: application/json\r\naep-version: 0.1\r\n%s\r\n%s"
        % (b"HTTP/1.0" if shape == "http10" else b"HTTP/1.1", len(body), port, extra, body)
    )


def stream_request(thread: int) -> bytes:
    """The storm's subscriber request (bench/aep.py storm_main) for thread C{thread}'s session."""
    session = f"s{thread}"
    flt = urllib.parse.quote(json.dumps({"session": session}, separators=(",", ":")), safe="")
    position = urllib.parse.quote(
        json.dumps([{"session": session, "epoch": 0, "seq": STREAM_HELD - STREAM_REPLAY - 1}], separators=(",", ":")),
        safe="",
    )
    return b"GET /stream?filter=%s&from=%s HTTP/1.1\r\nHost: localhost\r\naccept: text/event-stream\r\n\r\n" % (
        flt.encode(),
        position.encode(),
    )


def hold_stream_events(port: int) -> None:
    """Post L{STREAM_HELD} events to each thread's session (what the stream shape replays)."""
    for thread in range(THREADS):
        with socket.create_connection(("127.0.0.1", port)) as s:
            rest = b""
            for n in range(1 if thread == 0 else 0, STREAM_HELD):  # (wait_accepting posted s0's first)
                s.sendall(request("single", port, thread, n))
                rest = read_answer(s, rest)


def read_answer(s: socket.socket, buffered: bytes = b"") -> bytes:
    """Read one answer (sized, chunked, or to the close); what follows it."""
    while b"\r\n\r\n" not in buffered:
        data = s.recv(65536)
        if not data:
            raise SystemExit(f"the server closed before answering: {buffered!r}")
        buffered += data
    head, _, rest = buffered.partition(b"\r\n\r\n")
    if b" 202 " not in head.split(b"\r\n", 1)[0]:
        raise SystemExit(f"not accepted: {head!r}")
    fields = dict(line.split(b":", 1) for line in head.lower().split(b"\r\n")[1:])
    if b"content-length" in fields:
        length = int(fields[b"content-length"])
        while len(rest) < length:
            rest += s.recv(65536)
        return rest[length:]
    if fields.get(b"transfer-encoding", b"").strip() == b"chunked":
        while True:
            while b"\r\n" not in rest:
                rest += s.recv(65536)
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                rest += s.recv(65536)
            rest = rest[size + 2 :]
            if size == 0:
                return rest
    while s.recv(65536):
        pass
    return b""


def load(shape: str, port: int, total: int, first: int = 0) -> float:
    """Send C{total} requests of C{shape} from L{THREADS} threads, each thread's numbered from
    C{first}; the wall time taken."""

    def worker(thread: int) -> None:
        count = total // THREADS
        if shape == "stream":
            ask = stream_request(thread)
            for _ in range(count):
                with socket.create_connection(("127.0.0.1", port)) as s:
                    s.sendall(ask)
                    got = b""
                    while got.count(b"\nid: ") < STREAM_REPLAY:
                        data = s.recv(65536)
                        if not data:
                            raise SystemExit(f"the stream ended before its replay: {got!r}")
                        got += data
            return
        if shape in KEEP_ALIVE:
            with socket.create_connection(("127.0.0.1", port)) as s:
                rest = b""
                for n in range(first, first + count):
                    s.sendall(request(shape, port, thread, n))
                    rest = read_answer(s, rest)
            return
        for n in range(first, first + count):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(request(shape, port, thread, n))
                read_answer(s)
                while s.recv(65536):  # the server closes
                    pass

    failures: list[BaseException] = []

    def run(thread: int) -> None:
        try:
            worker(thread)
        except BaseException as e:  # (a thread's SystemExit would end it silently)
            failures.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(THREADS)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise SystemExit(f"{len(failures)} of {THREADS} clients failed: {failures[0]}")
    return time.perf_counter() - started


def wait_listening(port: int, proc: subprocess.Popen[bytes], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited before listening")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit("the server did not listen in time")


def wait_accepting(port: int, seconds: float) -> None:
    """Until an event is accepted (with --redis, once the relay's store is up)."""
    deadline = time.monotonic() + seconds
    while True:
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(request("sdk", port, 0, 0))
            try:
                read_answer(s)
                return
            except SystemExit:
                if time.monotonic() > deadline:
                    raise
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=SHAPES)
    parser.add_argument("--requests", type=int, default=None, help="measured (default 4000; 600 under callgrind)")
    parser.add_argument("--callgrind", action="store_true", help="count instructions (valgrind) instead of CPU time")
    parser.add_argument("--floor", nargs="?", const="protocol", choices=("protocol", "shortcuts"),
                        help="bench/http_floor.py's protocol (or shortcuts) floor instead of relayd")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout whose relayd runs (default: this one)")
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    args.relayd_flags = flags  # (after --: more twistd relayd flags)
    total = args.requests or (600 if args.callgrind else 4000)
    port = free_port()
    tree = args.tree.resolve()
    if args.floor:
        argv = [sys.executable, str(tree / "bench" / "http_floor.py"), args.floor, str(port)]
    else:
        twistd = Path(sys.executable).with_name("twistd")
        argv = [
            sys.executable,
            str(twistd),
            "-n",
            "--pidfile=",
            "relayd",
            "--no-mcp",
            "--aep-listen",
            f"tcp:{port}:interface=127.0.0.1",
            "--aep-buffer",
            "1000",
            "--aep-max-sessions",
            "64",
            *args.relayd_flags,
        ]
    out = Path(tempfile.mkdtemp(prefix="request-cost-"))
    if args.callgrind:
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/callgrind.out.%p", *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAYD_")}
    env["PYTHONPATH"] = str(tree)
    with open(out / "server.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_listening(port, proc, 300 if args.callgrind else 30)
        wait_accepting(port, 120 if args.callgrind else 15)
        if args.shape == "stream":
            hold_stream_events(port)
        load(args.shape, port, WARM)
        # (an ndjson batch's events numbered past the warm-up's: repeated ones would take the duplicate path)
        measured_from = WARM if args.shape == "ndjson" else 0
        result: dict[str, object] = {
            "shape": args.shape,
            "server": "floor" if args.floor else "relayd",
            "tree": str(tree),
            "flags": args.relayd_flags,
            "requests": total,
        }
        if args.callgrind:
            subprocess.run(
                ["callgrind_control", "-z", str(proc.pid)],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            result["wall_s"] = load(args.shape, port, total, first=measured_from)
            subprocess.run(
                ["callgrind_control", "-d", str(proc.pid)],
                check=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            dumps = sorted(out.glob("callgrind.out.*.*"), key=lambda p: p.stat().st_mtime)
            totals = [line for line in dumps[-1].read_text().splitlines() if line.startswith(("summary:", "totals:"))]
            result["instructions_per_request"] = int(totals[0].split()[1]) // total
        else:
            cpu = process_cpu(proc.pid)
            result["wall_s"] = load(args.shape, port, total, first=measured_from)
            result["server_cpu_us_per_request"] = round((process_cpu(proc.pid) - cpu) / total * 1e6, 1)
        print(json.dumps(result))
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    main()
