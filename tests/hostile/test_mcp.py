"""Hostile input to the MCP tunnel relay, against a real ``twistd -n relayd`` over real sockets.

- Values a client chooses (lone surrogates, numbers of any size, line breaks, thousands of digits)
  get a documented 4xx or are handled; never a 500; nothing a client sends breaks SSE framing.
- Frames held for absent readers (first-frame backlogs, poll queues) have one process-wide byte
  bound, C{--mcp-max-buffered-bytes} (deployment-wide with C{--redis}): exactly the bound is
  accepted, one byte over is C{503 buffer_full} with C{Retry-After}.
- HEAD works wherever GET does; a known path answers other methods with a JSON 405 and C{Allow};
  unknown paths are a JSON 404; media types are case-insensitive.
- Memory stays within the documented bounds for each kind of client that never reads.
- A hypothesis property: malformed requests on every route never get a 5xx, always an answer.
"""

from __future__ import annotations

import json
import socket
import urllib.parse
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from tests.support.connections import (
    HeldConnection,
    SingleUseFactory,
    close_all,
    memory,
    open_many,
    require_open_files,
    sse_request,
)
from tests.support.http import HttpClient
from tests.support.mcp import assert_clean_log, start_mcp_process, until_store_answers
from tests.support.metrics import scrape, value
from tests.support.raw import first_response, raw_request
from tests.support.redis import redis_flags, shared_redis
from tests.support.sse import Message, SSEClient

TOKEN = "hostile_abcdefghijklmnopqrstuv"
MiB = 1024 * 1024


def frame(n: int, method: str = "p") -> bytes:
    """A valid JSON-RPC notification of exactly C{n} bytes (at least 42)."""
    head = b'{"jsonrpc":"2.0","method":"' + method.encode() + b'","params":"'
    pad = n - len(head) - 2
    assert pad >= 0, n
    return head + b"x" * pad + b'"}'


def poll_form(raw: bytes) -> bytes:
    """A frame as a poll queue holds it (a JSON string literal): what the buffered bound counts."""
    return orjson.dumps(raw.decode("utf-8"))


async def register(http: HttpClient, session: str, token: str = TOKEN) -> None:
    reply = await http.post("/register", json.dumps({"session": session, "token": token}).encode())
    assert reply.code == 200, reply.body


async def poll(http: HttpClient, session: str, query: str = "") -> Any:
    reply = await http.get(f"/{session}/poll?token={TOKEN}&wait=0{query}")
    assert reply.code == 200, (reply.code, reply.body)
    return reply.json()


async def next_mcp(stream: SSEClient) -> Message:
    while True:
        msg = await stream.next()
        assert msg is not None, "stream ended"
        if msg.event == "mcp":
            return msg


# Defect 4: every value a client chooses is handled -------------------------------------------------


