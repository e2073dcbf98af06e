"""Redis costs and script discipline, watched through MONITOR on a private redis-server.

- Round trips: one MCP tunnel round trip (agent posts a request, the page posts its reply) is two
  Redis commands; one AEP batch is one (its fan-out PUBLISH is made by the append script);
  docs/performance.md. These fail when someone adds a round trip.
- Keys: every command a script runs touches only keys the caller declared in C{KEYS}
  (docs/decisions.md REDIS-1), checked with C{COMMAND GETKEYS}; every script of every wing is run.
- Sources: every script is a C{.lua} file of its wing that the package ships, and no Python module
  of relayd carries Lua any more.
"""

from __future__ import annotations

import configparser
import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import txredisapi
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from relayd.aep.core.event import Event
from relayd.aep.redis import claims as redis_claims
from relayd.aep.redis import store as aep_store
from relayd.aep.redis.claims import RedisClaims
from relayd.aep.redis.store import RedisEventLog
from relayd.base.clock import Timekeeper
from relayd.base.errors import StoreUnavailable
from relayd.buzz.redis import state as redis_state
from relayd.buzz.redis.state import RedisReceipts
from relayd.mcp.core.store import (
    INBOUND,
    OUTBOUND,
    POLL,
    SSE,
    ClientRecord,
    Correlation,
    SessionRecord,
    SubscriberRecord,
)
from relayd.mcp.core.tunnel import TunnelRelay
from relayd.mcp.redis import store as mcp_store
from relayd.mcp.redis.store import RedisStore
from relayd.storage.redis_lua import Script
from tests.support.aep import event
from tests.support.cases import cases, expand
from tests.support.mcp import RecordingSink
from tests.support.redis import RedisServer, bucket_key, connected_redis, same_bucket, shared_redis
from tests.support.redis_monitor import Command, RedisMonitor

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "t" * 32
SESSION = "rt-session-1"


def _every_script() -> list[Script]:
    scripts = list(mcp_store._SCRIPTS.values())
    scripts += [aep_store._APPEND, aep_store._DROP, aep_store._REPLAY, redis_claims._ROSTER]
    scripts += [redis_state._CLAIM, redis_state._STORE_PLAN, redis_state._COMPLETE, redis_state._RELEASE]
    scripts += [redis_state._INDEX, redis_state._TRIM]
    return scripts


def _event(session: str, seq: int) -> Event:
    raw = json.dumps(event(session, seq, "progress.status"), separators=(",", ":")).encode()
    return Event.of(json.loads(raw), raw)


class Watched(TestCase):
    """A private redis-server (MONITOR must see only this test's commands), a client and a monitor."""

    async def setUp(self) -> None:  # type: ignore[override]
        server = RedisServer.start()
        self.addCleanup(server.cleanup)
        self.redis = await connected_redis(server.url)
        self.addCleanup(self.redis.close)
        self.monitor = await RedisMonitor.start(server.port)
        self.addCleanup(self.monitor.stop)
        self._marks = 0

    async def watched(self, work: Any) -> list[Command]:
        """The commands C{await work()} made (with those its scripts ran)."""
        self._marks += 1
        start, end = b"start-%d" % self._marks, b"end-%d" % self._marks
        await self.monitor.mark(self.redis, start)
        await work()
        await self.monitor.mark(self.redis, end)
        return self.monitor.between(start, end)


def _sent(commands: list[Command]) -> list[str]:
    """The commands relayd sent (not those its scripts ran)."""
    return [c.name for c in commands if not c.lua]


