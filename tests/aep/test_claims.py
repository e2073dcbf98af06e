"""The IClaims contract (claims, claimants, roster, command delivery), in memory and on Redis."""

from __future__ import annotations

import itertools
from typing import Any

from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from zope.interface.verify import verifyObject

from relayd.aep.core.claims import IClaims, MemoryClaims
from relayd.aep.core.event import Event
from relayd.aep.redis.claims import RedisClaims
from relayd.base.clock import Timekeeper
from tests.support.aep import event, wait_until
from tests.support.redis import connected_redis, shared_redis

_prefixes = itertools.count()


class Conn:
    """What claims need of a connection: its hello and its claims; it records commands sent to it."""

    def __init__(self, role: str = "both", agent: str = "a", accepts: list[str] | None = None) -> None:
        self.role = role
        self.hello_done = True
        self.identity = {"agent": agent}
        self.capabilities: dict[str, Any] = {} if accepts is None else {"control": {"accepts": accepts}}
        self.claims: list[str] = []
        self.commands: list[Event] = []

    def send_command(self, event: Event) -> None:
        self.commands.append(event)


def command(session: str) -> Event:
    ev = event(session, None, "control.pause", id=f"cmd-{session}")
    return Event.of(ev, None)


class ClaimsContract:
    async def make(self) -> IClaims:
        raise NotImplementedError

    async def test_claimants_roster_and_release(self) -> None:
        claims = await self.make()
        self.assertTrue(verifyObject(IClaims, claims))
        emitter, consumer, other = Conn(accepts=["control.pause"]), Conn(role="consumer"), Conn(agent="b")
        for conn in (emitter, consumer, other):
            claims.connect(conn)
        await claims.claim(emitter, "S")
        await claims.claim(emitter, "T")
        await claims.claim(consumer, "S")  # a consumer's claim never routes
        self.assertEqual([c.identity["agent"] for c in await claims.claimants("S")], ["a"])
        self.assertEqual((await claims.claimants("S"))[0].accepts, ["control.pause"])
        self.assertEqual(
            await claims.roster(),
            [{"session": "S", "agent": "a", "control": {"accepts": ["control.pause"]}},
             {"session": "T", "agent": "a", "control": {"accepts": ["control.pause"]}}],
        )
        await claims.claim(other, "S")
        self.assertEqual(len(await claims.claimants("S")), 2)
        await claims.disconnect(emitter)
        self.assertEqual([c.identity["agent"] for c in await claims.claimants("S")], ["b"])
        self.assertEqual(await claims.claimants("T"), [])

    async def test_deliver_reaches_the_claimant(self) -> None:
        claims = await self.make()
        emitter = Conn()
        claims.connect(emitter)
        await claims.claim(emitter, "S")
        (target,) = await claims.claimants("S")
        await claims.deliver(target, command("S"))
        self.assertEqual([c.ev["id"] for c in emitter.commands], ["cmd-S"])


class MemoryClaimsTests(ClaimsContract, TestCase):
    async def make(self) -> IClaims:
        return MemoryClaims()


class RedisClaimsTests(ClaimsContract, TestCase):
    async def make(self) -> IClaims:
        redis = await connected_redis(shared_redis().url)
        self.addCleanup(redis.close)
        bus = redis.bus()
        await bus.ready
        claims = RedisClaims(redis, bus, Timekeeper(reactor), prefix=f"claims{next(_prefixes)}:{id(self)}:")
        self.addCleanup(claims.stop)
        return claims

    async def test_a_claim_on_another_instance_routes_over_redis(self) -> None:
        a, b = await self.make(), await self.make()
        b.prefix = a.prefix  # two instances of one deployment
        emitter = Conn(agent="on-a")
        a.connect(emitter)
        await a.claim(emitter, "S")
        (target,) = await b.claimants("S")
        self.assertIsNone(target.local)  # it lives on the other instance
        await b.deliver(target, command("S"))
        await wait_until(lambda: emitter.commands)
        self.assertEqual(emitter.commands[0].ev["id"], "cmd-S")
