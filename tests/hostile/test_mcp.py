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
import urllib.parse
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor
from twisted.internet.defer import Deferred, DeferredList
from twisted.internet.threads import deferToThread
from twisted.trial.unittest import TestCase

from tests.mcp.harness import redis_flags
from tests.mcp.hostile_support import (
    Http,
    assert_clean_log,
    exchange,
    raw_request,
    start_mcp,
    until_store_answers,
)
from tests.robustness.support import HeldConnection, close_all, memory, open_many, require_open_files
from tests.support.metrics import scrape, value
from tests.support.redis import shared_redis
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


async def register(http: Http, session: str, token: str = TOKEN) -> None:
    reply = await http.post("/register", json.dumps({"session": session, "token": token}).encode())
    assert reply.code == 200, reply.body


async def poll(http: Http, session: str, query: str = "") -> Any:
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
        self.proc = await start_mcp(self)
        self.http = Http(self, self.proc.port("mcp"))
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
        for value in odd:
            for path in (f"/sess-h/poll?token={value}", f"/sess-h/poll?token={TOKEN}&wait=0&client={value}",
                         f"/sess-h/events?token={value}", f"/sess-h/poll?token={TOKEN}&wait=0&subscriber={value}",
                         f"/sess-h/poll?token={TOKEN}&wait=0&direction={value}"):
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
        self.proc = await start_mcp(self)
        self.http = Http(self, self.proc.port("mcp"))
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
        self.proc = await start_mcp(self, *self.flags)
        self.http = Http(self, self.proc.port("mcp"))
        if self.with_redis:
            await until_store_answers(self, self.http)
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
        other = await start_mcp(self, *self.flags)
        there = Http(self, other.port("mcp"))
        await until_store_answers(self, there)
        self.assertEqual((await self.http.post(f"/sess-1/inbox?token={TOKEN}", frame(CAP - 48))).code, 200)
        self.assertEqual((await there.post(f"/sess-2/inbox?token={TOKEN}", frame(48))).code, 200)
        self.assert_full(await there.post(f"/sess-3/inbox?token={TOKEN}", frame(48)))
        self.assert_full(await self.http.post(f"/sess-3/inbox?token={TOKEN}", frame(48)))
        self.assertEqual(len((await poll(there, "sess-2"))["frames"]), 1)
        self.assertEqual((await self.http.post(f"/sess-3/inbox?token={TOKEN}", frame(48))).code, 200)
        await assert_clean_log(self, other, there)
