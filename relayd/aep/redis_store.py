"""C{IEventLog} on Redis, shared by every relayd instance of a deployment.

Layout (every key under the deployment's prefix, default C{relayd:}):

- C{aep:lru}: sorted set of sessions scored by a write counter (C{aep:clock}); the lowest is the
  least recently written and is evicted first.
- C{aep:s:<session>}: sorted set (all scores 0, ordered by member) of C{<position><arrival>}
  members; a position is the length-prefixed decimal epoch and seq, so lexicographic order is exact
  integer order for any epoch (docs/decisions.md AEP-3) and equal positions keep arrival order.
- C{aep:e:<session>}: hash member -> the event's bytes (one line: events are stored in their
  newline-free wire form).
- C{aep:k:<session>}: hash dedupe key (C{source\\0id}) -> member, for admission dedupe, and
  C{aep:m:<session>}: hash member -> dedupe key, to forget the key of a trimmed event.

Appending a batch and reading a replay (or a page of one) are single Lua scripts, so several
instances can write one session at once without a lost update. (Keys are built inside the scripts: Redis Cluster is not
supported; use one primary.)
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

from twisted.internet.defer import Deferred
from zope.interface import implementer

from relayd import metrics
from relayd.aep.event import Event, stored_event
from relayd.aep.store import IEventLog, Position, Replay, exhausted_marker
from relayd.redis import Redis

STORE = "aep"
_FRAME = struct.Struct(">I")
_UNREADABLE = metrics.events_dropped.labels(relay="aep", reason="unreadable")

_APPEND = b"""
local prefix, capacity, max_sessions, blob = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local lru = prefix .. 'aep:lru'
local results = {}
local at, size = 1, #blob
local function field()
  local length = struct.unpack('>I4', blob, at)
  local value = string.sub(blob, at + 4, at + 3 + length)
  at = at + 4 + length
  return value
