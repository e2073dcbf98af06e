"""Events sent over WebSocket: one store write per read, frames after them wait, outages answered."""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, fail
from twisted.trial.unittest import TestCase

from relayd.base.errors import StoreUnavailable
from tests.support.aep import event, open_ws, start_relay, wait_until


class WebSocketIngest(TestCase):
    async def test_the_events_of_one_read_are_one_store_write_in_order(self) -> None:
        relay = await start_relay(self)
        log = relay.core.log
        writes: list[list[int]] = []
        append = log.append

        def counting(events):  # type: ignore[no-untyped-def]
            writes.append([e.position[1] for e in events])
            return append(events)

        log.append = counting
        client = await open_ws(self, relay, hello={"role": "both"})
        for seq in range(5):  # one reactor turn: one TCP write, one read on the relay's side
            client.send(event("batch", seq, "progress.status"))
        client.send({"type": "roster", "id": "after"})
        roster = await client.recv()
        # The roster (a frame after the events) already sees the claim the events made.
        self.assertEqual([e["session"] for e in roster["entries"]], ["batch"])
        self.assertEqual(writes, [[0, 1, 2, 3, 4]])

    async def test_plain_events_are_never_parsed_whole(self) -> None:
        # Over WebSocket as over POST, a plainly valid event is admitted from its envelope alone;
        # with no filter asking, nothing builds its parsed value on the way to the store.
        relay = await start_relay(self)
        log = relay.core.log
        stored: list[Any] = []
        append_now = log.append_now

        def keeping(events):  # type: ignore[no-untyped-def]
            stored.extend(events)
            return append_now(events)

        log.append_now = keeping  # (the in-memory log's every write: a socket's through its append)
        client = await open_ws(self, relay, hello={"role": "both"})
        client.send(event("lazy", 0, "progress.status"))
        await relay.post(event("lazy", 1, "progress.status"))
        await wait_until(lambda: len(stored) == 2)
        self.assertEqual([e._ev for e in stored], [None, None])

    async def test_a_store_outage_answers_every_event_with_its_cause(self) -> None:
        relay = await start_relay(self)
        relay.core.log.append = lambda events: fail(StoreUnavailable("aep"))
        client = await open_ws(self, relay, hello={"role": "emitter"})
        client.send(event("down", 0, "progress.status", id="e0"))
        client.send(event("down", 1, "progress.status", id="e1"))
        replies = [await client.recv(), await client.recv()]
        self.assertEqual([(r["code"], r["cause"]) for r in replies], [("unavailable", "e0"), ("unavailable", "e1")])
        self.assertEqual(await client.roundtrip(), [])  # the connection stays open


class WebSocketReplayFromAStore(TestCase):
    async def test_frames_after_a_subscribe_wait_for_its_replay(self) -> None:
        relay = await start_relay(self)
        await relay.post(*[event("held", seq, "progress.status") for seq in range(3)])
        log = relay.core.log
        replay = log.replay
        gate: list[Any] = []

        def slow_replay(session, after):  # type: ignore[no-untyped-def]
            d = Deferred()
            gate.append((d, replay(session, after)))
            return d

        log.replay = slow_replay
        client = await open_ws(self, relay, hello={})
        client.send({"type": "subscribe", "id": "s", "from": [{"session": "held", "seq": -1}]})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "s"})
        client.send({"type": "ping", "t": "after"})
        await wait_until(lambda: gate)
        d, answer = gate[0]
        answer.addCallback(d.callback)  # the store answers now
        frames = [await client.recv() for _ in range(4)]
        self.assertEqual([f.get("seq", f.get("type")) for f in frames], [0, 1, 2, "pong"])

    async def test_a_replay_the_store_cannot_read_is_an_error_and_no_subscription(self) -> None:
        relay = await start_relay(self)
        relay.core.log.replay = lambda session, after: fail(StoreUnavailable("aep"))
        client = await open_ws(self, relay, hello={})
        client.send({"type": "subscribe", "id": "s", "from": [{"session": "x", "seq": 0}]})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "s"})
        error = await client.recv()
        self.assertEqual((error["type"], error["code"], error["id"]), ("error", "unavailable", "s"))
        self.assertEqual(relay.core.subscribers, {})
