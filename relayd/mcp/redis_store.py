"""C{IMcpStore} on Redis, shared by every relayd instance of a deployment.

Layout (every key under the deployment's prefix, default C{relayd:}):

- C{mcp:s:<session>}: hash C{h} (token SHA-256 hex), C{t} (last seen, s); C{mcp:sessions}: sorted set
  of session ids scored by last seen (expiry scans and the session count).
- C{mcp:sub:<session>:<direction>}: hash subscriber id -> JSON C{[kind, label, instance, last_seen_ms,
  parked, arrival]}; C{mcp:pollers}: sorted set of C{<session>/<direction>/<id>} of pollers scored by
  last seen (idle pruning).
- C{mcp:q:<queue key>}: list of encoded frames; C{mcp:qm:<queue key>}: hash C{b} (bytes queued),
  C{d} (frames dropped since the last take).
- C{mcp:b:<session>:<direction>}: list, the first-frame backlog.
- C{mcp:c:<session>}: hash request-id key -> JSON C{[label, original id]}; C{mcp:co:<session>}: sorted
  set of the same keys by insertion (oldest evicted first).
- C{mcp:cl:<client id>}: JSON C{[session, label, legacy]} of a standard-endpoint client session,
  expiring after the client idle time unless touched.
- C{mcp:buffered}: bytes of frames in every queue and backlog of the deployment, kept by the same
  scripts that add and remove them (the bound C{--mcp-max-buffered-bytes} applies to it, so in Redis
  mode it is one bound for all instances together).

Every read-modify-write is one Lua script, so instances never lose each other's updates. (Keys are
built inside the scripts: Redis Cluster is not supported; use one primary.)
"""

from __future__ import annotations

from typing import Any

import orjson
from twisted.internet.defer import Deferred
from zope.interface import implementer

from relayd.mcp.store import (
    INBOUND,
    OUTBOUND,
    ClientRecord,
    Correlation,
    IMcpStore,
    SessionRecord,
    SubscriberRecord,
)
from relayd.redis import Redis

STORE = "mcp"

# Prepended to every script that removes frames: the buffered-bytes counter never goes below zero
# (frames stored before the counter existed are released without ever having been counted).
_RELEASE = b"""
local function release(p, n)
  if n > 0 and redis.call('DECRBY', p .. 'mcp:buffered', n) < 0 then
    redis.call('SET', p .. 'mcp:buffered', 0)
  end
end
"""
# A parked poll lasts at most 25 s; one parked far longer belongs to an instance that died.
STALE_PARKED_S = 120.0

_CLIENTS_TOUCH = b"""
local p, out = ARGV[1], {}
for i = 3, #ARGV do
  out[#out + 1] = redis.call('PEXPIRE', p .. 'mcp:cl:' .. ARGV[i], ARGV[2])
end
return out
"""

_SESSION_PUT = b"""
local p, id = ARGV[1], ARGV[2]
redis.call('HSET', p .. 'mcp:s:' .. id, 'h', ARGV[3], 't', ARGV[4])
redis.call('ZADD', p .. 'mcp:sessions', ARGV[4], id)
return 1
"""

_SESSION_TOUCH = b"""
local p, id = ARGV[1], ARGV[2]
local key = p .. 'mcp:s:' .. id
if redis.call('EXISTS', key) == 0 then return 0 end
redis.call('HSET', key, 't', ARGV[3])
redis.call('ZADD', p .. 'mcp:sessions', ARGV[3], id)
return 1
"""

# The stored and the presented token hashes are compared in Lua (not in constant time): both are
# SHA-256 digests, so timing reveals at most how many leading hex digits of two hashes agree, which
# says nothing useful about a token.
_SESSION_CHECK = b"""
local p, id = ARGV[1], ARGV[2]
local key = p .. 'mcp:s:' .. id
local stored = redis.call('HGET', key, 'h')
if not stored then return 'session_gone' end
if stored ~= ARGV[3] then return 'invalid_token' end
redis.call('HSET', key, 't', ARGV[4])
redis.call('ZADD', p .. 'mcp:sessions', ARGV[4], id)
return false
"""

_SUB_ALL = b"""
local p, s = ARGV[1], ARGV[2]
return {redis.call('HGETALL', p .. 'mcp:sub:' .. s .. ':inbound'), redis.call('HGETALL', p .. 'mcp:sub:' .. s .. ':outbound')}
"""

