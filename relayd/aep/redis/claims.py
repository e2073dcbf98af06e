"""AEP session claims across relayd instances on one Redis, and command delivery between them.

- Claims: C{aep:{b}:claims:<session>} hashes connection id -> claimant JSON (C{{b}}: the session's
  bucket tag, relayd/storage/buckets.py); C{aep:{b}:claimed} lists the bucket's sessions with
  claims (for the roster: one read and one script per bucket). Every instance refreshes C{aep:instance:<id>} (a key with a
  TTL); the claims of an instance whose key expired are ignored and cleaned up, so claims disappear
  when their connection *or their instance* dies.
- Commands for a claimant on another instance go over C{aep:cmd:<instance>}.

Live fan-out of events between instances is L{relayd.aep.redis.fanout}.
"""

from __future__ import annotations

import itertools
import uuid
from typing import Any

import orjson
from twisted.internet.defer import Deferred, gatherResults, succeed
from zope.interface import implementer

from relayd.aep.core.claims import Claimant, IClaims, MemoryClaims, claimant_of
from relayd.aep.core.event import Event, event_from
from relayd.base.clock import Timekeeper
from relayd.base.errors import first_error
from relayd.storage.buckets import BUCKETS, Buckets
from relayd.storage.redis import Redis, RedisBus
from relayd.storage.redis_lua import Script

STORE = "aep"
INSTANCE_TTL = 15.0
REFRESH = 5.0

_ROSTER = Script("relayd.aep", "roster")


