"""C{relayd-admin}: the operator's tools for a running relayd.

    relayd-admin aep tail [URL] [--filter JSON] [--session S] [--capture LEVEL] [--from all|JSON] [--no-live]
    relayd-admin aep post [URL] [FILE]            # NDJSON events from FILE or stdin
    relayd-admin mcp connect URL [tools | call NAME [ARGS] | send FRAME | watch]
    relayd-admin status [--aep URL] [--mcp URL] [--broker URL] [--metrics URL]
    relayd-admin broker issue|revoke|list ...     # Buzz broker credentials

Tokens come from C{--token} or the environment (C{AEP_TOKEN}, C{MCP_TOKEN}); the AEP tools send them
as C{Authorization: Bearer}, never in a URL. Plain standard-library HTTP: the tools need no reactor
and run wherever Python does.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import re
import select
import signal
import ssl
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterator, Sequence

import relayd
from relayd.cli import (
    CommandError,
    Failure,
    Parser,
    UsageError,
    non_negative_int,
    positive_int,
    positive_seconds,
    report,
    seconds,
)

DEFAULT_AEP = "http://127.0.0.1:8787"
DEFAULT_MCP = "http://127.0.0.1:8788"
DEFAULT_BROKER = "http://127.0.0.1:8789"
_ID = re.compile(r"(.+):([0-9]+):([0-9]+)")


# HTTP plumbing -----------------------------------------------------------------------------------


@dataclass
class Target:
    """A parsed base URL and how to reach it."""

    scheme: str
    host: str
    port: int
    path: str
    context: ssl.SSLContext | None = None

    @classmethod
    def parse(cls, url: str, cacert: str | None = None) -> Target:
        parts = urllib.parse.urlsplit(url if "://" in url else "http://" + url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UsageError(f"not an http(s) URL: {url!r}")
        context = None
        if parts.scheme == "https":
            context = ssl.create_default_context(cafile=cacert)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(parts.scheme, parts.hostname, port, parts.path.rstrip("/"), context)

    def connection(self, timeout: float) -> http.client.HTTPConnection:
        if self.scheme == "https":
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout, context=self.context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def url(self, path: str) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.path}{path}"


def _request(
    target: Target, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None,
    timeout: float = 10.0,
) -> tuple[int, bytes]:
    conn = target.connection(timeout)
    try:
        conn.request(method, target.path + path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _auth(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


class Stopped(Exception):
    """SIGINT or SIGTERM: stop quietly."""


def _stop_on_signals() -> None:
    def stop(signum: int, frame: Any) -> None:
        raise Stopped()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


# aep tail ----------------------------------------------------------------------------------------


@dataclass
class Tail:
    """An SSE consumer that resumes by position across disconnects and relay restarts."""

    target: Target
    token: str | None
    filter: dict[str, Any] | None = None
    capture: str | None = None
    start: Any = None  # "all", a list of {session, epoch, seq}, or None (live only)
    live: bool = True
    max_from: int = 100
    retry_max: float = 5.0
    idle_timeout: float = 75.0
    progress_every: float = 10.0
    out: IO[str] = field(default_factory=lambda: sys.stdout)
    err: IO[str] = field(default_factory=lambda: sys.stderr)
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)
    printed: int = 0
    skipped: int = 0
    _last_progress: float = 0.0

    def say(self, text: str) -> None:
        self.err.write(f"tail: {text}\n")
        self.err.flush()

    def resume_from(self) -> Any:
        """The C{from} of the next connection: what was asked, advanced to what was printed."""
        if self.start == "all":
            return "all"  # replays everything held; what was printed already is skipped by position
        entries: dict[str, tuple[int, int]] = {}
        for item in self.start or []:
            entries[item["session"]] = (int(item.get("epoch", 0)), int(item.get("seq", -1)))
        entries.update(self.positions)
        # The relay caps `from` (AEP_MAX_FROM); keep the most recently printed sessions.
        recent = list(entries.items())[-self.max_from :]
        if len(entries) > self.max_from:
            self.say(f"{len(entries) - self.max_from} older session position(s) not resumed (--max-from)")
        return [{"session": s, "epoch": e, "seq": q} for s, (e, q) in recent]

    def query(self) -> str:
        params: list[tuple[str, str]] = []
        if self.filter:
            params.append(("filter", json.dumps(self.filter, separators=(",", ":"))))
        if self.capture:
            params.append(("capture", self.capture))
        start = self.resume_from()
        if start == "all":
            params.append(("from", "all"))
        elif start:
            params.append(("from", json.dumps(start, separators=(",", ":"))))
        if not self.live:
            params.append(("live", "0"))
        return "/stream" + ("?" + urllib.parse.urlencode(params) if params else "")

    def run(self) -> int:
        """Follow the stream until stopped (or, with C{live=False}, until the replay completes)."""
        delay = 0.0
        attempt = 0
        while True:
            if delay:
                time.sleep(delay)  # a CLI's reconnect backoff
            try:
                finished = self.follow()
            except BrokenPipeError:
                return 0  # whoever read our output has gone (| head)
            except (OSError, http.client.HTTPException) as e:
                attempt += 1
                delay = min(self.retry_max, 0.2 * 2 ** min(attempt, 10))
                self.say(f"disconnected ({type(e).__name__}: {e}); reconnecting in {delay:.1f}s")
                continue
            if finished:
                return 0
            attempt = 1
            delay = 0.2
            self.say(f"stream ended; reconnecting in {delay:.1f}s")

    def follow(self) -> bool:
        """One connection; True when the stream ended for good (history only, replay complete)."""
        conn = self.target.connection(self.idle_timeout)
        try:
            path = self.query()
            headers = {"accept": "text/event-stream", **_auth(self.token)}
            conn.request("GET", self.target.path + path, headers=headers)
            response = conn.getresponse()
            if response.status in (400, 401, 403, 404):
                detail = response.read().decode("utf-8", "replace").strip()
                raise Failure(f"{self.target.url('/stream')} refused: {response.status} {detail}".strip())
            if response.status != 200:
                raise http.client.HTTPException(f"status {response.status}")
            resumed = self.resume_from()
            if resumed == "all":
                self.say(f"connected to {self.target.url('/stream')} (from all)")
            elif resumed:
                shown = ", ".join(f"{e['session']}:{e['epoch']}:{e['seq']}" for e in resumed[:3])
                more = f" and {len(resumed) - 3} more" if len(resumed) > 3 else ""
                self.say(f"connected to {self.target.url('/stream')}, resumed from {shown}{more}")
            else:
                self.say(f"connected to {self.target.url('/stream')}")
            return self._read(response)
        finally:
            conn.close()

    def _read(self, response: http.client.HTTPResponse) -> bool:
        event: dict[str, str] = {}
        data: list[str] = []
        for raw in response:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line == "":
                if data:
                    self._event(event.get("id"), "\n".join(data))
                event, data = {}, []
                self._progress()
                continue
            if line.startswith(":"):
                comment = line[1:].strip()
                if comment.startswith("replay-exhausted"):
                    self.say(f"{comment} (events before it are no longer held)")
                elif comment == "replay-complete":
                    return True
                elif comment == "shutting-down":
                    self.say("relay is shutting down")
                continue
            name, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if name == "data":
                data.append(value)
            else:
                event[name] = value
        return False

    def _event(self, event_id: str | None, data: str) -> None:
        if event_id:
            found = _ID.fullmatch(event_id)
            if found:
                session, position = found.group(1), (int(found.group(2)), int(found.group(3)))
                seen = self.positions.get(session)
                if seen is not None and position <= seen:
                    self.skipped += 1  # already printed before a reconnect
                    return
                self.positions.pop(session, None)
                self.positions[session] = position  # most recent last, for --max-from
        self.out.write(data + "\n")
        self.out.flush()
        self.printed += 1

    def _progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and (not self.progress_every or now - self._last_progress < self.progress_every):
            return
        self._last_progress = now
        last = ""
        if self.positions:
            session, (epoch, seq) = next(reversed(self.positions.items()))
            last = f", last {session}:{epoch}:{seq}"
        self.say(f"{self.printed} events, {len(self.positions)} sessions{last}")


def _tail(args: argparse.Namespace) -> int:
    flt: dict[str, Any] | None = None
    if args.filter:
        try:
            flt = json.loads(args.filter)
        except ValueError:
            raise UsageError("--filter is not JSON") from None
        if not isinstance(flt, dict):
            raise UsageError("--filter must be a JSON object")
    if args.session:
        flt = {**(flt or {}), "session": args.session}
    start: Any = None
    if args.start == "all":
        start = "all"
    elif args.start:
        try:
            start = json.loads(args.start)
        except ValueError:
            raise UsageError('--from must be "all" or a JSON array of {session, epoch, seq}') from None
        if not isinstance(start, list) or not all(isinstance(e, dict) and "session" in e for e in start):
            raise UsageError('--from must be "all" or a JSON array of {session, epoch, seq}')
    tail = Tail(
        Target.parse(_strip(args.url, "/stream"), args.cacert),
        args.token or os.environ.get("AEP_TOKEN") or None,
        filter=flt,
        capture=args.capture,
        start=start,
        live=not args.no_live,
        max_from=args.max_from,
        retry_max=args.retry_max,
        progress_every=args.progress,
    )
    try:
        return tail.run()
    except Stopped:
        tail._progress(force=True)
        return 0


# aep post ----------------------------------------------------------------------------------------


def _post(args: argparse.Namespace) -> int:
    target = Target.parse(_strip(args.url, "/events"), args.cacert)
    token = args.token or os.environ.get("AEP_TOKEN") or None
    from_stdin = args.file in (None, "-")
    try:
        fd = sys.stdin.fileno() if from_stdin else os.open(args.file, os.O_RDONLY)
    except OSError as e:  # as argparse reports a file argument it cannot open
        raise UsageError(f"argument file: can't open {args.file!r}: {e.strerror}") from None
    headers = {"aep-version": "0.1", "content-type": "application/x-ndjson", **_auth(token)}
    sent = batches = 0
    try:
        for batch in _batches(_lines(fd), args.batch, args.max_bytes):
            for attempt in range(args.retries + 1):
                try:
                    status, body = _request(target, "POST", "/events", b"".join(batch), headers)
                except (OSError, http.client.HTTPException) as e:
                    status, body = 0, _describe(e).encode()
                if status == 202 or (status and status < 500) or attempt == args.retries:
                    break
                time.sleep(min(5.0, 0.2 * 2**attempt))  # a CLI's retry backoff
            if status != 202:
                detail = body.decode("utf-8", "replace").strip()
                outcome = f"refused: {status} {detail}" if status else f"got no answer ({detail})"
                raise Failure(f"batch {batches + 1} ({len(batch)} events) {outcome}; {sent} events accepted before it")
            sent += len(batch)
            batches += 1
    finally:
        if not from_stdin:
            os.close(fd)
    sys.stderr.write(f"post: {sent} events accepted in {batches} batches\n")
    return 0


def _lines(fd: int) -> Iterator[bytes | None]:
    """The lines read from C{fd}, with C{None} whenever the input pauses (a pipe with nothing more yet)."""
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield line
        if not select.select([fd], [], [], 0.05)[0]:
            yield None  # a regular file is always readable: only pipes and terminals pause
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buffer += chunk
    if buffer:
        yield buffer


def _batches(lines: Iterator[bytes | None], size: int, max_bytes: int) -> Iterator[list[bytes]]:
    """NDJSON lines grouped into batches of at most C{size} events and C{max_bytes}; a batch also goes
    out as soon as the input pauses, so events piped in one at a time are posted at once."""
    batch: list[bytes] = []
    total = 0
    for line in lines:
        if line is None:
            if batch:
                yield batch
                batch, total = [], 0
            continue
        line = line.strip()
        if not line:
            continue
        if batch and (len(batch) >= size or total + len(line) + 1 > max_bytes):
            yield batch
            batch, total = [], 0
        batch.append(line + b"\n")
        total += len(line) + 1
    if batch:
        yield batch


# mcp connect -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class McpEndpoints:
    """The session's URLs, derived as the MCP relay's clients do (docs/mcp.md)."""

    base: str
    session: str
    token: str

    def url(self, leg: str, query: str = "") -> str:
        token = urllib.parse.quote(self.token, safe="")
        return f"{self.base}/{self.session}/{leg}?token={token}{query}"


def mcp_endpoints(url: str, token: str | None = None, relay_path: str = "agent-relay") -> McpEndpoints:
    """An explicit token wins, then C{?token=}, then C{?key=}; a share URL (C{?session=}) names the relay
    path; a direct path drops a trailing C{inbox}, C{events} or C{outbox} and ends with the session."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    token = token or next(iter(query.get("token") or query.get("key") or []), None)
    if not token:
        raise UsageError("no token in URL and --token / MCP_TOKEN unset")
    origin = f"{parts.scheme}://{parts.netloc}"
    if "session" in query:
        return McpEndpoints(origin + "/" + relay_path.strip("/"), query["session"][0], token)
    segments = [s for s in parts.path.split("/") if s]
    if segments and segments[-1] in ("inbox", "events", "outbox"):
        segments.pop()
    if not segments:
        raise UsageError("could not determine session id from URL")
    session = segments.pop()
    return McpEndpoints(origin + ("/" + "/".join(segments) if segments else ""), session, token)


