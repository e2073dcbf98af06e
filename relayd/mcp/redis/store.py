"""C{IMcpStore} on Redis, shared by every relayd instance of a deployment.

Layout (every key under the deployment's prefix, default C{relayd:}; C{{b}} is the tag of the
session's bucket, relayd/storage/buckets.py, so that a session's keys and its bucket's keys share a
Redis Cluster slot; C{<s>} is the session id):

- C{mcp:{b}:s:<s>}: hash C{h} (token SHA-256 hex), C{t} (last seen, s); C{mcp:{b}:sessions}: sorted
  set of the bucket's session ids scored by last seen (expiry scans and the session count, summed
  over the buckets).
- C{mcp:{b}:sub:<s>:<direction>}: hash subscriber id -> JSON C{[kind, label, instance, last_seen_ms,
  parked, arrival]} (arrival from the session's counter C{mcp:{b}:n:<s>}: arrival order is only
  compared within a session); C{mcp:{b}:pollers}: sorted set of C{<session>/<direction>/<id>} of
  the bucket's pollers scored by last seen (idle pruning).
- C{mcp:{b}:q:<s>/<direction>/<id>}: list of encoded frames; C{mcp:{b}:qm:<s>/<direction>/<id>}: hash
  C{b} (bytes queued), C{d} (frames dropped since the last take).
- C{mcp:{b}:b:<s>:<direction>}: list, the first-frame backlog.
- C{mcp:{b}:c:<s>}: hash request-id key -> JSON C{[label, original id]}; C{mcp:{b}:co:<s>}: sorted
  set of the same keys by insertion within the session (oldest evicted first).
- C{mcp:own:<client address>}: sorted set of the ids of sessions that address registered (by
  register time; ended ones are pruned when it is counted), kept twice the session TTL after its
  last register (C{--mcp-max-sessions-per-address}).
- C{mcp:{c}:cl:<client id>}: JSON C{[session, label, answers_on_stream]} of a standard-endpoint client session
  (C{{c}}: the client id's bucket), expiring after the client idle time unless touched.
- C{mcp:{b}:buffered}: bytes of frames in the bucket's queues and backlogs, kept by the same scripts
  that add and remove them; the bound C{--mcp-max-buffered-bytes} applies to the sum over the
  buckets (read with one C{MGET} on a single primary), so in Redis mode it is one bound for all
  instances together.

Every read-modify-write is one Lua script (C{relayd/mcp/lua/}), so instances never lose each other's
updates; each script is given every key it touches in C{KEYS} (docs/decisions.md REDIS-1), all of one
bucket. A posted frame's authentication, correlation and subscriber lookup are one script
(C{inbox.lua}, C{outbox.lua}). Keyspace version 4; in version 3 the session index, pollers, buffered
counter and one arrival counter were deployment-wide.
"""

from __future__ import annotations

from typing import Any

import orjson
from twisted.internet.defer import Deferred, gatherResults
from zope.interface import implementer

from relayd.base.errors import StoreUnavailable, first_error
from relayd.mcp.core.store import (
    INBOUND,
    OUTBOUND,
    ClientRecord,
    Correlation,
    IMcpStore,
    InboxStart,
    OutboxStart,
    SessionRecord,
    SubscriberRecord,
    queue_key,
)
from relayd.storage.buckets import BUCKETS, Buckets
from relayd.storage.redis import Redis
from relayd.storage.redis_lua import Script

STORE = "mcp"

# A parked poll lasts at most 25 s; one parked far longer belongs to an instance that died.
STALE_PARKED_S = 120.0
# Sessions looked at beyond those that must end to make room for a register (sessions with readers
# are skipped): the least recently seen of all, or the first registered from the address.
_ROOM_LOOKS = 32
# Looks at a session's subscribers before dropping it gives up (each look sees a new subscriber).
_DROP_ATTEMPTS = 8

