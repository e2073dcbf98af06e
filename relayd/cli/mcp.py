"""C{relayd-admin mcp connect}: act as an MCP client of a session on the MCP tunnel relay.

    relayd-admin mcp connect URL [tools | call NAME [ARGS] | send FRAME | watch]

The token comes from C{--token}, C{MCP_TOKEN}, or the URL's C{?token=} or C{?key=}.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import secrets
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

import relayd
from relayd.base.clock import BlockingClock
from relayd.cli import Failure, UsageError, positive_seconds
from relayd.cli.client import CACERT_HELP, Target, describe


def add_parser(tools: Any) -> None:
    """Add C{mcp connect} to C{relayd-admin}'s subcommands (C{tools})."""
    mcp = tools.add_parser("mcp", help="MCP tunnel relay: act as an MCP client")
    mcp_sub = mcp.add_subparsers(dest="subcommand", required=True, metavar="{connect}")
    cmd = mcp_sub.add_parser("connect", help="Initialize, then tools/list (the default), tools/call, send or watch")
    cmd.add_argument("url", help="Session URL: the demo page's .../<session>/mcp, a share URL with ?session=, "
                     "or .../<session>[/inbox|events]")
    cmd.add_argument("command", nargs="?", default="tools", choices=("tools", "call", "send", "watch"),
                     help="What to do once initialized")
    cmd.add_argument("args", nargs="*", help="For call: NAME [ARGUMENTS-JSON]; for send: FRAME-JSON")
    cmd.add_argument("--token", help="Session token [default: $MCP_TOKEN, then the URL's ?token= or ?key=]")
    cmd.add_argument("--relay", metavar="PATH",
                     help="Relay path of a share URL [default: $MCP_RELAY_PATH, else agent-relay]")
    cmd.add_argument("--timeout", type=positive_seconds, default=15.0, metavar="SECONDS",
                     help="Seconds to wait for each answer")
    cmd.add_argument("--cacert", metavar="FILE", help=CACERT_HELP)
    # Options may follow COMMAND and its ARGS (relayd.cli.admin parses this command intermixed).
    cmd.set_defaults(run=connect, prog=cmd.prog, intermixed=cmd)


@dataclass(frozen=True)
class McpEndpoints:
    """The session's URLs, derived as the MCP relay's clients do (docs/mcp.md)."""

    base: str
    session: str
    token: str

    def url(self, leg: str, query: str = "") -> str:
        token = urllib.parse.quote(self.token, safe="")
        return f"{self.base}/{self.session}/{leg}?token={token}{query}"


# The last segment of a session's URLs: the tunnel's legs and the standard endpoint's (docs/mcp.md).
_LEGS = frozenset(("inbox", "events", "outbox", "poll", "mcp", "sse", "messages"))


def mcp_endpoints(url: str, token: str | None = None, relay_path: str = "agent-relay") -> McpEndpoints:
    """An explicit token wins, then C{?token=}, then C{?key=}; a share URL (C{?session=}) names the relay
    path; a direct path drops a trailing leg (C{inbox}, C{events}, C{outbox}, or the standard endpoint's
    C{mcp}, C{sse}, C{messages}: the URL the demo page shows) and ends with the session."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qs(parts.query)
    token = token or next(iter(query.get("token") or query.get("key") or []), None)
    if not token:
        raise UsageError("no token in URL and --token / MCP_TOKEN unset")
    origin = f"{parts.scheme}://{parts.netloc}"
    if "session" in query:
        return McpEndpoints(origin + "/" + relay_path.strip("/"), query["session"][0], token)
    segments = [s for s in parts.path.split("/") if s]
    if segments and segments[-1] in _LEGS:
        segments.pop()
    if not segments:
        raise UsageError("could not determine session id from URL")
    session = segments.pop()
    return McpEndpoints(origin + ("/" + "/".join(segments) if segments else ""), session, token)


class McpSession:
    """An MCP client over the relay: SSE outbound for answers, POST inbox for requests.

    Both legs carry a C{client=} label of this run's own: once a labelled reader (any standard
    client's session) is on the session, the relay routes each reply only to its asker's label
    (docs/decisions.md MCP-6), so an unlabelled tool would never hear its answers.
    """

    def __init__(
        self, endpoints: McpEndpoints, cacert: str | None = None, timeout: float = 15.0,
        clock: BlockingClock | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.cacert = cacert
        self.timeout = timeout
        self.clock = clock or BlockingClock()
        self.frames: queue.Queue[Any] = queue.Queue()
        self._opened = threading.Event()
        self._error: list[str] = []
        self._conn: http.client.HTTPConnection | None = None
        self.label = "relayd-admin-" + secrets.token_hex(6)

    def open(self) -> None:
        """Open the outbound SSE leg and wait until the relay has answered its headers."""
        threading.Thread(target=self._listen, daemon=True).start()
        if not self._opened.wait(self.timeout) or self._error:
            raise Failure(self._error[0] if self._error else "the events stream did not open")

    def _listen(self) -> None:
        url = self.endpoints.url("events", "&direction=outbound&client=" + self.label)
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
            self._error.append(f"events stream: {describe(e)}")
            self._opened.set()
        finally:
            self.frames.put(None)

    def send(self, frame: dict[str, Any]) -> None:
        body = json.dumps(frame, separators=(",", ":")).encode()
        url = self.endpoints.url("inbox", "&client=" + self.label)
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
        deadline = self.clock.monotonic() + self.timeout
        while True:
            remaining = deadline - self.clock.monotonic()
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


def connect(args: argparse.Namespace, clock: BlockingClock) -> int:
    """C{relayd-admin mcp connect}."""
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
    session = McpSession(endpoints, args.cacert, args.timeout, clock)
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
