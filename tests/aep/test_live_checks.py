"""aep.md §9.1: the checks of the upstream live.js conformance tool, items 1-15, against relayd in-process.

Item 14 runs without a token, item 15 with one; items 11-12 (the opt-in ``--evict`` checks) run with a
buffer of 8 over both SSE ``live=0`` and WebSocket, at the "strict" byte-identity grade.
"""

from __future__ import annotations

import json
import re

from twisted.trial.unittest import TestCase

from tests.support.aep import (
    AUTH,
    TOKEN,
    OnRedis,
    comments_of,
    event,
    events_of,
    open_sse,
    open_ws,
    seqs,
    start_relay,
    subscribe,
    valid,
)
from tests.support.redis import session_key

CLOSED_CODES = {"invalid-filter", "unknown-dialect", "unauthorized", "limit-exceeded"}


class LiveChecks(TestCase):
    async def test_01_discovery(self) -> None:
        relay = await start_relay(self)
        response, body = await relay.get("/events")
        self.assertEqual(response.code, 200)
        self.assertEqual(response.headers.getRawHeaders("content-type"), ["application/json"])
        doc = json.loads(body)
        self.assertIsInstance(doc["aep"], list)
        self.assertIn("0.1", doc["aep"])
        self.assertIsInstance(doc["endpoints"]["events"], str)
        self.assertIsInstance(doc["endpoints"]["stream"], str)
        response, well_known = await relay.get("/.well-known/aep")
        self.assertEqual((response.code, json.loads(well_known)), (200, doc))

    async def test_02_version_gate(self) -> None:
        relay = await start_relay(self)
        response, body = await relay.post(event(), headers={"aep-version": "9.9"})
        self.assertEqual(response.code, 426)
        self.assertIsInstance(json.loads(body)["versions"], list)

    async def test_03_reject_invalid(self) -> None:
        relay = await start_relay(self)
        ev = event()
        del ev["id"]
        response, body = await relay.post(ev)
        self.assertEqual(response.code, 400)
        self.assertIsInstance(json.loads(body)["error"], str)
        self.assertEqual(relay.core.log.session_count(), 0)

    async def test_04_ingest_fanout(self) -> None:
        relay = await start_relay(self)
        stream = await open_sse(self, relay, filter={"session": "fan"})
        batch = [
            event("fan", 0, "session.started"),
            event("fan", 1, "tool.completed", data={"tool": "Bash"}),
            event("fan", 2, "session.ended"),
        ]
        await relay.post(event("other", 0))  # filtered out
        response, _ = await relay.post(*batch)
        self.assertIn(response.code, (200, 202))
        got = [(await stream.next_event()).json() for _ in batch]
        for ev in got:
            valid(self, ev)
        self.assertEqual([e["id"] for e in got], [e["id"] for e in batch])
        positions = [(e.get("epoch", 0), e["seq"]) for e in got]
        self.assertEqual(positions, sorted(positions))

    async def test_05_resume(self) -> None:
        relay = await start_relay(self)
        await relay.post(*[event("res", i, "progress.status") for i in range(3)])
        stream = await open_sse(self, relay, filter={"session": "res"}, from_=[{"session": "res", "epoch": 0, "seq": 0}])
        got = [await stream.next_event() for _ in range(2)]
        self.assertEqual(seqs(got), [1, 2])
        # No duplicate follows: the next thing on the stream is a live event posted now.
        await relay.post(event("res", 3, "progress.status"))
        self.assertEqual((await stream.next_event()).json()["seq"], 3)

    async def test_06_capture_downlevel(self) -> None:
        relay = await start_relay(self)
        canary = "CANARY-7f3e9b"
        stream = await open_sse(self, relay, filter={"session": "cap"}, capture="metadata")
        await relay.post(
            event("cap", 0, "run.started", capture="redacted", data={"prompt": f"do it {canary}", "trigger": "user"})
        )
        msg = await stream.next_event()
        self.assertNotIn(canary, msg.data)
        ev = msg.json()
        self.assertEqual(ev["capture"], "metadata")
        self.assertNotIn("prompt", ev["data"])
        self.assertEqual(ev["data"]["trigger"], "user")

    async def test_07_hello_ws(self) -> None:
        relay = await start_relay(self)
        first = await open_ws(self, relay)
        first.send(event())
        reply = await first.recv()
        self.assertEqual(reply["type"], "error")
        self.assertRegex(reply["code"], "hello")

        second = await open_ws(self, relay)
        reply = await second.hello(versions=["9.9"])
        self.assertEqual(reply["type"], "error")
        self.assertRegex(reply["code"], "version")
        self.assertIsInstance(reply["versions"], list)

        third = await open_ws(self, relay)
        reply = await third.hello()
        self.assertEqual(reply["type"], "hello")
        self.assertEqual(reply["versions"], ["0.1"])

    async def test_08_subscribe_limits(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={})
        many = [{"session": f"s{i}", "epoch": 0, "seq": 0} for i in range(1024)]
        client.send({"type": "subscribe", "id": "big", "filter": {}, "from": many})
        reply = await client.recv()
        self.assertEqual(reply["id"], "big")
        if reply["type"] != "subscribed":
            self.assertEqual(reply["type"], "error")
            self.assertIn(reply["code"], CLOSED_CODES)
        await subscribe(self, client, "after-big")

        client.send({"type": "subscribe", "id": "obj", "filter": {}, "from": {}})
        reply = await client.recv()
        self.assertEqual(reply["type"], "error")
        self.assertIn(reply["code"], CLOSED_CODES)
        self.assertEqual(reply["id"], "obj")
        await subscribe(self, client, "after-obj")
        self.assertFalse(client.closed.called)

    async def test_09_ignore_unknown(self) -> None:
        relay = await start_relay(self)
        client = await open_ws(self, relay)
        reply = await client.hello(capabilities={"zzz-unknown": {"x": 1}, "emits": ["session.*"]})
        self.assertEqual(reply["type"], "hello")
        client.send({"type": "zigzag", "id": "z", "payload": [1, 2, 3]})
        self.assertEqual(await subscribe(self, client, "after-zigzag", filter={"session": "u"}), [])
        await relay.post(event("u", 0))
        self.assertEqual((await client.recv())["id"], "u-0-session.started")

    async def test_10_replay_all(self) -> None:
        relay = await start_relay(self)
        await relay.post(event("s1", 0), event("s1", 1, "progress.status"), event("s2", 0))
        stream = await open_sse(self, relay, live="0", from_="all")
        self.assertEqual(stream.code, 200)
        messages = await stream.read_until_end()
        by_session: dict[str, list[int]] = {}
        for msg in events_of(messages):
            ev = msg.json()
            by_session.setdefault(ev["session"], []).append(ev["seq"])
        self.assertEqual(by_session, {"s1": [0, 1], "s2": [0]})
        self.assertEqual(comments_of(messages), ["replay-complete"])


