"""An append Redis holds without answering (the script already in its socket while Redis is paused)
is answered as an unknown outcome, not as "nothing accepted", and the client's retry reaches every
live consumer once: the append Redis reaches after its deadline does nothing
(relayd/aep/lua/append.lua)."""

from __future__ import annotations

import json

from twisted.trial.unittest import TestCase

from tests.support.aep import AEPRelay, event, open_sse, open_ws, start_relay
from tests.support.redis import RedisServer


class OutcomeUnknown(TestCase):
    timeout = 30

    async def asyncSetUp(self) -> tuple[AEPRelay, AEPRelay]:
        self.server = RedisServer.start()  # a private server: pausing it holds every client of it
        self.addCleanup(self.server.cleanup)
        shared = {"redis": self.server.url, "redis_prefix": "unknown:"}
        return await start_relay(self, **shared), await start_relay(self, **shared)

    async def test_held_append_is_unknown_and_its_retry_reaches_consumers_once(self) -> None:
        a, b = await self.asyncSetUp()
        on_a, on_b = await open_sse(self, a), await open_sse(self, b)
        batch = [event("held", 1, "progress.status"), event("held", 2, "progress.status")]
        response, _ = await a.post(event("other", 1))  # Redis has the append script (EVALSHA runs it)
        self.assertEqual(response.code, 202)
        for stream in (on_a, on_b):
            self.assertEqual((await stream.next_event()).json()["session"], "other")

        # Redis is paused, so the append script relayd sends waits in its socket until after relayd
        # stopped waiting (2 s).
        self.server.pause(self)
        response, body = await a.post(*batch)
        self.assertEqual(response.code, 503)
        answer = json.loads(body)
        self.assertEqual((answer["error"], answer["store"]), ("outcome-unknown", "aep"))
        self.assertIn("may have been stored", answer["detail"])
        self.assertIn("retry", answer["detail"])
        await self.server.resume()  # then Redis runs the script it held, past its deadline

        response, _ = await a.post(*batch)  # the client's retry, as the answer says
        self.assertEqual(response.code, 202)
        response, _ = await a.post(event("held", 3, "progress.status"))  # the last thing either stream gets
        self.assertEqual(response.code, 202)
        for stream in (on_a, on_b):
            received = [(await stream.next_event()).json()["id"] for _ in range(3)]
            self.assertEqual(received, ["held-1-progress.status", "held-2-progress.status", "held-3-progress.status"])
        history = await open_sse(self, b, live="0", from_=[{"session": "held"}])
        replayed = [m.json()["id"] for m in await history.read_until_end() if m.comment is None]
        self.assertEqual(replayed, ["held-1-progress.status", "held-2-progress.status", "held-3-progress.status"])

    async def test_held_websocket_events_are_answered_outcome_unknown(self) -> None:
        a, _ = await self.asyncSetUp()
        emitter = await open_ws(self, a, hello={"versions": ["0.1"], "role": "emitter"})
        response, _ = await a.post(event("other", 1))  # Redis has the append script
        self.assertEqual(response.code, 202)
        self.server.pause(self)
        emitter.send(event("ws", 1, "progress.status"))
        frame = await emitter.recv(timeout=10)
        self.assertEqual((frame["type"], frame["code"], frame["cause"]), ("error", "outcome-unknown", "ws-1-progress.status"))
        self.assertIn("may have been stored", frame["detail"])
        await self.server.resume()
