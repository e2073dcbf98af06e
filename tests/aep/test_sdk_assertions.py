"""aep.md §9.4: the relay-facing assertions of the TypeScript SDK smoke test (1-14).

The relay runs with a token, as in ``run-smoke.sh``. Where the SDK smoke relies on an SDK-side
behaviour (a target that acks, a consumer that tracks positions), a WebSocket client plays that part.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import TestCase

from tests.support.aep import comments_of, event, events_of, open_sse, open_ws, seqs, start_relay, subscribe, valid
from tests.support.ws import WSClient

TOKEN = "sdk-smoke-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ACKS = ["control.accepted", "control.rejected"]
RESPOND = "control.attention.respond"


class TargetEmitter:
    """A simulated SDK emitter: claims a session and answers each command with a sequenced ack."""

    def __init__(self, client: WSClient, session: str, agent: str) -> None:
        self.client = client
        self.session = session
        self.agent = agent
        self.seq = 0
        self.pending: set[str] = set()  # attention.requested ids still open

    def emit(self, type: str, **extra: Any) -> dict[str, Any]:
        ev = event(self.session, self.seq, type, agent=self.agent, id=f"{self.agent}-{self.seq}", **extra)
        self.seq += 1
        self.client.send(ev)
        return ev

    async def answer(self) -> tuple[bytes, dict[str, Any]]:
        """Receive one command; ack it (accepted, or rejected ``invalid`` for an unknown subject)."""
        raw = await self.client.recv_raw()
        cmd = json.loads(raw)
        if cmd.get("subject") in self.pending:
            self.pending.discard(cmd["subject"])
            ack = self.emit("control.accepted", cause=cmd["id"], data={})
        else:
            ack = self.emit("control.rejected", cause=cmd["id"], data={"reason": "invalid", "detail": "unknown subject"})
        return raw, ack


class SDKSmoke(TestCase):
    async def setup_control(self, accepts: list[str] | None = None) -> tuple[Any, TargetEmitter, WSClient]:
        """Relay with a token, a target emitter that claimed session ``smoke``, and an ack-watching sender."""
        relay = await start_relay(self, aep_token=TOKEN)
        control: dict[str, Any] = {"ack_window_ms": 10000}
        if accepts is not None:
            control["accepts"] = accepts
        client = await open_ws(
            self,
            relay,
            AUTH,
            hello={"role": "emitter", "identity": {"agent": "smoke-agent"}, "capabilities": {"control": control}},
        )
        target = TargetEmitter(client, "smoke", "smoke-agent")
        target.emit("session.started", data={"client": "sdk"})
        await client.roundtrip()
        sender = await open_ws(self, relay, AUTH, hello={"role": "both", "identity": {"agent": "smoke-ui"}})
        await subscribe(self, sender, "ctl-acks", filter={"type": ACKS})
        return relay, target, sender

    def command(self, session: str = "smoke", type: str = RESPOND, **extra: Any) -> dict[str, Any]:
        extra.setdefault("data", {"answer": {"option": "allow"}})
        return event(session, None, type, agent="smoke-ui", source="aep://test/agent/smoke-ui", **extra)

    async def test_01_command_to_single_claimant_is_accepted_with_cause(self) -> None:
        _, target, sender = await self.setup_control(accepts=[RESPOND])
        request = target.emit("attention.requested", data={"kind": "permission", "prompt": "run ls?"})
        target.pending.add(request["id"])
        await target.client.roundtrip()
        cmd = self.command(id="cmd-1", subject=request["id"])
        sender.send(cmd)
        raw, ack = await target.answer()
        self.assertEqual(raw, json.dumps(cmd).encode())  # forwarded byte-identically, bare
        got = await sender.recv()
        self.assertEqual(got, ack)
        self.assertEqual((got["type"], got["cause"]), ("control.accepted", "cmd-1"))
        valid(self, got)

    async def test_02_unknown_subject_is_nacked_invalid_through_fanout(self) -> None:
        _, target, sender = await self.setup_control(accepts=[RESPOND])
        sender.send(self.command(id="cmd-2", subject="no-such-request"))
        _, nack = await target.answer()
        got = await sender.recv()
        self.assertEqual(got, nack)
        self.assertEqual((got["type"], got["cause"], got["data"]["reason"]), ("control.rejected", "cmd-2", "invalid"))

    async def test_03_unclaimed_session_is_refused_no_route_at_once(self) -> None:
        _, target, sender = await self.setup_control()
        sender.send(self.command(session="nobody-home", id="cmd-3", type="control.pause", data={}))
        reply = await sender.recv(timeout=4)
        self.assertEqual((reply["type"], reply["cause"]), ("error", "cmd-3"))
        self.assertIn("no-route", reply["code"] + " " + reply.get("detail", ""))
        self.assertEqual(await target.client.roundtrip(), [])  # nothing was broadcast

    async def run_attention_chain(self) -> dict[str, Any]:
        """attention.requested; a respond command; the target's ack, attention.answered and .resolved."""
        _, target, sender = self.setup
        request = target.emit("attention.requested", data={"kind": "permission", "prompt": "run ls?"})
        target.pending.add(request["id"])
        await target.client.roundtrip()
        cmd = self.command(id="cmd-chain", subject=request["id"])
        sender.send(cmd)
        _, ack = await target.answer()
        target.emit("attention.answered", subject=request["id"], cause=ack["id"], data={"answer": {"option": "allow"}})
        target.emit("attention.resolved", subject=request["id"], data={"outcome": "answered"})
        await target.client.roundtrip()
        return cmd

    async def chain_on_stream(self) -> tuple[dict[str, Any], list[Any]]:
        """The attention chain, with an SSE consumer opened before it (after session.started)."""
        self.setup = await self.setup_control(accepts=[RESPOND])
        relay = self.setup[0]
        stream = await open_sse(self, relay, AUTH, filter={"session": "smoke"}, from_=[{"session": "smoke", "epoch": 0, "seq": -1}])
        cmd = await self.run_attention_chain()
        messages = [await stream.next_event() for _ in range(6)]
        return cmd, messages

    async def test_04_consumer_sees_session_started_and_the_attention_chain(self) -> None:
        _, messages = await self.chain_on_stream()
        types = [m.event for m in messages]
        self.assertEqual(
            [t for t in types if t != RESPOND],
            ["session.started", "attention.requested", "control.accepted", "attention.answered", "attention.resolved"],
        )
        for msg in messages:
            valid(self, msg.json())
            self.assertEqual(msg.event, msg.json()["type"])

    async def test_05_routed_command_is_on_the_stream(self) -> None:
        cmd, messages = await self.chain_on_stream()
        commands = [m for m in messages if m.event == RESPOND]
        self.assertEqual(len(commands), 1)
        self.assertEqual(commands[0].json(), cmd)
        self.assertIsNone(commands[0].id)  # commands carry no position

    async def test_06_seqs_strictly_monotonic_and_positions_tracked(self) -> None:
        _, messages = await self.chain_on_stream()
        sequenced = [m for m in messages if m.event != RESPOND]
        self.assertEqual(seqs(sequenced), sorted(set(seqs(sequenced))))
        for msg in sequenced:
            ev = msg.json()
            self.assertEqual(msg.id, f"smoke:{ev.get('epoch', 0)}:{ev['seq']}")
        # The tracked position resumes exactly after the last event seen.
        relay, target, _ = self.setup
        resumed = await open_sse(self, relay, {**AUTH, "last-event-id": sequenced[-1].id}, filter={"session": "smoke"})
        nxt = target.emit("progress.status", data={"message": "next"})
        self.assertEqual((await resumed.next_event()).json()["id"], nxt["id"])

    async def test_07_roster_lists_the_live_claim_verbatim_not_http_sessions(self) -> None:
        relay, _, sender = await self.setup_control(accepts=[RESPOND, "control.cancel"])
        await relay.post(event("http-only", 0), token=TOKEN)
        sender.send({"type": "roster", "id": "ros"})
        reply = await sender.recv()
        self.assertEqual(reply["id"], "ros")
        self.assertEqual(
            reply["entries"],
            [
                {
                    "session": "smoke",
                    "agent": "smoke-agent",
                    "control": {"ack_window_ms": 10000, "accepts": [RESPOND, "control.cancel"]},
                }
            ],
        )

    async def test_08_from_all_cold_start_replays_held_history(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        await relay.post(event("cold-a", 0), event("cold-a", 1, "progress.status"), event("cold-b", 0), token=TOKEN)
        client = await open_ws(self, relay, AUTH, hello={"role": "consumer"})
        replay = await subscribe(self, client, "cold", filter={}, from_="all")
        self.assertEqual(
            [(e["session"], e["seq"]) for e in replay], [("cold-a", 0), ("cold-a", 1), ("cold-b", 0)]
        )

    async def test_09_same_id_from_two_sources_both_delivered(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        stream = await open_sse(self, relay, AUTH, filter={"session": "twin"})
        one = event("twin", 0, id="same-id", source="aep://a/agent/one/session/twin")
        two = event("twin", 1, "progress.status", id="same-id", source="aep://a/agent/two/session/twin")
        await relay.post(one, token=TOKEN)
        await relay.post(two, token=TOKEN)
        self.assertEqual((await stream.next_event()).json(), one)
        self.assertEqual((await stream.next_event()).json(), two)
        history = await open_sse(self, relay, AUTH, live="0", filter={"session": "twin"})
        self.assertEqual(seqs(await history.read_until_end()), [0, 1])

    async def test_10_same_source_and_id_into_another_session_is_passed(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        stream = await open_sse(self, relay, AUTH, filter={"session": ["rep-a", "rep-b"]})
        first = event("rep-a", 0, id="dup", source="aep://a/agent/x")
        again = event("rep-b", 0, id="dup", source="aep://a/agent/x")
        await relay.post(first, token=TOKEN)
        await relay.post(again, token=TOKEN)
        self.assertEqual((await stream.next_event()).json(), first)
        self.assertEqual((await stream.next_event()).json(), again)

    async def test_11_wrong_token_on_post_is_401(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        response, _ = await relay.post(event(), token="not-the-token")
        self.assertEqual(response.code, 401)
        self.assertEqual(relay.core.log.session_count(), 0)

    async def test_12_from_with_241_positions_replays_then_goes_live(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        await relay.post(*[event("logs", i, "log.emitted", data={"line": i}) for i in range(3)], token=TOKEN)
        # Short entries (epoch defaults to 0) keep the query under the 16 KiB request-line limit.
        positions: list[dict[str, Any]] = [{"session": f"g{i}", "seq": 5} for i in range(240)]
        positions.append({"session": "logs", "epoch": 0, "seq": -1})
        stream = await open_sse(self, relay, AUTH, filter={"type": ["log.emitted"]}, from_=positions)
        self.assertEqual(seqs([await stream.next_event() for _ in range(3)]), [0, 1, 2])
        await relay.post(event("logs", 3, "log.emitted"), token=TOKEN)
        self.assertEqual((await stream.next_event()).json()["seq"], 3)

    async def test_12_over_websocket(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        await relay.post(*[event("logs", i, "log.emitted", data={"line": i}) for i in range(3)], token=TOKEN)
        positions = [{"session": f"gone-session-{i}", "epoch": 0, "seq": 5} for i in range(240)]
        positions.append({"session": "logs", "epoch": 0, "seq": -1})
        client = await open_ws(self, relay, AUTH, hello={"role": "consumer"})
        replay = await subscribe(self, client, "logs", filter={"type": ["log.emitted"]}, from_=positions)
        self.assertEqual([e["seq"] for e in replay], [0, 1, 2])
        await relay.post(event("logs", 3, "log.emitted"), token=TOKEN)
        self.assertEqual((await client.recv())["seq"], 3)

    async def test_13_live_false_from_all_ends_at_replay_complete(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        await relay.post(event("h1", 0), event("h2", 0), event("h1", 1, "progress.status"), token=TOKEN)
        stream = await open_sse(self, relay, AUTH, live="0", from_="all")
        messages = await stream.read_until_end()
        self.assertEqual(
            [(m.json()["session"], m.json()["seq"]) for m in events_of(messages)], [("h2", 0), ("h1", 0), ("h1", 1)]
        )
        self.assertEqual(messages[-1].comment, "replay-complete")

    async def test_14_live_false_from_mid_stream_replays_strictly_after(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        await relay.post(*[event("mid", i, "progress.status") for i in range(5)], token=TOKEN)
        stream = await open_sse(self, relay, AUTH, live="0", from_=[{"session": "mid", "epoch": 0, "seq": 2}])
        messages = await stream.read_until_end()
        self.assertEqual(seqs(messages), [3, 4])
        self.assertEqual(comments_of(messages), ["replay-complete"])