class Evict(TestCase):
    """Items 11 and 12 (live.js ``--evict``) against a relay with C{AEP_BUFFER=8}."""

    BUFFER = 8

    def flood_lines(self) -> list[bytes]:
        # Deliberately not relayd's own serialisation: spaces, an escape, unusual key order.
        lines = []
        for seq in range(self.BUFFER + 8):
            ev = {
                "type": "progress.status",
                "aep": "0.1",
                "id": f"ev-{seq:04d}",
                "time": "2026-11-29T00:00:00Z",
                "source": "aep://test/agent/flood/session/flood",
                "agent": "flood",
                "session": "flood",
                "epoch": 1,
                "seq": seq,
                "data": {"message": "caf\u00e9 \u2603 " + "x" * seq, "step": seq},
            }
            line = json.dumps(ev, separators=(", ", ": "))  # ensure_ascii: \u00e9 escapes
            lines.append(line.encode())
        return lines

    async def flood(self):
        relay = await start_relay(self, aep_buffer=self.BUFFER)
        lines = self.flood_lines()
        for start in range(0, len(lines), 500):
            chunk = b"".join(line + b"\n" for line in lines[start : start + 500])
            response, _ = await relay.request(
                "POST", "/events", chunk, {"aep-version": "0.1", "content-type": "application/x-ndjson"}
            )
            self.assertEqual(response.code, 202)
        return relay, lines

    async def replay_both(self, relay):
        """(SSE messages, WS frames as raw bytes) of a replay from (1, 0)."""
        stream = await open_sse(self, relay, live="0", from_=[{"session": "flood", "epoch": 1, "seq": 0}])
        sse_messages = await stream.read_until_end()
        client = await open_ws(self, relay, hello={})
        client.send({"type": "subscribe", "id": "evict-1", "filter": {}, "from": [{"session": "flood", "epoch": 1, "seq": 0}]})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "evict-1"})
        client.send({"type": "ping", "t": "sync"})
        ws_frames = []
        while True:
            raw = await client.recv_raw()
            if json.loads(raw) == {"type": "pong", "t": "sync"}:
                break
            ws_frames.append(raw)
        return sse_messages, ws_frames

    async def test_11_evict_replay_exhausted(self) -> None:
        relay, lines = await self.flood()
        sse_messages, ws_frames = await self.replay_both(relay)

        # SSE: the marker first, then the held events ascending, then replay-complete.
        self.assertIsNotNone(sse_messages[0].comment)
        marker = re.fullmatch(r"replay-exhausted flood (\d+):(\d+)", sse_messages[0].comment)
        self.assertIsNotNone(marker, sse_messages[0].comment)
        sse_earliest = (int(marker.group(1)), int(marker.group(2)))
        self.assertEqual(sse_messages[-1].comment, "replay-complete")
        sse_positions = [(m.json()["epoch"], m.json()["seq"]) for m in sse_messages[1:-1]]

        # WS: the replay-exhausted frame (echoing the subscription id) before any event.
        frames = [json.loads(raw) for raw in ws_frames]
        self.assertEqual(frames[0]["type"], "replay-exhausted")
        self.assertEqual(frames[0]["sub"], "evict-1")
        self.assertEqual(frames[0]["session"], "flood")
        ws_earliest = (frames[0]["earliest"]["epoch"], frames[0]["earliest"]["seq"])
        ws_positions = [(f["epoch"], f["seq"]) for f in frames[1:]]

        self.assertEqual(sse_earliest, ws_earliest)
        self.assertGreater(sse_earliest, (1, 0))
        last = len(lines) - 1
        for positions in (sse_positions, ws_positions):
            self.assertEqual(positions[0], sse_earliest)
            self.assertEqual(positions, sorted(set(positions)))  # strictly ascending
            self.assertEqual(positions[-1], (1, last))
            self.assertEqual(len(positions), self.BUFFER)

    async def test_12_evict_byte_identity_strict(self) -> None:
        relay, lines = await self.flood()
        sse_messages, ws_frames = await self.replay_both(relay)
        posted = {json.loads(line)["id"]: line for line in lines}
        sse_payloads = {m.json()["id"]: m.data.encode() for m in events_of(sse_messages)}
        ws_payloads = {json.loads(raw)["id"]: raw for raw in ws_frames if b'"aep"' in raw}
        self.assertEqual(len(sse_payloads), self.BUFFER)
        self.assertEqual(sse_payloads.keys(), ws_payloads.keys())
        for event_id, payload in sse_payloads.items():
            self.assertEqual(payload, posted[event_id])  # strict: the posted line, byte for byte
            self.assertEqual(ws_payloads[event_id], posted[event_id])


