"""HTTP-level cases: routes and status tables (§2), SSE (§3, E1-E6), poll (§4, P1-P15), the cases with
no upstream test, and the HTTP-facing decisions (2, 3, 5, 8, 9). All served in memory
(tests/support/inmemory.py: relayd's own site, channel and request, no socket); streams and parked
polls end on the wing's clock and by the client's connection being lost."""

from __future__ import annotations

import json

from tests.support.inmemory import Connection, InMemoryMcpCase, Reply
from tests.support.mcp import TOKEN
from tests.support.sse import Message

LIST = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":[]}'
REPLY = b'{"jsonrpc":"2.0","id":1,"result":{"tools":[]}}'


def note(n: int) -> bytes:
    return b'{"jsonrpc":"2.0","method":"notifications/n","params":{"n":%d}}' % n


class RoutingTests(InMemoryMcpCase):
    def test_health(self) -> None:
        for path in ("/", "/healthz"):
            reply = self.get(path)
            self.assertEqual(reply.code, 200)
            self.assertEqual(reply.body, b'{"ok":true,"service":"agent-integrations-relay"}')
            self.assertEqual(reply.header("content-type"), "application/json")
            self.assertIsNone(reply.header("access-control-allow-origin"))

    def test_health_is_exact_raw_url(self) -> None:
        reply = self.get("/?x=1")
        self.assertEqual((reply.code, reply.json()), (404, {"error": "not_found"}))
        # HEAD works wherever GET does (RFC 9110): the headers, GET's length, no body.
        head = self.request("HEAD", "/")
        self.assertEqual((head.code, head.body), (200, b""))
        self.assertEqual(head.header("content-length"), str(len(b'{"ok":true,"service":"agent-integrations-relay"}')))
        head = self.request("HEAD", "/?x=1")
        self.assertEqual((head.code, head.body), (404, b""))

    def test_not_found_shapes(self) -> None:
        self.register()
        for path in ("/nope", "/register/", "/sess/inbox/", "/a/inbox", "/sess/other", "/s%20s/inbox", "/sess"):
            reply = self.post(path, {})
            self.assertEqual((reply.code, reply.json()), (404, {"error": "not_found"}), path)

    def test_decision3_not_found_carries_cors(self) -> None:
        reply = self.get("/nope", origin="https://x.example")
        self.assertEqual(reply.code, 404)
        self.assertEqual(reply.header("access-control-allow-origin"), "*")
        self.assertEqual(reply.header("content-type"), "application/json")

    def test_method_not_allowed(self) -> None:
        self.register()
        cases = [("GET", "/register"), ("GET", "/sess/inbox"), ("GET", "/sess/outbox"), ("POST", "/sess/events"),
                 ("POST", "/sess/poll"), ("GET", "/sess/unregister"), ("PUT", "/register")]
        for method, path in cases:
            reply = self.request(method, path)
            self.assertEqual((reply.code, reply.json()), (405, {"error": "method_not_allowed"}), (method, path))
            self.assertEqual(reply.header("access-control-allow-origin"), "*")

    def test_options_is_204_with_cors(self) -> None:
        for path in ("/register", "/sess/inbox", "/sess/events", "/sess/poll", "/sess/unregister"):
            reply = self.request("OPTIONS", path, headers={"origin": "https://x.example"})
            self.assertEqual((reply.code, reply.body), (204, b""), path)
            self.assertEqual(reply.header("access-control-allow-origin"), "*")
            self.assertEqual(reply.header("access-control-allow-methods"), "GET, POST, OPTIONS")
            self.assertEqual(
                reply.header("access-control-allow-headers"), "content-type, x-csrf-token, accept, authorization"
            )
            self.assertEqual(reply.header("access-control-max-age"), "86400")
            self.assertIsNone(reply.header("vary"))