_PACKAGE = "relayd.mcp"
# The scripts that remove frames share release.lua (the buffered total never goes below zero).
_RELEASING = ("sub_remove", "drop_session", "push", "take", "backlog_append", "backlog_take")
# The scripts whose write a client is told is done (a register's, an inbox or outbox frame's ok; a
# frame queued or buffered for a reader): with --redis-wait-replicas they wait for the replicas.
_DURABLE = ("session_put", "inbox", "outbox", "push", "backlog_append")
_SCRIPTS = {
    name: Script(_PACKAGE, name, ("release",) if name in _RELEASING else (), durable=name in _DURABLE)
    for name in (
        "clients_touch", "session_put", "session_touch", "session_check", "session_delete", "sub_all",
        "sub_add", "sub_update", "sub_remove", "sub_find", "poller_check", "drop_session", "push", "take",
        "put_back", "backlog_append", "backlog_take", "correlation_record", "correlation_consume",
        "inbox", "outbox", "session_look",
    )
}  # fmt: skip


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

    def __init__(
        self, redis: Redis, prefix: str = "relayd:", ttl_ms: float = 14_400_000, *, buckets: Buckets = BUCKETS
    ) -> None:
        self.redis = redis
        self.prefix = prefix.encode("utf-8")
        self.buckets = buckets
        # How long an address's set of sessions outlives its last register: its sessions are gone by then
        # unless used, and an address that never registers again leaves nothing behind.
        self._owned_ms = max(1, int(2 * ttl_ms))

    # key names (docs/decisions.md REDIS-1: a session's keys carry its bucket's tag)

    def _in_bucket(self, session_id: str) -> tuple[bytes, bytes]:
        """The session's key prefix (C{mcp:{b}:}) and its id as bytes."""
        name = session_id.encode("utf-8")
        return self.prefix + b"mcp:" + self.buckets.tag_of(name) + b":", name

    def _index_keys(self, tag: bytes) -> tuple[bytes, bytes, bytes]:
        """A bucket's sessions index, pollers index and buffered-bytes counter."""
        p = self.prefix + b"mcp:" + tag + b":"
        return p + b"sessions", p + b"pollers", p + b"buffered"

    def _sessions_of(self, session_id: str) -> bytes:
        return self._index_keys(self.buckets.tag_of(session_id.encode("utf-8")))[0]

    def _pollers_of(self, session_id: str) -> bytes:
        return self._index_keys(self.buckets.tag_of(session_id.encode("utf-8")))[1]

    def _buffered_of(self, session_id: str) -> bytes:
        return self._index_keys(self.buckets.tag_of(session_id.encode("utf-8")))[2]

    def _session_key(self, session_id: str) -> bytes:
        p, name = self._in_bucket(session_id)
        return p + b"s:" + name

    def _seq_key(self, session_id: str) -> bytes:
        """The session's subscriber arrival counter."""
        p, name = self._in_bucket(session_id)
        return p + b"n:" + name

    def _sub_key(self, session_id: str, direction: str) -> bytes:
        p, name = self._in_bucket(session_id)
        return p + b"sub:" + name + b":" + direction.encode("utf-8")

    def _backlog_key(self, session_id: str, direction: str) -> bytes:
        p, name = self._in_bucket(session_id)
        return p + b"b:" + name + b":" + direction.encode("utf-8")

    def _correlation_keys(self, session_id: str) -> tuple[bytes, bytes]:
        p, name = self._in_bucket(session_id)
        return p + b"c:" + name, p + b"co:" + name

    def _queue_keys(self, key: str) -> tuple[bytes, bytes]:
        """The list and the counters of the queue C{<session>/<direction>/<subscriber>}."""
        p, _ = self._in_bucket(key.partition("/")[0])
        name = key.encode("utf-8")
        return p + b"q:" + name, p + b"qm:" + name

    def _owned_key(self, owner: str) -> bytes:
        return self.prefix + b"mcp:own:" + owner.encode("utf-8")

    def _client_key(self, client_id: str) -> bytes:
        name = client_id.encode("utf-8")
        return self.prefix + b"mcp:" + self.buckets.tag_of(name) + b":cl:" + name

    def _each_bucket(self, command: str, index: int, *args: Any) -> Deferred[list[Any]]:
        """C{command} on every bucket's index (0: sessions, 1: pollers), answers in bucket order."""
        reads = [self.redis.execute(STORE, command, self._index_keys(tag)[index], *args) for tag in self.buckets.tags]
        return gatherResults(reads, consumeErrors=True).addErrback(first_error)

    def _run(self, name: str, keys: list[bytes], *args: Any) -> Deferred[Any]:
        return _SCRIPTS[name](self.redis, STORE, keys, args)

    # client sessions

    def put_client(self, client_id: str, record: ClientRecord, idle_ms: float) -> Deferred[None]:
        value = orjson.dumps([record.session, record.label, record.answers_on_stream])
        d = self.redis.execute(STORE, "SET", self._client_key(client_id), value, "PX", max(1, int(idle_ms)))
        return d.addCallback(_none)

    def get_client(self, client_id: str) -> Deferred[ClientRecord | None]:
        def build(value: Any) -> ClientRecord | None:
            if not value:
                return None
            session, label, on_stream = orjson.loads(value)
            return ClientRecord(session, label, bool(on_stream))

        return self.redis.execute(STORE, "GET", self._client_key(client_id)).addCallback(build)

    def touch_clients(self, client_ids: list[str], idle_ms: float) -> Deferred[list[bool]]:
        if not client_ids:
            return _fired_with([])
        # One script per bucket of client ids (each touches one slot), answers put back in order.
        groups: dict[bytes, list[int]] = {}
        for i, client_id in enumerate(client_ids):
            groups.setdefault(self.buckets.tag_of(client_id.encode("utf-8")), []).append(i)
        ms = max(1, int(idle_ms))
        runs = [(at, self._run("clients_touch", [self._client_key(client_ids[i]) for i in at], ms)) for at in groups.values()]

        def merged(answers: list[list[Any]]) -> list[bool]:
            flags = [False] * len(client_ids)
            for (at, _), replies in zip(runs, answers, strict=True):
                for i, flag in zip(at, replies, strict=True):
                    flags[i] = int(flag) == 1
            return flags

        return gatherResults([d for _, d in runs], consumeErrors=True).addCallbacks(merged, first_error)

    def delete_client(self, client_id: str) -> Deferred[bool]:
        return self.redis.execute(STORE, "DEL", self._client_key(client_id)).addCallback(lambda n: int(n) > 0)

    # sessions

    def get_session(self, session_id: str) -> Deferred[SessionRecord | None]:
        def build(values: list[Any]) -> SessionRecord | None:
            digest, seen = values
            if digest is None:
                return None
            return SessionRecord(session_id, _text(digest), float(seen))

        return self.redis.execute(STORE, "HMGET", self._session_key(session_id), "h", "t").addCallback(build)

    def put_session(self, record: SessionRecord) -> Deferred[None]:
        keys = [self._session_key(record.id), self._sessions_of(record.id)]
        d = self._run("session_put", keys, record.id, record.token_hash, repr(record.last_seen))
        if record.owner:
            # The address's set is in no bucket (its sessions are in many): two commands of its own.
            owned, seen = self._owned_key(record.owner), repr(record.last_seen)
            d.addCallback(lambda _: self.redis.execute(STORE, "ZADD", owned, seen, record.id))
            d.addCallback(lambda _: self.redis.execute(STORE, "PEXPIRE", owned, self._owned_ms))
        return d.addCallback(_none)

    def touch_session(self, session_id: str, now: float) -> Deferred[None]:
        keys = [self._session_key(session_id), self._sessions_of(session_id)]
        return self._run("session_touch", keys, session_id, repr(now)).addCallback(_none)

    def check_session(self, session_id: str, token_hash: str, now: float) -> Deferred[str | None]:
        keys = [self._session_key(session_id), self._sessions_of(session_id)]
        d = self._run("session_check", keys, session_id, token_hash, repr(now))
        return d.addCallback(lambda reason: None if reason is None else _text(reason))

    def session_stamp(self) -> object | None:
        # Other instances change sessions unseen: every post's script authenticates (stamp ignored).
        return None

    def delete_session(self, session_id: str) -> Deferred[bool]:
        keys = [self._session_key(session_id), self._sessions_of(session_id)]
        return self._run("session_delete", keys, session_id).addCallback(lambda n: int(n) > 0)

    def expired_session_ids(self, cutoff: float) -> Deferred[list[str]]:
        d = self._each_bucket("ZRANGEBYSCORE", 0, "-inf", f"({cutoff!r}")
        return d.addCallback(lambda lists: [_text(i) for ids in lists for i in ids])

    def session_count(self) -> Deferred[int]:
        return self._each_bucket("ZCARD", 0).addCallback(lambda counts: sum(int(n) for n in counts))

    def session_room(self, owner: str | None, cap: int) -> Deferred[tuple[int, list[str]]]:
        return Deferred.fromCoroutine(self._session_room(owner, cap))

    async def _session_room(self, owner: str | None, cap: int) -> tuple[int, list[str]]:
        index = None if owner is None else self._owned_key(owner)
        if index is None:  # every bucket's sessions (sent at once)
            total = await self.session_count()
        else:
            total = int(await self.redis.execute(STORE, "ZCARD", index))
        if total < cap:
            return 0, []  # the common case: one command (one per bucket for the deployment's bound)
        # At the bound: look at a few more than must end of the first the address registered (ended
        # ones are pruned) or of the least recently seen of all, never at all of them (one register
        # is never a thousand Redis calls).
        stop = total - cap + _ROOM_LOOKS
        if index is None:
            # The least recently seen of all: the first of each bucket's, merged by last seen.
            lists = await self._each_bucket("ZRANGE", 0, 0, stop, "WITHSCORES")
            seen_ids = sorted((float(flat[i + 1]), _text(flat[i])) for flat in lists for i in range(0, len(flat), 2))
            ids = [session_id for _, session_id in seen_ids[: stop + 1]]
        else:
            ids = [_text(i) for i in await self.redis.execute(STORE, "ZRANGE", index, 0, stop)]
        looks = [
            self._run("session_look", [self._session_key(i), self._sub_key(i, INBOUND), self._sub_key(i, OUTBOUND)])
            for i in ids
        ]  # sent at once, answered in order
        ended, unread = [], []
        for session_id, look in zip(ids, looks, strict=True):
            seen, readers = await look
            if seen is None:
                ended.append(session_id)
            elif not int(readers):
                unread.append((float(seen), session_id))
        if ended and owner is not None:
            await self.redis.execute(STORE, "ZREM", index, *ended)
            total -= len(ended)
        excess = total - cap + 1
        if excess <= 0:
            return 0, []
        unread.sort()
        return excess, [session_id for _, session_id in unread[:excess]]

    # subscribers

    def add_subscriber(self, record: SubscriberRecord) -> Deferred[None]:
        return self._run(
            "sub_add",
            [self._sub_key(record.session, record.direction), self._seq_key(record.session), self._pollers_of(record.session)],
            record.id,
            record.kind,
            record.label or "",
            "0" if record.label is None else "1",
            record.instance,
            _ms(record.last_seen),
            record.queue_key,
        ).addCallback(_none)

    def get_subscriber(self, session_id: str, direction: str, subscriber_id: str) -> Deferred[SubscriberRecord | None]:
        d = self.redis.execute(STORE, "HGET", self._sub_key(session_id, direction), subscriber_id)
        return d.addCallback(lambda v: None if v is None else _record(session_id, direction, subscriber_id, v))

    def find_subscriber(self, session_id: str, subscriber_id: str) -> Deferred[list[SubscriberRecord]]:
        def build(flat: list[Any]) -> list[SubscriberRecord]:
            return [_record(session_id, _text(d), subscriber_id, v) for d, v in zip(flat[::2], flat[1::2], strict=True)]

        keys = [self._sub_key(session_id, INBOUND), self._sub_key(session_id, OUTBOUND)]
        return self._run("sub_find", keys, subscriber_id).addCallback(build)

    def subscribers(self, session_id: str, direction: str) -> Deferred[list[SubscriberRecord]]:
        d = self.redis.execute(STORE, "HGETALL", self._sub_key(session_id, direction))
        return d.addCallback(lambda flat: _records(session_id, direction, flat))

    def all_subscribers(self, session_id: str) -> Deferred[tuple[list[SubscriberRecord], list[SubscriberRecord]]]:
        def build(both: list[Any]) -> tuple[list[SubscriberRecord], list[SubscriberRecord]]:
            return _records(session_id, INBOUND, both[0] or []), _records(session_id, OUTBOUND, both[1] or [])

        keys = [self._sub_key(session_id, INBOUND), self._sub_key(session_id, OUTBOUND)]
        return self._run("sub_all", keys).addCallback(build)

    def update_subscriber(
        self, session_id: str, direction: str, subscriber_id: str, last_seen: float | None, parked_delta: int
    ) -> Deferred[None]:
        seen = "" if last_seen is None else _ms(last_seen)
        member = queue_key(session_id, direction, subscriber_id)
        keys = [self._sub_key(session_id, direction), self._pollers_of(session_id)]
        return self._run("sub_update", keys, subscriber_id, seen, parked_delta, member).addCallback(_none)

    def remove_subscriber(self, session_id: str, direction: str, subscriber_id: str) -> Deferred[SubscriberRecord | None]:
        member = queue_key(session_id, direction, subscriber_id)
        q, qm = self._queue_keys(member)
        keys = [self._sub_key(session_id, direction), q, qm, self._pollers_of(session_id), self._buffered_of(session_id)]
        d = self._run("sub_remove", keys, subscriber_id, member)
        return d.addCallback(lambda v: None if not v else _record(session_id, direction, subscriber_id, v))

    def idle_pollers(self, cutoff: float) -> Deferred[list[SubscriberRecord]]:
        return Deferred.fromCoroutine(self._idle_pollers(cutoff))

    async def _idle_pollers(self, cutoff: float) -> list[SubscriberRecord]:
        lists = await self._each_bucket("ZRANGEBYSCORE", 1, "-inf", f"({_ms(cutoff)}")
        stale = _ms(cutoff - STALE_PARKED_S)
        checks = []
        for member in (m for members in lists for m in members):
            session, direction, subscriber = _text(member).split("/")
            keys = [self._pollers_of(session), self._sub_key(session, direction)]
            d = self._run("poller_check", keys, member, subscriber, stale)
            checks.append((session, direction, subscriber, d))  # sent at once, answered in order
        found = []
        for session, direction, subscriber, d in checks:
            packed = await d
            if packed:
                found.append(_record(session, direction, subscriber, packed))
        return found

    def drop_session_state(self, session_id: str) -> Deferred[list[SubscriberRecord]]:
        return Deferred.fromCoroutine(self._drop_session_state(session_id))

    async def _drop_session_state(self, session_id: str) -> list[SubscriberRecord]:
        c, co = self._correlation_keys(session_id)
        fixed = [
            self._sub_key(session_id, INBOUND),
            self._sub_key(session_id, OUTBOUND),
            self._backlog_key(session_id, INBOUND),
            self._backlog_key(session_id, OUTBOUND),
            c,
            co,
            self._pollers_of(session_id),
            self._buffered_of(session_id),
            self._seq_key(session_id),
        ]
        for _ in range(_DROP_ATTEMPTS):
            # The script needs every queue's keys up front: look, then drop unless a subscriber
            # arrived meanwhile (then look again).
            both = await self._run("sub_all", fixed[:2])
            keys, args = list(fixed), [session_id]
            for direction, flat in zip((INBOUND, OUTBOUND), both, strict=False):
                for subscriber in (flat or [])[::2]:
                    keys += self._queue_keys(queue_key(session_id, direction, _text(subscriber)))
                    args.append(f"{direction}/{_text(subscriber)}")
            flat = await self._run("drop_session", keys, *args)
            if int(flat[0]) == 1:
                return [_record(session_id, _text(flat[i]), flat[i + 1], flat[i + 2]) for i in range(1, len(flat), 3)]
        # Readers subscribing faster than the session can be dropped: the caller retries later.
        raise StoreUnavailable(STORE, "the session's subscribers kept changing while it was dropped")

    # posts

    def start_inbox(
        self,
        session_id: str,
        token_hash: str,
        now: float,
        direction: str,
        key: bytes | None,
        correlation: Correlation | None,
        cap: int,
        stamp: object | None = None,
    ) -> Deferred[InboxStart]:
        c, co = self._correlation_keys(session_id)
        keys = [self._session_key(session_id), self._sessions_of(session_id), c, co, self._sub_key(session_id, direction)]
        value = b"" if correlation is None else _correlation_value(correlation)

        def build(reply: list[Any]) -> InboxStart:
            if reply[0] is not None:
                return InboxStart(_text(reply[0]))
            return InboxStart(None, int(reply[1]) == 1, int(reply[2]) == 1, _records(session_id, direction, reply[3]))

        d = self._run("inbox", keys, session_id, token_hash, repr(now), b"" if key is None else key, value, cap)
        return d.addCallback(build)

    def start_outbox(
        self, session_id: str, token_hash: str, now: float, key: bytes | None, stamp: object | None = None
    ) -> Deferred[OutboxStart]:
        c, co = self._correlation_keys(session_id)
        keys = [
            self._session_key(session_id),
            self._sessions_of(session_id),
            c,
            co,
            self._sub_key(session_id, INBOUND),
            self._sub_key(session_id, OUTBOUND),
        ]

        def build(reply: list[Any]) -> OutboxStart:
            if reply[0] is not None:
                return OutboxStart(_text(reply[0]))
            return OutboxStart(
                None,
                _correlation(reply[1]),
                _records(session_id, INBOUND, reply[2] or []),
                _records(session_id, OUTBOUND, reply[3] or []),
            )

        d = self._run("outbox", keys, session_id, token_hash, repr(now), b"" if key is None else key)
        return d.addCallback(build)

    # queues

    def push(self, key: str, item: bytes, max_items: int, max_bytes: int) -> Deferred[int]:
        return self._run("push", [*self._queue_keys(key), self._buffered_of(key.partition("/")[0])], item, max_items, max_bytes).addCallback(int)

    def take(self, key: str) -> Deferred[tuple[list[bytes], int]]:
        d = self._run("take", [*self._queue_keys(key), self._buffered_of(key.partition("/")[0])])
        return d.addCallback(lambda r: (list(r[0] or []), int(r[1])))

    def put_back(self, key: str, items: list[bytes]) -> Deferred[None]:
        if not items:
            return _fired()
        return self._run("put_back", [*self._queue_keys(key), self._buffered_of(key.partition("/")[0])], *items).addCallback(_none)

    def size(self, key: str) -> Deferred[int]:
        return self.redis.execute(STORE, "LLEN", self._queue_keys(key)[0]).addCallback(int)

    def buffered_bytes(self) -> Deferred[int]:
        # The sum of the buckets' counters (each never below zero).
        d = self.redis.get_many(STORE, [self._index_keys(tag)[2] for tag in self.buckets.tags])
        return d.addCallback(lambda values: sum(max(0, int(n or 0)) for n in values))

    # backlogs

    def append_backlog(self, session_id: str, direction: str, frame: bytes, cap: int) -> Deferred[None]:
        keys = [self._backlog_key(session_id, direction), self._buffered_of(session_id)]
        return self._run("backlog_append", keys, frame, cap).addCallback(_none)

    def take_backlog(self, session_id: str, direction: str) -> Deferred[list[bytes]]:
        keys = [self._backlog_key(session_id, direction), self._buffered_of(session_id)]
        return self._run("backlog_take", keys).addCallback(lambda items: list(items or []))

    # correlations

    def record_correlation(self, session_id: str, key: bytes, correlation: Correlation, cap: int) -> Deferred[None]:
        keys = list(self._correlation_keys(session_id))
        return self._run("correlation_record", keys, key, _correlation_value(correlation), cap).addCallback(_none)

    def claim_correlation(self, session_id: str, key: bytes, correlation: Correlation, cap: int) -> Deferred[bool]:
        keys = list(self._correlation_keys(session_id))
        d = self._run("correlation_record", keys, key, _correlation_value(correlation), cap, "claim")
        return d.addCallback(lambda n: int(n) == 1)

    def correlation_pending(self, session_id: str, key: bytes) -> Deferred[bool]:
        d = self.redis.execute(STORE, "HEXISTS", self._correlation_keys(session_id)[0], key)
        return d.addCallback(lambda n: int(n) == 1)

    def consume_correlation(self, session_id: str, key: bytes) -> Deferred[Correlation | None]:
        keys = list(self._correlation_keys(session_id))
        return self._run("correlation_consume", keys, key).addCallback(_correlation)


def _correlation_value(correlation: Correlation) -> bytes:
    original = None if correlation.original_id is None else correlation.original_id.decode("utf-8")
    return orjson.dumps([correlation.label, original])


def _correlation(value: Any) -> Correlation | None:
    if not value:
        return None
    label, original = orjson.loads(value)
    return Correlation(label, None if original is None else original.encode("utf-8"))


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
