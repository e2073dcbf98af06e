"""Keyspace version 4 is cluster-safe (issue 25 acceptance 5): every script relayd runs is given keys
of one Redis Cluster slot (the AEP append's shard channel with them), whatever the ids and the prefix, and a prefix that would take over the
keys' hash tags is refused at start with one line.

The slots are computed here (relayd/storage/buckets.py's CRC16) and checked against a real
cluster-enabled redis-server's C{CLUSTER KEYSLOT}. The operations run against a real Redis: every
command relayd sends is recorded, and each script's C{KEYS} must share one slot; the ids and
prefixes are drawn by hypothesis (each drawn example is run; a failure names it).
"""

from __future__ import annotations

import io
import socket
import sys
from collections import Counter
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet.defer import Deferred
from twisted.trial.unittest import TestCase

from relayd.aep.redis import store as aep_store
from relayd.compat.txredisapi import unframed
from relayd.storage.buckets import BUCKETS, SLOTS, Buckets, key_slot, redis_prefix
from relayd.tap import Options
from tests.storage.test_redis_scripts import Ids, every_operation
from tests.support.redis import RedisServer, cluster_port, connected_redis, shared_redis

# Ids relayd must tag like any other: the empty AEP session, braces, Unicode.
ODD_IDS = st.one_of(
    st.sampled_from(["", "{x}", "}", "{", "a}b", "{}", "é☃", "x{y}z"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="/\n\x00"), max_size=12),
)
PREFIXES = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="{}\n\r \x00"), min_size=0, max_size=8
)