class PrefixTests(InMemoryMcpCase):
    flags = {"mcp-prefix": "/relay/"}

    def test_prefix_routes_and_health(self) -> None:
        self.assertEqual(self.prefix, "/relay")
        self.register()
        self.assertEqual(self.get("/").code, 200)  # {prefix}/ is health
        root = self.wing.request("GET", "/")
        self.assertEqual(root.code, 200)
        bare = self.wing.request("POST", "/register")
        self.assertEqual(bare.code, 404)
        self.assertEqual(self.post("/sess/inbox?token=" + TOKEN, raw=LIST).code, 200)


class RegisterTests(InMemoryMcpCase):
    def test_register_table(self) -> None:
        cases = [
            (b"", 400, {"error": "invalid_json", "detail": "no JSON value (the text is empty)"}),
            (b"{nope", 400, {"error": "invalid_json", "detail": "unexpected character, expected a string key at byte 1"}),
            (b"null", 400, "missing_fields"),
            (b"42", 400, "missing_fields"),
            (b'"s"', 400, "missing_fields"),
            (b'{"session":"sess"}', 400, "missing_fields"),
            (b'{"session":5,"token":"' + TOKEN.encode() + b'"}', 400, "missing_fields"),
            (b'{"session":"a b c","token":"' + TOKEN.encode() + b'"}', 401, "invalid_session_id"),
            (b'{"session":"sess","token":"short"}', 401, "invalid_token"),
        ]
        for body, code, error in cases:
            reply = self.post("/register", raw=body)
            self.assertEqual((reply.code, reply.json()), (code, error if isinstance(error, dict) else {"error": error}), body)

    def test_register_taken_and_idempotent(self) -> None:
        self.register()
        again = self.post("/register", {"session": "sess", "token": TOKEN})
        self.assertEqual((again.code, again.json()), (200, {"ok": True}))
        taken = self.post("/register", {"session": "sess", "token": "x" * 32})
        self.assertEqual((taken.code, taken.json()), (401, {"error": "session_taken"}))

    def test_register_free_again_after_unregister(self) -> None:
        self.register()
        self.post(f"/sess/unregister?token={TOKEN}")
        reply = self.post("/register", {"session": "sess", "token": "y" * 32})
        self.assertEqual(reply.code, 200)


class SessionCapTests(InMemoryMcpCase):
    flags = {"mcp-max-sessions": "1"}

    def test_decision9_session_cap_is_503(self) -> None:
        self.register()
        reader = self.events(query="&direction=inbound")  # a session with a reader never ends for room
        self.assertEqual(reader.status(), 200)
        reply = self.post("/register", {"session": "other", "token": TOKEN})
        self.assertEqual((reply.code, reply.json()), (503, {"error": "too_many_sessions"}))


