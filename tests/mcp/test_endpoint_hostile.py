"""Hostile input on the standard endpoint of a real relayd: every answer is a documented status, never
a 500, a hang or a traceback in the log; the relay still serves an SDK-shaped exchange afterwards."""

from __future__ import annotations

from twisted.internet import threads
from twisted.trial.unittest import TestCase

from tests.support.http import HttpClient
from tests.support.mcp import assert_clean_log, start_mcp_process
from tests.support.raw import first_response, raw_request

TOKEN = b"hostile_token_0123456789abcdef"
SESSION = b"hostile1"
AUTH = (b"authorization", b"Bearer " + TOKEN)
ACCEPT = (b"accept", b"application/json, text/event-stream")
INIT = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{}}}'


class HostileEndpoint(TestCase):
    timeout = 120

    async def test_hostile_requests_get_documented_statuses(self) -> None:
        proc = await start_mcp_process(self)
        port = proc.port("mcp")
        http = HttpClient.on_port(self, port)
        assert (await http.post("/register", b'{"session":"hostile1","token":"%s"}' % TOKEN)).code == 200
        mcp = b"/" + SESSION + b"/mcp"
        tools_list = b'{"jsonrpc":"2.0","id":2,"method":"tools/list"}'
        cases: list[tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes | None, set[int]]] = [
            (b"POST", mcp, [AUTH, ACCEPT], b"", {400}),
            (b"POST", mcp, [AUTH, ACCEPT], b"[]", {400}),
            (b"POST", mcp, [AUTH, ACCEPT], b"\xff\xfe{", {400}),
            (b"POST", mcp, [AUTH, ACCEPT], b'{"jsonrpc":"2.0","id":{"a":[1,2]},"method":"x"}', {400}),
            (b"POST", mcp, [AUTH, ACCEPT], b"[" * 5000 + b"]" * 5000, {400}),
            (b"POST", mcp, [AUTH, ACCEPT, (b"mcp-session-id", b"\xff\x00bad")], tools_list, {400, 404}),
            (b"POST", mcp, [AUTH, ACCEPT, (b"mcp-session-id", b"x" * 4000)], tools_list, {404}),
            (b"POST", mcp, [AUTH, ACCEPT, (b"mcp-protocol-version", b"\xff\xff")], tools_list, {400}),
            (b"POST", mcp, [AUTH, ACCEPT, (b"mcp-protocol-version", b"2026-07-28"), (b"mcp-method", b"\xff")],
             b'{"jsonrpc":"2.0","id":3,"method":"tools/list","params":{"_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28"}}}',
             {400}),
            (b"POST", mcp, [AUTH, ACCEPT, (b"mcp-protocol-version", b"2026-07-28")],
             b'{"jsonrpc":"2.0","id":3,"method":"tools/list","params":[1]}', {400}),
            (b"GET", mcp, [AUTH, (b"accept", b"text/event-stream"), (b"mcp-session-id", b"nope"),
                           (b"last-event-id", b"\xff-99999999999999999999999")], None, {404}),
            (b"DELETE", mcp, [AUTH], None, {400}),
            (b"PUT", mcp, [AUTH], b"{}", {405}),
            (b"POST", b"/" + SESSION + b"/messages?sessionId=%00%ff", [AUTH], tools_list, {404}),
            (b"POST", b"/" + SESSION + b"/sse", [AUTH], tools_list, {405}),
            (b"POST", mcp, [(b"authorization", b"Bearer \xff\xfe")], INIT, {401}),
            (b"POST", mcp, [(b"authorization", b"Basic abc")], INIT, {401}),
            (b"POST", b"/nosuchsess/mcp", [AUTH], INIT, {410}),
            (b"OPTIONS", mcp, [], None, {204}),
        ]
        for method, target, headers, body, expected in cases:
            status, _, answer = await threads.deferToThread(first_response, port, raw_request(method, target, headers, body))
            assert status in expected, (method, target, headers, body[:80] if body else body, status, answer[:300])
        await assert_clean_log(self, proc, http)