class ClientChosenValues(TestCase):
    """Lone surrogates, numbers of any size and shape, line breaks and endless digits: never a 500."""

    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.proc = await start_mcp_process(self)
        self.http = HttpClient.on_port(self, self.proc.port("mcp"))
        self.streams: list[SSEClient] = []
        await register(self.http, "sess-h")

    async def tearDown(self) -> None:  # type: ignore[override]
        for stream in self.streams:
            await stream.close()

    async def events(self, query: str) -> SSEClient:
        stream = await SSEClient.connect(f"{self.http.base}/sess-h/events?token={TOKEN}{query}")
        self.streams.append(stream)
        self.assertEqual(stream.code, 200)
        return stream

    async def test_inbox_request_with_a_lone_surrogate_id_is_relayed(self) -> None:
        raw = b'{"jsonrpc":"2.0","id":"\\ud800","method":"tools/call"}'
        # Unlabelled, labelled, and a second labelled client with the same id (rewritten, then restored).
        for query in ("", "&client=a", "&client=b"):
            reply = await self.http.post(f"/sess-h/inbox?token={TOKEN}{query}", raw)
            self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'), query)
        frames = (await poll(self.http, "sess-h"))["frames"]
        self.assertEqual(frames[:2], [raw.decode(), raw.decode()])
        rewritten = json.loads(frames[2])
        self.assertTrue(rewritten["id"].startswith("relayd-"))
        await assert_clean_log(self, self.proc, self.http)

    async def test_unlabelled_request_reusing_a_labelled_pending_id_cannot_take_its_reply(self) -> None:
        agent_a = await self.events("&direction=outbound&client=a")
        request = b'{"jsonrpc":"2.0","id":5,"method":"tools/call"}'
        for query in ("&client=a", ""):  # a asks; an unlabelled poster reuses a's pending id
            reply = await self.http.post(f"/sess-h/inbox?token={TOKEN}{query}", request)
            self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'), query)
        asked = [json.loads(f)["id"] for f in (await poll(self.http, "sess-h"))["frames"] if '"id"' in f]
        self.assertEqual(asked[0], 5)
        self.assertNotEqual(asked[1], 5)  # the page never sees one id twice
        for id_, result in ((asked[1], "for the unlabelled poster"), (asked[0], "for a")):
            body = json.dumps({"jsonrpc": "2.0", "id": id_, "result": result}).encode()
            reply = await self.http.post(f"/sess-h/outbox?token={TOKEN}", body)
            self.assertEqual(reply.code, 200)
        self.assertEqual((await next_mcp(agent_a)).json(), {"jsonrpc": "2.0", "id": 5, "result": "for a"})
        await assert_clean_log(self, self.proc, self.http)

    async def test_outbox_response_with_a_lone_surrogate_id_is_relayed(self) -> None:
        agent_a = await self.events("&direction=outbound&client=a")
        agent_b = await self.events("&direction=outbound&client=b")
        request = b'{"jsonrpc":"2.0","id":"\\udfff","method":"tools/call"}'
        for label in ("a", "b"):
            reply = await self.http.post(f"/sess-h/inbox?token={TOKEN}&client={label}", request)
            self.assertEqual(reply.code, 200)
        first, second = [json.loads(f) for f in (await poll(self.http, "sess-h"))["frames"][-2:]]
        self.assertEqual(first["id"], "\udfff")
        # The page answers both; each agent gets its own reply, under the id it sent.
        for asked, result in ((first["id"], "A"), (second["id"], "B")):
            body = json.dumps({"jsonrpc": "2.0", "id": asked, "result": result}).encode()  # \\udfff escaped
            reply = await self.http.post(f"/sess-h/outbox?token={TOKEN}", body)
            self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'))
        got_a, got_b = (await next_mcp(agent_a)).json(), (await next_mcp(agent_b)).json()
        self.assertEqual((got_a["id"], got_a["result"]), ("\udfff", "A"))
        self.assertEqual((got_b["id"], got_b["result"]), ("\udfff", "B"))
        await assert_clean_log(self, self.proc, self.http)

    async def test_frame_with_line_breaks_and_a_lone_surrogate_reaches_an_open_stream_on_one_line(self) -> None:
        page = await self.events("")
        raw = (
            b'{"jsonrpc":"2.0",\r\n "method":"notifications/x",\n "params":'
            b'{"s":"\\ud800\\u2028\\u0000\\ufeff","n":1e400,"big":123456789012345678901234567890}\r}'
        )
        reply = await self.http.post(f"/sess-h/inbox?token={TOKEN}", raw)
        self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'))
        msg = await next_mcp(page)
        self.assertEqual(msg.fields, ["event", "data"])
        # Only the line breaks (whitespace between tokens) are gone: every value is as posted.
        self.assertEqual(msg.data, raw.replace(b"\r", b"").replace(b"\n", b"").decode())
        self.assertEqual(json.loads(msg.data or ""), json.loads(raw))
        for line in page.received.split(b"\n"):
            self.assertTrue(line == b"" or line.startswith((b"event: ", b"data: ", b"retry: ", b": ")), line)
        await assert_clean_log(self, self.proc, self.http)

    async def test_poll_wait_of_any_shape_is_clamped(self) -> None:
        await self.http.post(f"/sess-h/inbox?token={TOKEN}", frame(64))
        # Thousands of digits: the longest wait (25 s), answered at once because a frame is queued.
        reply = await self.http.get(f"/sess-h/poll?token={TOKEN}&wait={'1' * 5000}")
        self.assertEqual(reply.code, 200, reply.body)
        self.assertEqual(reply.json()["frames"], [frame(64).decode()])
        subscriber = reply.json()["subscriber"]
        # Everything else means no wait (or 1 ms): each answers with nothing queued.
        for wait in ("-" + "9" * 5000, "0" * 5000 + "1", "1e999", "Infinity", "NaN", "%D9%A3", "+", "", "%20%201",
                     "%00", "%FF%FE", "-0", "0x10"):
            reply = await self.http.get(f"/sess-h/poll?token={TOKEN}&subscriber={subscriber}&wait={wait}")
            self.assertEqual((reply.code, reply.json()), (200, {"subscriber": subscriber, "frames": []}), wait)
        await assert_clean_log(self, self.proc, self.http)

    async def test_numbers_of_any_size_and_shape_in_every_json_field(self) -> None:
        huge = ["9" * 5000, "-" + "9" * 5000, "1e400", "-1e400", "1.5e-400", "-0", "18446744073709551616",
                "1E+2", "0.1", "123456789012345678901234567890"]
        for number in huge:
            for body in (
                f'{{"session":{number},"token":"{TOKEN}"}}',
                f'{{"session":"sess-n","token":{number}}}',
            ):
                reply = await self.http.post("/register", body.encode())
                self.assertEqual((reply.code, reply.json()), (400, {"error": "missing_fields"}), body[:40])
        reply = await self.http.post("/register", b"9" * 5000)
        self.assertEqual((reply.code, reply.json()), (400, {"error": "missing_fields"}))
        # Extra fields holding any number are ignored.
        body = f'{{"session":"sess-n","token":"{TOKEN}","x":{"9" * 5000},"y":1e400}}'.encode()
        self.assertEqual((await self.http.post("/register", body)).code, 200)
        # A frame's id and params may hold any number: relayed as posted, never refused for it.
        page = (await poll(self.http, "sess-n"))["subscriber"]
        for number in huge:
            raw = f'{{"jsonrpc":"2.0","id":{number},"method":"x","params":[{number}]}}'.encode()
            reply = await self.http.post(f"/sess-n/inbox?token={TOKEN}", raw)
            self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'), number[:20])
            self.assertEqual((await poll(self.http, "sess-n", f"&subscriber={page}"))["frames"], [raw.decode()])
            reply = await self.http.post(
                f"/sess-n/outbox?token={TOKEN}", f'{{"jsonrpc":"2.0","id":{number},"result":{number}}}'.encode()
            )
            self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'), number[:20])
        # Unregister's token field, too.
        reply = await self.http.post("/sess-n/unregister", b'{"token":' + b"9" * 5000 + b"}")
        self.assertEqual((reply.code, reply.json()), (401, {"error": "invalid_token"}))
        await assert_clean_log(self, self.proc, self.http)

    async def test_any_unicode_in_tokens_labels_and_bodies(self) -> None:
        odd = ["%00", "%0D%0A", "%FF", "%ED%A0%80", "%EF%BB%BF", "\\ud800", "%E2%80%A8"]
        for odd_value in odd:
            for path in (f"/sess-h/poll?token={odd_value}", f"/sess-h/poll?token={TOKEN}&wait=0&client={odd_value}",
                         f"/sess-h/events?token={odd_value}", f"/sess-h/poll?token={TOKEN}&wait=0&subscriber={odd_value}",
                         f"/sess-h/poll?token={TOKEN}&wait=0&direction={odd_value}"):
                reply = await self.http.get(path)
                self.assertIn(reply.code, (200, 401), path)
        bodies = [b'{"session":"sess-u","token":"\\ud800' + b"x" * 20 + b'"}', b'\xef\xbb\xbf{"session":"s"}',
                  b'{"session":"sess\\u0000x","token":"\\u0000' + b"y" * 20 + b'"}', b'{"session":"\xff\xfe"}',
                  b'{"jsonrpc":"2.0","method":"\xed\xa0\x80"}', b"\x00", b'"\\ud800"', b"[" * 5000]
        for body in bodies:
            for path in ("/register", f"/sess-h/inbox?token={TOKEN}", f"/sess-h/outbox?token={TOKEN}",
                         "/sess-h/unregister"):
                reply = await self.http.post(path, body)
                self.assertIn(reply.code, (200, 400, 401), (path, body[:30]))
        # A lone-surrogate token registers and authenticates like any other.
        self.assertEqual((await self.http.post("/sess-u/inbox?token=x", frame(64))).code, 401)
        reply = await self.http.post("/sess-u/unregister", b'{"token":"\\ud800' + b"x" * 20 + b'"}')
        self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'))
        await assert_clean_log(self, self.proc, self.http)