class InboxOutboxTests(InMemoryMcpCase):
    def test_status_table(self) -> None:
        self.register()
        for route in ("inbox", "outbox"):
            ok = self.post(f"/sess/{route}?token={TOKEN}", raw=LIST if route == "inbox" else REPLY)
            self.assertEqual((ok.code, ok.json()), (200, {"ok": True}))
            bad = self.post(f"/sess/{route}?token={TOKEN}", raw=b'garbage "jsonrpc"')
            self.assertEqual((bad.code, bad.json()), (401, {"error": "invalid_token_or_frame"}))
            wrong = self.post(f"/sess/{route}?token=wrong-token-wrong-token", raw=LIST)
            self.assertEqual((wrong.code, wrong.json()), (401, {"error": "invalid_token_or_frame"}))
            missing = self.post(f"/sess/{route}", raw=LIST)
            self.assertEqual((missing.code, missing.json()), (401, {"error": "invalid_token_or_frame"}))
            gone = self.post(f"/gone/{route}?token={TOKEN}", raw=LIST)
            self.assertEqual((gone.code, gone.json()), (410, {"error": "session_gone"}))
            gone_no_token = self.post(f"/gone/{route}", raw=LIST)
            self.assertEqual(gone_no_token.code, 401)

    def test_decision5_bearer_header_wins_over_query(self) -> None:
        self.register()
        ok = self.post("/sess/inbox?token=wrong-token-wrong-token", raw=LIST, authorization=f"Bearer {TOKEN}")
        self.assertEqual(ok.code, 200)
        bad = self.post(f"/sess/inbox?token={TOKEN}", raw=LIST, authorization="Bearer wrong-token-wrong-token")
        self.assertEqual(bad.code, 401)
        stream = self.events(token="", query="&direction=outbound", authorization=f"Bearer {TOKEN}")
        self.assertEqual(stream.status(), 200)
        polled = self.request("GET", "/sess/poll?wait=0", headers={"authorization": f"Bearer {TOKEN}"})
        self.assertEqual(polled.code, 200)

    def test_body_cap_exact_limit_accepted(self) -> None:
        self.register()
        padding = 256 * 1024 - len(b'{"jsonrpc":"2.0","method":"n","params":{"p":""}}')
        body = b'{"jsonrpc":"2.0","method":"n","params":{"p":"' + b"x" * padding + b'"}}'
        self.assertEqual(len(body), 262144)
        reply = self.post(f"/sess/inbox?token={TOKEN}", raw=body)
        self.assertEqual(reply.code, 200)

    def test_decision2_body_over_cap_is_a_real_413_with_cors(self) -> None:
        self.register()
        body = b'{"jsonrpc":"2.0","method":"n","params":{"p":"' + b"x" * (256 * 1024) + b'"}}'
        for path in (f"/sess/inbox?token={TOKEN}", "/gone/outbox", "/register"):
            reply = self.post(path, raw=body, origin="https://x.example")
            self.assertEqual((reply.code, reply.json()), (413, {"error": "payload_too_large"}), path)
            self.assertEqual(reply.header("access-control-allow-origin"), "*")


class UnregisterTests(InMemoryMcpCase):
    def test_unregister_table(self) -> None:
        self.register()
        missing = self.post("/sess/unregister")
        self.assertEqual((missing.code, missing.json()), (401, {"error": "invalid_token"}))
        wrong = self.post("/sess/unregister?token=wrong-token-wrong-token")
        self.assertEqual((wrong.code, wrong.json()), (401, {"error": "invalid_token"}))
        ok = self.post(f"/sess/unregister?token={TOKEN}")
        self.assertEqual((ok.code, ok.json()), (200, {"ok": True}))
        again = self.post(f"/sess/unregister?token={TOKEN}")
        self.assertEqual((again.code, again.json()), (200, {"ok": True, "alreadyGone": True}))
        missing_gone = self.post("/sess/unregister")
        self.assertEqual(missing_gone.code, 401)

    def test_decision8_token_in_json_body(self) -> None:
        self.register()
        ok = self.post("/sess/unregister", {"token": TOKEN})
        self.assertEqual((ok.code, ok.json()), (200, {"ok": True}))
        self.assertEqual(self.poll(query="&wait=0").code, 410)