_SESSION_DELETE = b"""
local p, id = ARGV[1], ARGV[2]
redis.call('ZREM', p .. 'mcp:sessions', id)
return redis.call('DEL', p .. 'mcp:s:' .. id)
"""

_SUB_ADD = b"""
local p, s, d, id, kind = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local label = ARGV[6]
if ARGV[7] == '0' then label = false end
local seen = tonumber(ARGV[9])
local seq = redis.call('INCR', p .. 'mcp:seq')
redis.call('HSET', p .. 'mcp:sub:' .. s .. ':' .. d, id, cjson.encode({kind, label, ARGV[8], seen, 0, seq}))
local member = s .. '/' .. d .. '/' .. id
if kind == 'poll' then
  redis.call('ZADD', p .. 'mcp:pollers', seen, member)
else
  redis.call('ZREM', p .. 'mcp:pollers', member)
end
return 1
"""

_SUB_UPDATE = b"""
local p, s, d, id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local key = p .. 'mcp:sub:' .. s .. ':' .. d
local v = redis.call('HGET', key, id)
if not v then return 0 end
local r = cjson.decode(v)
if ARGV[5] ~= '' then r[4] = tonumber(ARGV[5]) end
r[5] = r[5] + tonumber(ARGV[6])
redis.call('HSET', key, id, cjson.encode(r))
if r[1] == 'poll' then redis.call('ZADD', p .. 'mcp:pollers', r[4], s .. '/' .. d .. '/' .. id) end
return 1
"""

_SUB_REMOVE = _RELEASE + b"""
local p, s, d, id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local key = p .. 'mcp:sub:' .. s .. ':' .. d
local v = redis.call('HGET', key, id)
local qk = s .. '/' .. d .. '/' .. id
release(p, tonumber(redis.call('HGET', p .. 'mcp:qm:' .. qk, 'b') or '0'))
redis.call('DEL', p .. 'mcp:q:' .. qk, p .. 'mcp:qm:' .. qk)
redis.call('ZREM', p .. 'mcp:pollers', qk)
if not v then return false end
redis.call('HDEL', key, id)
return v
"""

_SUB_FIND = b"""
local p, s, id = ARGV[1], ARGV[2], ARGV[3]
local out = {}
for _, d in ipairs({'inbound', 'outbound'}) do
  local v = redis.call('HGET', p .. 'mcp:sub:' .. s .. ':' .. d, id)
  if v then out[#out + 1] = d; out[#out + 1] = v end
end
return out
"""

_IDLE_POLLERS = b"""
local p, cutoff, stale = ARGV[1], ARGV[2], tonumber(ARGV[3])
local out = {}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', p .. 'mcp:pollers', '-inf', '(' .. cutoff)) do
  local s, d, id = string.match(m, '^([^/]+)/([^/]+)/([^/]+)$')
  local v = redis.call('HGET', p .. 'mcp:sub:' .. s .. ':' .. d, id)
  if not v then
    redis.call('ZREM', p .. 'mcp:pollers', m)
  else
    local r = cjson.decode(v)
    if r[5] <= 0 or r[4] < stale then
      out[#out + 1] = s; out[#out + 1] = d; out[#out + 1] = id; out[#out + 1] = v
    end
  end
end
return out
"""

_DROP_SESSION = _RELEASE + b"""
local p, s = ARGV[1], ARGV[2]
local out = {}
for _, d in ipairs({'inbound', 'outbound'}) do
  local key = p .. 'mcp:sub:' .. s .. ':' .. d
  local all = redis.call('HGETALL', key)
  for i = 1, #all, 2 do
    local qk = s .. '/' .. d .. '/' .. all[i]
    release(p, tonumber(redis.call('HGET', p .. 'mcp:qm:' .. qk, 'b') or '0'))
    redis.call('DEL', p .. 'mcp:q:' .. qk, p .. 'mcp:qm:' .. qk)
    redis.call('ZREM', p .. 'mcp:pollers', qk)
    out[#out + 1] = d; out[#out + 1] = all[i]; out[#out + 1] = all[i + 1]
  end
  local backlog = p .. 'mcp:b:' .. s .. ':' .. d
  local size = 0
  for _, f in ipairs(redis.call('LRANGE', backlog, 0, -1)) do size = size + #f end
  release(p, size)
  redis.call('DEL', key, backlog)
end
redis.call('DEL', p .. 'mcp:c:' .. s, p .. 'mcp:co:' .. s)
return out
"""

