"""A Redis that refuses commands (memory full under noeviction, a read-only replica, a replica cut
from its primary, a script running too long) is a store outage on every wing: AEP and MCP answer
503, the broker's store fails with StoreUnavailable (its outage verdict), never a 500; the refusal
is logged once per outage, naming Redis's error; and no writing script runs past maxmemory."""

from __future__ import annotations

import json
import re
import socket
from typing import Any

from twisted.internet import defer, threads
from twisted.logger import formatEvent, globalLogPublisher
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.base.errors import StoreRefused, StoreUnavailable
from relayd.buzz.redis.state import RedisReceipts
from relayd.storage.redis import refusal_code
from relayd.storage.redis_lua import lua_source
from tests.storage.test_redis import admin, until
from tests.storage.test_redis_scripts import _every_script
from tests.support.aep import event, open_sse, start_relay
from tests.support.cases import cases, expand
from tests.support.http import HttpClient
from tests.support.redis import RedisServer, bucket_key, connected_redis, free_port, session_key
from tests.support.wing import Wing

TOKEN = "t" * 32
RELEASE = lua_source("relayd.mcp", "release")


def used_memory(port: int) -> int:
    return int(re.search(rb"used_memory:(\d+)", admin(port, b"INFO memory\r\n")).group(1))  # type: ignore[union-attr]


class Refusals(TestCase):
    timeout = 30

    def setUp(self) -> None:
        # A private server: its faults concern this test only.
        self.server = RedisServer.start()
        self.addCleanup(self.server.cleanup)
        self.lines: list[str] = []

        def observe(e: dict[str, Any]) -> None:
            if e.get("log_namespace") == "relayd.storage.redis.Redis":
                self.lines.append(formatEvent(e))

        globalLogPublisher.addObserver(observe)
        self.addCleanup(globalLogPublisher.removeObserver, observe)

    def refusal_lines(self) -> list[str]:
        return [line for line in self.lines if "refuses commands" in line]

    async def fault(self, kind: str) -> bytes:
        """Make Redis refuse writes (and, for some kinds, reads) as C{kind}; returns its error's first word."""
        port = self.server.port
        if kind == "oom":
            admin(port, b"CONFIG SET maxmemory-policy noeviction\r\nCONFIG SET maxmemory 1\r\n")
            return b"OOM"
        if kind == "readonly":
            admin(port, b"REPLICAOF 127.0.0.1 %d\r\n" % free_port())  # a primary that never answers
            return b"READONLY"
        if kind == "masterdown":  # (a write is refused as READONLY first; a read as MASTERDOWN)
            admin(port, b"CONFIG SET replica-serve-stale-data no\r\nREPLICAOF 127.0.0.1 %d\r\n" % free_port())
            return b"MASTERDOWN"
        assert kind == "busy"
        admin(port, b"CONFIG SET busy-reply-threshold 10\r\n")

        def spin() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
                s.sendall(b"EVAL \"while true do end\" 0\r\n")
                return s.recv(256)

        running = threads.deferToThread(spin)
        self.addCleanup(lambda: running)
        self.addCleanup(admin, port, b"SCRIPT KILL\r\n")
        # Polling an external server until its script runs past the threshold.
        await until(self, lambda: admin(port, b"PING\r\n").startswith(b"-BUSY"), "the script never made Redis busy")
        return b"BUSY"

    def mend(self, kind: str) -> None:
        commands = {
            "oom": b"CONFIG SET maxmemory 0\r\n",
            "readonly": b"REPLICAOF NO ONE\r\n",
            "masterdown": b"REPLICAOF NO ONE\r\n",
            "busy": b"SCRIPT KILL\r\n",
        }
        admin(self.server.port, commands[kind])


