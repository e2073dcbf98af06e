"""An append Redis holds without answering (the script already in its socket) is answered as an
unknown outcome, not as "nothing accepted", and the client's retry reaches every live consumer
once: the append Redis reaches after its deadline does nothing (relayd/aep/lua/append.lua)."""

from __future__ import annotations

import json

from twisted.trial.unittest import TestCase

from tests.support.aep import AEPRelay, event, open_sse, start_relay
from tests.support.redis import RedisServer
from tests.test_redis import admin


class OutcomeUnknown(TestCase):
    timeout = 30

    async def asyncSetUp(self) -> tuple[AEPRelay, AEPRelay]:
        # A private server: CLIENT PAUSE holds every client of it.
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)
        shared = {"redis": self.server.url, "redis_prefix": "unknown:"}
        return await start_relay(self, **shared), await start_relay(self, **shared)

    async def test_held_append_is_unknown_and_its_retry_reaches_consumers_once(self) -> None:
        a, b = await self.asyncSetUp()
        on_a, on_b = await open_sse(self, a), await open_sse(self, b)
        batch = [event("held", 1, "progress.status"), event("held", 2, "progress.status")]

        # Writes wait in Redis (as behind DEBUG SLEEP): the append script is sent, and held.
        self.assertEqual(admin(self.server.port, b"CLIENT PAUSE 20000 WRITE\r\n"), b"+OK\r\n")
        response, body = await a.post(*batch)
        self.assertEqual(response.code, 503)
        answer = json.loads(body)
        self.assertEqual((answer["error"], answer["store"]), ("outcome-unknown", "aep"))
        self.assertIn("may have been stored", answer["detail"])
        self.assertIn("retry", answer["detail"])
        # Redis runs the held script now (before any command sent after this answer).
        self.assertEqual(admin(self.server.port, b"CLIENT UNPAUSE\r\n"), b"+OK\r\n")

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