_PUSH = _RELEASE + b"""
local p, k, item = ARGV[1], ARGV[2], ARGV[3]
local max_items, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local q, m = p .. 'mcp:q:' .. k, p .. 'mcp:qm:' .. k
local n = redis.call('RPUSH', q, item)
local bytes = redis.call('HINCRBY', m, 'b', #item)
redis.call('INCRBY', p .. 'mcp:buffered', #item)
local dropped = 0
while n > 1 and (n > max_items or bytes > max_bytes) do
  local old = redis.call('LPOP', q)
  bytes = redis.call('HINCRBY', m, 'b', -#old)
  release(p, #old)
  n = n - 1
  dropped = dropped + 1
end
if dropped > 0 then redis.call('HINCRBY', m, 'd', dropped) end
return dropped
"""

_TAKE = _RELEASE + b"""
local p, k = ARGV[1], ARGV[2]
local q, m = p .. 'mcp:q:' .. k, p .. 'mcp:qm:' .. k
local items = redis.call('LRANGE', q, 0, -1)
local dropped = redis.call('HGET', m, 'd')
release(p, tonumber(redis.call('HGET', m, 'b') or '0'))
redis.call('DEL', q, m)
return {items, tonumber(dropped or '0')}
"""

_PUT_BACK = b"""
local p, k = ARGV[1], ARGV[2]
local q, m = p .. 'mcp:q:' .. k, p .. 'mcp:qm:' .. k
for i = #ARGV, 3, -1 do
  redis.call('LPUSH', q, ARGV[i])
  redis.call('HINCRBY', m, 'b', #ARGV[i])
  redis.call('INCRBY', p .. 'mcp:buffered', #ARGV[i])
end
return 1
"""

_BACKLOG_APPEND = _RELEASE + b"""
local p, key, cap = ARGV[1], ARGV[2], tonumber(ARGV[4])
local n = redis.call('RPUSH', key, ARGV[3])
redis.call('INCRBY', p .. 'mcp:buffered', #ARGV[3])
while n > cap do
  release(p, #redis.call('LPOP', key))
  n = n - 1
end
return 1
"""

_BACKLOG_TAKE = _RELEASE + b"""
local p, key = ARGV[1], ARGV[2]
local items = redis.call('LRANGE', key, 0, -1)
local size = 0
for _, f in ipairs(items) do size = size + #f end
release(p, size)
redis.call('DEL', key)
return items
"""

_CORRELATION_RECORD = b"""
local p, s, key, cap = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[5])
local c, co = p .. 'mcp:c:' .. s, p .. 'mcp:co:' .. s
redis.call('HSET', c, key, ARGV[4])
redis.call('ZADD', co, redis.call('INCR', p .. 'mcp:cseq'), key)
while redis.call('ZCARD', co) > cap do
  local oldest = redis.call('ZPOPMIN', co)
  redis.call('HDEL', c, oldest[1])
end
return 1
"""

_CORRELATION_CONSUME = b"""
local p, s, key = ARGV[1], ARGV[2], ARGV[3]
local c = p .. 'mcp:c:' .. s
local v = redis.call('HGET', c, key)
if not v then return false end
redis.call('HDEL', c, key)
redis.call('ZREM', p .. 'mcp:co:' .. s, key)
return v
"""


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _record(session: str, direction: str, subscriber: bytes | str, packed: bytes) -> SubscriberRecord:
    kind, label, instance, seen_ms, parked, _ = orjson.loads(packed)
    sid = subscriber.decode() if isinstance(subscriber, bytes) else subscriber
    return SubscriberRecord(
        sid, session, direction, kind, label if label is not False else None, seen_ms / 1000, parked, instance
    )


def _records(session: str, direction: str, flat: list[Any]) -> list[SubscriberRecord]:
    """Records from an C{HGETALL} reply, in arrival order."""
    found = [(orjson.loads(v)[5], sid, v) for sid, v in zip(flat[::2], flat[1::2], strict=True)]
    found.sort(key=lambda r: r[0])
    return [_record(session, direction, sid, v) for _, sid, v in found]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@implementer(IMcpStore)