class EventsTests(InMemoryMcpCase):
    def assert_refused(self, stream: Connection, code: int, body: bytes) -> Reply:
        refusal = stream.reply()
        self.assertEqual((refusal.code, refusal.body), (code, body))
        return refusal

    def test_e1_events_after_unregister_is_410(self) -> None:
        self.register()
        self.post(f"/sess/unregister?token={TOKEN}")
        refusal = self.assert_refused(self.events(query="&direction=outbound"), 410, b"event: error\ndata: session_gone\n\n")
        self.assertEqual(refusal.header("content-type"), "text/event-stream")
        self.assertIsNone(refusal.header("cache-control"))
        self.assertEqual(refusal.header("access-control-allow-origin"), "*")

    def test_e2_never_registered_is_410(self) -> None:
        self.assert_refused(self.events(session="never"), 410, b"event: error\ndata: session_gone\n\n")

    def test_e3_wrong_token_is_401(self) -> None:
        self.register()
        refusal = self.events(token="wrong-token-wrong-token").reply()
        self.assertEqual(refusal.code, 401)
        self.assertIn(b"invalid_token", refusal.body)

    def test_e4_no_token_is_401(self) -> None:
        self.register()
        stream = self.wing.open("GET", f"{self.prefix}/sess/events")
        self.assert_refused(stream, 401, b"event: error\ndata: invalid_token\n\n")

    def test_e5_open_stream_ends_after_unregister(self) -> None:
        self.register()
        stream = self.events(query="&direction=outbound")
        self.assertEqual(stream.status(), 200)
        self.assertFalse(stream.ended())
        self.post(f"/sess/unregister?token={TOKEN}")
        self.wing.advance(0)
        self.assertTrue(stream.ended())
        self.assert_refused(self.events(query="&direction=outbound"), 410, b"event: error\ndata: session_gone\n\n")

    def test_e6_same_tick_frames_all_arrive(self) -> None:
        self.register()
        stream = self.events()
        for i in range(3):
            self.post(f"/sess/inbox?token={TOKEN}", raw=note(i))
        self.wing.advance(0)  # one turn for all three
        self.assertEqual(sorted(m.json()["params"]["n"] for m in mcp_events(stream)), [0, 1, 2])

    def test_success_headers_preamble_and_framing(self) -> None:
        self.register()
        stream = self.events()
        head = stream.head()
        self.assertEqual(head.code, 200)
        self.assertEqual(head.header("content-type"), "text/event-stream")
        self.assertEqual(head.header("cache-control"), "no-cache")
        self.assertEqual(head.header("x-accel-buffering"), "no")
        self.assertEqual(head.header("access-control-allow-origin"), "*")
        self.assertIsNone(head.header("content-length"))
        self.post(f"/sess/inbox?token={TOKEN}", raw=LIST)
        self.wing.advance(0)
        (event,) = mcp_events(stream)
        self.assertEqual(stream.body(), b"retry: 2000\n\nevent: mcp\ndata: " + LIST + b"\n\n")
        self.assertEqual((event.event, event.data), ("mcp", LIST.decode()))

    def test_keepalive_comment_from_the_shared_heartbeat(self) -> None:
        self.register()
        stream = self.events()
        hub = self.wing.service.resource.hub
        hub.beat()  # what the shared 15 s loop runs
        self.wing.advance(0)
        self.assertEqual([m.comment for m in stream.events() if m.comment is not None], ["keepalive"])
        self.assertTrue(stream.body().endswith(b": keepalive\n\n"))
        self.assertEqual(hub._loop.interval, 15.0)

    def test_decision4_multiline_frame_is_one_data_line(self) -> None:
        self.register()
        stream = self.events()
        self.post(f"/sess/inbox?token={TOKEN}", raw=b'{\n "jsonrpc": "2.0",\r\n "method": "x"\n}')
        self.wing.advance(0)
        (event,) = mcp_events(stream)
        self.assertEqual(event.data, '{ "jsonrpc": "2.0", "method": "x"}')
        self.assertEqual(event.fields, ["event", "data"])

    def test_presence_and_peer_left_on_disconnect(self) -> None:
        self.register()
        page = self.events()
        agent = self.events(query="&direction=outbound")
        self.wing.advance(0)
        (joined,) = [m.json() for m in mcp_events(page)]
        self.assertEqual(joined["method"], "notifications/peer_joined")
        self.assertEqual(list(joined["params"]), ["subscriberId", "ts"])
        agent.lose()
        self.wing.advance(0)
        left = mcp_events(page)[1].json()
        self.assertEqual(left["method"], "notifications/peer_left")
        self.assertEqual(left["params"]["subscriberId"], joined["params"]["subscriberId"])

    def test_decision1_backlog_delivered_to_first_sse_subscriber(self) -> None:
        self.register()
        self.post(f"/sess/inbox?token={TOKEN}", raw=LIST)
        stream = self.events()
        self.wing.advance(0)
        self.assertEqual(mcp_events(stream)[0].data, LIST.decode())


def mcp_events(stream: Connection) -> list[Message]:
    """The C{event: mcp} messages a stream has had (not its comments and C{retry:} preamble)."""
    return [message for message in stream.events() if message.event == "mcp"]