@expand
class EveryWing(Refusals):
    @cases("oom", "readonly", "masterdown", "busy")
    async def test_refusal_is_503_on_aep_and_mcp_logged_once(self, kind: str) -> None:
        flags = {"redis": self.server.url, "redis-prefix": "refused:"}
        aep = await start_relay(self, redis=self.server.url, redis_prefix="refused:")
        mcp = await Wing.start("mcp", {**flags, "mcp-reap-interval-ms": "0"})
        self.addCleanup(mcp.stop)
        page = HttpClient(self, mcp.url + mcp.settings["mcp-prefix"])
        response, _ = await aep.post(event("S", 1))
        self.assertEqual(response.code, 202)

        code = await self.fault(kind)
        if kind == "masterdown":  # reads are refused too: the first refusal is a replay's
            response, body = await aep.get("/stream?live=0&from=" + json.dumps([{"session": "S"}]))
            self.assertEqual((response.code, json.loads(body)), (503, {"error": "store-unavailable", "store": "aep"}))
        for attempt in range(3):
            response, body = await aep.post(event("S", 2 + attempt), event("S", 10 + attempt))
            self.assertEqual((response.code, json.loads(body)), (503, {"error": "store-unavailable", "store": "aep"}))
            reply = await page.post("/register", json.dumps({"session": f"sess{attempt}", "token": TOKEN}).encode())
            self.assertEqual((reply.code, reply.json()), (503, {"error": "store_unavailable", "store": "mcp"}))
        # One line for the outage per Redis client (each wing started here has its own, as two
        # processes would), not one per request.
        lines = self.refusal_lines()
        self.assertEqual(len(lines), 2, lines)
        for line in lines:
            self.assertIn(f"refuses commands: {code.decode()} ", line)
            self.assertIn("answering 503 store-unavailable", line)

        self.mend(kind)
        # Polling an external server that comes back by itself (a replica promoted, a script killed).
        await until(self, lambda: admin(self.server.port, b"SET probe 1\r\n") == b"+OK\r\n", "Redis stayed refusing")
        response, _ = await aep.post(event("S", 5))
        self.assertEqual(response.code, 202)
        reply = await page.post("/register", json.dumps({"session": "sess9", "token": TOKEN}).encode())
        self.assertEqual(reply.code, 200)
        self.assertTrue(any("runs the commands it refused again" in line for line in self.lines), self.lines)


@expand
class MemoryFull(Refusals):
    """maxmemory with noeviction: a write script is refused before it writes; a replay still runs."""

    async def test_aep_writes_nothing_past_maxmemory_and_replays(self) -> None:
        aep = await start_relay(self, redis=self.server.url, redis_prefix="full:")
        response, _ = await aep.post(event("S", 1))
        self.assertEqual(response.code, 202)
        before, keys = used_memory(self.server.port), admin(self.server.port, b"DBSIZE\r\n")
        admin(self.server.port, b"CONFIG SET maxmemory-policy noeviction\r\nCONFIG SET maxmemory %d\r\n" % before)
        big = "x" * 50_000  # 1 MB in all
        for seq in range(2, 12):
            response, _ = await aep.post(event("S", seq, "progress.status", note=big), event("T", seq, note=big))
            self.assertEqual(response.code, 503)
        # Nothing was written: no key more, none longer (each POST would have stored 100 KB).
        self.assertEqual(admin(self.server.port, b"DBSIZE\r\n"), keys)
        self.assertEqual(admin(self.server.port, b"ZCARD %s\r\nEXISTS %s\r\n" % (session_key("full:", "aep", "s", "S"), session_key("full:", "aep", "s", "T"))), b":1\r\n:0\r\n")
        # Reads are not writes: the history is still served.
        history = await open_sse(self, aep, live="0", from_=[{"session": "S"}])
        self.assertEqual([m.json()["seq"] for m in await history.read_until_end() if m.comment is None], [1])

    @cases("flags", "plain")
    async def test_every_write_script_is_refused_before_it_writes(self, shebang: str) -> None:
        # "plain": the scripts as Redis before 7 gets them (no shebang): the append's first write
        # is one Redis refuses under maxmemory.
        from relayd.aep.core.event import Event
        from relayd.aep.redis.store import RedisEventLog

        redis = await connected_redis(self.server.url)
        self.addCleanup(redis.close)
        redis.script_flags = shebang == "flags"
        log = RedisEventLog(redis, 10, 10, prefix="plain:")
        raw = json.dumps(event("S", 1)).encode()
        await log.append([Event.of(json.loads(raw), raw)])
        admin(self.server.port, b"CONFIG SET maxmemory-policy noeviction\r\nCONFIG SET maxmemory 1\r\n")
        for seq in (2, 3):
            events = []
            for session in ("S", "new"):
                raw = json.dumps(event(session, seq)).encode()
                events.append(Event.of(json.loads(raw), raw))
            failure = await self.assertFailure(log.append(events), StoreRefused)
            self.assertEqual(failure.code, "OOM")
        admin(self.server.port, b"CONFIG SET maxmemory 0\r\n")
        self.assertEqual(admin(self.server.port, b"ZCARD %s\r\nGET %s\r\n" % (session_key("plain:", "aep", "s", "S"), bucket_key("plain:", "aep", "clock", "S"))), b":1\r\n$1\r\n2\r\n")
        replay = await log.replay("S", (0, -1))
        self.assertEqual([e.position for e in replay.events], [(0, 1)])

    async def test_broker_receipts_fail_as_an_outage(self) -> None:
        redis = await connected_redis(self.server.url)
        self.addCleanup(redis.close)
        receipts = RedisReceipts(redis, Timekeeper(redis.clock.reactor), lambda effects: defer.succeed(None), prefix="b:")
        self.addCleanup(receipts.close)
        await receipts.bus.ready
        admin(self.server.port, b"CONFIG SET maxmemory-policy noeviction\r\nCONFIG SET maxmemory 1\r\n")
        failure = await self.assertFailure(receipts.claim("p", "r", b"d" * 32), StoreUnavailable)
        self.assertIn("OOM command not allowed", str(failure))


