"""decisions.md "AEP relay": one test per deliberate difference from the reference relay (AEP 1-14); those
whose subject is the relay's answers and streams, not the wire or the WebSocket, in memory."""

from __future__ import annotations

import json

from twisted.trial.unittest import TestCase

import relayd.aep.core.event as event_module
from relayd.aep.config import SETTINGS
from relayd.base.config import is_loopback_endpoint, resolve
from tests.support.aep import (
    AUTH,
    TOKEN,
    aep_in_memory,
    comments_of,
    event,
    events_of,
    open_sse,
    open_ws,
    post_in_memory,
    replay_in_memory,
    start_relay,
    stream_in_memory,
    subscribe,
)
from tests.support.sse import SSEClient

NDJSON = {"aep-version": "0.1", "content-type": "application/x-ndjson"}
JSON = {"aep-version": "0.1", "content-type": "application/json"}


class Decisions(TestCase):
    async def test_decision_01_websocket_replay_applies_the_capture_ceiling(self) -> None:
        relay = await start_relay(self)
        await relay.post(
            event("d1", 0, "run.started", capture="redacted", data={"prompt": "secret words", "trigger": "user"}),
            event("d1", 1, "tool.completed", capture="full", data={"result": "stdout", "digest": "sha256:ab"}),
        )
        client = await open_ws(self, relay, hello={"role": "consumer"})
        replay = await subscribe(self, client, "cap", filter={"session": "d1"}, from_="all", capture="metadata")
        self.assertEqual(
            replay,
            [
                event("d1", 0, "run.started", capture="metadata", data={"trigger": "user"}),
                event("d1", 1, "tool.completed", capture="metadata", data={"digest": "sha256:ab"}),
            ],
        )
        # And the same ceiling live.
        await relay.post(event("d1", 2, "run.started", capture="full", data={"prompt": "more", "trigger": "api"}))
        self.assertEqual((await client.recv())["data"], {"trigger": "api"})

    async def test_decision_02_null_and_malformed_input_never_crash_or_kill(self) -> None:
        relay = await start_relay(self, allow_origin=["*"])
        client = await open_ws(self, relay)
        client.send_raw(b"null")
        self.assertEqual((await client.recv())["code"], "bad-json")
        self.assertEqual((await client.hello())["type"], "hello")  # still open, hello still possible
        for raw in (b"null", b"[null]", b"42", b'"text"', b"{", b'{"type": null}'):
            client.send_raw(raw)
        for _ in range(5):
            self.assertEqual((await client.recv())["code"], "bad-json")
        for bad_from in ([None], [{"session": None}], [{"session": "s", "seq": "1"}], [{"session": "s", "epoch": -1}], [1]):
            client.send({"type": "subscribe", "id": "f", "filter": {}, "from": bad_from})
            reply = await client.recv()
            self.assertEqual((reply["type"], reply["code"], reply["id"]), ("error", "invalid-filter", "f"), bad_from)
        client.send({"aep": "0.1", "type": "session.started"})
        self.assertEqual((await client.recv())["code"], "invalid-event")
        self.assertEqual(await client.roundtrip(), [])  # every refusal left the connection open

        for bad_from in ("[null]", '[{"session":null}]', '[{"session":"s","seq":1.5}]', "[[]]", '[{"session":"s","epoch":true}]'):
            stream = await SSEClient.connect(relay.url + "/stream?from=" + bad_from)
            self.assertEqual(stream.code, 400, bad_from)
            self.assertEqual(stream.header("access-control-allow-origin"), "*")
            self.assertIsNone(stream.header("content-type"))
        response, _ = await relay.get("/healthz")
        self.assertEqual(response.code, 200)

    async def test_decision_03_positions_are_exact_integers_for_any_epoch(self) -> None:
        relay = await start_relay(self)
        for base in (8192, 2**53 + 1, 1_732_000_000_000, 2**64 + 1):
            session = f"e{base}"
            lines = [
                # Out of order on purpose; as floats, base and base+1 (and seq 1 and 2) would collide.
                f'{{"aep":"0.1","id":"{session}-{e}-{s}","type":"progress.status","time":"t","source":"aep://x",'
                f'"agent":"a","session":"{session}","epoch":{base + e},"seq":{s}}}'.encode()
                for e, s in ((1, 2), (0, 2), (1, 1), (0, 1))
            ]
            response, _ = await relay.request("POST", "/events", b"\n".join(lines), NDJSON)
            self.assertEqual(response.code, 202)
            everything = await open_sse(self, relay, live="0", filter={"session": session})
            got = [(m.json()["epoch"], m.json()["seq"], m.id) for m in events_of(await everything.read_until_end())]
            expected = [(base + e, s) for e, s in ((0, 1), (0, 2), (1, 1), (1, 2))]
            self.assertEqual(got, [(e, s, f"{session}:{e}:{s}") for e, s in expected])
            resumed = await open_sse(
                self, relay, live="0", from_=[{"session": session, "epoch": base, "seq": 2}]
            )
            self.assertEqual(
                [(m.json()["epoch"], m.json()["seq"]) for m in events_of(await resumed.read_until_end())],
                [(base + 1, 1), (base + 1, 2)],
            )
            client = await open_ws(self, relay, hello={})
            replay = await subscribe(self, client, "r", from_=[{"session": session, "epoch": base, "seq": 2}])
            self.assertEqual([(e["epoch"], e["seq"]) for e in replay], [(base + 1, 1), (base + 1, 2)])

    async def test_decision_05_a_batch_is_validated_whole(self) -> None:
        relay = await start_relay(self)
        stream = await open_sse(self, relay)
        client = await open_ws(self, relay, hello={})
        await subscribe(self, client, "all")
        bad = event("d5", 3, severity="loud")
        response, body = await relay.post(event("d5", 0), event("d5", 1), event("d5", 2), bad, event("d5", 4))
        self.assertEqual(response.code, 400)
        self.assertEqual(json.loads(body), {"error": "invalid-event", "line": 3, "detail": "bad severity"})
        self.assertEqual(relay.core.log.session_count(), 0)
        self.assertEqual(await client.roundtrip(), [])
        await relay.post(event("later", 0))
        self.assertEqual((await stream.next_event()).json()["session"], "later")

    async def test_decision_06_the_capture_ceiling_is_validated(self) -> None:
        relay = await start_relay(self, allow_origin=["*"])
        for value in ("bogus", "FULL", "meta"):
            stream = await SSEClient.connect(relay.url + "/stream?capture=" + value)
            self.assertEqual(stream.code, 400, value)
            self.assertEqual(stream.header("access-control-allow-origin"), "*")
        client = await open_ws(self, relay, hello={})
        for value in ("bogus", 3, ["full"], {"level": "none"}):
            client.send({"type": "subscribe", "id": "c", "capture": value})
            reply = await client.recv()
            self.assertEqual((reply["type"], reply["code"], reply["id"]), ("error", "invalid-filter", "c"), value)
        for value in ("none", "metadata", "redacted", "full"):
            await subscribe(self, client, value, capture=value)
            stream = await open_sse(self, relay, capture=value)
            self.assertEqual(stream.code, 200)

    async def test_decision_07_closing_on_backpressure_carries_delivered(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={"role": "consumer"})
        await subscribe(self, client, "bp", filter={"session": "bp"})
        # The client stops reading; 20 MiB of `notice` events (never dropped silently) fill the
        # kernel's buffers, then the relay's queue past its 8 MiB bound, and it gives up on the
        # connection with a `closing` frame. Then the client reads again and sees it all.
        client.protocol.transport.pauseProducing()
        blob = "x" * (256 * 1024)
        burst = [event("bp", seq, "progress.status", severity="notice", data={"message": blob}) for seq in range(80)]
        for half in (burst[:40], burst[40:]):
            response, _ = await relay.post(*half)
            self.assertEqual(response.code, 202)
        client.protocol.transport.resumeProducing()
        received = []
        while True:
            msg = await client.recv()
            if msg is None:
                break
            received.append(msg)
        self.assertEqual(await client.closed, (1013, "backpressure"))
        closing = received[-1]
        delivered_events = received[:-1]
        self.assertEqual(closing["type"], "closing")
        self.assertEqual(closing["reason"], "backpressure")
        self.assertGreater(len(delivered_events), 0)
        self.assertLess(len(delivered_events), len(burst))
        last = delivered_events[-1]
        self.assertEqual(closing["delivered"], [{"sub": "bp", "session": "bp", "epoch": 0, "seq": last["seq"]}])
        self.assertEqual(seqs_of(delivered_events), list(range(len(delivered_events))))

    async def test_decision_08_a_reused_subscription_id_replaces_the_subscription(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={})
        await subscribe(self, client, "same", filter={"session": "old"})
        await subscribe(self, client, "same", filter={"session": "new"})
        await relay.post(event("old", 0), event("new", 0))
        self.assertEqual([e["session"] for e in await client.roundtrip()], ["new"])
        client.send({"type": "unsubscribe", "id": "same"})
        self.assertEqual(await client.recv(), {"type": "unsubscribed", "id": "same"})
        await relay.post(event("new", 1, "progress.status"))
        self.assertEqual(await client.roundtrip(), [])  # nothing leaked
        _, body = await relay.get("/healthz")
        self.assertEqual(json.loads(body)["subscribers"], 0)

    async def test_decision_11_default_bind_is_loopback(self) -> None:
        listen = resolve(SETTINGS, {}, {})["aep-listen"]
        self.assertEqual(listen, ["tcp:8787:interface=127.0.0.1"])
        self.assertTrue(all(is_loopback_endpoint(d) for d in listen))

    async def test_decision_12_fanout_forwards_posted_bytes_and_serialises_once_per_level(self) -> None:
        relay = await start_relay(self)
        calls = []
        real_dumps = event_module.dumps
        self.patch(event_module, "dumps", lambda obj: calls.append(obj) or real_dumps(obj))
        plain = [await open_sse(self, relay) for _ in range(2)]
        capped = [await open_sse(self, relay, capture="metadata") for _ in range(3)]
        sockets = [await open_ws(self, relay, hello={}) for _ in range(2)]
        for client in sockets:
            await subscribe(self, client, "m", capture="metadata")
        posted = (
            b'{ "type" : "tool.completed", "aep":"0.1", "id":"d12\\u0041", "time":"t", "source":"aep://x",'
            b'  "agent":"a", "session":"d12", "seq":0, "capture":"full", "data":{"result":"\\u00e9", "digest":"d"} }'
        )
        response, _ = await relay.request("POST", "/events", posted, JSON)
        self.assertEqual(response.code, 202)
        for stream in plain:
            self.assertEqual((await stream.next_event()).data.encode(), posted)  # byte identity, as posted
        compact = b'{"type":"tool.completed","aep":"0.1","id":"d12A","time":"t","source":"aep://x","agent":"a",' \
                  b'"session":"d12","seq":0,"capture":"metadata","data":{"digest":"d"}}'
        for stream in capped:
            self.assertEqual((await stream.next_event()).data.encode(), compact)
        for client in sockets:
            self.assertEqual(await client.recv_raw(), compact)
        self.assertEqual(len(calls), 1)  # one serialisation for five downlevelled subscribers

        # A posted body with line breaks cannot go out as is: compact, serialised once for everyone.
        calls.clear()
        pretty = json.dumps(event("d12", 1, "progress.status"), indent=2).encode()
        await relay.request("POST", "/events", pretty, JSON)
        for stream in plain:
            self.assertEqual((await stream.next_event()).data.encode(), json.dumps(event("d12", 1, "progress.status"), separators=(",", ":")).encode())
        for stream in capped:
            await stream.next_event()
        self.assertEqual(len(calls), 1)

    async def test_decision_14_commands_agent_events_and_errors_are_never_buffered(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        target = await open_ws(self, relay, AUTH, hello={"role": "emitter", "identity": {"agent": "t"}})
        target.send(event("d14", 0, agent="t"))
        await target.roundtrip()
        sender = await open_ws(self, relay, AUTH, hello={"role": "both"})
        await subscribe(self, sender, "acks", filter={"type": ["control.accepted", "control.rejected"]})
        cmd = event("d14", None, "control.pause", id="c14", data={})
        sender.send(cmd)
        self.assertEqual(await target.recv(), cmd)
        sender.send(event("nobody", None, "control.pause", id="c14-elsewhere", data={}))
        self.assertEqual((await sender.recv())["code"], "no-route")
        sender.send({"aep": "0.1", "id": "broken", "type": "session.started"})
        self.assertEqual((await sender.recv())["code"], "invalid-event")
        await relay.post(event(None, None, "agent.heartbeat"), token=TOKEN)
        self.assertEqual(await sender.roundtrip(), [])  # the relay never acks a command
        history = await open_sse(self, relay, AUTH, live="0", from_="all")
        messages = await history.read_until_end()
        self.assertEqual([m.event for m in events_of(messages)], ["session.started"])
        self.assertEqual(comments_of(messages), ["replay-complete"])


def seqs_of(events: list[dict]) -> list[int]:
    return [e["seq"] for e in events]


class DecisionsInMemory(TestCase):
    """The decisions whose subject is what the relay answers and streams, not the wire: in memory."""

    def test_decision_04_attention_routed_without_seq_is_live_only(self) -> None:
        relay = aep_in_memory(self)
        stream = stream_in_memory(relay, filter={"session": "d4"})
        routed = event("d4", None, "attention.routed", subject="req-1", data={"to": "human"})
        self.assertEqual(post_in_memory(relay, routed).code, 202)
        relay.advance(0)
        (msg,) = events_of(stream.events())
        self.assertEqual((msg.json(), msg.id), (routed, None))
        self.assertEqual(events_of(replay_in_memory(relay, from_="all")), [])
        self.assertEqual(relay.service.relay.log.session_count(), 0)
        reply = post_in_memory(relay, event("d4", 3, "attention.routed"))
        self.assertEqual((reply.code, reply.json()["error"]), (400, "invalid-event"))

    def test_decision_09_body_limit_counts_bytes_and_utf8_is_decoded_whole(self) -> None:
        relay = aep_in_memory(self, aep_max_body=600)
        stream = stream_in_memory(relay)
        text = "h\u00e9llo \u2603 \U0001f600"
        body = json.dumps(event("d9", 0, data={"text": text}), ensure_ascii=False).encode()
        split = body.index("\u2603".encode()) + 1  # inside the three bytes of the snowman
        chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (split, body[:split], len(body) - split, body[split:])
        connection = relay.connect()
        connection.send(
            b"POST /events HTTP/1.1\r\nHost: localhost\r\naep-version: 0.1\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n" + chunked
        )
        self.assertEqual(connection.reply().code, 202)
        relay.advance(0)
        (msg,) = events_of(stream.events())
        self.assertEqual(msg.json()["data"]["text"], text)
        self.assertEqual(msg.data.encode(), body)

        wide = json.dumps(event("d9", 1, data={"text": "\u00e9" * 250}), ensure_ascii=False).encode()
        self.assertLess(len(wide.decode()), 600)
        self.assertGreater(len(wide), 600)
        reply = relay.post("/events", wide, JSON)
        self.assertEqual((reply.code, reply.json()["error"]), (413, "payload-too-large"))

        reply = relay.post("/events", body.replace("\u2603".encode(), b"\xe2\x98"), JSON)
        self.assertEqual((reply.code, reply.json()["error"]), (400, "invalid-json"))

    def test_decision_10_sse_headers_are_flushed_on_subscribe(self) -> None:
        relay = aep_in_memory(self, allow_origin=["*"])  # heartbeat 25 s: no ping will come to the rescue
        stream = stream_in_memory(relay)
        head = stream.head()
        self.assertEqual(head.code, 200)
        self.assertEqual(head.header("content-type"), "text/event-stream")
        self.assertEqual(head.header("cache-control"), "no-cache")
        self.assertEqual(head.header("access-control-allow-origin"), "*")
        self.assertEqual(stream.body(), b"")

    def test_decision_13_capture_annotations_are_relayd_data(self) -> None:
        # No schema files are consulted: the relay prunes field by field from its own table.
        relay = aep_in_memory(self)
        stream = stream_in_memory(relay, capture="metadata")
        post_in_memory(
            relay,
            event("d13", 0, capture="full", data={"label": "my laptop", "cwd": "/home/me", "client": "claude-code"}),
            event("d13", 1, "x.acme.custom.thing", capture="full", data={"anything": 1}),
        )
        relay.advance(0)
        first, second = (m.json() for m in events_of(stream.events()))
        self.assertEqual((first["capture"], first["data"]), ("metadata", {"client": "claude-code"}))
        self.assertEqual(second["capture"], "metadata")
        self.assertNotIn("data", second)