class Roster(TestCase):
    async def test_13_roster(self) -> None:
        relay = await start_relay(self)
        control = {"accepts": ["control.attention.respond"], "ack_window_ms": 10000}
        emitter = await open_ws(
            self, relay, hello={"role": "emitter", "identity": {"agent": "agent-r"}, "capabilities": {"control": control}}
        )
        emitter.send(event("ros", 0, agent="agent-r"))
        self.assertEqual(await emitter.roundtrip(), [])  # the claim is in place

        consumer = await open_ws(self, relay, hello={"role": "consumer"})
        consumer.send({"type": "roster", "id": "r-1"})
        reply = await consumer.recv()
        self.assertEqual(reply["type"], "roster")
        self.assertEqual(reply["id"], "r-1")
        entries = [e for e in reply["entries"] if e["session"] == "ros"]
        self.assertEqual(len(entries), 1)
        self.assertEqual(entries[0]["agent"], "agent-r")
        self.assertEqual(entries[0]["control"], control)

        emitter.send({"type": "roster", "id": "r-2"})
        reply = await emitter.recv()
        self.assertEqual((reply["type"], reply["code"], reply["id"]), ("error", "unauthorized", "r-2"))
        self.assertEqual(await emitter.roundtrip(), [])  # not closed
        self.assertFalse(emitter.closed.called)