# Defect 11: the HTTP surface follows RFC 9110 ----------------------------------------------------------


class HttpSurface(TestCase):
    timeout = 60

    async def setUp(self) -> None:  # type: ignore[override]
        self.proc = await start_mcp_process(self)
        self.http = HttpClient.on_port(self, self.proc.port("mcp"))
        await register(self.http, "sess-r")

    async def test_head_on_health_answers_like_get_without_a_body(self) -> None:
        get = await self.http.get("/healthz")
        for path in ("/", "/healthz"):
            head = await self.http.request("HEAD", path)
            self.assertEqual((head.code, head.body), (200, b""), path)
            self.assertEqual(head.header("content-type"), "application/json")
            self.assertEqual(head.header("content-length"), str(len(get.body)))
        await assert_clean_log(self, self.proc, self.http)  # no "I think I'll eat it"

    async def test_head_on_events_and_poll_authenticates_without_subscribing_or_taking(self) -> None:
        page = await SSEClient.connect(f"{self.http.base}/sess-r/events?token={TOKEN}")
        self.addCleanup(page.close)
        await self.http.post(f"/sess-r/outbox?token={TOKEN}", frame(64))  # backlogged for the first agent
        for route, kind in (("events", "text/event-stream"), ("poll", "application/json")):
            head = await self.http.request("HEAD", f"/sess-r/{route}?token={TOKEN}&direction=outbound")
            self.assertEqual((head.code, head.body), (200, b""), route)
            self.assertEqual(head.header("content-type"), kind)
            self.assertEqual(head.header("access-control-allow-origin"), "*")
            for token, status in (("wrong_token_wrong_token", 401), ("", 401)):
                head = await self.http.request("HEAD", f"/sess-r/{route}?token={token}")
                self.assertEqual((head.code, head.body), (status, b""), (route, token))
            head = await self.http.request("HEAD", f"/gone-session/{route}?token={TOKEN}")
            self.assertEqual((head.code, head.body), (410, b""), route)
        # Nothing was subscribed (no peer_joined) and nothing taken: the first real agent gets the frame.
        agent = await self.http.get(f"/sess-r/poll?token={TOKEN}&direction=outbound&wait=0")
        self.assertEqual(agent.json()["frames"], [frame(64).decode()])
        joined = (await next_mcp(page)).json()
        self.assertEqual(joined["params"]["subscriberId"], agent.json()["subscriber"])
        await assert_clean_log(self, self.proc, self.http)

    async def test_other_methods_on_a_known_path_are_json_405_with_allow(self) -> None:
        cases = {
            "/register": (["GET", "HEAD", "PUT", "DELETE", "PATCH"], "POST, OPTIONS"),
            "/sess-r/inbox": (["GET", "PUT", "DELETE", "BREW"], "POST, OPTIONS"),
            "/sess-r/outbox": (["GET", "HEAD", "TRACE"], "POST, OPTIONS"),
            "/sess-r/unregister": (["GET", "DELETE"], "POST, OPTIONS"),
            "/sess-r/events": (["POST", "PUT", "DELETE"], "GET, HEAD, OPTIONS"),
            "/sess-r/poll": (["POST", "PATCH"], "GET, HEAD, OPTIONS"),
            "/healthz": (["POST", "PUT", "DELETE", "OPTIONS"], "GET, HEAD"),
            "/": (["POST", "DELETE"], "GET, HEAD"),
        }
        for path, (methods, allow) in cases.items():
            for method in methods:
                reply = await self.http.request(method, path, b"{}")
                self.assertEqual(reply.code, 405, (method, path))
                self.assertEqual(reply.header("allow"), allow, (method, path))
                self.assertEqual(reply.header("content-type"), "application/json")
                if method != "HEAD":
                    self.assertEqual(reply.json(), {"error": "method_not_allowed"})
            if allow != "GET, HEAD":
                options = await self.http.request("OPTIONS", path)
                self.assertEqual((options.code, options.header("allow")), (204, allow), path)
        # The session still works: none of those did anything.
        self.assertEqual((await poll(self.http, "sess-r"))["frames"], [])
        await assert_clean_log(self, self.proc, self.http)

    async def test_unknown_paths_are_json_404_for_every_method(self) -> None:
        for path in ("/nope", "/healthz/", "/sess-r/inbox/", "/sess-r", "/%00", "/sess-r/events%0D%0A"):
            for method in ("GET", "HEAD", "POST", "PUT", "OPTIONS", "BREW"):
                reply = await self.http.request(method, path)
                self.assertEqual(reply.code, 404, (method, path))
                self.assertEqual(reply.header("content-type"), "application/json")
                if method != "HEAD":
                    self.assertEqual(reply.json(), {"error": "not_found"})
        await assert_clean_log(self, self.proc, self.http)

    async def test_media_types_are_case_insensitive(self) -> None:
        for content_type in ("Application/JSON; Charset=utf-8", "APPLICATION/JSON", "application/json;charset=UTF-8"):
            reply = await self.http.request(
                "POST", "/register", json.dumps({"session": "sess-m", "token": TOKEN}).encode(),
                {"content-type": content_type},
            )
            self.assertEqual(reply.code, 200, content_type)
            reply = await self.http.request(
                "POST", f"/sess-m/inbox?token={TOKEN}", frame(64), {"content-type": content_type}
            )
            self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'), content_type)
        await assert_clean_log(self, self.proc, self.http)


