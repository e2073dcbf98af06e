"""Lua scripts shipped as package data (C{<wing>/lua/<name>.lua}) and run with EVALSHA.

Every script names every key it touches in C{KEYS} (docs/decisions.md REDIS-1): the Python side
builds the key names, the script only uses them. A script is sent by its SHA-1; when Redis answers
C{NOSCRIPT} (first use, a restart, C{SCRIPT FLUSH}) it is sent once more in full with EVAL, which
also loads it for the next EVALSHA.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from importlib import resources
from typing import Any

import txredisapi
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure

from relayd.redis import Redis


def lua_source(package: str, name: str) -> bytes:
    """The text of C{<package>/lua/<name>.lua}."""
    return resources.files(package).joinpath("lua", f"{name}.lua").read_bytes()


class Script:
    """One Lua script of a wing, loaded once from package data.

    @param includes: names of files in the same C{lua} directory prepended to the script (shared
        local functions, e.g. the MCP buffered-bytes release).
    """

    def __init__(self, package: str, name: str, includes: Sequence[str] = ()) -> None:
        self.name = name
        self.body = b"".join(lua_source(package, part) for part in (*includes, name))
        self.sha = hashlib.sha1(self.body).hexdigest().encode("ascii")

    def __call__(self, redis: Redis, store: str, keys: Sequence[Any], args: Sequence[Any] = ()) -> Deferred[Any]:
        """Run the script; errbacks as L{Redis.execute} does."""
        d = redis.execute(store, b"EVALSHA", self.sha, len(keys), *keys, *args)

        def unknown(f: Failure) -> Any:
            if f.check(txredisapi.ResponseError) and str(f.value).startswith("NOSCRIPT"):
                return redis.execute(store, b"EVAL", self.body, len(keys), *keys, *args)
            return f

        return d.addErrback(unknown)


def tagged(session: bytes) -> bytes:
    """C{{session}}: the hash tag that keeps one session's keys in one Redis Cluster slot."""
    return b"{" + session + b"}"
