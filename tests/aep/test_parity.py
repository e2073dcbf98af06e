"""aep.md §9.5: the extra parity tests derived from the reference relay's code, where tests/aep/test_http.py
does not already cover them (426/415, 413s, /healthz with a token, 401 CORS and the preflight live there).
"""

from __future__ import annotations

import json
from typing import Any

from twisted.internet import threads
from twisted.trial.unittest import TestCase

from relayd.aep.core.backlog import HARD_BACKLOG
from relayd.aep.core.event import Event
from relayd.aep.core.filters import match_all
from relayd.aep.http import SSESubscriber
from tests.support.aep import (
    AUTH,
    TOKEN,
    AEPRelay,
    aep_in_memory,
    comments_of,
    event,
    events_of,
    open_sse,
    open_ws,
    post_in_memory,
    replay_in_memory,
    seqs,
    start_relay,
    stream_in_memory,
    subscribe,
)
from tests.support.inmemory import InMemoryWing
from tests.support.raw import raw_exchange
from tests.support.sse import SSEClient
from tests.support.ws import WSClient
from tests.web.test_sse import Harness

NDJSON = {"aep-version": "0.1", "content-type": "application/x-ndjson"}


def ingest(relay: InMemoryWing, *events: dict[str, Any]) -> None:
    reply = post_in_memory(relay, *events)
    assert reply.code == 202, reply


class BatchLines(TestCase):
    def test_invalid_event_names_its_line_among_non_blank_lines(self) -> None:
        relay = aep_in_memory(self)
        live = stream_in_memory(relay)
        bad = event("b", 2)
        del bad["seq"]
        body = b"\n".join(
            [json.dumps(event("b", 0)).encode(), b"", b"   ", json.dumps(event("b", 1)).encode(), json.dumps(bad).encode(), b""]
        )
        reply = relay.post("/events", body, NDJSON)
        self.assertEqual(reply.code, 400)
        self.assertEqual(reply.json(), {"error": "invalid-event", "line": 2, "detail": "seq required (integer >= 0)"})
        # Decision AEP 5: the lines before it were not ingested either (nothing buffered, nothing fanned out).
        self.assertEqual(relay.service.relay.log.session_count(), 0)
        ingest(relay, event("after", 0))
        relay.advance(0)
        self.assertEqual([m.json()["session"] for m in events_of(live.events())], ["after"])


class Buffering(TestCase):
    def test_duplicate_is_fanned_out_live_but_replayed_once(self) -> None:
        relay = aep_in_memory(self)
        live = stream_in_memory(relay, filter={"session": "dup"})
        ev = event("dup", 0)
        ingest(relay, ev)
        ingest(relay, ev)
        relay.advance(0)
        self.assertEqual([m.json() for m in events_of(live.events())], [ev, ev])
        self.assertEqual(seqs(replay_in_memory(relay, filter={"session": "dup"})), [0])

    def test_trimming_drops_the_lowest_position_and_forgets_its_id(self) -> None:
        relay = aep_in_memory(self, aep_buffer=3)
        ingest(relay, *[event("trim", seq, "progress.status", id=f"e{seq}") for seq in (1, 2, 3)])
        ingest(relay, event("trim", 0, "progress.status", id="e0"))  # arrives late, is the lowest: dropped
        ingest(relay, event("trim", 4, "progress.status", id="e4"))  # pushes out seq 1
        self.assertEqual(seqs(replay_in_memory(relay, filter={"session": "trim"})), [2, 3, 4])
        # The id of a trimmed event is forgotten: it is admitted again.
        ingest(relay, event("trim", 5, "progress.status", id="e1"))
        ids = [m.json()["id"] for m in replay_in_memory(relay, filter={"session": "trim"}) if m.data]
        self.assertEqual(ids, ["e3", "e4", "e1"])

    def test_equal_positions_keep_arrival_order(self) -> None:
        relay = aep_in_memory(self)
        ingest(relay, event("eq", 2, id="late-2"), event("eq", 1, id="first-1"), event("eq", 1, id="second-1"))
        ids = [m.json()["id"] for m in replay_in_memory(relay, filter={"session": "eq"}) if m.data]
        self.assertEqual(ids, ["first-1", "second-1", "late-2"])

    def test_least_recently_written_session_is_evicted_at_max_sessions(self) -> None:
        relay = aep_in_memory(self, aep_max_sessions=2)
        ingest(relay, event("A", 0))
        ingest(relay, event("B", 0))
        ingest(relay, event("A", 0))  # a duplicate write still refreshes A's recency
        ingest(relay, event("C", 0))  # evicts B, the least recently written
        self.assertEqual([m.json()["session"] for m in replay_in_memory(relay, from_="all") if m.data], ["A", "C"])