class ScriptFlags(Refusals):
    """Each script's shebang says what it does (relayd/storage/redis_lua.py), and Redis 7 holds it to that."""

    async def test_flags_match_the_commands_each_script_calls(self) -> None:
        redis = await connected_redis(self.server.url)
        self.addCleanup(redis.close)
        for script in _every_script():
            called = sorted(set(re.findall(rb"redis\.call\('([A-Z]+)'", script.body)))
            info = await redis.execute("probe", "COMMAND", "INFO", *called)
            flags = {
                name: {f.encode() if isinstance(f, str) else f for f in entry[2]}
                for name, entry in zip(called, info, strict=True)
            }
            writes = [name for name in called if b"write" in flags[name]]
            grows = [name for name in called if b"denyoom" in flags[name]]
            if script.shebang == b"#!lua flags=no-writes\n":
                self.assertEqual(writes, [], script.name)
            elif script.shebang == b"#!lua flags=allow-oom\n":
                # Only deletes of its own (the shared release.lua lowers a counter it finds).
                own = set(re.findall(rb"redis\.call\('([A-Z]+)'", script.plain_body.replace(RELEASE, b"")))
                self.assertEqual([name for name in grows if name in own], [], script.name)
            else:
                self.assertEqual((script.shebang, bool(grows)), (b"#!lua\n", True), script.name)

    async def test_every_write_script_is_refused_before_it_runs(self) -> None:
        redis = await connected_redis(self.server.url)
        self.addCleanup(redis.close)
        admin(self.server.port, b"CONFIG SET maxmemory-policy noeviction\r\nCONFIG SET maxmemory 1\r\n")
        keys, args = [b"probe:%d" % i for i in range(12)], [b"1"] * 12
        for script in _every_script():
            outcome = await script(redis, "probe", keys, args).addCallbacks(lambda _: None, lambda f: f.value)
            if script.shebang == b"#!lua\n":
                self.assertIsInstance(outcome, StoreRefused, script.name)
                self.assertEqual(outcome.code, "OOM", script.name)
            else:  # runs (on these made-up keys it may fail, but never for memory)
                self.assertFalse(isinstance(outcome, StoreRefused), (script.name, outcome))


class Classified(TestCase):
    """The refusals a test cannot cause on one redis-server, as Redis words them."""

    @staticmethod
    def lines() -> dict[str, str]:
        return {
            "MISCONF": "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            "LOADING": "LOADING Redis is loading the dataset in memory",
            "NOREPLICAS": "NOREPLICAS Not enough good replicas to write.",
            "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
            "CLUSTERDOWN": "CLUSTERDOWN The cluster is down",
            # Before Redis 7, a script's refused call is quoted inside ERR.
            "OOM": "ERR Error running script (call to f_0123): @user_script:3: @user_script: 3: "
            "-OOM command not allowed when used memory > 'maxmemory'.",
        }

    def test_refusals(self) -> None:
        for code, message in self.lines().items():
            self.assertEqual(refusal_code(message), code, message)

    def test_answers_are_not_refusals(self) -> None:
        for message in ("WRONGTYPE Operation against a key holding the wrong kind of value", "ERR syntax error",
                        "ERR Error running script: attempt to compare nil with number (BOOMER)"):
            self.assertIsNone(refusal_code(message), message)