@implementer(IClaims)
class RedisClaims:
    """C{IClaims} over every instance sharing one Redis."""

    def __init__(
        self, redis: Redis, bus: RedisBus, clock: Timekeeper, prefix: str = "relayd:", *, buckets: Buckets = BUCKETS
    ) -> None:
        self.redis = redis
        self.buckets = buckets
        self.clock = clock
        self.prefix = prefix.encode("utf-8")
        self.instance = uuid.uuid4().hex[:16]
        self.started = int(clock.seconds() * 1000)
        self.local = MemoryClaims()
        self._ids: dict[Any, str] = {}
        self._by_id: dict[str, Any] = {}
        self._counter = itertools.count()
        self._confirmed = False
        bus.subscribe(self._key(b"aep:cmd:", self.instance), self._command_received)
        self._alive()
        self._loop = clock.looping_call(REFRESH, self._alive)

    def _key(self, *parts: bytes | str) -> bytes:
        return self.prefix + b"".join(p.encode("utf-8") if isinstance(p, str) else p for p in parts)

    def _claims_key(self, session: str | bytes) -> bytes:
        """A session's claims hash, C{aep:{b}:claims:<session>} (in its bucket, like its event keys)."""
        name = session.encode("utf-8") if isinstance(session, str) else session
        return self.prefix + b"aep:" + self.buckets.tag_of(name) + b":claims:" + name

    def _claimed_key(self, tag: bytes) -> bytes:
        """A bucket's set of sessions with claims."""
        return self.prefix + b"aep:" + tag + b":claimed"

    def _alive(self) -> Deferred[Any]:
        """Refresh this instance's liveness key (its claims count only while it exists)."""
        d = self.redis.execute(
            STORE, "SET", self._key(b"aep:instance:", self.instance), b"1", "PX", int(INSTANCE_TTL * 1000)
        )

        def confirmed(_: Any) -> None:
            self._confirmed = True

        # Redis away: the claims expire with the key, as they must.
        return d.addCallbacks(confirmed, lambda f: None)

    def stop(self) -> None:
        self.clock.stop_loop(self._loop)

    # Local bookkeeping ---------------------------------------------------------------------------

    def connect(self, conn: Any) -> None:
        self.local.connect(conn)
        conn_id = f"{self.instance}:{next(self._counter)}"
        self._ids[conn] = conn_id
        self._by_id[conn_id] = conn

    def disconnect(self, conn: Any) -> Deferred[None]:
        sessions = list(conn.claims)
        self.local.disconnect(conn)
        conn_id = self._ids.pop(conn, None)
        self._by_id.pop(conn_id, None)  # type: ignore[arg-type]
        if conn_id is None or not sessions:
            return succeed(None)
        ds = [self.redis.execute(STORE, "HDEL", self._claims_key(s), conn_id) for s in sessions]
        for d in ds:
            d.addErrback(lambda f: None)  # an unreachable Redis forgets them with the instance key
        return succeed(None)

    def claim(self, conn: Any, session: str) -> Deferred[None]:
        if session in conn.claims:
            return succeed(None)
        self.local.claim(conn, session)
        info = {
            "role": conn.role,
            "identity": conn.identity,
            "capabilities": conn.capabilities,
            # Roster order over instances: instance start, instance, connection, claim.
            "order": [self.started, self.instance, int(self._ids[conn].rsplit(":", 1)[1]), len(conn.claims) - 1],
        }
        d = succeed(None) if self._confirmed else self._alive()  # at start-up the loop may not have run yet
        d.addCallback(
            lambda _: self.redis.execute(STORE, "HSET", self._claims_key(session), self._ids[conn], orjson.dumps(info))
        )
        claimed = self._claimed_key(self.buckets.tag_of(session.encode("utf-8")))
        d.addCallback(lambda _: self.redis.execute(STORE, "SADD", claimed, session))
        return d.addCallback(lambda _: None)

    # Queries over every instance ----------------------------------------------------------------

    def claimants(self, session: str) -> Deferred[list[Claimant]]:
        d = self.redis.execute(STORE, "HGETALL", self._claims_key(session))
        return d.addCallback(lambda flat: self._alive_only({session: _pairs(flat)})).addCallback(
            lambda by_session: [c for c, _ in by_session.get(session, [])]
        )

    def roster(self) -> Deferred[list[dict[str, Any]]]:
        tags = self.buckets.tags

        def read(members: list[list[bytes]]) -> Deferred[Any]:
            # One script per bucket with claims, given every claims hash it reads (docs/decisions.md REDIS-1).
            runs = [
                _ROSTER(self.redis, STORE, [self._claimed_key(tag), *[self._claims_key(s) for s in sessions]], sessions)
                for tag, sessions in zip(tags, members, strict=True)
                if sessions
            ]
            return gatherResults(runs, consumeErrors=True).addCallback(lambda flats: [x for f in flats for x in f])

        reads = [self.redis.execute(STORE, "SMEMBERS", self._claimed_key(tag)) for tag in tags]
        d = gatherResults(reads, consumeErrors=True).addCallback(read).addErrback(first_error)

        def collect(flat: list[Any]) -> dict[str, list[tuple[bytes, bytes]]]:
            by_session = {flat[i].decode("utf-8"): _pairs(flat[i + 1]) for i in range(0, len(flat), 2)}
            for _, session in self.local.local_roster():
                by_session.setdefault(session, [])
            return by_session

        def entries(by_session: dict[str, list[tuple[Claimant, int]]]) -> list[dict[str, Any]]:
            rows = [
                (claimant.order, claimant.roster_entry(session))
                for session, claimants in by_session.items()
                for claimant, _ in claimants
            ]
            rows.sort(key=lambda row: row[0])
            return [entry for _, entry in rows]

        return d.addCallback(collect).addCallback(self._alive_only).addCallback(entries)

    def _alive_only(self, by_session: dict[str, list[tuple[bytes, bytes]]]) -> Deferred[dict[str, list[tuple[Claimant, int]]]]:
        decoded: dict[str, list[tuple[Claimant, str]]] = {}
        instances: set[str] = set()
        for session, pairs in by_session.items():
            for conn_id_raw, info_raw in pairs:
                conn_id = conn_id_raw.decode("utf-8")
                info = orjson.loads(info_raw)
                if info.get("role") == "consumer":
                    continue
                claimant = Claimant(
                    conn_id=conn_id,
                    role=info.get("role", "both"),
                    identity=info.get("identity") or {},
                    capabilities=info.get("capabilities") or {},
                    local=self._by_id.get(conn_id),
                    order=tuple(_order_key(info.get("order"))),
                )
                decoded.setdefault(session, []).append((claimant, conn_id))
                instances.add(conn_id.split(":", 1)[0])
        if not instances:
            out: dict[str, list[tuple[Claimant, int]]] = {}
            for session in by_session:
                self._merge_local(out, session)
            return succeed(out)
        names = sorted(instances)
        d = self.redis.get_many(STORE, [self._key(b"aep:instance:", i) for i in names])

        def keep(values: list[Any]) -> dict[str, list[tuple[Claimant, int]]]:
            live = {name for name, value in zip(names, values, strict=True) if value is not None}
            live.add(self.instance)
            out: dict[str, list[tuple[Claimant, int]]] = {}
            for session, claimants in decoded.items():
                for claimant, conn_id in claimants:
                    instance = conn_id.split(":", 1)[0]
                    if instance in live and (instance != self.instance or claimant.local is not None):
                        out.setdefault(session, []).append((claimant, 0))
                    else:  # a dead instance's (or our own closed connection's) claim: clean it up
                        self.redis.execute(STORE, "HDEL", self._claims_key(session), conn_id).addErrback(
                            lambda f: None
                        )
            # This process's own claims count at once, even before their write reaches Redis.
            for session in by_session:
                self._merge_local(out, session)
            for held in out.values():
                held.sort(key=lambda pair: pair[0].order)
            return out

        return d.addCallback(keep)

    def _merge_local(self, out: dict[str, list[tuple[Claimant, int]]], session: str) -> None:
        known = {claimant.conn_id for claimant, _ in out.get(session, [])}
        for conn in self.local.local_claimants(session):
            conn_id = self._ids.get(conn)
            if conn_id is not None and conn_id not in known:
                out.setdefault(session, []).append((self._claimant(conn, session), 0))

    def _claimant(self, conn: Any, session: str) -> Claimant:
        counter = int(self._ids[conn].rsplit(":", 1)[1])
        claimant = claimant_of(conn, (self.started, self.instance, counter, conn.claims.index(session)))
        claimant.conn_id = self._ids[conn]
        return claimant

    # Commands ----------------------------------------------------------------------------------

    def deliver(self, claimant: Claimant, event: Event) -> Deferred[None]:
        if claimant.local is not None:
            claimant.local.send_command(event)
            return succeed(None)
        instance = claimant.conn_id.split(":", 1)[0]
        message = claimant.conn_id.encode("utf-8") + b"\n" + event.payload(None)
        return self.redis.execute(STORE, "PUBLISH", self._key(b"aep:cmd:", instance), message).addCallback(
            lambda _: None
        )

    def _command_received(self, message: bytes) -> None:
        conn_id, _, raw = message.partition(b"\n")
        conn = self._by_id.get(conn_id.decode("utf-8"))
        if conn is not None:
            conn.send_command(event_from(raw))

    def local_claimant(self, conn: Any) -> Claimant:
        return claimant_of(conn)


def _pairs(flat: list[Any]) -> list[tuple[bytes, bytes]]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def _order_key(order: Any) -> list[Any]:
    return order if isinstance(order, list) and len(order) == 4 else [0, "", 0, 0]