class Control(TestCase):
    async def test_14_control_auth_gate_without_token(self) -> None:
        relay = await start_relay(self)
        target = await open_ws(
            self,
            relay,
            hello={
                "role": "emitter",
                "identity": {"agent": "target"},
                "capabilities": {"control": {"accepts": ["control.attention.respond"], "ack_window_ms": 10000}},
            },
        )
        target.send(event("gate", 0, agent="target"))
        await target.roundtrip()
        watcher = await open_ws(self, relay, hello={"role": "consumer"})
        await subscribe(self, watcher, "acks", filter={"type": ["control.accepted", "control.rejected"]})

        consumer = await open_ws(self, relay, hello={"role": "consumer", "identity": {"agent": "ui"}})
        cmd = event("gate", None, "control.attention.respond", id="cmd-gate", agent="ui", data={"answer": {"option": "yes"}})
        consumer.send(cmd)
        reply = await consumer.recv()
        self.assertEqual((reply["type"], reply["code"], reply["cause"]), ("error", "unauthorized", "cmd-gate"))
        # The command never reached the target and nobody saw an ack.
        self.assertEqual(await target.roundtrip(), [])
        self.assertEqual(await watcher.roundtrip(), [])

    async def test_15_control_behalf_refusal_with_token(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        response, _ = await relay.post(event("behalf", 0), token=TOKEN)
        self.assertEqual(response.code, 202)
        response, _ = await relay.post(event("behalf", 1, "progress.status"), token=TOKEN)
        self.assertEqual(response.code, 202)
        discovery = json.loads((await relay.get("/events", AUTH))[1])
        self.assertIn("control", discovery["capabilities"])

        sender = await open_ws(self, relay, AUTH, hello={"role": "consumer", "identity": {"agent": "ui"}})
        sender.send(event("behalf", None, "control.pause", id="cmd-behalf", agent="ui", data={}))
        reply = await sender.recv()
        self.assertEqual((reply["type"], reply["code"], reply["cause"]), ("error", "no-route", "cmd-behalf"))

        stream = await open_sse(
            self, relay, AUTH, live="0", from_=[{"session": "behalf", "epoch": 0, "seq": 0}], filter={"session": "behalf"}
        )
        messages = await stream.read_until_end()
        self.assertEqual([m.json()["id"] for m in events_of(messages)], ["behalf-1-progress.status"])
        self.assertEqual(comments_of(messages), ["replay-complete"])


# Issue 5: the same checks against relays that keep their state in Redis.


class LiveChecksOnRedis(OnRedis, LiveChecks):
    pass


class EvictOnRedis(OnRedis, Evict):
    pass


class RosterOnRedis(OnRedis, Roster):
    pass


class ControlOnRedis(OnRedis, Control):
    pass


class StateIsInRedis(OnRedis, TestCase):
    async def test_the_buffer_lives_in_redis(self) -> None:
        relay = await start_relay(self)
        self.assertEqual(type(relay.core.log).__name__, "RedisEventLog")
        response, _ = await relay.post(event("in-redis", 0))
        self.assertEqual(response.code, 202)
        prefix = relay.core.log.prefix
        members = await relay.redis.execute("test", "ZRANGE", session_key(prefix.decode(), "aep", "s", "in-redis"), 0, -1)
        self.assertEqual(len(members), 1)
