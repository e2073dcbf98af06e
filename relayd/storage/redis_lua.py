"""Lua scripts shipped as package data (C{<wing>/lua/<name>.lua}) and run with EVALSHA.

Every script names every key it touches in C{KEYS} (docs/decisions.md REDIS-1): the Python side
builds the key names, the script only uses them. A script is sent by its SHA-1; when Redis answers
C{NOSCRIPT} (first use, a restart, C{SCRIPT FLUSH}) it is sent once more in full with EVAL, which
also loads it for the next EVALSHA.

Every script file starts with a Redis 7 shebang that says what it may do (docs/deployment.md "Redis
memory"): C{#!lua} writes and is refused before it starts while Redis is out of memory (maxmemory
with noeviction), a read-only replica or refusing writes; C{#!lua flags=allow-oom} only deletes
(and may free memory then); C{#!lua flags=no-writes} only reads, so replays work while writes are
refused. Redis before 7 does not read a shebang (it is a syntax error there): the script is sent
without that line, and there a write script's first write is one Redis refuses under maxmemory
(tests/storage/test_redis_refusals.py checks both).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from relayd.base.errors import StoreRefused
from relayd.compat.txredisapi import Framed
from relayd.storage.redis import Redis

SHEBANGS = (b"#!lua\n", b"#!lua flags=allow-oom\n", b"#!lua flags=no-writes\n")


def lua_source(package: str, name: str) -> bytes:
    """The text of C{<package>/lua/<name>.lua}."""
    return resources.files(package).joinpath("lua", f"{name}.lua").read_bytes()


class Script:
    """One Lua script of a wing, loaded once from package data.

    @param includes: names of files in the same C{lua} directory prepended to the script (shared
        local functions, e.g. the MCP buffered-bytes release).
    @param durable: the script's write is one a client is told is done (stored, accepted, settled):
        with C{--redis-wait-replicas} its answer waits for that many replicas (L{Redis.execute}).
    """

    def __init__(self, package: str, name: str, includes: Sequence[str] = (), *, durable: bool = False) -> None:
        self.name = name
        self.durable = durable
        source = lua_source(package, name)
        shebang, _, rest = source.partition(b"\n")
        self.shebang = shebang + b"\n"
        if self.shebang not in SHEBANGS:
            raise ValueError(f"{package}/lua/{name}.lua must start with one of {SHEBANGS}")
        # (Includes have no shebang: only the script's first line may be one.)
        self.plain_body = b"".join(lua_source(package, part) for part in includes) + rest
        self.body = self.shebang + self.plain_body
        self.sha = hashlib.sha1(self.body).hexdigest().encode("ascii")
        self.plain_sha = hashlib.sha1(self.plain_body).hexdigest().encode("ascii")

    def __call__(self, redis: Redis, store: str, keys: Sequence[Any], args: Sequence[Any] = ()) -> Deferred[Any]:
        """Run the script; errbacks as L{Redis.execute} does."""
        sha = self.sha if redis.script_flags else self.plain_sha
        d = redis.execute(store, b"EVALSHA", sha, key_count(keys), *keys, *args, durable=self.durable)
        return d.addErrback(self._unknown, redis, store, keys, args)

    def many(
        self, redis: Redis, store: str, calls: Sequence[tuple[Sequence[Any], Sequence[Any]]]
    ) -> list[Deferred[Any]]:
        """Run the script once per C{(keys, args)}, all sent at once (L{Redis.execute_many}: one
        write per connection, on a Redis Cluster one per master); each answer as L{__call__}'s."""
        sha = self.sha if redis.script_flags else self.plain_sha
        commands = [(b"EVALSHA", sha, key_count(keys), *keys, *args) for keys, args in calls]
        sent = redis.execute_many(store, commands, durable=self.durable)
        return [
            d.addErrback(self._unknown, redis, store, keys, args) for d, (keys, args) in zip(sent, calls, strict=True)
        ]

    def _unknown(self, f: Failure, redis: Redis, store: str, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """C{NOSCRIPT}: the script in full (EVAL, which loads it for the next EVALSHA)."""
        if isinstance(f.value, StoreRefused) and f.value.code == "NOSCRIPT":
            body = self.body if redis.script_flags else self.plain_body
            return redis.execute(store, b"EVAL", body, key_count(keys), *keys, *args, durable=self.durable)
        return f


def key_count(keys: Sequence[Any]) -> int:
    """How many keys C{keys} names: a L{Framed} among them stands for several (the first key stays
    plain: a Redis Cluster client routes the script by it, relayd/storage/cluster.py)."""
    count = len(keys)
    for key in keys:
        if type(key) is Framed:
            count += len(key.args) - 1
    return count


def tagged(session: bytes) -> bytes:
    """C{{session}}: the hash tag that keeps one session's keys in one Redis Cluster slot."""
    return b"{" + session + b"}"
