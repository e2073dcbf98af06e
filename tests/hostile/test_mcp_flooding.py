"""One client address tries to fill the MCP relay's session tables and lock everyone else out.

- Tunnel sessions (C{register} needs no credential): an address holds at most
  C{--mcp-max-sessions-per-address}; beyond it, that address's least recently seen session without
  readers ends, and only when all of them have readers is its register refused (C{503
  too_many_sessions}). Other addresses register all along. At C{--mcp-max-sessions}, the least
  recently seen session without readers of all ends before a register is refused.
- Standard-endpoint client sessions: an address holds at most C{--mcp-max-clients-per-address} on a
  process; beyond it, that address's least recently used idle client session ends (its next request
  is C{404}), and only when none is idle is its C{initialize} refused (C{503}).
- The address is the connection's peer, or with C{--trust-forwarded-for} the forwarded one: a client
  that writes any C{X-Forwarded-For} it likes to an untrusting relay is still one address. An IPv6
  address counts by its /64: one holder rotating through its /64 is still one address.
- Each session ended to make room is logged (one line, no token) and counted.
"""

from __future__ import annotations

import json
from typing import Any

from twisted.trial.unittest import TestCase

from tests.support.http import HttpClient, Reply
from tests.support.mcp import TOKEN, assert_clean_log, start_mcp_process, until_store_answers
from tests.support.mcp_clients import RemoteRelay, SimulatedPage, compact
from tests.support.redis import redis_flags, shared_redis
from tests.support.sse import SSEClient

ATTACKER = "203.0.113.7"
PAGE = "198.51.100.1"


class SessionFlood(TestCase):
    timeout = 60
    with_redis = False

    async def start(self, *flags: str) -> None:
        if self.with_redis:
            shared = redis_flags(shared_redis().url)
            flags = (*flags, f"--redis={shared['redis']}", f"--redis-prefix={shared['redis-prefix']}")
        self.proc = await start_mcp_process(self, "--mcp-max-sessions-per-address", "4", *flags)
        self.http = HttpClient.on_port(self, self.proc.port("mcp"))
        self.streams: list[SSEClient] = []
        if self.with_redis:
            await until_store_answers(self.proc)

    async def tearDown(self) -> None:  # type: ignore[override]
        for stream in getattr(self, "streams", []):
            await stream.close()

    async def register(self, session: str, address: str) -> Reply:
        body = json.dumps({"session": session, "token": TOKEN}).encode()
        return await self.http.post("/register", body, **{"x-forwarded-for": address})

    async def live(self, session: str) -> bool:
        # HEAD authenticates without subscribing or taking anything: 200 live, 410 gone.
        reply = await self.http.request("HEAD", f"/{session}/poll?token={TOKEN}")
        self.assertIn(reply.code, (200, 410))
        return reply.code == 200

    async def read(self, session: str) -> None:
        stream = await SSEClient.connect(f"{self.http.base}/{session}/events?token={TOKEN}")
        self.streams.append(stream)
        self.assertEqual(stream.code, 200)

    async def test_one_address_holds_its_bound_and_every_other_address_registers(self) -> None:
        await self.start("--trust-forwarded-for", "1")
        flood = [f"flood-{n:02d}" for n in range(30)]
        for session in flood:
            reply = await self.register(session, ATTACKER)
            self.assertEqual((reply.code, reply.body), (200, b'{"ok":true}'))
        # Each register past the bound ended the address's least recently seen session.
        self.assertEqual([s for s in flood if await self.live(s)], flood[-4:])
        self.assertEqual((await self.register("page-one", PAGE)).code, 200)
        await self.read("page-one")
        # Readers keep sessions: with a reader on each of its four, the address is refused...
        for session in flood[-4:]:
            await self.read(session)
        refused = await self.register("flood-more", ATTACKER)
        self.assertEqual((refused.code, refused.json()), (503, {"error": "too_many_sessions"}))
        self.assertTrue(all([await self.live(s) for s in flood[-4:]]))
        # ... and no other address is held up.
        self.assertEqual((await self.register("page-two", PAGE)).code, 200)
        self.assertEqual((await self.register("page-three", "198.51.100.2")).code, 200)
        await assert_clean_log(self, self.proc, self.http)

    async def test_at_the_session_cap_the_oldest_session_without_readers_ends(self) -> None:
        await self.start("--trust-forwarded-for", "1", "--mcp-max-sessions", "6")
        # Many addresses, one session each (no per-address bound helps), nobody reading.
        for n in range(6):
            self.assertEqual((await self.register(f"spread-{n}", f"203.0.113.{n + 10}")).code, 200)
        await self.read("spread-5")
        self.assertEqual((await self.register("page-one", PAGE)).code, 200)  # exactly at the cap + 1
        self.assertEqual([await self.live(f"spread-{n}") for n in range(6)], [False] + [True] * 5)
        for n in range(1, 5):
            await self.read(f"spread-{n}")
        await self.read("page-one")
        refused = await self.register("page-two", PAGE)  # every session has a reader
        self.assertEqual((refused.code, refused.json()), (503, {"error": "too_many_sessions"}))
        await assert_clean_log(self, self.proc, self.http)

    async def test_an_ipv6_holder_rotating_through_its_64_is_one_address(self) -> None:
        await self.start("--trust-forwarded-for", "1")
        rotating = [f"rot6-{n:02d}" for n in range(10)]
        for n, session in enumerate(rotating):  # ten addresses of one /64
            self.assertEqual((await self.register(session, f"2001:db8:7:7:{n:x}:{n:x}::{n + 1:x}")).code, 200)
        self.assertEqual([s for s in rotating if await self.live(s)], rotating[-4:])
        # Another /64 is another address.
        self.assertEqual((await self.register("other-64", "2001:db8:7:8::1")).code, 200)
        self.assertTrue(await self.live("other-64"))
        log = self.proc.log
        self.assertIn(b"to make room under the per-address bound (4) of 2001:db8:7:7::/64", log)
        self.assertNotIn(TOKEN.encode(), log)
        await assert_clean_log(self, self.proc, self.http)

    async def test_forwarded_for_is_not_believed_unless_trusted(self) -> None:
        await self.start()
        rotating = [f"spoof-{n:02d}" for n in range(10)]
        for n, session in enumerate(rotating):
            self.assertEqual((await self.register(session, f"192.0.2.{n}")).code, 200)
        self.assertEqual([s for s in rotating if await self.live(s)], rotating[-4:])  # one address: the peer


