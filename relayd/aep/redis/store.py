"""C{IEventLog} on Redis, shared by every relayd instance of a deployment.

Layout (every key under the deployment's prefix, default C{relayd:}; C{{s}} is the session as a
Redis Cluster hash tag, so that one session's keys share a slot):

- C{aep:lru}: sorted set of sessions scored by a write counter (C{aep:clock}); the lowest is the
  least recently written and is evicted first. C{aep:evicting}: sorted set of sessions evicted
  whose keys are not dropped yet (they count as gone).
- C{aep:s:{s}}: sorted set (all scores 0, ordered by member) of C{<position><arrival>\\n<id>\\n<dedupe
  key>} members, one per event; a position is the length-prefixed decimal epoch and seq, so
  lexicographic order is exact integer order for any epoch (docs/decisions.md AEP-3), and equal
  positions keep arrival order (the session's counter C{aep:n:{s}}, 16 digits). The dedupe key
  comes last (it may hold any byte): a trimmed member says which key to forget.
- C{aep:e:{s}}: hash of the events' bytes (one line each: events are stored in their newline-free
  wire form). An event is stored alone under its arrival (C{<id>} empty), or, when it came in the
  usual batch (one session, every key new, every event after every held one, two events up to the
  buffer's size and 128 KiB), with the rest of its batch: the batch's fan-out message as the append
  got it (a header, then the events joined by line breaks) under C{<id>}, the first event's arrival, its
  header's length under C{h<id>} and its count of held events under C{c<id>}; the event is the
  line (arrival - id) after the header, and the message goes with its last held event. Batches
  stored so are trimmed one after another, so at most one is held in part: a session keeps its
  held events and less than 128 KiB of trimmed ones.
- C{aep:k:{s}}: hash of the held events' dedupe keys (C{source\\0id}) -> C{''}, for admission dedupe
  (a hash rather than a set: one C{HMGET} checks a batch on Redis before 6.2).

Keyspace version 3 (relayd/storage/redis.py). Before it, an event's bytes and its dedupe key were two
fields of C{aep:e:{s}} (C{<member>}, C{k<member>}) and C{aep:k:{s}} mapped a dedupe key to its member
(docs/performance.md "Not met: 100,000 events/s per instance").

Appending a batch and reading a replay (or a page of one) are single Lua scripts
(C{relayd/aep/lua/}), so several instances can write one session at once without a lost update.
Each script is given every key it touches in C{KEYS} (docs/decisions.md REDIS-1). An append that
evicts a session that is not in its batch cannot name that session's keys in advance: it moves the
session to C{aep:evicting} and its keys are dropped by C{drop.lua} before the append answers (or by
the next append of that session). The LRU is one deployment-wide key used together with a batch's
sessions: Redis Cluster is not supported yet; use one primary.
"""

from __future__ import annotations

import struct
from typing import Any, Sequence

from twisted.internet.defer import Deferred, gatherResults
from zope.interface import implementer

from relayd.aep import metrics
from relayd.aep.core.event import Event, stored_event
from relayd.aep.core.store import IEventLog, Position, Replay, exhausted_marker
from relayd.base.errors import StoreUnavailable
from relayd.storage.redis import Redis
from relayd.storage.redis_lua import Script, tagged

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


FANOUT_CHANNEL = b"aep:fanout"  # after the prefix: every instance's accepted events


def fanout_header(instance: str) -> bytes:
    """What a fan-out message starts with: the publishing instance, then a newline, then the events."""
    return instance.encode("utf-8") + b"\n"


@implementer(IEventLog)
class RedisEventLog:
    """C{IEventLog} in Redis (see the module docstring for the layout)."""

    paged = True

    def __init__(
        self, redis: Redis, capacity: int, max_sessions: int, prefix: str = "relayd:", *, publisher: str | None = None
    ) -> None:
        self.redis = redis
        self.capacity = capacity
        self.max_sessions = max_sessions
        self.prefix = prefix.encode("utf-8")
        self._lru = self.prefix + b"aep:lru"
        self._clock = self.prefix + b"aep:clock"
        self._evicting = self.prefix + b"aep:evicting"
        # With C{publisher} (this instance's id on the fan-out, as RedisFanout sends it), C{append}
        # can publish a batch itself, in the same script that stores it.
        self._fanout: tuple[bytes, bytes] | None = (
            None if publisher is None else (self.prefix + FANOUT_CHANNEL, fanout_header(publisher))
        )
        self._sessions = 0

    def _session_keys(self, session: bytes) -> list[bytes]:
        """Members, events, dedupe keys and arrival counter of one session."""
        tag = tagged(session)
        p = self.prefix
        return [p + b"aep:s:" + tag, p + b"aep:e:" + tag, p + b"aep:k:" + tag, p + b"aep:n:" + tag]

    @property
    def publishes(self) -> bool:
        """Whether C{append(events, publish=True)} publishes (made with a C{publisher})."""
        return self._fanout is not None

    def append(self, events: Sequence[Event], publish: bool = False) -> Deferred[list[bool]]:
        """Store the events; with C{publish}, also hand all of them (duplicates too) to the fan-out
        in the same script, so the batch is sent to Redis once (docs/performance.md)."""
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
        sessions = [s.encode("utf-8") for s in numbers]
        keys = [self._lru, self._clock, self._evicting]
        for name in sessions:
            keys += self._session_keys(name)
        channel, header = self._fanout if publish and self._fanout is not None else (b"", b"")
        if header and payloads:
            payloads[0] = header + payloads[0]  # (not the whole message copied again)
        message = b"\n".join(payloads) if payloads else header
        deadline = self.redis.deadline()
        args = [self.capacity, self.max_sessions, b"".join(parts), channel, message, len(header), deadline, *sessions]
        return _APPEND(self.redis, STORE, keys, args).addCallback(self._appended)

    def _appended(self, result: Any) -> Deferred[list[bool]] | list[bool]:
        if result == b"late":
            # Redis reached the append after its deadline and did nothing (append.lua).
            raise StoreUnavailable(STORE, "Redis ran the append too late to answer in time; nothing was stored")
        self._sessions = int(result[1])
        stored = [flag == 49 for flag in result[0]]  # b"1"
        victims = result[2:]
        if not victims:
            return stored
        # Sessions evicted to make room whose keys were not in this batch: dropped before the
        # append answers, so an evicted session is gone once the write that evicted it is done.
        drops = [
            _DROP(self.redis, STORE, [self._evicting, *self._session_keys(victim)], [victim]) for victim in victims
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
        keys = [*self._session_keys(name)[:2], self._evicting]
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
        def decode(members: list[bytes]) -> list[str]:
            self._sessions = len(members)
            return [m.decode("utf-8") for m in members]

        return self.redis.execute(STORE, "ZRANGE", self._lru, 0, -1).addCallback(decode)

    def session_count(self) -> int:
        """The count seen at the last write or listing (health must not wait on Redis)."""
        return self._sessions
