"""C{relayd-admin aep tail|post}: follow an AEP relay's stream, post events to it.

    relayd-admin aep tail [URL] [--filter JSON] [--session S] [--capture LEVEL] [--from all|JSON] [--no-live]
    relayd-admin aep post [URL] [FILE]            # NDJSON events from FILE or stdin

The token comes from C{--token} or C{AEP_TOKEN} and goes as C{Authorization: Bearer}, never in a URL.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import sys
import urllib.parse
from dataclasses import dataclass, field
from typing import IO, Any, Iterator

from relayd.base.clock import BlockingClock
from relayd.cli import Failure, UsageError, non_negative_int, positive_int, positive_seconds, seconds
from relayd.cli.client import (
    CACERT_HELP,
    DEFAULT_AEP,
    Stopped,
    Target,
    auth,
    describe,
    request,
    without_suffix,
)

_ID = re.compile(r"(.+):([0-9]+):([0-9]+)")


def add_parser(tools: Any) -> None:
    """Add C{aep tail} and C{aep post} to C{relayd-admin}'s subcommands (C{tools})."""
    aep = tools.add_parser("aep", help="AEP relay: tail a stream, post events")
    aep_sub = aep.add_subparsers(dest="command", required=True, metavar="{tail,post}")
    cmd = aep_sub.add_parser("tail", help="Print events as they arrive; reconnects and resumes by position")
    cmd.add_argument("url", nargs="?", default=DEFAULT_AEP, help="Relay base URL")
    cmd.add_argument("--token", help="Bearer token [default: $AEP_TOKEN]")
    cmd.add_argument("--filter", help='Attribute-match filter, a JSON object, e.g. {"severity":["warning","error"]}')
    cmd.add_argument("--session", help="Only this session (added to --filter)")
    cmd.add_argument("--capture", help="Capture ceiling: none, metadata, redacted or full [default: the relay's]")
    cmd.add_argument("--from", dest="start", help='Replay first: "all" or a JSON array of {session, epoch, seq}')
    cmd.add_argument("--no-live", action="store_true", help="History only: stop at replay-complete")
    cmd.add_argument("--max-from", type=positive_int, default=100, metavar="N",
                     help="Most session positions sent when resuming")
    cmd.add_argument("--retry-max", type=positive_seconds, default=5.0, metavar="SECONDS",
                     help="Longest reconnect delay in seconds")  # 0 would reconnect in a busy loop
    cmd.add_argument("--progress", type=seconds, default=10.0, metavar="SECONDS",
                     help="Seconds between progress lines on stderr (0: none)")
    cmd.add_argument("--cacert", metavar="FILE", help=CACERT_HELP)
    cmd.set_defaults(run=tail, prog=cmd.prog)

    cmd = aep_sub.add_parser("post", help="Post NDJSON events from a file or stdin")
    cmd.add_argument("url", nargs="?", default=DEFAULT_AEP, help="Relay base URL")
    cmd.add_argument("file", nargs="?", help="NDJSON file [default: stdin]")
    cmd.add_argument("--token", help="Bearer token [default: $AEP_TOKEN]")
    cmd.add_argument("--batch", type=positive_int, default=100, metavar="N", help="Most events per POST")
    cmd.add_argument("--max-bytes", type=positive_int, default=1024 * 1024, metavar="BYTES",
                     help="Most bytes per POST")
    cmd.add_argument("--retries", type=non_negative_int, default=3, metavar="N",
                     help="Retries of a batch on connection errors and 5xx answers")
    cmd.add_argument("--cacert", metavar="FILE", help=CACERT_HELP)
    cmd.set_defaults(run=post, prog=cmd.prog)


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
    clock: BlockingClock = field(default_factory=BlockingClock)
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
                self.clock.sleep(delay)  # a CLI's reconnect backoff
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
            headers = {"accept": "text/event-stream", **auth(self.token)}
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
                self.report_progress()
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

    def report_progress(self, force: bool = False) -> None:
        """A progress line on stderr, at most every C{progress_every} seconds (C{force}: now)."""
        now = self.clock.monotonic()
        if not force and (not self.progress_every or now - self._last_progress < self.progress_every):
            return
        self._last_progress = now
        last = ""
        if self.positions:
            session, (epoch, seq) = next(reversed(self.positions.items()))
            last = f", last {session}:{epoch}:{seq}"
        self.say(f"{self.printed} events, {len(self.positions)} sessions{last}")


def tail(args: argparse.Namespace, clock: BlockingClock) -> int:
    """C{relayd-admin aep tail}."""
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
    follower = Tail(
        Target.parse(without_suffix(args.url, "/stream"), args.cacert),
        args.token or os.environ.get("AEP_TOKEN") or None,
        filter=flt,
        capture=args.capture,
        start=start,
        live=not args.no_live,
        max_from=args.max_from,
        retry_max=args.retry_max,
        progress_every=args.progress,
        clock=clock,
    )
    try:
        return follower.run()
    except Stopped:
        follower.report_progress(force=True)
        return 0


# aep post ----------------------------------------------------------------------------------------


def post(args: argparse.Namespace, clock: BlockingClock) -> int:
    """C{relayd-admin aep post}."""
    if args.file is None and args.url != DEFAULT_AEP and "://" not in args.url:
        # `aep post events.ndjson`: one positional that is not a URL is the file, the relay the default.
        args.file, args.url = args.url, DEFAULT_AEP
    target = Target.parse(without_suffix(args.url, "/events"), args.cacert)
    token = args.token or os.environ.get("AEP_TOKEN") or None
    from_stdin = args.file in (None, "-")
    try:
        fd = sys.stdin.fileno() if from_stdin else os.open(args.file, os.O_RDONLY)
    except OSError as e:  # as argparse reports a file argument it cannot open
        raise UsageError(f"argument file: can't open {args.file!r}: {e.strerror}") from None
    headers = {"aep-version": "0.1", "content-type": "application/x-ndjson", **auth(token)}
    sent = batches = 0
    try:
        for batch in _batches(_lines(fd), args.batch, args.max_bytes):
            for attempt in range(args.retries + 1):
                try:
                    status, body = request(target, "POST", "/events", b"".join(batch), headers)
                except (OSError, http.client.HTTPException) as e:
                    status, body = 0, describe(e).encode()
                if status == 202 or (status and status < 500) or attempt == args.retries:
                    break
                clock.sleep(min(5.0, 0.2 * 2**attempt))  # a CLI's retry backoff
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
