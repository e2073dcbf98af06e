"""C{IEventLog} on Redis, shared by every relayd instance of a deployment.

Layout (every key under the deployment's prefix, default C{relayd:}; C{{b}} is the tag of the
session's bucket, relayd/storage/buckets.py, so that a session's keys and its bucket's keys share a
Redis Cluster slot; C{<s>} is the session):

- C{aep:{b}:lru}: sorted set of the bucket's sessions scored by a write counter (C{aep:{b}:clock});
  the lowest is the least recently written and is evicted first. C{aep:{b}:evicting}: sorted set
  of the bucket's sessions evicted whose keys are not dropped yet (they count as gone).
  C{--aep-max-sessions} is a quota per bucket: a bucket keeps at most ⌈max / buckets⌉ sessions,
  and eviction is least-recently-written within the bucket (docs/scaling.md "Buckets").
- C{aep:{b}:s:<s>}: sorted set (all scores 0, ordered by member) of C{<position><arrival>\n<id>\n<dedupe
  key>} members, one per event; a position is the length-prefixed decimal epoch and seq, so
  lexicographic order is exact integer order for any epoch (docs/decisions.md AEP-3), and equal
  positions keep arrival order (the session's counter C{aep:{b}:n:<s>}, 16 digits). The dedupe key
  comes last (it may hold any byte): a trimmed member says which key to forget.
- C{aep:{b}:e:<s>}: hash of the events' bytes (one line each: events are stored in their newline-free
  wire form). An event is stored alone under its arrival (C{<id>} empty), or, when it came in the
  usual batch (one session, every key new, every event after every held one, two events up to the
  buffer's size and 128 KiB), with the rest of its batch: the batch's fan-out message as the append
  got it (a header, then the events joined by line breaks) under C{<id>}, the first event's arrival, its
  header's length under C{h<id>} and its count of held events under C{c<id>}; the event is the
  line (arrival - id) after the header, and the message goes with its last held event. Batches
  stored so are trimmed one after another, so at most one is held in part: a session keeps its
  held events and less than 128 KiB of trimmed ones.
- C{aep:{b}:k:<s>}: hash of the held events' dedupe keys (C{source\0id}) -> C{''}, for admission dedupe
  (a hash rather than a set: one C{HMGET} checks a batch on Redis before 6.2).

Keyspace version 4 (relayd/storage/redis.py). In version 3 the keys were tagged by the session itself
and the LRU, clock and evicting set were deployment-wide; before it, an event's bytes and its dedupe
key were two fields of C{aep:e:{s}} (docs/performance.md "Not met: 100,000 events/s per instance").

Appending a batch and reading a replay (or a page of one) are single Lua scripts
(C{relayd/aep/lua/}), so several instances can write one session at once without a lost update.
Each script is given every key it touches in C{KEYS} (docs/decisions.md REDIS-1), all of one
bucket: a batch whose sessions fall in several buckets is one append per bucket (each with its own
fan-out message), all sent on one connection (on a Redis Cluster one per master:
relayd/storage/cluster.py C{execute_many}), their replies matched to the buckets in order. An
append that evicts a session that is not in its batch cannot name that session's keys in advance:
it moves the session to its bucket's C{evicting} set and its keys are dropped by C{drop.lua}
before the append answers (or by the next append of that session).
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

from twisted.internet.defer import Deferred, gatherResults, succeed
from zope.interface import implementer

from relayd.aep import metrics
from relayd.aep.core.event import Event, stored_event
from relayd.aep.core.store import IEventLog, Position, Replay, exhausted_marker
from relayd.base.errors import StoreUnavailable, first_error
from relayd.compat.txredisapi import Framed
from relayd.storage.buckets import BUCKETS, Buckets
from relayd.storage.redis import Redis
from relayd.storage.redis_lua import Script

STORE = "aep"
_LENGTH = struct.Struct(">I")
_UNREADABLE = metrics.events_dropped.labels(relay="aep", reason="unreadable")

_APPEND = Script("relayd.aep", "append", durable=True)  # an ingest's 202 / a socket's ack
_DROP = Script("relayd.aep", "drop")
_REPLAY = Script("relayd.aep", "replay")


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


WRITTEN_KEPT = 1024  # sessions whose keys RedisEventLog keeps made (about 600 bytes each)

FANOUT_CHANNEL = b"aep:fanout"  # after the prefix: every instance's accepted events


class FanoutChannels:
    """Where a bucket's accepted events are published for the other instances (relayd/aep/redis/fanout.py).

    On a single primary and with Sentinel, one classic channel for every bucket, C{<prefix>aep:fanout}
    (C{PUBLISH}). On a Redis Cluster (L{Redis.sharded_pubsub}) each bucket has its shard channel,
    C{<prefix>aep:{b}:fanout} (C{SPUBLISH}): its name carries the bucket's tag, so it lives in the
    slot of the bucket's keys, the append script publishes it on the master it runs on, and only the
    instances subscribed to that bucket hear it (relayd/storage/sharded.py).
    """

    def __init__(self, prefix: bytes, sharded: bool, buckets: Buckets = BUCKETS) -> None:
        self.prefix = prefix
        self.sharded = sharded
        self.buckets = buckets
        self.command = b"SPUBLISH" if sharded else b"PUBLISH"
        self._classic = prefix + FANOUT_CHANNEL
        self._every = list(dict.fromkeys(self.of(tag) for tag in buckets.tags))

    def of(self, tag: bytes) -> bytes:
        """The channel of the bucket C{tag}."""
        return self.prefix + b"aep:" + tag + b":fanout" if self.sharded else self._classic

    def of_session(self, session: str | None) -> bytes:
        """The channel of a session's bucket (an event without a session goes with the session C{""}:
        only subscriptions that pin no session can match it, and they hear every bucket)."""
        return self.of(self.buckets.tag_of((session or "").encode("utf-8")))

    def every(self) -> list[bytes]:
        """Every bucket's channel (one on a single primary)."""
        return self._every