class Resume(TestCase):
    def test_last_event_id_resumes(self) -> None:
        relay = aep_in_memory(self)
        ingest(relay, *[event("a:b", seq, "progress.status") for seq in range(4)])  # a session with a colon
        resumed = stream_in_memory(relay, {"last-event-id": "a:b:0:1"}, filter={"session": "a:b"})
        self.assertEqual(seqs(resumed.events()), [2, 3])

    def test_from_overrides_last_event_id(self) -> None:
        relay = aep_in_memory(self)
        ingest(relay, *[event("ov", seq, "progress.status") for seq in range(4)])
        replay = replay_in_memory(relay, {"last-event-id": "ov:0:0"}, from_=[{"session": "ov", "epoch": 0, "seq": 2}])
        self.assertEqual(seqs(replay), [3])

    def test_malformed_last_event_id_is_ignored(self) -> None:
        relay = aep_in_memory(self)
        ingest(relay, event("m", 0))
        for value in ("m:0", "m:x:1", "m:0:-1", ":0:1"):
            replay = stream_in_memory(relay, {"last-event-id": value}, live="0")
            self.assertEqual(replay.head().code, 200, value)
            self.assertTrue(replay.ended(), value)
            self.assertEqual(comments_of(replay.events()), ["replay-complete"])