class SessionFloodOnRedis(SessionFlood):
    """The same bounds with C{--redis}: sessions, and what each address registered, counted in Redis."""

    with_redis = True


class ClientSessionFlood(TestCase):
    timeout = 60
    session = "clientflood"

    async def setUp(self) -> None:  # type: ignore[override]
        self.proc = await start_mcp_process(self, "--mcp-max-clients-per-address", "3", "--trust-forwarded-for", "1")
        relay = RemoteRelay(self, f"http://127.0.0.1:{self.proc.port('mcp')}")
        self.http = relay.http
        self.streams: list[SSEClient] = []
        body = json.dumps({"session": self.session, "token": TOKEN}).encode()
        self.assertEqual((await self.http.post("/register", body)).code, 200)
        self.page = SimulatedPage(relay, self.session)
        await self.page.start()

    async def tearDown(self) -> None:  # type: ignore[override]
        for stream in self.streams:
            await stream.close()

    async def mcp(self, message: Any, address: str, sid: str | None = None) -> Reply:
        headers = {"authorization": f"Bearer {TOKEN}", "accept": "application/json, text/event-stream",
                   "x-forwarded-for": address}
        if sid is not None:
            headers["mcp-session-id"] = sid
        return await self.http.post(f"/{self.session}/mcp", compact(message), **headers)

    async def initialize(self, address: str) -> Reply:
        return await self.mcp({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "flood", "version": "1"}}}, address)

    async def new_client(self, address: str) -> str:
        reply = await self.initialize(address)
        self.assertEqual(reply.code, 200, reply.body)
        sid = reply.header("mcp-session-id")
        assert sid is not None
        return sid

    async def usable(self, sid: str, address: str) -> bool:
        reply = await self.mcp({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, address, sid)
        self.assertIn(reply.code, (200, 404))
        return reply.code == 200

    async def listen(self, sid: str, address: str) -> None:
        stream = await SSEClient.connect(f"{self.http.base}/{self.session}/mcp", headers={
            "authorization": f"Bearer {TOKEN}", "accept": "text/event-stream", "mcp-session-id": sid,
            "x-forwarded-for": address})
        self.streams.append(stream)
        self.assertEqual(stream.code, 200)

    async def test_one_address_holds_its_bound_and_every_other_address_initializes(self) -> None:
        sids = [await self.new_client(ATTACKER) for _ in range(10)]
        # Each initialize past the bound ended the address's least recently used idle client session.
        self.assertTrue(await self.usable(sids[7], ATTACKER))  # used: now the most recently used
        sids.append(await self.new_client(ATTACKER))  # ends sids[8]
        self.assertEqual([await self.usable(s, ATTACKER) for s in sids], [False] * 7 + [True, False, True, True])
        page = await self.new_client(PAGE)
        # Busy client sessions (an open GET stream) never end: the address is refused instead.
        for sid in (sids[7], sids[9], sids[10]):
            await self.listen(sid, ATTACKER)
        refused = await self.initialize(ATTACKER)
        self.assertEqual((refused.code, refused.header("retry-after")), (503, "5"))
        self.assertEqual(refused.json()["error"]["code"], -32003)
        self.assertEqual(len([await self.new_client("198.51.100.2") for _ in range(3)]), 3)
        self.assertTrue(await self.usable(page, PAGE))
        await assert_clean_log(self, self.proc, self.http)

    async def test_an_ipv6_holder_rotating_through_its_64_is_one_address(self) -> None:
        sids = [await self.new_client(f"2001:db8:5:5::{n + 1:x}") for n in range(6)]
        self.assertEqual([await self.usable(s, "2001:db8:5:5::99") for s in sids], [False] * 3 + [True] * 3)
        self.assertEqual(len([await self.new_client(f"2001:db8:5:6::{n + 1:x}") for n in range(3)]), 3)
        self.assertIn(b"ended 1 idle MCP client session(s) to make room under the per-address bound (3) of "
                      b"2001:db8:5:5::/64", self.proc.log)
        await assert_clean_log(self, self.proc, self.http)