def _keyslot_on(port: int, keys: list[bytes]) -> list[int]:
    """C{CLUSTER KEYSLOT} of each key, asked of the redis-server on C{port} (RESP, binary-safe)."""
    request = b"".join(
        b"*3\r\n$7\r\nCLUSTER\r\n$7\r\nKEYSLOT\r\n$%d\r\n%s\r\n" % (len(key), key) for key in keys
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        data = b""
        while data.count(b"\r\n") < len(keys):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    lines = data.split(b"\r\n")[: len(keys)]
    assert all(line.startswith(b":") for line in lines), lines
    return [int(line[1:]) for line in lines]


class Slots(TestCase):
    def test_key_slot_is_redis_clusters(self) -> None:
        server = RedisServer.start("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", port=cluster_port())
        self.addCleanup(server.cleanup)
        keys: list[bytes] = []

        @settings(max_examples=200, database=None, deadline=None)
        @given(st.binary(max_size=20) | ODD_IDS.map(lambda t: t.encode("utf-8")))
        def collect(key: bytes) -> None:
            keys.append(key)

        collect()
        keys += [b"relayd:schema", b"{relayd}:x", b"a{}b", b"{}{x}", b"{{x}}", b"}{x}", b"aep:lru", *BUCKETS.tags]
        self.assertEqual([key_slot(k) for k in keys], _keyslot_on(server.port, keys))

    def test_the_buckets_spread_evenly_over_the_slots(self) -> None:
        self.assertEqual(len(set(BUCKETS.tags)), BUCKETS.count)
        self.assertGreaterEqual(BUCKETS.count, 64)
        shares = [key_slot(tag) * BUCKETS.count // SLOTS for tag in BUCKETS.tags]
        self.assertEqual(sorted(shares), list(range(BUCKETS.count)))  # one bucket in each 1/64 of the slots
        for masters in (3, 4, 6):  # masters owning equal contiguous ranges, as redis-cli creates them
            held = Counter(key_slot(tag) * masters // SLOTS for tag in BUCKETS.tags)
            self.assertLessEqual(max(held.values()), -(-BUCKETS.count // masters) + 1, (masters, held))
        self.assertEqual(Buckets(1).tags, (Buckets(1).tag_of(b"anything"),))


_APPENDS = (aep_store._APPEND.sha, aep_store._APPEND.plain_sha, aep_store._APPEND.body, aep_store._APPEND.plain_body)


def _keys_of(command: tuple[Any, ...]) -> list[bytes] | None:
    """A script's KEYS, and the shard channel the AEP append publishes on (C{SPUBLISH}: on a Redis
    Cluster it must be in the slot of the script's keys); C{None} for another command."""
    command = tuple(unframed(command))  # (keys framed once: relayd/compat/txredisapi.py Framed)
    if command[0] in (b"EVALSHA", b"EVAL"):
        count = int(command[2])
        keys = list(command[3 : 3 + count])
        if command[1] in _APPENDS:
            argv = command[3 + count :]
            channel, publish = argv[3], argv[7]  # (append.lua: ARGV[4], ARGV[8])
            if channel and publish == b"SPUBLISH":
                keys.append(channel)
        return keys
    return None


class EveryScriptOneSlot(TestCase):
    timeout = 120

    async def test_every_script_invocation_touches_one_slot(self) -> None:
        redis = await connected_redis(shared_redis().url)
        self.addCleanup(redis.close)
        sent: list[tuple[Any, ...]] = []
        execute, execute_many = redis.execute, redis.execute_many
        batches = 0  # calls sending several scripts at once (an append over several buckets)

        def recording(store: str, *command: Any, durable: bool = False) -> Deferred[Any]:
            sent.append(command)
            return execute(store, *command, durable=durable)

        def recording_many(store: str, commands: Any, durable: bool = False) -> list[Deferred[Any]]:
            nonlocal batches
            batches += sum(command[0] in (b"EVALSHA", b"EVAL") for command in commands) > 1
            sent.extend(commands)
            return execute_many(store, commands, durable=durable)

        redis.execute = recording  # type: ignore[method-assign]
        redis.execute_many = recording_many  # type: ignore[method-assign]
        # The AEP fan-out as on a Redis Cluster (shard channels: SPUBLISH, which Redis 7 runs on one
        # primary too), so that each append's channel is counted with its keys.
        redis.sharded_pubsub = True
        examples: list[tuple[str, Ids]] = [("k:", Ids()), ("", Ids("", "", ("",)))]

        @settings(max_examples=25, database=None, deadline=None)
        @given(PREFIXES, ODD_IDS.filter(lambda t: "/" not in t), ODD_IDS, st.lists(ODD_IDS, max_size=4), ODD_IDS)
        def collect(prefix: str, session: str, client: str, aep: list[str], owner: str) -> None:
            examples.append((prefix, Ids(session, client, tuple(aep), owner)))

        collect()
        scripts = channels = 0
        for n, (prefix, ids) in enumerate(examples):
            sent.clear()
            await every_operation(redis, f"slots{n}:{prefix}", ids)
            for command in sent:
                name = command[0].upper() if isinstance(command[0], bytes) else command[0].encode().upper()
                keys = _keys_of(command)
                if keys is None:
                    # Plain commands are single-key, but for MGET (Redis.get_many: split by slot on a cluster).
                    self.assertNotIn(name, (b"DEL", b"EXISTS", b"SUNION", b"ZUNIONSTORE"), (prefix, ids, command))
                    continue
                scripts += 1
                channels += len(keys) > int(command[2])
                slots = {key_slot(k) for k in keys}
                self.assertLessEqual(len(slots), 1, f"prefix {prefix!r}, {ids}: {command[:3 + len(keys)]}")
        self.assertGreater(scripts, 40 * len(examples))
        self.assertGreater(batches, 0)  # the scripts sent together were checked too
        self.assertGreater(channels, len(examples))


class BadPrefix(TestCase):
    def test_a_prefix_with_a_brace_is_refused_at_start_with_one_line(self) -> None:
        for prefix in ("re{lay:", "{relayd}:", "a}b:"):
            with self.assertRaises(ValueError):
                redis_prefix(prefix)
            err = io.StringIO()
            self.patch(sys, "stderr", err)
            with self.assertRaises(SystemExit) as exit:
                Options(environ={}).parseOptions(["--redis", "redis://127.0.0.1:1/0", "--redis-prefix", prefix])
            self.assertEqual(exit.exception.code, 2)
            lines = err.getvalue().splitlines()
            self.assertEqual(len(lines), 1, lines)
            self.assertTrue(lines[0].startswith(f"relayd: error: --redis-prefix: '{prefix}' must not contain"), lines)
        self.assertEqual(redis_prefix("relayd:"), "relayd:")