class PollTests(InMemoryMcpCase):
    def test_p1_first_poll_then_frame(self) -> None:
        self.register()
        first = self.poll(query="&direction=inbound&wait=0")
        self.assertEqual(first.code, 200)
        sub = first.json()["subscriber"]
        self.assertRegex(sub, r"^[a-f0-9]{16}$")
        self.assertEqual(first.json()["frames"], [])
        self.assertEqual(self.post(f"/sess/inbox?token={TOKEN}", raw=LIST).code, 200)
        second = self.poll(query=f"&direction=inbound&wait=0&subscriber={sub}").json()
        self.assertEqual(second["subscriber"], sub)
        (frame,) = second["frames"]
        self.assertIsInstance(frame, str)
        self.assertEqual((json.loads(frame)["method"], json.loads(frame)["id"]), ("tools/list", 1))

    def test_p2_wrong_token_is_401(self) -> None:
        self.register()
        reply = self.get("/sess/poll?token=wrong&wait=0")
        self.assertEqual((reply.code, reply.json()), (401, {"error": "invalid_token"}))

    def test_p3_p8_shape_and_headers(self) -> None:
        self.register()
        reply = self.poll(query="&wait=0")
        self.assertEqual(reply.code, 200)
        self.assertIn("application/json", reply.header("content-type") or "")
        self.assertIn("no-store", reply.header("cache-control") or "")
        self.assertEqual(sorted(reply.json()), ["frames", "subscriber"])
        self.assertTrue(reply.body.startswith(b'{"subscriber":"'))

    def test_p5_parked_poll_returns_when_a_frame_arrives(self) -> None:
        self.register()
        sub = self.poll(query="&wait=0").json()["subscriber"]
        parked = self.park(query=f"&wait=10000&subscriber={sub}")
        self.wing.advance(9.999)
        self.assertEqual(parked.received(), b"")  # parked
        self.post(f"/sess/inbox?token={TOKEN}", raw=LIST)
        self.assertEqual(len(parked.reply().json()["frames"]), 1)  # at once, not at the end of its wait

    def test_p6_short_wait_returns_empty_after_it(self) -> None:
        self.register()
        parked = self.park(query="&wait=150")
        self.wing.advance(0.149)
        self.assertEqual(parked.received(), b"")
        self.wing.advance(0.001)
        self.assertEqual(parked.reply().json()["frames"], [])

    def test_p7_client_abort_loses_nothing(self) -> None:
        self.register()
        sub = self.poll(query="&wait=0").json()["subscriber"]
        parked = self.park(query=f"&wait=10000&subscriber={sub}")
        self.assertEqual(self.tunnel.parked_polls(), 1)
        parked.lose()
        self.assertEqual(self.tunnel.parked_polls(), 0)
        self.post(f"/sess/inbox?token={TOKEN}", raw=LIST)
        again = self.poll(query=f"&wait=0&subscriber={sub}").json()
        self.assertEqual((again["subscriber"], len(again["frames"])), (sub, 1))

    def test_p9_page_and_agent_both_poll(self) -> None:
        self.register()
        page = self.poll(query="&direction=inbound&wait=0").json()["subscriber"]
        agent = self.poll(query="&direction=outbound&wait=0").json()["subscriber"]
        self.post(f"/sess/inbox?token={TOKEN}", raw=LIST)
        frames = self.poll(query=f"&direction=inbound&wait=0&subscriber={page}").json()["frames"]
        self.assertEqual([json.loads(f).get("method") for f in frames], ["notifications/peer_joined", "tools/list"])
        self.post(f"/sess/outbox?token={TOKEN}", raw=REPLY)
        got = self.poll(query=f"&direction=outbound&wait=0&subscriber={agent}").json()["frames"]
        self.assertEqual([json.loads(f) for f in got], [{"jsonrpc": "2.0", "id": 1, "result": {"tools": []}}])

    def test_p12_labelled_pollers(self) -> None:
        self.register()
        alice = self.poll(query="&direction=outbound&wait=0&client=alice").json()["subscriber"]
        mallory = self.poll(query="&direction=outbound&wait=0&client=mallory").json()["subscriber"]
        self.post(f"/sess/inbox?token={TOKEN}&client=alice", raw=b'{"jsonrpc":"2.0","id":7,"method":"x"}')
        self.post(f"/sess/outbox?token={TOKEN}", raw=b'{"jsonrpc":"2.0","id":7,"result":{}}')
        a = self.poll(query=f"&direction=outbound&wait=0&subscriber={alice}").json()["frames"]
        m = self.poll(query=f"&direction=outbound&wait=0&subscriber={mallory}").json()["frames"]
        self.assertEqual((len(a), m), (1, []))

    def test_p14_poll_after_unregister_is_410(self) -> None:
        self.register()
        self.post(f"/sess/unregister?token={TOKEN}")
        reply = self.poll(query="&wait=0")
        self.assertEqual((reply.code, reply.body), (410, b'{"error":"session_gone"}'))

    def test_p15_unregister_releases_parked_poll(self) -> None:
        self.register()
        parked = self.park(query="&direction=outbound&wait=10000")
        self.assertEqual((self.tunnel.parked_polls(), parked.received()), (1, b""))
        self.post(f"/sess/unregister?token={TOKEN}")
        reply = parked.reply()  # at once, not at the end of its wait
        self.assertEqual((reply.code, reply.json()["frames"]), (200, []))

    def test_php4_first_frame_before_subscriber_reaches_first_poller(self) -> None:
        self.register()
        init = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}'
        self.assertEqual(self.post(f"/sess/inbox?token={TOKEN}", raw=init).code, 200)
        frames = self.poll(query="&direction=inbound&wait=0").json()["frames"]
        self.assertEqual([json.loads(f)["method"] for f in frames], ["initialize"])
        self.assertEqual(self.poll(query="&direction=inbound&wait=0").json()["frames"], [])  # PHP5