# Defect 9: one bound on the bytes held for absent readers -------------------------------------------

CAP = 4096


class BufferedBytesBound(TestCase):
    """C{--mcp-max-buffered-bytes}: first-frame backlogs and poll queues of all sessions together."""

    timeout = 60
    with_redis = False

    def state_flags(self) -> list[str]:
        if not self.with_redis:
            return []
        flags = redis_flags(shared_redis().url)
        return [f"--redis={flags['redis']}", f"--redis-prefix={flags['redis-prefix']}"]

    async def setUp(self) -> None:  # type: ignore[override]
        self.flags = [f"--mcp-max-buffered-bytes={CAP}", *self.state_flags()]
        self.proc = await start_mcp_process(self, *self.flags)
        self.http = HttpClient.on_port(self, self.proc.port("mcp"))
        if self.with_redis:
            await until_store_answers(self.proc)
        for session in ("sess-1", "sess-2", "sess-3"):
            await register(self.http, session)

    def assert_full(self, reply: Any) -> None:
        self.assertEqual((reply.code, reply.json()), (503, {"error": "buffer_full"}))
        self.assertEqual(reply.header("retry-after"), "5")
        self.assertEqual(reply.header("access-control-allow-origin"), "*")

    async def test_backlogs_exactly_at_the_bound_are_accepted_one_byte_over_is_refused(self) -> None:
        posts = [("sess-1", "inbox", 2000), ("sess-1", "outbox", 1000), ("sess-2", "inbox", CAP - 3000)]
        for session, route, size in posts:
            reply = await self.http.post(f"/{session}/{route}?token={TOKEN}", frame(size))
            self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'), (session, route))
        # Exactly at the bound. The smallest frame more is refused, before anything is stored.
        over = frame(48, "o")
        self.assert_full(await self.http.post(f"/sess-2/outbox?token={TOKEN}", over))
        # A session whose readers are connected is not held back by the full buffer.
        page = await SSEClient.connect(f"{self.http.base}/sess-3/events?token={TOKEN}")
        self.addCleanup(page.close)
        self.assertEqual((await self.http.post(f"/sess-3/inbox?token={TOKEN}", frame(64))).code, 200)
        self.assertEqual((await next_mcp(page)).data, frame(64).decode())
        # A reader takes its backlog: the room it frees is usable again, to the byte.
        self.assertEqual((await poll(self.http, "sess-1"))["frames"], [frame(2000).decode()])
        self.assertEqual((await self.http.post(f"/sess-2/outbox?token={TOKEN}", frame(2000))).code, 200)
        self.assert_full(await self.http.post(f"/sess-2/outbox?token={TOKEN}", frame(48)))
        # The refused frames were never stored: the agent gets the accepted one only.
        agent = await poll(self.http, "sess-2", "&direction=outbound")
        self.assertEqual(agent["frames"], [frame(2000).decode()])
        await assert_clean_log(self, self.proc, self.http)

    async def test_poll_queues_count_once_per_waiting_poller(self) -> None:
        first = await poll(self.http, "sess-1")
        second = await poll(self.http, "sess-1")
        # A frame for two pollers waits in two queues: counted twice, in the form the queue holds.
        size = 48
        while len(poll_form(frame(size + 1))) * 2 <= CAP:
            size += 1
        big = frame(size)
        self.assertEqual(len(poll_form(big)) * 2, CAP)
        self.assertEqual((await self.http.post(f"/sess-1/inbox?token={TOKEN}", big)).code, 200)
        self.assert_full(await self.http.post(f"/sess-1/inbox?token={TOKEN}", frame(48)))
        # One poller takes its copy; half the bound is free again.
        taken = await poll(self.http, "sess-1", f"&subscriber={first['subscriber']}")
        self.assertEqual(taken["frames"], [big.decode()])
        self.assert_full(await self.http.post(f"/sess-1/inbox?token={TOKEN}", big))  # needs two queues' worth
        fits = 48
        while len(poll_form(frame(fits + 1))) * 2 <= CAP // 2:
            fits += 1
        self.assertEqual(len(poll_form(frame(fits))) * 2, CAP // 2)
        self.assertEqual((await self.http.post(f"/sess-1/inbox?token={TOKEN}", frame(fits))).code, 200)
        self.assert_full(await self.http.post(f"/sess-1/inbox?token={TOKEN}", frame(48)))
        rest = await poll(self.http, "sess-1", f"&subscriber={second['subscriber']}")
        self.assertEqual(rest["frames"], [big.decode(), frame(fits).decode()])
        await assert_clean_log(self, self.proc, self.http)

    async def test_unregister_and_a_labelled_reply_refused_for_room_lose_nothing(self) -> None:
        # Fill the bound with one backlog, then end its session: the room comes back.
        self.assertEqual((await self.http.post(f"/sess-2/inbox?token={TOKEN}", frame(CAP))).code, 200)
        self.assert_full(await self.http.post(f"/sess-1/inbox?token={TOKEN}", frame(48)))
        reply = await self.http.post("/sess-2/unregister", json.dumps({"token": TOKEN}).encode())
        self.assertEqual(reply.code, 200)
        # A labelled agent polls; the page's reply is refused while the bound is full, and the
        # page's retry still reaches that agent once there is room.
        agent = await poll(self.http, "sess-1", "&direction=outbound&client=a")
        request = b'{"jsonrpc":"2.0","id":7,"method":"tools/list"}'
        self.assertEqual((await self.http.post(f"/sess-1/inbox?token={TOKEN}&client=a", request)).code, 200)
        self.assertEqual((await self.http.post(f"/sess-3/inbox?token={TOKEN}", frame(CAP - len(request)))).code, 200)
        answer = b'{"jsonrpc":"2.0","id":7,"result":{}}'
        self.assert_full(await self.http.post(f"/sess-1/outbox?token={TOKEN}", answer))
        self.assertEqual(len((await poll(self.http, "sess-3"))["frames"]), 1)  # room again
        self.assertEqual((await self.http.post(f"/sess-1/outbox?token={TOKEN}", answer)).code, 200)
        got = await poll(self.http, "sess-1", f"&direction=outbound&client=a&subscriber={agent['subscriber']}")
        self.assertEqual(got["frames"], [answer.decode()])
        await assert_clean_log(self, self.proc, self.http)


class BufferedBytesBoundOnRedis(BufferedBytesBound):
    """The same bound with C{--redis}: counted in Redis, one bound for every instance together."""

    with_redis = True

    async def test_the_bound_is_shared_by_every_instance(self) -> None:
        other = await start_mcp_process(self, *self.flags)
        there = HttpClient.on_port(self, other.port("mcp"))
        await until_store_answers(other)
        self.assertEqual((await self.http.post(f"/sess-1/inbox?token={TOKEN}", frame(CAP - 48))).code, 200)
        self.assertEqual((await there.post(f"/sess-2/inbox?token={TOKEN}", frame(48))).code, 200)
        self.assert_full(await there.post(f"/sess-3/inbox?token={TOKEN}", frame(48)))
        self.assert_full(await self.http.post(f"/sess-3/inbox?token={TOKEN}", frame(48)))
        self.assertEqual(len((await poll(there, "sess-2"))["frames"]), 1)
        self.assertEqual((await self.http.post(f"/sess-3/inbox?token={TOKEN}", frame(48))).code, 200)
        await assert_clean_log(self, other, there)


# Memory: each kind of client that never reads stays within its documented bound ----------------------

SLACK = 32 * MiB  # allocator and interpreter noise on top of what the relay holds on purpose
BIG = 250 * 1024  # a frame near the 256 KiB body limit


class NeverReadingClients(TestCase):
    timeout = 120

    async def test_stream_reader_that_stops_reading_is_cut_at_its_bound(self) -> None:
        """A stream whose client stops reading holds at most --mcp-queue-bytes, then is cut off."""
        queue_bytes = 2 * MiB
        proc = await start_mcp_process(self, "--no-access-log", f"--mcp-queue-bytes={queue_bytes}")
        port, pid = proc.port("mcp"), proc.transport.pid
        http = HttpClient.on_port(self, port)
        await register(http, "sess-s")
        path = f"/sess-s/events?token={TOKEN}"
        last = b'"method":"end"'
        fast = (await open_many(port, 1, lambda: HeldConnection(sse_request(path), watch=last)))[0]
        slow = (await open_many(port, 1, lambda: HeldConnection(sse_request(path), stop_reading=True)))[0]
        self.addCleanup(close_all, [fast, slow])
        base = memory(pid)["VmRSS"]
        posts = 256  # 64 MiB: without the bound the silent reader would hold all of it
        for _ in range(posts):
            reply = await http.post(f"/sess-s/inbox?token={TOKEN}", frame(BIG))
            self.assertEqual(reply.code, 200)
        self.assertEqual((await http.post(f"/sess-s/inbox?token={TOKEN}", frame(64, "end"))).code, 200)
        await fast.seen.addTimeout(30, reactor)  # the reading client got everything
        growth = memory(pid)["VmHWM"] - base
        # The silent one was cut off: once it reads again it finds the end of a short stream.
        slow.transport.resumeProducing()
        await slow.lost.addTimeout(30, reactor)
        bound = queue_bytes * 1.25 + SLACK
        print(f"\nMCP SSE reader not reading: {posts * BIG / MiB:.0f} MiB posted, it got {slow.received / MiB:.1f} "
              f"MiB; server peak +{growth / MiB:.1f} MiB (bound {bound / MiB:.0f} MiB)")
        self.assertLess(slow.received, posts * BIG / 4)
        self.assertLess(growth, bound)

    async def test_many_parked_polls_and_their_queues_stay_bounded(self) -> None:
        """1000 parked polls whose clients never read: a few KiB each, and the frames queued for
        them afterwards count against --mcp-max-buffered-bytes."""
        sessions, per_session, warm = 100, 10, 100
        parked = sessions * per_session
        cap = 16 * MiB
        require_open_files(parked + 512)
        proc = await start_mcp_process(
            self, "--no-access-log", f"--mcp-max-buffered-bytes={cap}", "--max-client-connections=0",
            "--metrics-listen", "tcp:0:interface=127.0.0.1",
            listen="tcp:0:interface=127.0.0.1:backlog=1024", wait_for=("mcp", "metrics"),
        )
        port, pid = proc.port("mcp"), proc.transport.pid
        http = HttpClient.on_port(self, port)
        metrics_url = f"http://127.0.0.1:{proc.port('metrics')}/metrics"
        names = [f"sess-p{i}" for i in range(sessions)]
        for name in names:
            await register(http, name)
        held: list[HeldConnection] = []
        self.addCleanup(close_all, held)

        async def park(count: int) -> None:
            start = len(held)
            for i in range(start, start + count):
                request = raw_request(b"GET", f"/{names[i % sessions]}/poll?token={TOKEN}&wait=25000".encode())
                protocol = HeldConnection(request, stop_reading=True)
                reactor.connectTCP("127.0.0.1", port, SingleUseFactory(protocol))
                held.append(protocol)
            while True:  # until the relay has parked every one of them
                samples, _ = await scrape(metrics_url, http.pool)
                if value(samples, "relayd_connections", relay="mcp", transport="longpoll") >= len(held):
                    return

        await park(warm)
        base = memory(pid)["VmRSS"]
        await park(parked - warm)
        per_poll = (memory(pid)["VmRSS"] - base) / (parked - warm)
        # Every poll is answered by a frame; the clients still read nothing. Later frames queue for
        # ten idle pollers per session until the bound refuses them.
        refused = 0
        for i in range(sessions * 3):
            reply = await http.post(f"/{names[i % sessions]}/inbox?token={TOKEN}", frame(BIG))
            self.assertIn(reply.code, (200, 503))
            refused += reply.code == 503
        growth = memory(pid)["VmHWM"] - base
        bound = parked * 20 * 1024 + cap + SLACK
        print(f"\nMCP parked polls: {per_poll / 1024:.1f} KiB each; {sessions * 3} frames of {BIG // 1024} KiB for "
              f"{parked} pollers that never read, {refused} refused; peak +{growth / MiB:.1f} MiB (bound "
              f"{bound / MiB:.0f} MiB)")
        self.assertLess(per_poll, 20 * 1024)
        self.assertGreater(refused, 0)
        self.assertLess(growth, bound)

    async def test_many_sessions_filling_their_backlogs_stay_within_the_default_bound(self) -> None:
        """First-frame backlogs of many sessions (no reader ever comes): at most the default 64 MiB."""
        proc = await start_mcp_process(self, "--no-access-log")
        port, pid = proc.port("mcp"), proc.transport.pid
        http = HttpClient.on_port(self, port)
        sessions = [f"sess-b{i}" for i in range(16)]
        for name in sessions:
            await register(http, name)
        base = memory(pid)["VmRSS"]
        posts, accepted, refused = 448, 0, 0  # 112 MiB offered, 64 frames per backlog at most
        for i in range(posts):
            route = "inbox" if (i // len(sessions)) % 2 == 0 else "outbox"
            reply = await http.post(f"/{sessions[i % len(sessions)]}/{route}?token={TOKEN}", frame(BIG))
            if reply.code == 503:
                self.assertEqual(reply.json(), {"error": "buffer_full"})
                refused += 1
            else:
                self.assertEqual(reply.code, 200)
                accepted += 1
        growth = memory(pid)["VmHWM"] - base
        bound = 64 * MiB + SLACK
        print(f"\nMCP backlogs: {posts} frames of {BIG // 1024} KiB into {len(sessions)} sessions, {accepted} held, "
              f"{refused} refused; peak +{growth / MiB:.1f} MiB (bound {bound / MiB:.0f} MiB)")
        self.assertEqual(accepted, 64 * MiB // BIG)
        self.assertEqual(refused, posts - accepted)
        self.assertLess(growth, bound)


# Property: malformed requests on every route, one relay for the whole run ----------------------------

_SESSION = "hyp-sess"
_ROUTES = ["register", "inbox", "outbox", "events", "poll", "unregister"]
_PARAMS = ["token", "direction", "client", "wait", "subscriber"]
# Any code point, lone surrogates included (and, often, the ones that break naive code).
_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=24),
    st.sampled_from(["\ud800", "\udfff", "a\udbffb", "\x00", "\r\n", "\ufeff", "\u2028", "\U0001f600"]),
)
_NUMBERS = ["1e400", "-1e400", "9" * 5000, "-" + "9" * 5000, "1" + "0" * 30, "-0", "1.5e-400", "18446744073709551616",
            "1E+2", "-1.5e308", "0.0000001"]


class _Literal(str):
    """JSON text written as it is (a number no Python value writes that way)."""


_JSON_LEAF = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False), _TEXT,
    st.sampled_from(_NUMBERS).map(_Literal),
)
_JSON = st.recursive(
    _JSON_LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4), max_leaves=10
)
_WHITESPACE = st.sampled_from([b"", b" ", b"\n", b"\r\n", b"\t", b"\r"])