class McpSession:
    """An MCP client over the relay: SSE outbound for answers, POST inbox for requests."""

    def __init__(self, endpoints: McpEndpoints, cacert: str | None = None, timeout: float = 15.0) -> None:
        self.endpoints = endpoints
        self.cacert = cacert
        self.timeout = timeout
        self.frames: queue.Queue[Any] = queue.Queue()
        self._opened = threading.Event()
        self._error: list[str] = []
        self._conn: http.client.HTTPConnection | None = None

    def open(self) -> None:
        """Open the outbound SSE leg and wait until the relay has answered its headers."""
        threading.Thread(target=self._listen, daemon=True).start()
        if not self._opened.wait(self.timeout) or self._error:
            raise Failure(self._error[0] if self._error else "the events stream did not open")

    def _listen(self) -> None:
        url = self.endpoints.url("events", "&direction=outbound")
        target = Target.parse(url, self.cacert)
        parts = urllib.parse.urlsplit(url)
        conn = target.connection(timeout=3600)
        self._conn = conn
        try:
            conn.request("GET", parts.path + "?" + parts.query, headers={"accept": "text/event-stream"})
            response = conn.getresponse()
            if response.status != 200:
                detail = response.read()[:200].decode("utf-8", "replace").strip()
                self._error.append(f"events stream refused: {response.status} {detail}".strip())
                self._opened.set()
                return
            self._opened.set()
            kind: str | None = None
            data: list[str] = []
            for raw in response:
                line = raw.decode("utf-8").rstrip("\r\n")
                if line == "":
                    if kind == "mcp" and data:
                        try:
                            self.frames.put(json.loads("\n".join(data)))
                        except ValueError:
                            pass
                    kind, data = None, []
                elif line.startswith("event:"):
                    kind = line[6:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].lstrip(" ") if line[5:6] == " " else line[5:])
        except (OSError, http.client.HTTPException) as e:
            self._error.append(f"events stream: {_describe(e)}")
            self._opened.set()
        finally:
            self.frames.put(None)

    def send(self, frame: dict[str, Any]) -> None:
        body = json.dumps(frame, separators=(",", ":")).encode()
        url = self.endpoints.url("inbox")
        target = Target.parse(url, self.cacert)
        parts = urllib.parse.urlsplit(url)
        conn = target.connection(self.timeout)
        try:
            conn.request("POST", parts.path + "?" + parts.query, body=body, headers={"content-type": "application/json"})
            response = conn.getresponse()
            detail = response.read()
            if response.status >= 400:
                raise Failure(f"inbox refused: {response.status} {detail[:200].decode('utf-8', 'replace')}")
        finally:
            conn.close()

    def await_id(self, frame_id: Any) -> Any:
        """The response carrying C{frame_id}, or C{None} after the timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                frame = self.frames.get(timeout=remaining)
            except queue.Empty:
                return None
            if frame is None:
                raise Failure("the events stream ended")
            if isinstance(frame, dict) and frame.get("id") == frame_id and ("result" in frame or "error" in frame):
                return frame

    def request(self, frame_id: int, method: str, params: dict[str, Any] | None = None) -> Any:
        frame: dict[str, Any] = {"jsonrpc": "2.0", "id": frame_id, "method": method}
        if params is not None:
            frame["params"] = params
        self.send(frame)
        return self.await_id(frame_id)

    def close(self) -> None:
        if self._conn is not None and self._conn.sock is not None:
            try:
                self._conn.sock.shutdown(2)
            except OSError:
                pass


def _json_object(text: str, what: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        raise UsageError(f"{what} is not JSON") from None
    if not isinstance(value, dict):
        raise UsageError(f"{what} must be a JSON object")
    return value


def _mcp_connect(args: argparse.Namespace) -> int:
    relay = args.relay or os.environ.get("MCP_RELAY_PATH") or "agent-relay"
    endpoints = mcp_endpoints(args.url, args.token or os.environ.get("MCP_TOKEN") or None, relay)
    command = args.command
    # The command line is checked before anything is sent.
    if command == "call" and not args.args:
        raise UsageError("call needs a tool name")
    if command == "send" and not args.args:
        raise UsageError("send needs a JSON-RPC frame")
    if command in ("tools", "watch") and args.args:
        raise UsageError(f"{command} takes no arguments")
    arguments = _json_object(args.args[1], "call ARGUMENTS") if command == "call" and len(args.args) > 1 else {}
    frame = _json_object(args.args[0], "send FRAME") if command == "send" else None
    session = McpSession(endpoints, args.cacert, args.timeout)
    out = sys.stdout
    session.open()
    try:
        init = session.request(
            1, "initialize",
            {"protocolVersion": "2025-06-18", "capabilities": {},
             "clientInfo": {"name": "relayd-admin", "version": relayd.__version__}},
        )
        if init is None:
            raise Failure("no response — is the session live and the host connected?")
        session.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        if command == "tools":
            answer = session.request(2, "tools/list")
        elif command == "call":
            answer = session.request(3, "tools/call", {"name": args.args[0], "arguments": arguments})
        elif command == "send":
            assert frame is not None
            session.send(frame)
            answer = session.await_id(frame["id"]) if "id" in frame else None
        elif command == "watch":
            out.write(json.dumps(init) + "\n")
            while True:
                frame = session.frames.get()
                if frame is None:
                    return 0
                out.write(json.dumps(frame) + "\n")
                out.flush()
        else:  # argparse's choices keep anything else out
            raise UsageError(f"unknown command {command!r} (tools, call, send, watch)")
        out.write(json.dumps(answer, indent=2) + "\n" if answer is not None else "(no response)\n")
        return 0
    finally:
        session.close()


# status ------------------------------------------------------------------------------------------


def _status(args: argparse.Namespace) -> int:
    explicit = any((args.aep, args.mcp, args.broker))
    checks: list[tuple[str, str, Callable[[Target], dict[str, Any]]]] = []
    token = args.token or os.environ.get("AEP_TOKEN") or None
    if args.aep or not explicit:
        checks.append(("aep", args.aep or DEFAULT_AEP, lambda t: _aep_health(t, token)))
    if args.mcp or not explicit:
        checks.append(("mcp", args.mcp or DEFAULT_MCP, _mcp_health))
    if args.broker or not explicit:
        checks.append(("broker", args.broker or DEFAULT_BROKER, _broker_health))
    report: dict[str, dict[str, Any]] = {}
    for name, url, check in checks:
        try:
            report[name] = {"url": url, "up": True, **check(Target.parse(url, args.cacert))}
        except (OSError, http.client.HTTPException, ValueError) as e:
            report[name] = {"url": url, "up": False, "error": str(e) or type(e).__name__}
    if args.metrics:
        try:
            report["metrics"] = {"url": args.metrics, "up": True, **_metrics_summary(Target.parse(args.metrics, args.cacert))}
        except (OSError, http.client.HTTPException, ValueError) as e:
            report["metrics"] = {"url": args.metrics, "up": False, "error": str(e) or type(e).__name__}
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    else:
        for name, item in report.items():
            state = "up" if item["up"] else ("not running" if not explicit and name != "metrics" else "DOWN")
            if item.get("status") == "degraded":
                state = "degraded"  # answering, but cannot do its work (the broker's relay is unreachable)
            details = " ".join(
                f"{k}={v}" for k, v in _flat(item) if k not in ("url", "up") and not (k == "status" and v == state)
            )
            sys.stdout.write(f"{name:<8} {state:<12} {item['url']:<28} {details}\n")
    relays = [item["up"] for name, item in report.items() if name != "metrics"]
    if explicit or args.metrics:
        return 0 if all(item["up"] for item in report.values()) else 1
    return 0 if any(relays) else 1


def _aep_health(target: Target, token: str | None) -> dict[str, Any]:
    status, body = _request(target, "GET", "/healthz", headers=_auth(token), timeout=5)
    if status != 200:
        raise ValueError(f"/healthz answered {status}")
    health = json.loads(body)
    if token and "sessions" not in health:
        health["note"] = "token refused: counts hidden"
    health.pop("ok", None)
    return health


def _mcp_health(target: Target) -> dict[str, Any]:
    status, _ = _request(target, "GET", "/healthz", timeout=5)
    if status != 200:
        raise ValueError(f"/healthz answered {status}")
    return {}


def _flat(item: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """C{item}'s members, a nested object's as C{outer.inner}."""
    out: list[tuple[str, Any]] = []
    for key, value in item.items():
        if isinstance(value, dict):
            out.extend(_flat(value, f"{prefix}{key}."))
        else:
            out.append((prefix + key, value))
    return out


def _broker_health(target: Target) -> dict[str, Any]:
    """The broker's C{/healthz}: C{status} (C{ok}, or C{degraded} while its Nostr relay is
    unreachable) and C{upstream} (which relay, connected, since when, the last error)."""
    status, body = _request(target, "GET", "/healthz", timeout=5)
    if status != 200:
        raise ValueError(f"/healthz answered {status}")
    health = json.loads(body)
    health.pop("ok", None)
    return health


_SUMMARY = {
    "relayd_connections": "connections",
    "relayd_sessions": "sessions",
    "relayd_subscribers": "subscribers",
    "relayd_events_ingested_total": "ingested",
    "relayd_events_delivered_total": "delivered",
    "relayd_events_dropped_total": "dropped",
    "process_resident_memory_bytes": "rss_bytes",
    "process_open_fds": "open_fds",
}


def _metrics_summary(target: Target) -> dict[str, Any]:
    path = "" if target.path.endswith("/metrics") else "/metrics"
    status, body = _request(target, "GET", path, timeout=5)
    if status != 200:
        raise ValueError(f"/metrics answered {status}")
    totals: dict[str, float] = {}
    for line in body.decode("utf-8").splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in _SUMMARY:
            key = _SUMMARY[name]
            totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return {k: int(v) if v.is_integer() else v for k, v in totals.items()}


# command line ------------------------------------------------------------------------------------


def _strip(url: str, suffix: str) -> str:
    return url[: -len(suffix)] if url.rstrip("/").endswith(suffix) else url


def _parser() -> argparse.ArgumentParser:
    """The command line; every help text follows relayd/cli.py's style (tests/test_help.py checks it)."""
    p = Parser(prog="relayd-admin", description="Operator tools for a running relayd")
    p.add_argument("--version", action="version", version=f"relayd-admin {relayd.__version__}",
                   help="Show relayd-admin's version and exit")
    top = p.add_subparsers(dest="tool", required=True, metavar="{aep,mcp,status,broker}")

    aep = top.add_parser("aep", help="AEP relay: tail a stream, post events")
    aep_sub = aep.add_subparsers(dest="command", required=True, metavar="{tail,post}")
    tail = aep_sub.add_parser("tail", help="Print events as they arrive; reconnects and resumes by position")
    tail.add_argument("url", nargs="?", default=DEFAULT_AEP, help="Relay base URL")
    tail.add_argument("--token", help="Bearer token [default: $AEP_TOKEN]")
    tail.add_argument("--filter", help='Attribute-match filter, a JSON object, e.g. {"severity":["warning","error"]}')
    tail.add_argument("--session", help="Only this session (added to --filter)")
    tail.add_argument("--capture", help="Capture ceiling: none, metadata, redacted or full [default: the relay's]")
    tail.add_argument("--from", dest="start", help='Replay first: "all" or a JSON array of {session, epoch, seq}')
    tail.add_argument("--no-live", action="store_true", help="History only: stop at replay-complete")
    tail.add_argument("--max-from", type=positive_int, default=100, metavar="N",
                      help="Most session positions sent when resuming")
    tail.add_argument("--retry-max", type=positive_seconds, default=5.0, metavar="SECONDS",
                      help="Longest reconnect delay in seconds")  # 0 would reconnect in a busy loop
    tail.add_argument("--progress", type=seconds, default=10.0, metavar="SECONDS",
                      help="Seconds between progress lines on stderr (0: none)")
    tail.add_argument("--cacert", metavar="FILE", help="CA bundle for https relays [default: the system's]")
    tail.set_defaults(run=_tail, prog=tail.prog)

    post = aep_sub.add_parser("post", help="Post NDJSON events from a file or stdin")
    post.add_argument("url", nargs="?", default=DEFAULT_AEP, help="Relay base URL")
    post.add_argument("file", nargs="?", help="NDJSON file [default: stdin]")
    post.add_argument("--token", help="Bearer token [default: $AEP_TOKEN]")
    post.add_argument("--batch", type=positive_int, default=100, metavar="N", help="Most events per POST")
    post.add_argument("--max-bytes", type=positive_int, default=1024 * 1024, metavar="BYTES",
                      help="Most bytes per POST")
    post.add_argument("--retries", type=non_negative_int, default=3, metavar="N",
                      help="Retries of a batch on connection errors and 5xx answers")
    post.add_argument("--cacert", metavar="FILE", help="CA bundle for https relays [default: the system's]")
    post.set_defaults(run=_post, prog=post.prog)

    mcp = top.add_parser("mcp", help="MCP tunnel relay: act as an MCP client")
    mcp_sub = mcp.add_subparsers(dest="subcommand", required=True, metavar="{connect}")
    connect = mcp_sub.add_parser("connect", help="Initialize, then tools/list (the default), tools/call, send or watch")
    connect.add_argument("url", help="Session URL (share URL with ?session=, or .../<session>[/inbox|events])")
    connect.add_argument("command", nargs="?", default="tools", choices=("tools", "call", "send", "watch"),
                         help="What to do once initialized")
    connect.add_argument("args", nargs="*", help="For call: NAME [ARGUMENTS-JSON]; for send: FRAME-JSON")
    connect.add_argument("--token", help="Session token [default: $MCP_TOKEN, then the URL's ?token= or ?key=]")
    connect.add_argument("--relay", metavar="PATH",
                         help="Relay path of a share URL [default: $MCP_RELAY_PATH, else agent-relay]")
    connect.add_argument("--timeout", type=positive_seconds, default=15.0, metavar="SECONDS",
                         help="Seconds to wait for each answer")
    connect.add_argument("--cacert", metavar="FILE", help="CA bundle for https relays [default: the system's]")
    connect.set_defaults(run=_mcp_connect, prog=connect.prog)

    status = top.add_parser("status", help="Health and counts of a running relayd")
    status.add_argument("--aep", metavar="URL", help=f"AEP relay URL [default: {DEFAULT_AEP}]")
    status.add_argument("--mcp", metavar="URL", help=f"MCP relay URL [default: {DEFAULT_MCP}]")
    status.add_argument("--broker", metavar="URL", help=f"Broker URL [default: {DEFAULT_BROKER}]")
    status.add_argument("--metrics", metavar="URL", help="Metrics listener URL (adds counts from /metrics)")
    status.add_argument("--token", help="AEP token, to see its counts [default: $AEP_TOKEN]")
    status.add_argument("--json", action="store_true", help="Machine-readable output")
    status.add_argument("--cacert", metavar="FILE", help="CA bundle for https relays [default: the system's]")
    status.set_defaults(run=_status, prog=status.prog)

    # Parsed by relayd.buzz.admin (main hands it everything after "broker").
    top.add_parser("broker", help="Buzz broker credentials: issue, revoke, list (relayd-admin broker -h)", add_help=False)
    return p


def _describe(e: BaseException) -> str:
    """An OS or HTTP error in a few words (no errno, no class path)."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return str(e) or type(e).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """The C{relayd-admin} console script; returns the exit status (relayd/cli.py: 2 usage, 1 failure)."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["broker"]:
        from relayd.buzz.admin import main as broker_main  # a tool may import a wing

        return broker_main(args_list[1:])
    parser = _parser()
    try:
        args = parser.parse_args(args_list)
    except CommandError as e:
        return report(sys.stderr, e, parser.prog)
    _stop_on_signals()
    try:
        return int(args.run(args))
    except Stopped:
        return 0
    except CommandError as e:
        return report(sys.stderr, e, args.prog)
    except (OSError, http.client.HTTPException) as e:
        return report(sys.stderr, Failure(_describe(e)), args.prog)
    except Exception as e:  # never a traceback for an operator: one line, and the kind of fault
        return report(sys.stderr, Failure(f"unexpected {type(e).__name__}: {e}"), args.prog)


if __name__ == "__main__":
    sys.exit(main())