@expand
class RoundTrips(Watched):
    @cases(None, "client-1")  # the tunnel's agent; a labelled client of the standard endpoint
    async def test_an_mcp_round_trip_is_two_redis_commands(self, label: str | None) -> None:
        tunnel = TunnelRelay(RedisStore(self.redis, prefix="rt:"), Timekeeper(reactor))
        await tunnel.register(SESSION, TOKEN)
        page, agent = RecordingSink(), RecordingSink()
        await tunnel.open_stream(SESSION, TOKEN, INBOUND, None, page)
        await tunnel.open_stream(SESSION, TOKEN, OUTBOUND, label, agent)

        async def round_trip(n: int) -> None:
            request = {"jsonrpc": "2.0", "id": n, "method": "tools/list"}
            await tunnel.forward(SESSION, TOKEN, orjson.dumps(request), label)
            await tunnel.outbox(SESSION, TOKEN, orjson.dumps({"jsonrpc": "2.0", "id": n, "result": {}}))

        await round_trip(1)  # the scripts are loaded (NOSCRIPT, then EVAL) on first use
        delivered = len(agent.events)
        commands = await self.watched(lambda: round_trip(2))
        self.assertEqual(_sent(commands), ["EVALSHA", "EVALSHA"])
        self.assertEqual(len(agent.events), delivered + 1)  # the reply did reach the agent

    async def test_an_aep_batch_is_one_redis_command_with_its_fan_out(self) -> None:
        # (Two sessions of one bucket: a batch is one script per bucket its sessions are in.)
        log = RedisEventLog(self.redis, 1000, 64 * 64, prefix="rt:", publisher="instance")
        a, b = same_bucket(2)
        await log.append([_event(a, 0)], publish=True)
        batch = [_event(session, seq) for seq in range(1, 51) for session in (a, b)]
        commands = await self.watched(lambda: log.append(batch, publish=True))
        self.assertEqual(_sent(commands), ["EVALSHA"])
        published = [c for c in commands if c.lua and c.name == "PUBLISH"]
        self.assertEqual(len(published), 1)
        self.assertEqual(published[0].args[2].count(b"\n"), len(batch))  # the header's, then one per event

    async def test_the_usual_aep_batch_costs_redis_a_few_calls_not_some_per_event(self) -> None:
        # One session, no key held or repeated, the session full: the script stores and trims the
        # whole batch with variadic calls (relayd/aep/lua/append.lua); a duplicate sends the batch
        # to the per-event loop, which makes calls per event.
        log = RedisEventLog(self.redis, 100, 64, prefix="rt:", publisher="instance")
        await log.append([_event("a", seq) for seq in range(100)], publish=True)
        batch = [_event("a", seq) for seq in range(100, 200)]
        commands = await self.watched(lambda: log.append(batch, publish=True))
        self.assertEqual(_sent(commands), ["EVALSHA"])
        self.assertLess(len([c for c in commands if c.lua]), 25, [c.name for c in commands if c.lua])
        published = [c.args[2] for c in commands if c.lua and c.name == "PUBLISH"]
        self.assertEqual(published, [b"instance\n" + b"\n".join(e.raw for e in batch)])  # type: ignore[misc]
        again = [*[_event("a", seq) for seq in range(200, 299)], _event("a", 150)]
        commands = await self.watched(lambda: log.append(again))
        self.assertGreater(len([c for c in commands if c.lua]), 300)
        self.assertEqual(len((await log.replay("a", (0, -1))).events), 100)

    async def test_an_aep_batch_that_evicts_another_session_adds_one_command(self) -> None:
        log = RedisEventLog(self.redis, 10, 2 * 64, prefix="rt:")  # two sessions per bucket
        a, b, c, d = same_bucket(4)
        for session in (a, b, c):  # c evicts a: the drop script is loaded
            await log.append([_event(session, 0)])
        commands = await self.watched(lambda: log.append([_event(d, 0), _event(d, 1)]))
        self.assertEqual(_sent(commands), ["EVALSHA", "EVALSHA"])  # the append, then the drop of b
        self.assertEqual(await log.sessions(), [c, d])
        self.assertEqual((await log.replay(b, (0, -1))).events, ())


class DeclaredKeys(Watched):
    timeout = 60

    async def test_every_script_touches_only_the_keys_it_is_given(self) -> None:
        commands = await self.watched(self._every_operation)
        ran: set[bytes] = set()
        declared: list[bytes] | None = None
        touched: dict[tuple[bytes, ...], list[bytes]] = {}
        for command in commands:
            if not command.lua:
                declared = None
                if command.name in ("EVALSHA", "EVAL"):
                    count = int(command.args[2])
                    declared = command.args[3 : 3 + count]
                    if command.name == "EVALSHA":
                        ran.add(command.args[1])
                continue
            assert declared is not None, command
            args = tuple(command.args)
            if args not in touched:
                try:
                    touched[args] = await self.redis.execute("test", "COMMAND", "GETKEYS", *args)
                except txredisapi.ResponseError:
                    touched[args] = []  # PUBLISH and the like: no key arguments
            for key in touched[args]:
                self.assertIn(key, declared, f"{command.name} {key!r} is not among the script's KEYS")
        expected = {s.sha: s.name for s in _every_script()}
        self.assertEqual({expected[sha] for sha in set(expected) - ran}, set(), "scripts this test did not run")

    async def _every_operation(self) -> None:
        await every_operation(self.redis, "k:", Ids())