class RedisStore:
    """C{IMcpStore} in Redis (see the module docstring for the layout)."""

    def __init__(self, redis: Redis, prefix: str = "relayd:") -> None:
        self.redis = redis
        self.prefix = prefix.encode("utf-8")

    def _key(self, *parts: str) -> bytes:
        return self.prefix + b"mcp:" + ":".join(parts).encode("utf-8")

    def _eval(self, script: bytes, *args: Any) -> Deferred[Any]:
        return self.redis.eval(STORE, script, [], [self.prefix, *args])

    # client sessions

    def put_client(self, client_id: str, record: ClientRecord, idle_ms: float) -> Deferred[None]:
        value = orjson.dumps([record.session, record.label, record.legacy])
        d = self.redis.execute(STORE, "SET", self._key("cl", client_id), value, "PX", max(1, int(idle_ms)))
        return d.addCallback(_none)

    def get_client(self, client_id: str) -> Deferred[ClientRecord | None]:
        def build(value: Any) -> ClientRecord | None:
            if not value:
                return None
            session, label, legacy = orjson.loads(value)
            return ClientRecord(session, label, bool(legacy))

        return self.redis.execute(STORE, "GET", self._key("cl", client_id)).addCallback(build)

    def touch_clients(self, client_ids: list[str], idle_ms: float) -> Deferred[list[bool]]:
        if not client_ids:
            return _fired_with([])
        d = self._eval(_CLIENTS_TOUCH, max(1, int(idle_ms)), *client_ids)
        return d.addCallback(lambda flags: [int(f) == 1 for f in flags])

    def delete_client(self, client_id: str) -> Deferred[bool]:
        return self.redis.execute(STORE, "DEL", self._key("cl", client_id)).addCallback(lambda n: int(n) > 0)

    # sessions

    def get_session(self, session_id: str) -> Deferred[SessionRecord | None]:
        def build(values: list[Any]) -> SessionRecord | None:
            digest, seen = values
            if digest is None:
                return None
            return SessionRecord(session_id, _text(digest), float(seen))

        return self.redis.execute(STORE, "HMGET", self._key("s", session_id), "h", "t").addCallback(build)

    def put_session(self, record: SessionRecord) -> Deferred[None]:
        return self._eval(_SESSION_PUT, record.id, record.token_hash, repr(record.last_seen)).addCallback(_none)

    def touch_session(self, session_id: str, now: float) -> Deferred[None]:
        return self._eval(_SESSION_TOUCH, session_id, repr(now)).addCallback(_none)

    def check_session(self, session_id: str, token_hash: str, now: float) -> Deferred[str | None]:
        d = self._eval(_SESSION_CHECK, session_id, token_hash, repr(now))
        return d.addCallback(lambda reason: None if reason is None else _text(reason))

    def delete_session(self, session_id: str) -> Deferred[bool]:
        return self._eval(_SESSION_DELETE, session_id).addCallback(lambda n: int(n) > 0)

    def expired_session_ids(self, cutoff: float) -> Deferred[list[str]]:
        d = self.redis.execute(STORE, "ZRANGEBYSCORE", self.prefix + b"mcp:sessions", "-inf", f"({cutoff!r}")
        return d.addCallback(lambda ids: [_text(i) for i in ids])

    def session_count(self) -> Deferred[int]:
        return self.redis.execute(STORE, "ZCARD", self.prefix + b"mcp:sessions").addCallback(int)

    # subscribers

    def add_subscriber(self, record: SubscriberRecord) -> Deferred[None]:
        return self._eval(
            _SUB_ADD,
            record.session,
            record.direction,
            record.id,
            record.kind,
            record.label or "",
            "0" if record.label is None else "1",
            record.instance,
            _ms(record.last_seen),
        ).addCallback(_none)

    def get_subscriber(self, session_id: str, direction: str, subscriber_id: str) -> Deferred[SubscriberRecord | None]:
        d = self.redis.execute(STORE, "HGET", self._key("sub", session_id, direction), subscriber_id)
        return d.addCallback(lambda v: None if v is None else _record(session_id, direction, subscriber_id, v))

    def find_subscriber(self, session_id: str, subscriber_id: str) -> Deferred[list[SubscriberRecord]]:
        def build(flat: list[Any]) -> list[SubscriberRecord]:
            return [_record(session_id, _text(d), subscriber_id, v) for d, v in zip(flat[::2], flat[1::2], strict=True)]

        return self._eval(_SUB_FIND, session_id, subscriber_id).addCallback(build)

    def subscribers(self, session_id: str, direction: str) -> Deferred[list[SubscriberRecord]]:
        d = self.redis.execute(STORE, "HGETALL", self._key("sub", session_id, direction))
        return d.addCallback(lambda flat: _records(session_id, direction, flat))

    def all_subscribers(self, session_id: str) -> Deferred[tuple[list[SubscriberRecord], list[SubscriberRecord]]]:
        def build(both: list[Any]) -> tuple[list[SubscriberRecord], list[SubscriberRecord]]:
            return _records(session_id, INBOUND, both[0] or []), _records(session_id, OUTBOUND, both[1] or [])

        return self._eval(_SUB_ALL, session_id).addCallback(build)

    def update_subscriber(
        self, session_id: str, direction: str, subscriber_id: str, last_seen: float | None, parked_delta: int
    ) -> Deferred[None]:
        seen = "" if last_seen is None else _ms(last_seen)
        return self._eval(_SUB_UPDATE, session_id, direction, subscriber_id, seen, parked_delta).addCallback(_none)

    def remove_subscriber(self, session_id: str, direction: str, subscriber_id: str) -> Deferred[SubscriberRecord | None]:
        d = self._eval(_SUB_REMOVE, session_id, direction, subscriber_id)
        return d.addCallback(lambda v: None if not v else _record(session_id, direction, subscriber_id, v))

    def idle_pollers(self, cutoff: float) -> Deferred[list[SubscriberRecord]]:
        def build(flat: list[Any]) -> list[SubscriberRecord]:
            return [
                _record(_text(flat[i]), _text(flat[i + 1]), flat[i + 2], flat[i + 3]) for i in range(0, len(flat), 4)
            ]

        stale = _ms(cutoff - STALE_PARKED_S)
        return self._eval(_IDLE_POLLERS, _ms(cutoff), stale).addCallback(build)

    def drop_session_state(self, session_id: str) -> Deferred[list[SubscriberRecord]]:
        def build(flat: list[Any]) -> list[SubscriberRecord]:
            return [_record(session_id, _text(flat[i]), flat[i + 1], flat[i + 2]) for i in range(0, len(flat), 3)]

        return self._eval(_DROP_SESSION, session_id).addCallback(build)

    # queues

    def push(self, key: str, item: bytes, max_items: int, max_bytes: int) -> Deferred[int]:
        return self._eval(_PUSH, key, item, max_items, max_bytes).addCallback(int)

    def take(self, key: str) -> Deferred[tuple[list[bytes], int]]:
        return self._eval(_TAKE, key).addCallback(lambda r: (list(r[0] or []), int(r[1])))

    def put_back(self, key: str, items: list[bytes]) -> Deferred[None]:
        if not items:
            return _fired()
        return self._eval(_PUT_BACK, key, *items).addCallback(_none)

    def size(self, key: str) -> Deferred[int]:
        return self.redis.execute(STORE, "LLEN", self.prefix + b"mcp:q:" + key.encode()).addCallback(int)

    def buffered_bytes(self) -> Deferred[int]:
        d = self.redis.execute(STORE, "GET", self.prefix + b"mcp:buffered")
        return d.addCallback(lambda n: max(0, int(n or 0)))

    # backlogs

    def append_backlog(self, session_id: str, direction: str, frame: bytes, cap: int) -> Deferred[None]:
        key = self._key("b", session_id, direction)
        return self._eval(_BACKLOG_APPEND, key, frame, cap).addCallback(_none)

    def take_backlog(self, session_id: str, direction: str) -> Deferred[list[bytes]]:
        key = self._key("b", session_id, direction)
        return self._eval(_BACKLOG_TAKE, key).addCallback(lambda items: list(items or []))

    # correlations

    def record_correlation(self, session_id: str, key: bytes, correlation: Correlation, cap: int) -> Deferred[None]:
        original = None if correlation.original_id is None else correlation.original_id.decode("utf-8")
        value = orjson.dumps([correlation.label, original])
        return self._eval(_CORRELATION_RECORD, session_id, key, value, cap).addCallback(_none)

    def correlation_pending(self, session_id: str, key: bytes) -> Deferred[bool]:
        d = self.redis.execute(STORE, "HEXISTS", self._key("c", session_id), key)
        return d.addCallback(lambda n: int(n) == 1)

    def consume_correlation(self, session_id: str, key: bytes) -> Deferred[Correlation | None]:
        def build(value: Any) -> Correlation | None:
            if not value:
                return None
            label, original = orjson.loads(value)
            return Correlation(label, None if original is None else original.encode("utf-8"))

        return self._eval(_CORRELATION_CONSUME, session_id, key).addCallback(build)


def _none(_: Any) -> None:
    return None


def _fired_with(value: Any) -> Deferred[Any]:
    d: Deferred[Any] = Deferred()
    d.callback(value)
    return d


def _fired() -> Deferred[None]:
    d: Deferred[None] = Deferred()
    d.callback(None)
    return d


__all__ = ["STORE", "RedisStore"]
