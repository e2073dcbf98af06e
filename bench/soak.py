"""Soak: one real ``twistd -n relayd`` under a steady mix of all three relays, reporting server RSS and
latency over time (a benchmark script, not a test; CI runs a 30-second version in
tests/robustness/test_soak.py).

    python bench/soak.py --minutes 10            # the recorded run (docs/scaling.md)
    python bench/soak.py --seconds 30 --json out.json

The mix, all from asyncio clients in this process:
  AEP     an HTTP emitter (NDJSON batches, 50 sessions) and a WebSocket emitter; 20 SSE consumers of
          everything and 2 WebSocket consumers (delivery latency); 10 SSE consumers of one session each
          that drop and resume with Last-Event-ID every few seconds (checked: no gap, no duplicate).
  MCP     a page on inbound SSE answering tools/call; an agent on outbound SSE calling it (round trip),
          and a long-poll agent doing the same.
  broker  message.post actions through POST /v1/action against a real Nostr relay (PyPI nostr-relay),
          when it is installed (``--no-broker`` skips it; ``--require-broker`` fails without it).

Every interval one line: elapsed, server RSS and CPU, AEP deliveries/s and latency p50/p99, MCP round
trips and p50/p99, broker actions and p50/p99, errors. The exit status is 1 when anything went wrong
(a refused request, a gap or duplicate after resume, a traceback in the server log) or RSS kept
growing through the second half beyond ``--max-growth-mib``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TICK = os.sysconf("SC_CLK_TCK")
TOKEN = "soak-aep-token"
MCP_SESSION, MCP_TOKEN = "soakSess", "tok_soak_0123456789abcdefghij"
SESSIONS = 50
PAD = "x" * 300


# The server ------------------------------------------------------------------------------------


class Server:
    """relayd under twistd; its log goes to a file (checked for tracebacks at the end)."""

    def __init__(self, workdir: Path, broker: dict[str, str] | None, aep_buffer: int) -> None:
        self.log_path = workdir / "relayd.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT), AEP_TOKEN=TOKEN, RELAYD_MAX_CLIENT_CONNECTIONS="0")  # one client address
        twistd = Path(sys.executable).with_name("twistd")
        argv = [sys.executable, str(twistd)] if twistd.exists() else [
            sys.executable, "-c", "import sys; from twisted.scripts.twistd import run; sys.argv[0]='twistd'; run()"]
        argv += ["-n", "--pidfile=", "--logfile=-", "relayd",
                 "--aep-listen", "tcp:0:interface=127.0.0.1:backlog=1024",
                 "--mcp-listen", "tcp:0:interface=127.0.0.1",
                 "--metrics-listen", "tcp:0:interface=127.0.0.1",
                 # History that fills within the run: steady state, so RSS growth means a leak.
                 "--aep-buffer", str(aep_buffer)]
        wanted = ["aep", "mcp", "metrics"]
        if broker:
            argv += ["--broker-nostr-relay", broker["relay"], "--broker-state-dir", broker["state"],
                     "--broker-kek-file", broker["kek"], "--broker-listen", "tcp:0:interface=127.0.0.1"]
            wanted.append("broker")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=workdir,
                                     preexec_fn=_raise_nofile)
        self.ports: dict[str, int] = {}
        assert self.proc.stdout is not None
        patterns = {"aep": rb'aep listening on https?://[^\s"]+:(\d+)', "mcp": rb'mcp listening on https?://[^\s"]+:(\d+)',
                    "metrics": rb'metrics listening on https?://[^\s"]+:(\d+)',
                    "broker": rb'broker listening on https?://[^\s"]+:(\d+)'}
        for line in self.proc.stdout:
            self.log.write(line)
            for name, pattern in patterns.items():
                found = re.search(pattern, line)
                if found and name not in self.ports:
                    self.ports[name] = int(found.group(1))
            if all(name in self.ports for name in wanted):
                break
        else:
            raise RuntimeError("relayd did not start:\n" + self.log_path.read_text())
        self._drain = asyncio.get_event_loop().run_in_executor(None, self._copy_log)
        self._last_cpu = (time.monotonic(), self.cpu())

    def _copy_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
        self.log.flush()

    def cpu(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    def cpu_percent(self) -> float:
        now, cpu = time.monotonic(), self.cpu()
        then, before = self._last_cpu
        self._last_cpu = (now, cpu)
        return 100 * (cpu - before) / max(now - then, 1e-9)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    async def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            status = await asyncio.get_event_loop().run_in_executor(None, self.proc.wait, 20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            status = -9
        await self._drain
        self.log.close()
        return status


def _raise_nofile() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# Shared state ------------------------------------------------------------------------------------


class Stats:
    def __init__(self) -> None:
        self.counts: dict[str, int] = defaultdict(int)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.stopping = False
        self.totals: dict[str, int] = defaultdict(int)

    def error(self, what: str) -> None:
        if not self.stopping:
            self.errors.append(what)

    def take(self) -> tuple[dict[str, int], dict[str, list[float]]]:
        counts, latency = dict(self.counts), dict(self.latency)
        for name, value in counts.items():
            self.totals[name] += value
        self.counts, self.latency = defaultdict(int), defaultdict(list)
        return counts, latency


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def http(port: int, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
               conn: list[Any] | None = None) -> tuple[int, bytes]:
    """One request on a kept-alive connection (C{conn} holds it between calls)."""
    if conn is None or not conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        if conn is not None:
            conn[:] = [reader, writer]
    else:
        reader, writer = conn
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\ncontent-length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    writer.write(head.encode() + b"\r\n" + body)
    status_line = await reader.readline()
    length = 0
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
        if name.lower() == "transfer-encoding" and "chunked" in value:
            chunked = True
    if chunked:
        data = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                break
            data += await reader.readexactly(size)
            await reader.readline()
    else:
        data = await reader.readexactly(length) if length else b""
    if conn is None:
        writer.close()
    return int(status_line.split()[1]), data


class SSE:
    """A raw SSE reader calling C{on_event(event, data, id)} per message."""

    def __init__(self, port: int, path: str, headers: dict[str, str] | None = None) -> None:
        self.port, self.path, self.headers = port, path, headers or {}
        self.writer: asyncio.StreamWriter | None = None

    async def run(self, on_event: Any, opened: asyncio.Event | None = None) -> None:
        reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = f"GET {self.path} HTTP/1.1\r\nHost: localhost\r\n" + "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        self.writer.write(head.encode() + b"\r\n")
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"{self.path}: {status!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if opened is not None:
            opened.set()
        chunked_len = None
        event: dict[str, str] = {}
        buffer = b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            buffer += chunk
            # The relays answer SSE without chunked framing on HTTP/1.1 keep-alive? Strip chunk sizes if any.
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                text = line.decode("utf-8", "replace").rstrip("\r")
                if chunked_len is None and re.fullmatch(r"[0-9a-fA-F]+", text or "-"):
                    continue  # a chunk-size line
                if text == "":
                    if "data" in event:
                        on_event(event.get("event"), event["data"], event.get("id"))
                    event = {}
                elif text.startswith(":"):
                    continue
                else:
                    name, _, value = text.partition(":")
                    event[name] = value[1:] if value.startswith(" ") else value

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# AEP workload ------------------------------------------------------------------------------------


def aep_event(session: int, seq: int) -> dict[str, Any]:
    return {"aep": "0.1", "id": f"soak-{session}-{seq}", "type": "progress.status", "time": "2026-11-29T00:00:00Z",
            "source": f"aep://soak/agent/a/session/s{session}", "agent": "soak", "session": f"s{session}",
            "seq": seq, "severity": "notice", "data": {"message": PAD, "t": time.time()}}


async def aep_http_emitter(port: int, stats: Stats, seqs: dict[int, int], rate: float) -> None:
    conn: list[Any] = []
    auth = {"authorization": f"Bearer {TOKEN}", "aep-version": "0.1", "content-type": "application/x-ndjson"}
    session = 0
    while not stats.stopping:
        lines = []
        for _ in range(10):
            session = (session + 1) % (SESSIONS - 5)  # sessions 45..49 belong to the WebSocket emitter
            lines.append(json.dumps(aep_event(session, seqs[session]), separators=(",", ":")))
            seqs[session] += 1
        # Counted when sent: the run's end cancels this task, and a POST the relay has already taken must
        # not go uncounted (relayd's ingest count is checked against this one).
        stats.counts["aep_posted"] += 10
        status, body = await http(port, "POST", "/events", ("\n".join(lines) + "\n").encode(), auth, conn)
        if status != 202:
            stats.error(f"aep POST {status} {body[:100]!r}")
        await asyncio.sleep(10 / rate)


async def aep_ws_emitter(port: int, stats: Stats, seqs: dict[int, int], rate: float) -> None:
    from autobahn.asyncio.websocket import WebSocketClientFactory, WebSocketClientProtocol

    opened: asyncio.Future[Any] = asyncio.get_event_loop().create_future()

    class Emitter(WebSocketClientProtocol):
        def onOpen(self) -> None:
            self.sendMessage(json.dumps({"type": "hello", "versions": ["0.1"], "role": "emitter",
                                         "identity": {"agent": "soak-ws"}}).encode())
            opened.set_result(self)

        def onMessage(self, payload: bytes, isBinary: bool) -> None:
            msg = json.loads(payload)
            if msg.get("type") == "error":
                stats.error(f"aep ws error {msg}")

    factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/socket", headers={"authorization": f"Bearer {TOKEN}"})
    factory.protocol = Emitter
    await asyncio.get_event_loop().create_connection(factory, "127.0.0.1", port)
    proto = await opened
    session = SESSIONS - 5
    while not stats.stopping:
        session = SESSIONS - 5 + (session + 1) % 5
        proto.sendMessage(json.dumps(aep_event(session, seqs[session]), separators=(",", ":")).encode())
        seqs[session] += 1
        stats.counts["aep_posted"] += 1
        await asyncio.sleep(1 / rate)
    proto.sendClose(1000)


async def aep_sse_consumer(port: int, stats: Stats) -> None:
    def on_event(kind: str | None, data: str, event_id: str | None) -> None:
        stats.counts["aep_delivered"] += 1
        found = re.search(r'"t":([0-9.]+)', data)
        if found:
            stats.latency["aep"].append(time.time() - float(found.group(1)))

    await SSE(port, "/stream", {"authorization": f"Bearer {TOKEN}"}).run(on_event)
    stats.error("aep SSE consumer stream ended")


async def aep_ws_consumer(port: int, stats: Stats) -> None:
    from autobahn.asyncio.websocket import WebSocketClientFactory, WebSocketClientProtocol

    class Consumer(WebSocketClientProtocol):
        def onOpen(self) -> None:
            self.sendMessage(json.dumps({"type": "hello", "versions": ["0.1"], "role": "consumer"}).encode())
            self.sendMessage(json.dumps({"type": "subscribe", "id": 1}).encode())

        def onMessage(self, payload: bytes, isBinary: bool) -> None:
            found = re.search(rb'"t":([0-9.]+)', payload)
            if found:
                stats.counts["aep_delivered"] += 1
                stats.latency["aep"].append(time.time() - float(found.group(1)))

        def onClose(self, wasClean: bool, code: int | None, reason: str | None) -> None:
            stats.error(f"aep WS consumer closed {code}")

    factory = WebSocketClientFactory(f"ws://127.0.0.1:{port}/socket", headers={"authorization": f"Bearer {TOKEN}"})
    factory.protocol = Consumer
    factory.setProtocolOptions(autoPingInterval=0)
    await asyncio.get_event_loop().create_connection(factory, "127.0.0.1", port)


async def aep_resuming_consumer(port: int, stats: Stats, session: int, every: float) -> None:
    """One session; drops the connection every C{every} s and resumes with Last-Event-ID."""
    last: str | None = None
    expected: int | None = None

    def on_event(kind: str | None, data: str, event_id: str | None) -> None:
        nonlocal last, expected
        if event_id is None:
            return
        seq = int(event_id.rsplit(":", 1)[1])
        if expected is not None and seq != expected:
            stats.error(f"resume s{session}: expected seq {expected}, got {seq}")
        expected = seq + 1
        last = event_id
        stats.counts["aep_resumed_events"] += 1

    while not stats.stopping:
        headers = {"authorization": f"Bearer {TOKEN}"}
        if last is not None:
            headers["last-event-id"] = last
            stats.counts["aep_resumes"] += 1
        query = f'/stream?filter={{"session":"s{session}"}}'.replace('"', "%22").replace("{", "%7B").replace("}", "%7D")
        stream = SSE(port, query, headers)
        task = asyncio.ensure_future(stream.run(on_event))
        await asyncio.sleep(every)
        stream.close()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, OSError, RuntimeError):
            pass


# MCP workload ------------------------------------------------------------------------------------


async def mcp_page(port: int, stats: Stats, opened: asyncio.Event) -> None:
    """The page: answers every request it receives, in order, over one kept-alive connection."""
    conn: list[Any] = []
    requests: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def answer() -> None:
        while True:
            message = await requests.get()
            reply = {"jsonrpc": "2.0", "id": message["id"], "result": {"content": [{"type": "text", "text": "ok"}]}}
            status, _ = await http(port, "POST", f"/{MCP_SESSION}/outbox?token={MCP_TOKEN}",
                                   json.dumps(reply).encode(), {"content-type": "application/json"}, conn)
            if status != 200:
                stats.error(f"mcp outbox {status}")

    def on_event(kind: str | None, data: str, event_id: str | None) -> None:
        if kind != "mcp":
            return
        message = json.loads(data)
        if "id" in message and "method" in message:
            requests.put_nowait(message)

    worker = asyncio.ensure_future(answer())
    try:
        await SSE(port, f"/{MCP_SESSION}/events?token={MCP_TOKEN}&direction=inbound").run(on_event, opened)
        stats.error("mcp page stream ended")
    finally:
        worker.cancel()


async def mcp_sse_agent(port: int, stats: Stats, rate: float) -> None:
    waiting: dict[int, tuple[float, asyncio.Future[None]]] = {}

    def on_event(kind: str | None, data: str, event_id: str | None) -> None:
        if kind != "mcp":
            return
        message = json.loads(data)
        entry = waiting.pop(message.get("id"), None) if isinstance(message.get("id"), int) else None
        if entry is not None:
            stats.latency["mcp"].append(time.monotonic() - entry[0])
            stats.counts["mcp_round_trips"] += 1
            entry[1].set_result(None)

    opened = asyncio.Event()
    reader = asyncio.ensure_future(
        SSE(port, f"/{MCP_SESSION}/events?token={MCP_TOKEN}&direction=outbound").run(on_event, opened))
    try:
        await opened.wait()
        await _agent_calls(port, stats, rate, waiting)
    finally:
        reader.cancel()


async def _agent_calls(port: int, stats: Stats, rate: float, waiting: dict[int, tuple[float, asyncio.Future[None]]]) -> None:
    conn: list[Any] = []
    n = 1000
    while not stats.stopping:
        n += 1
        done = asyncio.get_event_loop().create_future()
        waiting[n] = (time.monotonic(), done)
        frame = {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "soak", "arguments": {}}}
        status, _ = await http(port, "POST", f"/{MCP_SESSION}/inbox?token={MCP_TOKEN}", json.dumps(frame).encode(),
                               {"content-type": "application/json"}, conn)
        if status != 200:
            stats.error(f"mcp inbox {status}")
        try:
            await asyncio.wait_for(done, 10)
        except TimeoutError:
            stats.error(f"mcp round trip {n} timed out")
        await asyncio.sleep(1 / rate)


async def mcp_poll_agent(port: int, stats: Stats, rate: float) -> None:
    conn: list[Any] = []
    status, body = await http(port, "GET", f"/{MCP_SESSION}/poll?token={MCP_TOKEN}&direction=outbound&wait=0", conn=conn)
    subscriber = json.loads(body)["subscriber"]
    post_conn: list[Any] = []
    n = 500000
    while not stats.stopping:
        n += 1
        started = time.monotonic()
        frame = {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "soak-poll", "arguments": {}}}
        await http(port, "POST", f"/{MCP_SESSION}/inbox?token={MCP_TOKEN}", json.dumps(frame).encode(),
                   {"content-type": "application/json"}, post_conn)
        answered = False
        while not answered and not stats.stopping:
            status, body = await http(
                port, "GET", f"/{MCP_SESSION}/poll?token={MCP_TOKEN}&direction=outbound&wait=5000&subscriber={subscriber}",
                conn=conn)
            if status != 200:
                stats.error(f"mcp poll {status}")
                return
            reply = json.loads(body)
            subscriber = reply["subscriber"]
            for raw in reply["frames"]:
                message = json.loads(raw) if isinstance(raw, str) else raw
                if message.get("id") == n:
                    answered = True
        if answered:
            stats.latency["mcp"].append(time.monotonic() - started)
            stats.counts["mcp_round_trips"] += 1
        await asyncio.sleep(1 / rate)


# Broker workload ---------------------------------------------------------------------------------


async def broker_agent(port: int, stats: Stats, credential: str, channel: str, rate: float) -> None:
    from relayd.buzz.core import contract

    conn: list[Any] = []
    n = 0
    while not stats.stopping:
        n += 1
        request = contract.build_request("message.post", {"channelId": channel, "content": f"soak {n}"}, f"soak-{uuid.uuid4()}")
        started = time.monotonic()
        status, body = await http(port, "POST", "/v1/action", contract.freeze(request),
                                  {"authorization": f"Bearer {credential}", "content-type": "application/json"}, conn)
        verdict = json.loads(body).get("status") if status == 200 else None
        if verdict != "succeeded":
            stats.error(f"broker {status} {body[:120]!r}")
        else:
            stats.latency["broker"].append(time.monotonic() - started)
            stats.counts["broker_actions"] += 1
        await asyncio.sleep(1 / rate)


def start_broker_backend(workdir: Path) -> tuple[Any, dict[str, str], str, str]:
    """A Nostr relay subprocess, a state dir with a KEK, and one credential for message.post."""
    from tests.support.nostr import NostrRelay

    relay = NostrRelay(str(workdir / "nostr"))
    os.makedirs(relay.workdir, exist_ok=True)
    relay.start()
    state = workdir / "broker-state"
    state.mkdir()
    kek = state / "soak.kek"
    kek.write_text(os.urandom(32).hex())
    channel = str(uuid.uuid4())
    # As an operator would (and in its own process: the broker's modules pick Twisted for autobahn,
    # this script's clients use asyncio).
    issued = subprocess.run(
        [sys.executable, "-m", "relayd.cli.admin", "broker", "issue", "--state-dir", str(state), "--kek-file", str(kek),
         "--agent", "soak", "--channel", channel, "--actions", "message.post"],
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=60,
    )
    if issued.returncode != 0:
        raise RuntimeError(issued.stderr)
    credential = json.loads(issued.stdout)["credential"]
    return relay, {"relay": relay.url, "state": str(state), "kek": str(kek)}, credential, channel


# The run -----------------------------------------------------------------------------------------

# What the metrics listener says at the end, summed over the other labels (relayd's own account).
SERIES = {
    "relayd_events_ingested_total": ("relay",),
    "relayd_events_delivered_total": ("relay",),
    "relayd_events_dropped_total": ("relay", "reason"),
    "relayd_replays_total": ("relay", "outcome"),
    "relayd_mcp_frames_total": ("direction",),
    "relayd_broker_actions_total": ("action", "status"),
    "relayd_nostr_relay_connections": ("state",),
    "relayd_http_requests_total": ("relay",),
    "relayd_store_errors_total": ("relay",),
}


async def scrape_metrics(port: int) -> dict[str, dict[str, float]]:
    """Selected series of C{/metrics}, keyed by name then by the label values joined with C{/}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body = await http(port, "GET", "/metrics")
    out: dict[str, dict[str, float]] = defaultdict(dict)
    if status != 200:
        return {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = SERIES.get(sample.name)
            if labels is None:
                continue
            key = "/".join(sample.labels.get(label, "") for label in labels)
            out[sample.name][key] = out[sample.name].get(key, 0.0) + sample.value
    return dict(out)


async def soak(args: argparse.Namespace) -> int:
    duration = args.seconds if args.seconds else args.minutes * 60
    workdir = Path(tempfile.mkdtemp(prefix="relayd-soak-"))
    wanted = set(args.relays.split(","))
    broker_wanted = not args.no_broker and "broker" in wanted
    if broker_wanted and importlib.util.find_spec("nostr_relay") is None:
        if args.require_broker:
            print("soak: nostr-relay is not installed; the broker part cannot run", file=sys.stderr)
            return 2
        print("soak: nostr-relay not installed: running without the broker", file=sys.stderr)
        broker_wanted = False
    nostr = None
    broker_cfg = credential = channel = None
    if broker_wanted:
        nostr, broker_cfg, credential, channel = start_broker_backend(workdir)
    server = Server(workdir, broker_cfg, args.aep_buffer)
    try:
        return await run_mix(args, duration, server, broker_cfg, credential, channel)
    finally:
        if server.proc.poll() is None:
            server.proc.kill()  # an exception above must not leave relayd running
        if nostr is not None:
            nostr.stop()


async def run_mix(args: argparse.Namespace, duration: float, server: Server, broker_cfg: dict[str, str] | None,
                  credential: str | None, channel: str | None) -> int:
    stats = Stats()
    seqs: dict[int, int] = defaultdict(int)
    aep, mcp = server.ports["aep"], server.ports["mcp"]
    wanted = set(args.relays.split(","))
    tasks: list[asyncio.Future[Any]] = []
    if "mcp" in wanted:
        status, _ = await http(mcp, "POST", "/register",
                               json.dumps({"session": MCP_SESSION, "token": MCP_TOKEN}).encode(),
                               {"content-type": "application/json"})
        assert status == 200, status
        page_open = asyncio.Event()
        tasks.append(asyncio.ensure_future(mcp_page(mcp, stats, page_open)))
        await page_open.wait()
        tasks += [asyncio.ensure_future(mcp_sse_agent(mcp, stats, rate=10)),
                  asyncio.ensure_future(mcp_poll_agent(mcp, stats, rate=2))]
    if "aep" in wanted:
        tasks += [asyncio.ensure_future(aep_sse_consumer(aep, stats)) for _ in range(20)]
        for _ in range(2):
            await aep_ws_consumer(aep, stats)
        tasks += [asyncio.ensure_future(aep_resuming_consumer(aep, stats, s, every=3 + s % 4)) for s in range(10)]
        tasks += [
            asyncio.ensure_future(aep_http_emitter(aep, stats, seqs, rate=args.aep_rate)),
            asyncio.ensure_future(aep_ws_emitter(aep, stats, seqs, rate=10)),
        ]
    # Agents whose every action the relay's metrics count exactly: at the end they finish the action
    # in flight instead of being cancelled in it (the relay would count what the client did not).
    finishing: list[asyncio.Future[Any]] = []
    if broker_cfg is not None:
        finishing.append(asyncio.ensure_future(broker_agent(server.ports["broker"], stats, credential, channel, rate=2)))
        tasks += finishing

    samples = []
    started = time.monotonic()
    relays = [r for r in ("aep", "mcp") if r in wanted] + (["broker"] if broker_cfg else [])
    print(f"soak: {duration:.0f}s, relays: {', '.join(relays)}; log {server.log_path}")
    print(f"{'t(s)':>6} {'rss MiB':>8} {'cpu%':>5} {'aep/s':>7} {'aep p50/p99 ms':>15} {'mcp rt':>6} "
          f"{'mcp p50/p99 ms':>15} {'brk':>4} {'brk p50/p99 ms':>15} {'errors':>6}")
    next_report = started + args.interval
    while time.monotonic() - started < duration:
        await asyncio.sleep(min(0.5, max(0.0, next_report - time.monotonic())))
        for task in tasks:
            if task.done() and task.exception() is not None:
                stats.error(f"{task.get_coro().__name__}: {task.exception()!r}")  # type: ignore[union-attr]
                tasks.remove(task)
                break
        if time.monotonic() < next_report:
            continue
        next_report += args.interval
        counts, latency = stats.take()
        sample = {
            "t": round(time.monotonic() - started, 1),
            "rss_mib": round(server.rss_mib(), 1),
            "cpu_percent": round(server.cpu_percent(), 1),
            "aep_delivered_per_s": round(counts.get("aep_delivered", 0) / args.interval),
            "aep_p50_ms": pct(latency.get("aep", []), 0.5), "aep_p99_ms": pct(latency.get("aep", []), 0.99),
            "mcp_round_trips": counts.get("mcp_round_trips", 0),
            "mcp_p50_ms": pct(latency.get("mcp", []), 0.5), "mcp_p99_ms": pct(latency.get("mcp", []), 0.99),
            "broker_actions": counts.get("broker_actions", 0),
            "broker_p50_ms": pct(latency.get("broker", []), 0.5), "broker_p99_ms": pct(latency.get("broker", []), 0.99),
            "resumes": counts.get("aep_resumes", 0),
            "errors": len(stats.errors),
        }
        samples.append(sample)

        def ms(a: float | None, b: float | None) -> str:
            return "-" if a is None else f"{a:.1f}/{b:.1f}"

        print(f"{sample['t']:>6} {sample['rss_mib']:>8} {sample['cpu_percent']:>5} {sample['aep_delivered_per_s']:>7} "
              f"{ms(sample['aep_p50_ms'], sample['aep_p99_ms']):>15} {sample['mcp_round_trips']:>6} "
              f"{ms(sample['mcp_p50_ms'], sample['mcp_p99_ms']):>15} {sample['broker_actions']:>4} "
              f"{ms(sample['broker_p50_ms'], sample['broker_p99_ms']):>15} {sample['errors']:>6}", flush=True)

    stats.stopping = True
    if finishing:
        await asyncio.wait(finishing, timeout=10)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    stats.take()  # what happened after the last report line still counts in the totals
    scraped = await scrape_metrics(server.ports["metrics"])
    exit_status = await server.stop()
    log = server.log_path.read_bytes()
    problems = list(stats.errors)
    if b"Traceback" in log:
        problems.append("a traceback in the relayd log")
    if exit_status != 0:
        problems.append(f"relayd exited {exit_status} on SIGTERM")
    half = samples[len(samples) // 2 :] if samples else []
    growth = (half[-1]["rss_mib"] - half[0]["rss_mib"]) if len(half) > 1 else 0.0
    if growth > args.max_growth_mib:
        problems.append(f"RSS grew {growth:.1f} MiB through the second half (limit {args.max_growth_mib})")
    summary = {
        "seconds": duration, "broker": broker_cfg is not None, "samples": samples,
        "rss_start_mib": samples[0]["rss_mib"] if samples else None,
        "rss_end_mib": samples[-1]["rss_mib"] if samples else None,
        "rss_max_mib": max((s["rss_mib"] for s in samples), default=None),
        "rss_growth_second_half_mib": round(growth, 1),
        "problems": problems[:50], "log": str(server.log_path),
        "totals": dict(stats.totals), "metrics": scraped,
    }
    print(f"soak: RSS {summary['rss_start_mib']} -> {summary['rss_end_mib']} MiB (max {summary['rss_max_mib']}), "
          f"second-half growth {growth:.1f} MiB; {len(problems)} problem(s)")
    for problem in problems[:10]:
        print(f"soak: problem: {problem}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 1 if problems else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run [default: 10]")
    p.add_argument("--seconds", type=float, help="how long to run, in seconds (overrides --minutes)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between report lines")
    p.add_argument("--aep-rate", type=float, default=200.0, help="events/s from the HTTP emitter")
    p.add_argument("--aep-buffer", type=int, default=500,
                   help="events relayd keeps per session (50 sessions at ~4 events/s each fill 500 in ~2 min)")
    p.add_argument("--max-growth-mib", type=float, default=20.0, help="RSS growth allowed through the second half")
    p.add_argument("--relays", default="aep,mcp,broker", help="which relays to load (comma list) [default: all]")
    p.add_argument("--no-broker", action="store_true", help="leave the broker out")
    p.add_argument("--require-broker", action="store_true", help="fail when the broker cannot run")
    p.add_argument("--json", help="write the samples and summary to this file")
    return asyncio.run(soak(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