@st.composite
def _json_text(draw: Any, value: Any = None) -> bytes:
    """JSON text of C{value} (drawn when None): any whitespace between tokens, strings escaped to
    ASCII or written raw (a lone surrogate then becomes invalid UTF-8)."""
    ascii_only = draw(st.booleans())
    ws = draw(_WHITESPACE)

    def write(v: Any) -> bytes:
        if isinstance(v, _Literal):
            return str(v).encode()
        if isinstance(v, str):
            return json.dumps(v, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
        if isinstance(v, dict):
            items = [write(k) + ws + b":" + ws + write(x) for k, x in v.items()]
            return b"{" + ws + (b"," + ws).join(items) + ws + b"}"
        if isinstance(v, list):
            return b"[" + ws + (b"," + ws).join(write(x) for x in v) + ws + b"]"
        return json.dumps(v).encode()

    return write(draw(_JSON) if value is None else value)


@st.composite
def _frame(draw: Any) -> bytes:
    """Mostly valid JSON-RPC (so frames get past parsing), holding any values."""
    message: dict[Any, Any] = {"jsonrpc": draw(st.sampled_from(["2.0", "2.0", "2.0", "1.0"]))}
    if draw(st.booleans()):
        message["method"] = draw(st.one_of(_TEXT, st.sampled_from(["tools/call", "notifications/peer_joined"])))
    if draw(st.booleans()):
        message["id"] = draw(_JSON)
    for key in draw(st.lists(st.sampled_from(["params", "result", "error"]), max_size=2, unique=True)):
        message[key] = draw(_JSON)
    if draw(st.integers(0, 5)) == 0:
        return draw(_json_text([message, message]))
    return draw(_json_text(message))


def _percent(draw: Any) -> bytes:
    raw = draw(st.one_of(
        _TEXT.map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.binary(max_size=16),
        st.sampled_from([b"9" * 5000, b"-" + b"9" * 5000, b"outbound", b"0", TOKEN.encode(), b"0123456789abcdef"]),
    ))
    return urllib.parse.quote_from_bytes(raw, safe=b"").encode() if draw(st.booleans()) else raw.translate(
        None, b" #\r\n"
    )


@st.composite
def _authenticated(draw: Any) -> bytes:
    """A request that gets past auth into the tunnel relay: a frame for the live session, or a poll of it."""
    extra = b"".join(b"&" + name + b"=" + _percent(draw) for name in draw(st.lists(
        st.sampled_from([b"client", b"direction", b"wait", b"subscriber"]), max_size=3)))
    if draw(st.booleans()):
        route = draw(st.sampled_from([b"inbox", b"outbox"]))
        target = b"/" + _SESSION.encode() + b"/" + route + b"?token=" + TOKEN.encode() + extra
        return raw_request(b"POST", target, [(b"content-type", b"application/json")], draw(_frame()))
    wait = b"&wait=" + draw(st.sampled_from([b"0", b"1", b"-" + b"9" * 5000, b"%FF", b"0" * 5000 + b"1"]))
    target = b"/" + _SESSION.encode() + b"/poll?token=" + TOKEN.encode() + wait + extra
    return raw_request(draw(st.sampled_from([b"GET", b"HEAD"])), target)


@st.composite
def _request(draw: Any) -> bytes:
    """One request as bytes: anything, at any route."""
    route = draw(st.sampled_from([*_ROUTES, "healthz", "other"]))
    session = draw(st.one_of(st.just(_SESSION), st.just(_SESSION), st.from_regex(r"[A-Za-z0-9_-]{4,64}", fullmatch=True),
                             _TEXT.map(lambda t: urllib.parse.quote(t.encode("utf-8", "surrogatepass")))))
    path = {"register": "/register", "healthz": "/healthz", "other": f"/{session}"}.get(route, f"/{session}/{route}")
    # Half the time the route's own method, so requests get past routing into the tunnel relay.
    own = b"GET" if route in ("events", "poll", "healthz") else b"POST"
    method = draw(st.sampled_from([own, own, own, b"GET", b"POST", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"BREW"]))
    query = b"&".join(
        draw(st.sampled_from(_PARAMS).map(str.encode) | st.binary(max_size=6).map(
            lambda b: urllib.parse.quote_from_bytes(b).encode())) + b"=" + _percent(draw)
        for _ in range(draw(st.integers(0, 4)))
    )
    token_ok = draw(st.booleans())
    if token_ok:
        query = b"token=" + TOKEN.encode() + (b"&wait=0" if route == "poll" else b"") + (b"&" + query if query else b"")
    target = path.encode() + (b"?" + query if query else b"")
    headers: list[tuple[bytes, bytes]] = []
    if draw(st.booleans()):
        headers.append((b"authorization", draw(st.one_of(
            st.just(b"Bearer " + TOKEN.encode()), st.binary(max_size=40).map(lambda b: b"Bearer " + b),
            st.binary(max_size=40),
        )).translate(None, b"\r\n")))
    if draw(st.booleans()):
        headers.append((b"content-type", draw(st.one_of(
            st.sampled_from([b"application/json", b"Application/JSON; Charset=utf-8", b"text/plain", b""]),
            st.binary(max_size=30),
        )).translate(None, b"\r\n")))
    if draw(st.booleans()):
        headers.append((b"origin", draw(st.binary(max_size=30)).translate(None, b"\r\n")))
    body = None
    if method != b"GET" or draw(st.booleans()):
        body = draw(st.one_of(
            _frame(), _frame(), _json_text(), st.binary(max_size=64),
            st.builds(lambda s, t: {"session": s, "token": t}, _JSON | st.just(_SESSION), _JSON | st.just(TOKEN))
            .flatmap(lambda v: _json_text(v)),
        ))
    return raw_request(method, target, headers, body)


class MalformedRequests(TestCase):
    """Hypothesis drives malformed requests at every route of one relay (started once, in this
    class's only test): never a 5xx, always an answer, and afterwards a clean log and a live relay."""

    timeout = 120

    async def test_no_request_gets_a_5xx_or_goes_unanswered(self) -> None:
        proc = await start_mcp_process(self)
        http = HttpClient.on_port(self, proc.port("mcp"))
        await register(http, _SESSION)
        port = proc.port("mcp")
        answered: list[int] = []

        @settings(max_examples=400, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(st.one_of(_request(), _authenticated()))
        def check(request: bytes) -> None:
            status, _, _ = first_response(port, request)
            assert status < 500, (status, request[:300])
            answered.append(status)

        await deferToThread(check)
        self.assertGreater(len(set(answered)), 4)  # the requests reached many outcomes, not one wall
        await assert_clean_log(self, proc, http)


class AnyFrameOnAStream(TestCase):
    """Hypothesis posts any frame a client might send while a reader listens over SSE: each arrives
    as one C{data:} line holding the same JSON text less its line breaks, or is refused with a 4xx."""

    timeout = 120

    async def test_frames_never_break_sse_framing(self) -> None:
        proc = await start_mcp_process(self)
        http = HttpClient.on_port(self, proc.port("mcp"))
        await register(http, _SESSION)
        port = proc.port("mcp")

        def run() -> None:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as reader:
                # HTTP/1.0: the stream comes unchunked, exactly as an EventSource parses it.
                reader.sendall(f"GET /{_SESSION}/events?token={TOKEN} HTTP/1.0\r\n\r\n".encode())
                pending = b""

                def next_event() -> bytes:
                    nonlocal pending
                    while True:
                        while b"\n\n" not in pending:
                            chunk = reader.recv(65536)
                            assert chunk, "the stream ended"
                            pending += chunk
                        event, pending = pending.split(b"\n\n", 1)
                        if b"event: mcp" in event:
                            return event

                @settings(max_examples=300, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(_frame())
                def check(body: bytes) -> None:
                    status, _, _ = first_response(port, raw_request(
                        b"POST", f"/{_SESSION}/inbox?token={TOKEN}".encode(), [(b"content-type", b"application/json")],
                        body,
                    ))
                    assert status in (200, 401), (status, body[:200])
                    if status != 200:
                        return
                    event = next_event()
                    lines = event.split(b"\n")
                    assert lines[0] == b"event: mcp" and len(lines) == 2 and lines[1].startswith(b"data: "), event
                    assert b"\r" not in event, event
                    # The same JSON text with only its line breaks (whitespace between tokens) gone.
                    assert lines[1][len(b"data: "):] == body.translate(None, b"\r\n"), (event, body)

                check()

        await deferToThread(run)
        await assert_clean_log(self, proc, http)