end
while at <= size do
  local session, pos, key, payload = field(), field(), field(), field()
  local skey, ekey, kkey, mkey = prefix .. 'aep:s:' .. session, prefix .. 'aep:e:' .. session, prefix .. 'aep:k:' .. session, prefix .. 'aep:m:' .. session
  if not redis.call('ZSCORE', lru, session) then
    while redis.call('ZCARD', lru) >= max_sessions do
      local oldest = redis.call('ZPOPMIN', lru)
      local victim = oldest[1]
      redis.call('DEL', prefix .. 'aep:s:' .. victim, prefix .. 'aep:e:' .. victim, prefix .. 'aep:k:' .. victim, prefix .. 'aep:m:' .. victim)
    end
  end
  redis.call('ZADD', lru, redis.call('INCR', prefix .. 'aep:clock'), session)
  if redis.call('HEXISTS', kkey, key) == 1 then
    results[#results + 1] = 0
  else
    local member = pos .. string.format('%016d', redis.call('INCR', prefix .. 'aep:arrival'))
    redis.call('ZADD', skey, 0, member)
    redis.call('HSET', ekey, member, payload)
    redis.call('HSET', kkey, key, member)
    redis.call('HSET', mkey, member, key)
    local excess = redis.call('ZCARD', skey) - capacity
    if excess > 0 then
      local gone = redis.call('ZRANGE', skey, 0, excess - 1)
      for _, m in ipairs(gone) do
        local key_of = redis.call('HGET', mkey, m)
        if key_of then redis.call('HDEL', kkey, key_of) end
        redis.call('HDEL', ekey, m)
        redis.call('HDEL', mkey, m)
      end
      redis.call('ZREMRANGEBYRANK', skey, 0, excess - 1)
    end
    results[#results + 1] = 1
  end
end
results[#results + 1] = redis.call('ZCARD', lru)
return results
"""

_REPLAY = b"""
local prefix, session, low, limit = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local skey, ekey = prefix .. 'aep:s:' .. session, prefix .. 'aep:e:' .. session
local first = redis.call('ZRANGE', skey, 0, 0)
if #first == 0 then return '' end
local members
if limit > 0 then
  members = redis.call('ZRANGEBYLEX', skey, low, '+', 'LIMIT', 0, limit)
else
  members = redis.call('ZRANGEBYLEX', skey, low, '+')
end
local cursor = ''
if limit > 0 and #members == limit then cursor = members[#members] end
local out = {first[1], cursor}
for _, m in ipairs(members) do
  local payload = redis.call('HGET', ekey, m)
  if payload then
    out[#out + 1] = m
    out[#out + 1] = payload
  end
end
return table.concat(out, '\\n')
"""


def encode_int(n: int) -> bytes:
    """A non-negative integer as a key that sorts like the integer: two-digit length, then digits."""
    digits = str(n).encode("ascii")
    return b"%02d" % len(digits) + digits


def encode_position(position: Position) -> bytes:
    return encode_int(position[0]) + encode_int(position[1])


def decode_position(member: bytes) -> Position:
    n = int(member[:2])
    epoch = int(member[2 : 2 + n])
    rest = member[2 + n :]
    m = int(rest[:2])
    return epoch, int(rest[2 : 2 + m])


def _epoch_key(epoch: int) -> bytes:
    # Epochs are positions' first field; a negative epoch (the relay grade does not check it)
    # counts as 0 like everywhere else.
    return encode_int(max(epoch, 0))


@implementer(IEventLog)
class RedisEventLog:
    """C{IEventLog} in Redis (see the module docstring for the layout)."""

    paged = True

    def __init__(self, redis: Redis, capacity: int, max_sessions: int, prefix: str = "relayd:") -> None:
        self.redis = redis
        self.capacity = capacity
        self.max_sessions = max_sessions
        self.prefix = prefix.encode("utf-8")
        self._sessions = 0

    def append(self, events: Sequence[Event]) -> Deferred[list[bool]]:
        # One length-framed argument for the whole batch: building a command of four arguments per
        # event cost the client more than Redis spends running the script.
        fields = []
        for event in events:
            source, event_id = event.key
            fields += [
                event.session.encode("utf-8"),  # type: ignore[union-attr]
                _epoch_key(event.position[0]) + encode_int(event.position[1]),
                source.encode("utf-8") + b"\x00" + event_id.encode("utf-8"),
                event.payload(None),
            ]
        blob = b"".join(_FRAME.pack(len(f)) + f for f in fields)
        args: list[Any] = [self.prefix, self.capacity, self.max_sessions, blob]

        def done(result: list[Any]) -> list[bool]:
            self._sessions = int(result[-1])
            return [int(flag) == 1 for flag in result[:-1]]

        return self.redis.eval(STORE, _APPEND, [], args).addCallback(done)

    def replay(self, session: str, after: Position, limit: int | None = None, cursor: Any = None) -> Deferred[Replay]:
        epoch, seq = after
        if cursor is not None:
            low = b"(" + cursor  # the page after the last member of the previous one
        elif seq < 0:
            low = b"[" + _epoch_key(epoch)
        else:
            low = b"(" + _epoch_key(epoch) + encode_int(seq) + b"\xff"
        args = [self.prefix, session.encode("utf-8"), low, limit or 0]

        def build(reply: bytes) -> Replay:
            # One bulk string (the earliest member, the next page's cursor or nothing, then member
            # and event lines): the client parses a single reply instead of one per event.
            if not reply:
                return Replay((), None)
            lines = reply.split(b"\n")
            earliest = decode_position(lines[0])
            events = []
            for raw in lines[3::2]:
                event = stored_event(raw)
                if event is None:
                    _UNREADABLE.inc()
                    continue
                events.append(event)
            if cursor is None:
                exhausted = exhausted_marker(earliest, after)
            elif lines[0] > cursor:  # all up to the previous page is gone: was more evicted meanwhile?
                exhausted = exhausted_marker(earliest, decode_position(cursor))
            else:
                exhausted = None
            return Replay(events, exhausted, lines[1] or None)

        return self.redis.eval(STORE, _REPLAY, [], args).addCallback(build)

    def sessions(self) -> Deferred[list[str]]:
        def decode(members: list[bytes]) -> list[str]:
            self._sessions = len(members)
            return [m.decode("utf-8") for m in members]

        return self.redis.execute(STORE, "ZRANGE", self.prefix + b"aep:lru", 0, -1).addCallback(decode)

    def session_count(self) -> int:
        """The count seen at the last write or listing (health must not wait on Redis)."""
        return self._sessions