@dataclass(frozen=True)
class Ids:
    """The ids L{every_operation} uses: an MCP session and client, AEP sessions (three of one bucket,
    so that one evicts another; then any others), a client address."""

    mcp_session: str = SESSION
    client: str = "c1"
    aep_sessions: tuple[str, ...] = ()
    owner: str = "192.0.2.1"


async def every_operation(redis: Any, prefix: str, ids: Ids) -> None:
    """Every operation of every wing's Redis store, so that every script is run (several times)."""
    await _mcp(redis, prefix, ids)
    await _aep(redis, prefix, ids)
    await _buzz(redis, prefix)


async def _mcp(redis: Any, prefix: str, ids: Ids) -> None:
    session = ids.mcp_session
    store = RedisStore(redis, prefix=prefix)
    await store.put_client(ids.client, ClientRecord(session, "l1"), 60_000)
    await store.touch_clients([ids.client, ids.client + "2", "c2"], 60_000)
    await store.get_client(ids.client)
    await store.put_session(SessionRecord(session, "h" * 64, 1.0))
    await store.touch_session(session, 2.0)
    await store.check_session(session, "h" * 64, 3.0)
    sse = SubscriberRecord("sub1", session, INBOUND, SSE, None, 3.0, 0, "i1")
    poll = SubscriberRecord("sub2", session, OUTBOUND, POLL, "l1", 3.0, 0, "i1")
    await store.add_subscriber(sse)
    await store.add_subscriber(poll)
    await store.update_subscriber(session, OUTBOUND, "sub2", 4.0, 1)
    await store.find_subscriber(session, "sub2")
    await store.all_subscribers(session)
    await store.start_inbox(session, "h" * 64, 5.0, INBOUND, b"1", Correlation("l1", None), 10)
    await store.start_outbox(session, "h" * 64, 5.0, b"1")
    await store.record_correlation(session, b"2", Correlation("l1", b"7"), 10)
    await store.consume_correlation(session, b"2")
    await store.push(poll.queue_key, b'"frame"', 10, 1000)
    frames, _ = await store.take(poll.queue_key)
    await store.put_back(poll.queue_key, frames)
    await store.buffered_bytes()
    await store.append_backlog(session, INBOUND, b"{}", 10)
    await store.take_backlog(session, INBOUND)
    await store.append_backlog(session, OUTBOUND, b"{}", 10)
    await store.update_subscriber(session, OUTBOUND, "sub2", 4.0, -1)
    await store.idle_pollers(1e9)
    await store.remove_subscriber(session, INBOUND, "sub1")
    await store.add_subscriber(sse)
    await store.put_session(SessionRecord("owned", "h" * 64, 1.0, ids.owner))
    await store.session_room(ids.owner, 1)
    await store.session_room(None, 1)
    await store.session_count()
    await store.expired_session_ids(1e12)
    await store.claim_correlation(session, b"3", Correlation("l1", b"7"), 10)
    await store.drop_session_state(session)
    await store.delete_session(session)


async def _aep(redis: Any, prefix: str, ids: Ids) -> None:
    a, b, c = same_bucket(3, "aep")
    log = RedisEventLog(redis, 2, 2 * 64, prefix=prefix, publisher="i")  # two sessions per bucket
    await log.append([_event(a, 0), _event(a, 1), _event(a, 2)], publish=True)  # trims
    await log.append([_event(b, 0)])
    await log.append([_event(c, 0), _event(a, 3)])  # evicts b (dropped after) and then c
    await log.replay(a, (0, -1), limit=1)
    others = list(ids.aep_sessions)
    if others:
        await log.append([_event(s, n) for n, s in enumerate(others)], publish=True)
        for session in others:
            await log.replay(session, (0, -1))
    await log.sessions()
    clock = Timekeeper(reactor)
    bus = redis.bus()
    claims = RedisClaims(redis, bus, clock, prefix)
    claims.stop()
    info = orjson.dumps({"role": "emitter", "order": [0, "", 0, 0]})
    for session in [a, b, *others]:
        await redis.execute("test", "SADD", bucket_key(prefix, "aep", "claimed", session), session)
        await redis.execute("test", "HSET", claims._claims_key(session), b"gone:0", info)
    await claims.roster()
    await claims.claimants(a)