class ResumeOnTheWire(TestCase):
    """Resume beside a WebSocket emitter (the upgrade needs a socket)."""

    async def test_id_line_absent_for_agent_events_and_commands_and_agent_events_never_replayed(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        stream = await open_sse(self, relay, AUTH)
        target = await open_ws(self, relay, AUTH, hello={"role": "emitter", "identity": {"agent": "t"}})
        target.send(event("cmds", 0))
        await target.roundtrip()
        claimed = await stream.next_event()
        self.assertEqual(claimed.id, "cmds:0:0")
        self.assertEqual(claimed.fields, ["event", "data", "id"])  # framing order

        heartbeat = event(None, None, "agent.heartbeat")
        await relay.post(heartbeat, token=TOKEN)
        msg = await stream.next_event()
        self.assertEqual((msg.event, msg.id, msg.fields), ("agent.heartbeat", None, ["event", "data"]))

        await relay.post(event("cmds", None, "control.pause", id="pause-1", data={}), token=TOKEN)
        msg = await stream.next_event()
        self.assertEqual((msg.event, msg.id, msg.fields), ("control.pause", None, ["event", "data"]))

        history = await open_sse(self, relay, AUTH, live="0", from_="all")
        self.assertEqual([m.event for m in await history.read_until_end() if m.data], ["session.started"])


class SocketFrames(TestCase):
    async def test_unsubscribe_of_unknown_id_still_answers(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={})
        client.send({"type": "unsubscribe", "id": "never-subscribed"})
        self.assertEqual(await client.recv(), {"type": "unsubscribed", "id": "never-subscribed"})

    async def test_unsubscribe_stops_delivery(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={})
        await subscribe(self, client, "u", filter={"session": "un"})
        client.send({"type": "unsubscribe", "id": "u"})
        self.assertEqual(await client.recv(), {"type": "unsubscribed", "id": "u"})
        await relay.post(event("un", 0))
        self.assertEqual(await client.roundtrip(), [])


class SocketEndpoint(TestCase):
    async def test_hello_reply_is_exact(self) -> None:
        relay = await start_relay(self, aep_buffer=8)
        client = await open_ws(self, relay)
        reply = await client.hello(role="consumer", identity={"agent": "me"}, capabilities={"filters": ["attr-match"]})
        discovery = json.loads((await relay.get("/events"))[1])
        self.assertEqual(
            reply,
            {"type": "hello", "versions": ["0.1"], "role": "both", "identity": {"agent": "aep-relay"},
             "capabilities": discovery["capabilities"]},
        )  # fmt: skip

    async def test_a_second_hello_is_ignored(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={"role": "consumer"})
        client.send({"type": "hello", "versions": ["9.9"], "role": "emitter"})
        self.assertEqual(await client.roundtrip(), [])
        client.send({"type": "roster", "id": "still-consumer"})
        self.assertEqual((await client.recv())["type"], "roster")  # the first hello's role stands

    async def test_connections_count_before_hello_but_list_after(self) -> None:
        relay = await start_relay(self)
        waiting = await open_ws(self, relay)
        _, body = await relay.get("/healthz")
        self.assertEqual(json.loads(body)["connections"], 1)
        _, body = await relay.get("/connections")
        self.assertEqual(json.loads(body)["connections"], [])
        await waiting.hello(role="emitter", identity={"agent": "e"}, capabilities={"control": {"accepts": ["control.pause"]}})
        waiting.send(event("listed", 0))
        await waiting.roundtrip()
        _, body = await relay.get("/connections")
        doc = json.loads(body)
        self.assertEqual(
            doc["connections"],
            [{"role": "emitter", "identity": {"agent": "e"}, "accepts": ["control.pause"], "sessions": ["listed"], "subscriptions": 0}],
        )
        self.assertEqual(list(doc["relay"]), ["sessions", "subscribers", "connections", "uptime_s", "control"])

    async def test_socket_needs_the_token_and_takes_it_from_the_query(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        with self.assertRaises(ConnectionError):  # the opening handshake is refused (401)
            await WSClient.connect(relay.ws_url)
        client = await WSClient.connect(relay.ws_url + f"?access_token={TOKEN}")
        self.addCleanup(client.close)
        self.assertEqual((await client.hello())["type"], "hello")

    async def test_plain_http_at_socket_is_404(self) -> None:
        relay = await start_relay(self)
        response, body = await relay.request("GET", "/socket")
        self.assertEqual((response.code, body), (404, b""))
        for method in ("POST", "PUT"):  # other methods than the upgrade's GET: 405
            response, body = await relay.request(method, "/socket")
            self.assertEqual(response.code, 405, method)
            self.assertEqual(response.headers.getRawHeaders("allow"), ["GET"])


class CommandRouting(TestCase):
    async def emitter(self, relay, session: str, agent: str, accepts=None) -> WSClient:
        caps = {} if accepts is None else {"control": {"accepts": accepts}}
        client = await open_ws(self, relay, AUTH, hello={"role": "emitter", "identity": {"agent": agent}, "capabilities": caps})
        client.send(event(session, 0, agent=agent, source=f"aep://t/agent/{agent}/session/{session}"))
        await client.roundtrip()
        return client

    async def test_ambiguous_when_two_emitters_claim_the_session(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        stream = await open_sse(self, relay, AUTH, filter={"type": ["control.pause"]})
        one = await self.emitter(relay, "shared", "one")
        two = await self.emitter(relay, "shared", "two")
        sender = await open_ws(self, relay, AUTH, hello={"role": "consumer"})
        sender.send(event("shared", None, "control.pause", id="amb", data={}))
        reply = await sender.recv()
        self.assertEqual(
            reply,
            {"type": "error", "code": "ambiguous", "cause": "amb", "detail": "2 connected emitters claim session shared"},
        )
        self.assertEqual(await one.roundtrip(), [])
        self.assertEqual(await two.roundtrip(), [])
        # Not fanned out: the next thing on the audit stream is a later, routable command.
        await two.close()
        sender.send(event("shared", None, "control.pause", id="routed", data={}))
        self.assertEqual((await one.recv())["id"], "routed")
        self.assertEqual((await stream.next_event()).json()["id"], "routed")

    async def test_unsupported_is_refused_not_forwarded_but_still_fanned_out(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        stream = await open_sse(self, relay, AUTH, filter={"session": "picky"})
        target = await self.emitter(relay, "picky", "picky", accepts=["control.cancel"])
        await stream.next_event()  # the claiming session.started
        sender = await open_ws(self, relay, AUTH, hello={"role": "consumer"})
        cmd = event("picky", None, "control.pause", id="unsup", data={})
        sender.send(cmd)
        reply = await sender.recv()
        self.assertEqual(
            reply,
            {"type": "error", "code": "unsupported", "cause": "unsup", "detail": "target does not accept control.pause"},
        )
        self.assertEqual(await target.roundtrip(), [])
        self.assertEqual((await stream.next_event()).json(), cmd)

    async def test_accepts_not_declared_forwards_everything(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        target = await self.emitter(relay, "open", "open")
        sender = await open_ws(self, relay, AUTH, hello={"role": "consumer"})
        cmd = event("open", None, "x.acme.control.reboot", id="vendor", data={})
        sender.send(cmd)
        self.assertEqual(await target.recv(), cmd)
        self.assertEqual(await sender.roundtrip(), [])  # no refusal, no ack from the relay

    async def test_posted_command_with_token_is_routed_and_audited(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        stream = await open_sse(self, relay, AUTH, filter={"type": ["control.*"]})
        target = await self.emitter(relay, "via-http", "t", accepts=["control.cancel"])
        cancel = event("via-http", None, "control.cancel", id="http-cancel", data={"scope": "run"})
        pause = event("via-http", None, "control.pause", id="http-pause", data={})  # unsupported: refusal dropped
        nowhere = event("nobody", None, "control.pause", id="http-nowhere", data={})  # no-route: dropped
        response, _ = await relay.post(cancel, pause, nowhere, token=TOKEN)
        self.assertEqual(response.code, 202)
        self.assertEqual(await target.roundtrip(), [cancel])
        self.assertEqual([(await stream.next_event()).json()["id"] for _ in range(2)], ["http-cancel", "http-pause"])
        await relay.post(event("via-http", None, "control.resume", id="sync"), token=TOKEN)
        self.assertEqual((await stream.next_event()).json()["id"], "sync")  # no-route was not fanned out

    async def test_without_token_a_ws_command_is_unauthorized_and_not_fanned_out(self) -> None:
        relay = await start_relay(self)
        stream = await open_sse(self, relay)
        client = await open_ws(self, relay, hello={})
        client.send(event("nt", 0))
        self.assertEqual((await stream.next_event()).event, "session.started")
        client.send(event("nt", None, "control.resume", id="noauth", data={}))
        reply = await client.recv()
        self.assertEqual((reply["type"], reply["code"], reply["cause"]), ("error", "unauthorized", "noauth"))
        self.assertIn("AEP_TOKEN", reply["detail"])
        self.assertEqual(await client.roundtrip(), [])
        await relay.post(event("nt", 1, "progress.status"))
        self.assertEqual((await stream.next_event()).event, "progress.status")


class Backpressure(TestCase):
    """aep.md §4/§5: above 1 MiB queued, events below `notice` are dropped; above 8 MiB the consumer is cut off."""

    async def test_websocket_drops_below_notice_past_one_mib_and_keeps_frames(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={"role": "consumer"})
        await subscribe(self, client, "soft", filter={"session": "soft"})
        blob = "x" * (256 * 1024)
        # The client stops reading; 6 MiB of notice events fill the kernel's buffers and leave
        # more than 1 MiB (and less than 8) queued in the relay.
        client.protocol.transport.pauseProducing()
        burst = [event("soft", seq, "progress.status", severity="notice", data={"m": blob}) for seq in range(24)]
        burst += [event("soft", seq, "progress.status", data={"m": "info"}) for seq in range(24, 27)]  # info: dropped
        burst += [event("soft", 27, "progress.status", severity="warning", data={"m": "kept"})]
        response, _ = await relay.post(*burst)
        self.assertEqual(response.code, 202)
        client.protocol.transport.resumeProducing()
        received = [await client.recv() for _ in range(25)]
        self.assertEqual([e["seq"] for e in received], [*range(24), 27])
        self.assertEqual(await client.roundtrip(), [])  # still open; frames still answered

    def test_sse_drops_below_notice_past_one_mib_and_cuts_off_past_eight(self) -> None:
        harness = Harness(max_buffer=HARD_BACKLOG)
        stream, transport, _ = harness.open()
        sub = SSESubscriber(match_all, None, stream)
        stream.pauseProducing()  # the client stopped reading
        big = Event.of(event("sse", 0, severity="notice", data={"m": "x" * (512 * 1024)}), None)
        sub.send(big)
        sub.send(big)
        self.assertGreater(stream.backlog, 1024 * 1024)
        before = stream.backlog
        sub.send(Event.of(event("sse", 1), None))  # info: dropped silently
        self.assertEqual((stream.backlog, sub.dropped), (before, 1))
        sub.send(Event.of(event("sse", 2, severity="notice"), None))  # notice: never dropped silently
        self.assertGreater(stream.backlog, before)
        while not stream.closed:
            sub.send(big)
        self.assertTrue(transport.disconnecting)  # cut off; the client resumes by position


class Shutdown(TestCase):
    async def test_sse_gets_shutting_down_and_websocket_1001(self) -> None:
        relay = await AEPRelay.start()
        stream = await SSEClient.connect(relay.url + "/stream")
        self.addCleanup(stream.close)
        client = await WSClient.connect(relay.ws_url)
        self.addCleanup(client.close)
        await client.hello()
        await relay.stop()
        messages = await stream.read_until_end()
        self.assertEqual(comments_of(messages), ["shutting-down"])
        self.assertEqual(await client.closed, (1001, "shutting down"))


class HeaderLimits(TestCase):
    async def test_request_line_over_16_kib_gets_431_not_a_dropped_connection(self) -> None:
        relay = await start_relay(self)
        long_from = "x" * 17000
        request = f"GET /stream?from={long_from} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()
        reply = await threads.deferToThread(raw_exchange, relay.url, request)
        self.assertTrue(reply.startswith(b"HTTP/1.1 431 "), reply[:60])
        headers = b"".join(f"x-h{i}: {'v' * 100}\r\n".encode() for i in range(200))
        reply = await threads.deferToThread(raw_exchange, relay.url, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n" + headers + b"\r\n")
        self.assertTrue(reply.startswith(b"HTTP/1.1 431 "), reply[:60])
        response, _ = await relay.get("/healthz")
        self.assertEqual(response.code, 200)
