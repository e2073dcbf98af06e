"""Issue 6 acceptance 4: ``relayd-admin`` as an operator runs it (a real subprocess).

``aep tail`` follows a real ``twistd -n relayd`` through a restart and prints every event exactly once;
``aep post`` feeds it; ``mcp connect`` lists and calls the tools of a page simulated in the test;
``status`` reports health and counts."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import tempfile
from typing import Any

from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from relayd.cli import UsageError
from relayd.cli.mcp import mcp_endpoints
from tests.support.aep import AEPRelay, event, ndjson
from tests.support.cases import cases, expand
from tests.support.command import Command
from tests.support.mcp import McpRelayCase
from tests.support.mcp_clients import PAGE_TOOLS, page_answer
from tests.support.sse import SSEClient
from tests.support.twistd import SYSTEMD_WRAPPER, RelaydProcess

TOKEN = "admin-tail-token-42"

# relayd/cli/__init__.py: every error is one line `PROG: error: WHAT` (argparse's own put the usage line first).
ERROR_LINE = re.compile(rb"^(relayd-admin(?: [a-z]+)*): error: \S[^\n]*$")


def assert_one_error(test: TestCase, command: Command, status: int, prog: str, what: bytes) -> None:
    """C{command} exited C{status} with one error line from C{prog} saying C{what}, and no traceback."""
    test.assertEqual(command.status, status, command.stderr)
    test.assertNotIn(b"Traceback", command.stderr)
    lines = command.stderr.decode().splitlines()
    if lines and lines[0].startswith("usage: "):  # argparse's usage errors only
        test.assertEqual(status, 2, command.stderr)
        lines = [line for line in lines if not line.startswith(" ")][1:]  # the usage may wrap
    test.assertEqual(len(lines), 1, command.stderr)
    match = ERROR_LINE.match(lines[0].encode())
    test.assertIsNotNone(match, command.stderr)
    assert match is not None
    test.assertEqual(match.group(1).decode(), prog)
    test.assertIn(what, command.stderr)


def _events(stdout: bytes) -> list[int]:
    return [json.loads(line)["seq"] for line in stdout.decode().splitlines()]


class TailAcrossRestart(TestCase):
    timeout = 90

    async def start_relay(self, sock: socket.socket) -> RelaydProcess:
        # The listening socket outlives each relayd, as under systemd socket activation: clients that
        # connect while relayd restarts wait in the kernel's backlog instead of being refused.
        proc = await RelaydProcess.start_for(
            self,
            ["--aep-listen", "systemd:domain=INET:name=relayd-aep", "--no-mcp"],
            env={"AEP_TOKEN": TOKEN},
            wrapper=SYSTEMD_WRAPPER,
            child_fds={3: sock.fileno()},
        )
        return proc

    async def post(self, url: str, seqs: range) -> None:
        poster = Command.admin("aep", "post", url, env={"AEP_TOKEN": TOKEN}, stdin=ndjson(*[event("S", i) for i in seqs]))
        self.assertEqual(await poster.finished(), 0, poster.stderr)
        self.assertIn(f"{len(seqs)} events accepted".encode(), poster.stderr)

    async def test_tail_resumes_without_gap_or_duplicate(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.addCleanup(sock.close)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"

        first = await self.start_relay(sock)
        tail = Command.admin("aep", "tail", url, "--session", "S", "--progress", "0", "--retry-max", "0.5",
                             env={"AEP_TOKEN": TOKEN})
        self.addCleanup(tail.stop)
        await tail.wait_stderr(rb"tail: connected to ")
        await self.post(url, range(0, 5))
        await tail.wait_stdout(rb'"seq":4')

        self.assertEqual(await first.terminate(signal.SIGTERM), 0)
        await tail.wait_stderr(rb"reconnecting")
        second = await self.start_relay(sock)
        # The emitter re-sends from 2 (as an SDK does with unacknowledged events); the restarted relay
        # holds 2..9. Whether the tail reconnects before or after this POST, it must print 5..9 once.
        await self.post(url, range(2, 10))
        await tail.wait_stdout(rb'"seq":9')
        await tail.wait_stderr(rb"resumed from S:0:4")
        await self.post(url, range(10, 11))  # and it is live again
        await tail.wait_stdout(rb'"seq":10')

        self.assertEqual(await tail.stop(signal.SIGTERM), 0)
        self.assertEqual(_events(tail.stdout), list(range(11)))
        self.assertNotIn(TOKEN.encode(), tail.stderr + tail.stdout)
        self.assertEqual(await second.terminate(signal.SIGTERM), 0)


class AdminAgainstInProcessAEP(TestCase):
    timeout = 30

    async def setUp(self) -> None:  # type: ignore[override]
        self.relay = await AEPRelay.start(aep_token=TOKEN)
        self.addCleanup(self.relay.stop)

    async def test_post_file_then_history_only_tail(self) -> None:
        directory = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, directory)
        path = os.path.join(directory, "events.ndjson")
        with open(path, "wb") as f:
            f.write(ndjson(*[event("A", i) for i in range(3)]) + b"\n\n" + ndjson(event("B", 0)))
        poster = Command.admin("aep", "post", self.relay.url, path, "--batch", "2", env={"AEP_TOKEN": TOKEN})
        self.assertEqual(await poster.finished(), 0, poster.stderr)
        self.assertIn(b"4 events accepted in 2 batches", poster.stderr)
        tail = Command.admin("aep", "tail", self.relay.url + "/stream", "--from", "all", "--no-live",
                             "--filter", '{"session":"A"}', "--token", TOKEN)
        self.assertEqual(await tail.finished(), 0, tail.stderr)
        self.assertEqual(_events(tail.stdout), [0, 1, 2])

    async def test_post_refusal_names_the_batch_and_exits_1(self) -> None:
        bad = ndjson(event("A", 0)) + b'{"aep":"0.1"}\n'
        poster = Command.admin("aep", "post", self.relay.url, env={"AEP_TOKEN": TOKEN}, stdin=bad)
        await poster.finished()
        assert_one_error(self, poster, 1, "relayd-admin aep post", b"refused: 400")
        self.assertIn(b"invalid-event", poster.stderr)

    async def test_tail_with_a_wrong_token_fails_with_1(self) -> None:
        tail = Command.admin("aep", "tail", self.relay.url, "--token", "wrong")
        await tail.finished()
        assert_one_error(self, tail, 1, "relayd-admin aep tail", b"/stream refused: 401")

    async def test_post_with_a_wrong_token_fails_with_1(self) -> None:
        poster = Command.admin("aep", "post", self.relay.url, "--token", "wrong", stdin=ndjson(event("A", 0)))
        await poster.finished()
        assert_one_error(self, poster, 1, "relayd-admin aep post", b"batch 1 (1 events) refused: 401")

    async def test_tail_prints_live_events_with_filter_and_capture(self) -> None:
        tail = Command.admin("aep", "tail", self.relay.url, "--filter", '{"session":"L"}', "--capture", "none",
                             env={"AEP_TOKEN": TOKEN})
        self.addCleanup(tail.stop)
        await tail.wait_stderr(rb"connected to")
        await self.relay.post(event("L", 0, data={"text": "secret words"}), event("M", 0), token=TOKEN)
        await tail.wait_stdout(rb"\n")
        printed = json.loads(tail.stdout.decode().splitlines()[0])
        self.assertEqual((printed["session"], printed["seq"], printed["capture"]), ("L", 0, "none"))
        self.assertNotIn("data", printed)  # the ceiling applied

    async def test_status_reports_counts_and_a_down_relay(self) -> None:
        from twisted.internet import reactor

        from relayd.base.clock import Timekeeper
        from relayd.web import metrics_listener

        service = metrics_listener.make_service(["tcp:0:interface=127.0.0.1"], reactor, Timekeeper(reactor))
        service.startService()
        self.addCleanup(service.stopService)
        (port,) = await service.ports()
        stream = await SSEClient.connect(self.relay.url + "/stream", {"authorization": f"Bearer {TOKEN}"})
        self.addCleanup(stream.close)
        await self.relay.post(event("Z", 0), token=TOKEN)
        status = Command.admin("status", "--aep", self.relay.url, "--metrics", f"http://127.0.0.1:{port.getHost().port}",
                               "--json", env={"AEP_TOKEN": TOKEN})
        self.assertEqual(await status.finished(), 0, status.stderr)
        report = json.loads(status.stdout)
        self.assertEqual(report["aep"]["up"], True)
        self.assertEqual((report["aep"]["sessions"], report["aep"]["subscribers"]), (1, 1))
        self.assertGreaterEqual(report["metrics"]["sessions"], 1)
        self.assertGreater(report["metrics"]["rss_bytes"], 0)

        down = Command.admin("status", "--aep", "http://127.0.0.1:9")
        self.assertEqual(await down.finished(), 1)
        self.assertIn(b"DOWN", down.stdout)


@expand
class McpConnect(McpRelayCase):
    """A page simulated over inbound SSE answers what ``relayd-admin mcp connect`` asks."""

    timeout = 30
    SESSION = "Ab3_x9Zq"
    TOKEN_ = "tok_abcdefghijklmnopqrstuvwxyz01"

    async def setUp(self) -> None:  # type: ignore[override]
        self.page_loop: Deferred[None] | None = None
        await super().setUp()
        await self.register(self.SESSION, self.TOKEN_)
        page = await self.events(self.SESSION, "&direction=inbound", token=self.TOKEN_)
        self.seen: list[dict[str, Any]] = []

        async def serve() -> None:
            while True:
                msg = await page.next(timeout=30)
                if msg is None:
                    return
                if msg.event != "mcp":
                    continue
                message = json.loads(msg.data or "")
                self.seen.append(message)
                reply = page_answer(message)
                if reply is not None:
                    r = await self.post(f"/{self.SESSION}/outbox?token={self.TOKEN_}", reply)
                    assert r.code == 200

        self.page_loop = Deferred.fromCoroutine(serve()).addErrback(lambda f: None)

    async def test_lists_the_page_tools(self) -> None:
        url = f"{self.base}/{self.SESSION}?token={self.TOKEN_}"
        connect = Command.admin("mcp", "connect", url)
        self.assertEqual(await connect.finished(), 0, connect.stderr)
        self.assertEqual(json.loads(connect.stdout)["result"]["tools"], PAGE_TOOLS)
        methods = [m.get("method") for m in self.seen if not m.get("method", "").startswith("notifications/peer_")]
        self.assertEqual(methods, ["initialize", "notifications/initialized", "tools/list"])

    async def test_calls_a_tool_with_the_token_from_the_environment(self) -> None:
        url = f"{self.base}/{self.SESSION}/events"
        connect = Command.admin("mcp", "connect", url, "call", "whiteboard_add_sticky", '{"x": 3}',
                                env={"MCP_TOKEN": self.TOKEN_})
        self.assertEqual(await connect.finished(), 0, connect.stderr)
        text = json.loads(connect.stdout)["result"]["content"][0]["text"]
        self.assertEqual(json.loads(text), {"name": "whiteboard_add_sticky", "arguments": {"x": 3}})

    async def test_the_pages_mcp_url_with_the_token_after_it_calls_a_tool(self) -> None:
        # The URL the demo page shows (the standard endpoint), --token after it, then `call`.
        url = f"{self.base}/{self.SESSION}/mcp"
        connect = Command.admin("mcp", "connect", url, "--token", self.TOKEN_, "call", "whiteboard_add_sticky", '{"x": 4}')
        self.assertEqual(await connect.finished(), 0, connect.stderr)
        text = json.loads(connect.stdout)["result"]["content"][0]["text"]
        self.assertEqual(json.loads(text), {"name": "whiteboard_add_sticky", "arguments": {"x": 4}})

    @cases(tools=("tools",), call=("call", "whiteboard_add_sticky"))
    async def test_the_token_may_follow_the_subcommand(self, *command: str) -> None:
        url = f"{self.base}/{self.SESSION}/sse"
        connect = Command.admin("mcp", "connect", url, *command, "--token", self.TOKEN_)
        self.assertEqual(await connect.finished(), 0, connect.stderr)
        self.assertIn("result", json.loads(connect.stdout))

    async def test_works_on_a_session_a_standard_client_uses(self) -> None:
        # A standard client's session is open on the tunnel session (a labelled reader): replies are
        # routed per label from then on, and the tool's own requests still find their way back.
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
        reply = await self.post(f"/{self.SESSION}/mcp", init, authorization=f"Bearer {self.TOKEN_}",
                                accept="application/json, text/event-stream")
        self.assertEqual(reply.code, 200, reply.body)
        self.assertTrue(reply.headers.getRawHeaders(b"mcp-session-id"))
        connect = Command.admin("mcp", "connect", f"{self.base}/{self.SESSION}?token={self.TOKEN_}", "--timeout", "5")
        self.assertEqual(await connect.finished(), 0, connect.stderr)
        self.assertEqual(json.loads(connect.stdout)["result"]["tools"], PAGE_TOOLS)

    async def test_a_wrong_token_is_refused(self) -> None:
        connect = Command.admin("mcp", "connect", f"{self.base}/{self.SESSION}?token=nope")
        await connect.finished()
        assert_one_error(self, connect, 1, "relayd-admin mcp connect", b"events stream refused: 401")


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


@expand
class ErrorsInOneFormat(TestCase):
    """Issue 11: every relayd-admin command reports a bad command line (2) or a failure (1) as argparse
    does, one line on stderr, never a traceback. {dir} is an empty temporary directory, {closed} a
    port nothing listens on."""

    timeout = 30

    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="relayd-admin-errors-")
        self.addCleanup(shutil.rmtree, self.dir)

    def argv(self, args: tuple[str, ...]) -> list[str]:
        closed = str(_closed_port())
        return [a.replace("{dir}", self.dir).replace("{closed}", closed) for a in args]

    @cases(
        unknown_tool=(("frobnicate",), "relayd-admin", b"invalid choice: 'frobnicate'"),
        no_tool=((), "relayd-admin", b"the following arguments are required"),
        tail_max_from_zero=(("aep", "tail", "--max-from", "0"), "relayd-admin aep tail",
                            b"argument --max-from: '0' must be a positive integer"),
        tail_filter_not_json=(("aep", "tail", "--filter", "{bad"), "relayd-admin aep tail", b"--filter is not JSON"),
        tail_filter_not_object=(("aep", "tail", "--filter", "[1]", "--session", "S"), "relayd-admin aep tail",
                                b"--filter must be a JSON object"),
        tail_zero_retry_max=(("aep", "tail", "--retry-max", "0"), "relayd-admin aep tail",
                             b"argument --retry-max: '0' must be more than 0 seconds"),
        tail_bad_from=(("aep", "tail", "--from", "yesterday"), "relayd-admin aep tail", b'--from must be "all"'),
        tail_not_http=(("aep", "tail", "ftp://host/"), "relayd-admin aep tail", b"not an http(s) URL"),
        post_negative_retries=(("aep", "post", "--retries", "-1"), "relayd-admin aep post",
                               b"argument --retries: '-1' must be 0 or more"),
        post_batch_not_int=(("aep", "post", "--batch", "ten"), "relayd-admin aep post",
                            b"argument --batch: 'ten' is not an integer"),
        post_missing_file=(("aep", "post", "http://127.0.0.1:{closed}", "{dir}/none.ndjson"),
                           "relayd-admin aep post", b"argument file: can't open"),
        # `aep post FILE` (docs/deployment.md): one positional that is not a URL is the file.
        post_file_alone=(("aep", "post", "{dir}/none.ndjson"), "relayd-admin aep post", b"argument file: can't open"),
        connect_no_token=(("mcp", "connect", "http://127.0.0.1:{closed}/r/S"), "relayd-admin mcp connect",
                          b"no token in URL"),
        connect_bad_command=(("mcp", "connect", "http://127.0.0.1:{closed}/r/S?token=t", "dance"),
                             "relayd-admin mcp connect", b"invalid choice: 'dance'"),
        connect_call_bad_json=(("mcp", "connect", "http://127.0.0.1:{closed}/r/S?token=t", "call", "t", "{bad"),
                               "relayd-admin mcp connect", b"call ARGUMENTS is not JSON"),
        connect_send_not_object=(("mcp", "connect", "http://127.0.0.1:{closed}/r/S?token=t", "send", "[1]"),
                                 "relayd-admin mcp connect", b"send FRAME must be a JSON object"),
        connect_call_without_name=(("mcp", "connect", "http://127.0.0.1:{closed}/r/S?token=t", "call"),
                                   "relayd-admin mcp connect", b"call needs a tool name"),
        connect_zero_timeout=(("mcp", "connect", "http://x/r/S?token=t", "--timeout", "0"),
                              "relayd-admin mcp connect", b"argument --timeout: '0' must be more than 0 seconds"),
        status_not_http=(("status", "--aep", "ftp://host/"), "relayd-admin status", b"not an http(s) URL"),
        broker_no_command=(("broker",), "relayd-admin broker", b"the following arguments are required"),
        broker_issue_no_agent=(("broker", "issue", "--state-dir", "{dir}"), "relayd-admin broker issue",
                               b"the following arguments are required: --agent"),
        broker_issue_needs_a_channel=(("broker", "issue", "--state-dir", "{dir}", "--agent", "a"),
                                      "relayd-admin broker issue", b"--channel is required for agents.create"),
        broker_issue_unknown_action=(("broker", "issue", "--state-dir", "{dir}", "--agent", "a", "--actions", "sign"),
                                     "relayd-admin broker issue", b"--actions: unknown action 'sign'"),
        broker_issue_bad_expiry=(("broker", "issue", "--state-dir", "{dir}", "--agent", "a", "--actions",
                                  "profile.set", "--expires", "soon"), "relayd-admin broker issue", b"--expires: "),
        broker_kek_file_unreadable=(("broker", "issue", "--state-dir", "{dir}", "--agent", "a", "--actions",
                                     "profile.set", "--kek-file", "{dir}"),
                                    "relayd-admin broker issue", b"--kek-file: cannot read (Is a directory)"),
        broker_revoke_both=(("broker", "revoke", "--state-dir", "{dir}", "--id", "1", "--agent", "a"),
                            "relayd-admin broker revoke", b"not allowed with argument"),
    )
    async def test_usage_error_exits_2(self, args: tuple[str, ...], prog: str, what: bytes) -> None:
        command = Command.admin(*self.argv(args))
        await command.finished()
        assert_one_error(self, command, 2, prog, what)

    @cases(
        post_unreachable=(("aep", "post", "http://127.0.0.1:{closed}", "--retries", "0"), "relayd-admin aep post",
                          b"batch 1 (1 events) got no answer (Connection refused); 0 events accepted before it"),
        connect_unreachable=(("mcp", "connect", "http://127.0.0.1:{closed}/r/S?token=t", "--timeout", "5"),
                             "relayd-admin mcp connect", b"events stream: Connection refused"),
        broker_list_missing_state_dir=(("broker", "list", "--state-dir", "{dir}/none"), "relayd-admin broker list",
                                       b"no broker state in "),
        broker_revoke_missing_state_dir=(("broker", "revoke", "--state-dir", "{dir}/none", "--id", "1"),
                                         "relayd-admin broker revoke", b"no broker state in "),
        broker_revoke_unknown_agent=(("broker", "revoke", "--state-dir", "{dir}", "--agent", "nobody"),
                                     "relayd-admin broker revoke", b"no agent 'nobody'"),
        broker_state_not_a_database=(("broker", "list", "--state-dir", "{dir}"), "relayd-admin broker list",
                                     b"database"),
    )
    async def test_failure_exits_1(self, args: tuple[str, ...], prog: str, what: bytes) -> None:
        if args[-1:] == ("{dir}",) and args[1] == "list":
            with open(os.path.join(self.dir, "broker.sqlite3"), "wb") as f:
                f.write(b"not a database\n" * 512)  # a state file something else overwrote
        command = Command.admin(*self.argv(args), stdin=ndjson(event("A", 0)))
        await command.finished()
        assert_one_error(self, command, 1, prog, what)

    async def test_state_dir_is_not_created_by_list(self) -> None:
        missing = os.path.join(self.dir, "typo")
        command = Command.admin("broker", "list", "--state-dir", missing)
        self.assertEqual(await command.finished(), 1)
        self.assertFalse(os.path.exists(missing))


# mcp-relay.md §10.1: deriving the endpoints from a URL (the npx CLI's eight cases).


@expand
class ShareURLTests(TestCase):
    def test_share_url(self) -> None:
        e = mcp_endpoints("https://h.example/whiteboard?session=ABC&token=XYZ")
        assert e.url("inbox") == "https://h.example/agent-relay/ABC/inbox?token=XYZ"
        assert e.url("events", "&direction=outbound") == "https://h.example/agent-relay/ABC/events?token=XYZ&direction=outbound"

    def test_key_alias(self) -> None:
        assert mcp_endpoints("https://h.example/x?session=S&key=K").token == "K"

    def test_direct_path_with_events_stripped(self) -> None:
        e = mcp_endpoints("https://h.example/mcp-relay/S1/events?token=T")
        assert (e.base, e.session) == ("https://h.example/mcp-relay", "S1")

    def test_explicit_token_wins(self) -> None:
        assert mcp_endpoints("https://h.example/r/S?token=URL", token="EXPLICIT").token == "EXPLICIT"

    def test_custom_relay_path(self) -> None:
        assert mcp_endpoints("https://h.example/?session=S&token=T", relay_path="/custom/").base == "https://h.example/custom"

    def test_token_is_url_encoded(self) -> None:
        assert mcp_endpoints("https://h.example/r/S", token="a/b").url("inbox").endswith("?token=a%2Fb")

    def test_missing_token(self) -> None:
        with self.assertRaises(UsageError, match="(?i)token"):
            mcp_endpoints("https://h.example/r/S")

    @cases(mcp=("mcp",), sse=("sse",), messages=("messages",), inbox=("inbox",), outbox=("outbox",))
    def test_the_standard_endpoints_url_names_its_session(self, leg: str) -> None:
        e = mcp_endpoints(f"https://h.example/r/S1/{leg}?token=T")
        assert (e.base, e.session) == ("https://h.example/r", "S1")

    def test_missing_session(self) -> None:
        with self.assertRaises(UsageError, match="(?i)session"):
            mcp_endpoints("https://h.example/?token=T")