def session_quota(max_sessions: int, buckets: Buckets) -> int:
    """Sessions one bucket keeps (C{--aep-max-sessions} split over the buckets, rounded up)."""
    return max(1, -(-max_sessions // buckets.count))


def fanout_header(instance: str) -> bytes:
    """What a fan-out message starts with: the publishing instance, then a newline, then the events."""
    return instance.encode("utf-8") + b"\n"


@implementer(IEventLog)
class RedisEventLog:
    """C{IEventLog} in Redis (see the module docstring for the layout)."""

    paged = True

    def __init__(
        self,
        redis: Redis,
        capacity: int,
        max_sessions: int,
        prefix: str = "relayd:",
        *,
        publisher: str | None = None,
        buckets: Buckets = BUCKETS,
    ) -> None:
        self.redis = redis
        self.capacity = capacity
        self.max_sessions = max_sessions
        self.buckets = buckets
        self._quota = session_quota(max_sessions, buckets)
        self.prefix = prefix.encode("utf-8")
        # With C{publisher} (this instance's id on the fan-out, as RedisFanout sends it), C{append}
        # can publish a batch itself, in the same script that stores it, on its bucket's channel.
        self.channels = FanoutChannels(self.prefix, redis.sharded_pubsub, buckets)
        self._header: bytes | None = None if publisher is None else fanout_header(publisher)
        # Sessions held, by bucket tag (as the last write or listing of each bucket saw them).
        self._held: dict[bytes, int] = {}
        self._sessions = 0
        self._bucket_keys: dict[bytes, tuple[bytes, bytes, bytes]] = {}
        # Sessions appended to lately: each one's bucket tag, name in bytes, and an append's keys for
        # it alone (its bucket's three, then its own four), so that the next append of its events
        # hashes no name and builds no key (L{_written_session}). Emptied when it holds L{WRITTEN_KEPT}.
        # (The keys after the first framed once: relayd/compat/txredisapi.py Framed.)
        self._written: dict[str, tuple[bytes, bytes, tuple[bytes, Framed]]] = {}
        # The script's bounds, as the command writes them.
        self._bounds = (b"%d" % capacity, b"%d" % self._quota)

    def _bucket(self, tag: bytes) -> tuple[bytes, bytes, bytes]:
        """A bucket's LRU, write counter and evicting set (made once per bucket: every append names them)."""
        keys = self._bucket_keys.get(tag)
        if keys is None:
            p = self.prefix + b"aep:" + tag
            keys = self._bucket_keys[tag] = (p + b":lru", p + b":clock", p + b":evicting")
        return keys

    def _written_session(self, session: str) -> tuple[bytes, bytes, tuple[bytes, Framed]]:
        """C{session}'s bucket tag, name in bytes, and the keys of an append of its events alone."""
        known = self._written.get(session)
        if known is None:
            if len(self._written) >= WRITTEN_KEPT:
                self._written.clear()
            name = session.encode("utf-8")
            tag = self.buckets.tag_of(name)
            lru, *rest = (*self._bucket(tag), *self._session_keys(name, tag))
            known = self._written[session] = (tag, name, (lru, Framed(rest)))
        return known

    def _session_keys(self, session: bytes, tag: bytes | None = None) -> list[bytes]:
        """Members, events, dedupe keys and arrival counter of one session."""
        p = self.prefix + b"aep:" + (tag or self.buckets.tag_of(session))
        return [p + b":s:" + session, p + b":e:" + session, p + b":k:" + session, p + b":n:" + session]

    @property
    def publishes(self) -> bool:
        """Whether C{append(events, publish=True)} publishes (made with a C{publisher})."""
        return self._header is not None

    def append(self, events: Sequence[Event], publish: bool = False) -> Deferred[list[bool]]:
        """Store the events; with C{publish}, also hand all of them (duplicates too) to the fan-out
        in the same script, so the batch is sent to Redis once (docs/performance.md). A batch
        whose sessions fall in several buckets is one script per bucket, sent at once."""
        written = self._written_session
        tags: dict[str, bytes] = {}
        for event in events:
            session = event.session
            if session not in tags:
                tags[session] = written(session)[0]  # type: ignore[index, arg-type]
        if not tags:
            return succeed([])
        deadline = self.redis.deadline()
        if len(set(tags.values())) == 1:
            tag = next(iter(tags.values()))
            keys, args = self._append_call(tag, events, publish, deadline)
            return _APPEND(self.redis, STORE, keys, args).addCallback(self._appended, tag)
        groups: dict[bytes, list[int]] = {}
        for i, event in enumerate(events):
            groups.setdefault(tags[event.session], []).append(i)  # type: ignore[index]
        # Every bucket's script sent at once: on one connection, or on a Redis Cluster one per
        # master (relayd/storage/cluster.py), each reply matched to its bucket in order.
        calls = [self._append_call(tag, [events[i] for i in at], publish, deadline) for tag, at in groups.items()]
        sent = _APPEND.many(self.redis, STORE, calls)
        parts = [d.addCallback(self._appended, tag) for d, tag in zip(sent, groups, strict=True)]

        def merged(answers: list[list[bool]]) -> list[bool]:
            stored = [False] * len(events)
            for at, flags in zip(groups.values(), answers, strict=True):
                for i, flag in zip(at, flags, strict=True):
                    stored[i] = flag
            return stored

        # A bucket that failed fails the batch (503): its retry is idempotent by (source, id).
        return gatherResults(parts, consumeErrors=True).addCallbacks(merged, first_error)

    def _append_call(
        self, tag: bytes, events: Sequence[Event], publish: bool, deadline: int
    ) -> tuple[Sequence[bytes | Framed], list[Any]]:
        """The keys and arguments of one bucket's append (all of C{events} are of sessions in the
        bucket C{tag}; C{deadline} as L{Redis.deadline} gave it for the batch)."""
        # Two arguments for the whole batch (building a command of four arguments per event cost
        # the client more than Redis spends running the script): the events' framed session
        # numbers, positions and keys, and their bytes joined by line breaks after the fan-out
        # header, which is the fan-out message itself: the script publishes it as it came (each
        # string the script makes costs Redis a pass over its bytes, docs/performance.md).
        numbers: dict[str, bytes] = {}
        parts: list[bytes] = []
        add = parts.append
        payloads: list[bytes] = []
        keep = payloads.append
        epoch_of: dict[int, bytes] = {}
        pack = _LENGTH.pack
        for event in events:
            session = event.session
            number = numbers.get(session)  # type: ignore[arg-type]
            if number is None:
                digits = b"%d" % (len(numbers) + 1)
                number = numbers[session] = pack(len(digits)) + digits  # type: ignore[index]
            epoch, seq = event.position
            epoch_key = epoch_of.get(epoch)
            if epoch_key is None:
                epoch_key = epoch_of[epoch] = _epoch_key(epoch)
            digits = b"%d" % seq
            n = len(digits)
            source, event_id = event.key
            key = f"{source}\x00{event_id}".encode()
            # The session number, the position (encode_int, inlined; one byte for its length: epoch
            # and seq have at most MAX_POSITION_DIGITS digits and a sign, so it is under 256 bytes),
            # the dedupe key.
            add(b"%s%c%s%02d%s%s%s" % (number, len(epoch_key) + 2 + (n > 99) + n, epoch_key, n, digits, pack(len(key)), key))
            # The posted bytes when they are the wire form (no copy kept on the event).
            keep(event.raw if event.raw is not None else event.payload(None))
        if len(numbers) == 1:  # (the usual batch, and every single event)
            _, name, alone = self._written_session(next(iter(numbers)))
            sessions = [name]
            keys: Sequence[bytes | Framed] = alone
        else:
            sessions = [s.encode("utf-8") for s in numbers]
            keys = list(self._bucket(tag))
            for name in sessions:
                keys += self._session_keys(name, tag)
        header = self._header if publish and self._header is not None else b""
        channel = self.channels.of(tag) if header else b""
        if header and payloads:
            payloads[0] = header + payloads[0]  # (not the whole message copied again)
        message = b"\n".join(payloads) if payloads else header
        args = [*self._bounds, b"".join(parts), channel, message, len(header), deadline,
                self.channels.command, *sessions]  # fmt: skip
        return keys, args

    def _held_in(self, tag: bytes, count: int) -> None:
        self._sessions += count - self._held.get(tag, 0)
        self._held[tag] = count

    def _appended(self, result: Any, tag: bytes) -> Deferred[list[bool]] | list[bool]:
        if result == b"late":
            # Redis reached the append after its deadline and did nothing (append.lua).
            raise StoreUnavailable(STORE, "Redis ran the append too late to answer in time; nothing was stored")
        self._held_in(tag, int(result[1]))
        stored = [flag == 49 for flag in result[0]]  # b"1"
        victims = result[2:]
        if not victims:
            return stored
        # Sessions evicted to make room whose keys were not in this batch: dropped before the
        # append answers, so an evicted session is gone once the write that evicted it is done.
        evicting = self._bucket(tag)[2]
        drops = [
            _DROP(self.redis, STORE, [evicting, *self._session_keys(victim, tag)], [victim]) for victim in victims
        ]
        return gatherResults(drops, consumeErrors=True).addCallback(lambda _: stored)

    def replay(self, session: str, after: Position, limit: int | None = None, cursor: Any = None) -> Deferred[Replay]:
        epoch, seq = after
        if cursor is not None:
            # The page after the last member of the previous one (C{cursor} is its position and
            # arrival, which the member continues with a line break).
            low = b"(" + cursor + b"\xff"
        elif seq < 0:
            low = b"[" + _epoch_key(epoch)
        else:
            low = b"(" + _epoch_key(epoch) + encode_int(seq) + b"\xff"
        name = session.encode("utf-8")
        tag = self.buckets.tag_of(name)
        keys = [*self._session_keys(name, tag)[:2], self._bucket(tag)[2]]
        args = [name, low, limit or 0]

        def build(reply: list[bytes]) -> Replay:
            # The earliest member, the next page's cursor or nothing, then runs of events joined by
            # line breaks (replay.lua): a few strings per page instead of one per event. (Or b"": none.)
            if not reply:
                return Replay((), None)
            first, following = reply[0], reply[1]
            earliest = decode_position(first)
            events = []
            for run in reply[2:]:
                for raw in run.split(b"\n"):
                    event = stored_event(raw)
                    if event is None:
                        _UNREADABLE.inc()
                        continue
                    events.append(event)
            if cursor is None:
                exhausted = exhausted_marker(earliest, after)
            elif first > cursor:  # all up to the previous page is gone: was more evicted meanwhile?
                exhausted = exhausted_marker(earliest, decode_position(cursor))
            else:
                exhausted = None
            return Replay(events, exhausted, following or None)

        return _REPLAY(self.redis, STORE, keys, args).addCallback(build)

    def sessions(self) -> Deferred[list[str]]:
        """Every bucket's sessions, bucket after bucket (least recently written first within each)."""
        tags = self.buckets.tags
        reads = self.redis.execute_many(STORE, [(b"ZRANGE", self._bucket(tag)[0], 0, -1) for tag in tags])

        def decode(lists: list[list[bytes]]) -> list[str]:
            out = []
            for tag, members in zip(tags, lists, strict=True):
                self._held_in(tag, len(members))
                out += [m.decode("utf-8") for m in members]
            return out

        return gatherResults(reads, consumeErrors=True).addCallbacks(decode, first_error)

    def session_count(self) -> int:
        """The count seen at the last writes or listing (health must not wait on Redis)."""
        return self._sessions