class PollsBesideStreams(InMemoryMcpCase):
    """Polls announced on, and told apart from, an SSE stream."""

    def test_p10_new_poller_announced_on_page_sse(self) -> None:
        self.register()
        page = self.events()
        sub = self.poll(query="&direction=outbound&wait=0").json()["subscriber"]
        self.wing.advance(0)
        joined = mcp_events(page)[0].json()
        self.assertEqual((joined["method"], joined["params"]["subscriberId"]), ("notifications/peer_joined", sub))

    def test_p11_three_polls_one_peer_joined(self) -> None:
        self.register()
        page = self.events()
        sub = self.poll(query="&direction=outbound&wait=0").json()["subscriber"]
        for _ in range(2):
            self.poll(query=f"&direction=outbound&wait=0&subscriber={sub}")
        self.post(f"/sess/inbox?token={TOKEN}", raw=LIST)  # a marker after the polls
        self.wing.advance(0)
        methods = [m.json().get("method") for m in mcp_events(page)]
        self.assertEqual(methods, ["notifications/peer_joined", "tools/list"])

    def test_p13_sse_id_not_adopted(self) -> None:
        self.register()
        page = self.events()
        self.events(query="&direction=outbound")
        self.wing.advance(0)
        sse_id = mcp_events(page)[0].json()["params"]["subscriberId"]
        reply = self.poll(query=f"&direction=outbound&wait=0&subscriber={sse_id}")
        self.assertEqual(reply.code, 200)
        self.assertNotEqual(reply.json()["subscriber"], sse_id)


class SlowReaderTests(InMemoryMcpCase):
    flags = {"mcp-queue-frames": "5"}

    def test_decision9_sse_subscriber_that_never_reads_is_cut_off(self) -> None:
        """A client that stops reading: its stream is paused, then closed past the frame bound."""
        self.register()
        stream = self.events()
        self.assertEqual(stream.status(), 200)
        (sse,) = list(self.service.resource.hub.streams)
        sse.pauseProducing()  # what the transport does once the client's window is full
        for i in range(10):
            self.post(f"/sess/inbox?token={TOKEN}", raw=note(i))
        self.assertTrue(sse.closed)
        self.wing.advance(0)
        self.assertTrue(stream.ended())