async def _buzz(redis: Any, prefix: str) -> None:
    async def no_effects(effects: list[dict[str, Any]]) -> None:
        return None

    receipts = RedisReceipts(redis, Timekeeper(reactor), no_effects, prefix=prefix, max_receipts=1)
    await receipts.claim("p", "r1", b"d" * 32)
    await receipts.store_plan("p", "r1", b"d" * 32, b"plan")
    await receipts.complete("p", "r1", b"d" * 32, b'{"ok":true}', [])
    await receipts.claim("p", "r0", b"d" * 32)
    await receipts.complete("p", "r0", b"d" * 32, b'{"ok":true}', [])  # past the cap of 1: a trim
    assert receipts.trimming is not None
    await receipts.trimming
    await receipts.claim("p", "r2", b"d" * 32)
    await receipts.release("p", "r2")
    await receipts.close()


class Sources(TestCase):
    def test_every_script_is_a_lua_file_the_package_ships(self) -> None:
        parser = configparser.ConfigParser()
        parser.read(ROOT / "setup.cfg")
        package_data = {
            package: [p.strip() for p in re.split(r"[,\n]", patterns) if p.strip()]
            for package, patterns in parser["options.package_data"].items()
        }
        files = sorted((ROOT / "relayd").rglob("*.lua"))
        self.assertGreater(len(files), 20)
        for path in files:
            relative = path.relative_to(ROOT)
            package = ".".join(relative.parts[:-2])
            inside = "/".join(relative.parts[-2:])
            patterns = package_data.get(package, [])
            self.assertTrue(any(fnmatch.fnmatch(inside, p) for p in patterns), f"{relative} is not package data")
        names = {Path(p).name for s in _every_script() for p in [s.name + ".lua"]}
        self.assertLessEqual(names, {p.name for p in files})

    def test_no_python_module_holds_lua(self) -> None:
        lua = re.compile(r"redis\.call\(|redis\.pcall\(|\bKEYS\[|\bARGV\[")
        offenders = [
            str(path.relative_to(ROOT))
            for path in (ROOT / "relayd").rglob("*.py")
            if lua.search(path.read_text(encoding="utf-8"))
        ]
        self.assertEqual(offenders, [])


@expand
class DropRetries(TestCase):
    """Dropping a session looks at its subscribers, then drops it unless one arrived meanwhile;
    it looks at most C{_DROP_ATTEMPTS} times, then answers StoreUnavailable (the caller retries)."""

    @cases(mcp_store._DROP_ATTEMPTS - 1, mcp_store._DROP_ATTEMPTS)
    async def test_a_session_whose_subscribers_keep_changing(self, interfered: int) -> None:
        redis = await connected_redis(shared_redis().url)
        self.addCleanup(redis.close)
        store = RedisStore(redis, prefix=f"drop-{interfered}:")
        await store.put_session(SessionRecord(SESSION, "h" * 64, 1.0))
        await store.add_subscriber(SubscriberRecord("first", SESSION, INBOUND, SSE, None, 1.0, 0, "i1"))
        run = store._run
        looks = [0]

        async def interfering(name: str, keys: list[bytes], *args: Any) -> Any:
            result = await run(name, keys, *args)
            if name == "sub_all" and looks[0] < interfered:
                looks[0] += 1  # a reader subscribes between the look and the drop
                record = SubscriberRecord(f"late{looks[0]}", SESSION, OUTBOUND, SSE, None, 1.0, 0, "i2")
                await run("sub_add", [store._sub_key(SESSION, OUTBOUND), store._seq_key(SESSION), store._pollers_of(SESSION)],
                          record.id, SSE, "", "0", "i2", 1000, record.queue_key)
            return result

        store._run = lambda name, keys, *args: Deferred.fromCoroutine(interfering(name, keys, *args))  # type: ignore[method-assign]
        if interfered < mcp_store._DROP_ATTEMPTS:
            dropped = await store.drop_session_state(SESSION)
            self.assertEqual(len(dropped), 1 + interfered)
            self.assertEqual(await store.all_subscribers(SESSION), ([], []))
        else:
            with self.assertRaises(StoreUnavailable):
                await store.drop_session_state(SESSION)
            inbound, outbound = await store.all_subscribers(SESSION)
            self.assertEqual(len(inbound) + len(outbound), 1 + interfered)  # nothing was dropped
