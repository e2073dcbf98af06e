"""Idempotency receipts and pending signed events on Redis, shared by every broker instance.

With several relayd processes behind a load balancer, a retry may reach another instance than the
first attempt, and concurrent duplicates may be spread over instances. Both need the receipts in
one place; credentials, keys and agents stay in the (shared) SQLite state directory.

Layout (every key under the deployment's prefix, default C{relayd:}):

- C{buzz:r:{<principal>:<requestId>}}: hash C{d} (SHA-256 of the request bytes), C{s} (C{claimed},
  C{pending} or C{done}), C{p} (the stored plan while pending), C{v} (the verdict once done);
  expires L{RETENTION} after its last write.
- C{buzz:l:{<principal>:<requestId>}}: the claim's lease, the holder's token, with a millisecond
  expiry. While it lives, other instances wait; when the holder crashes it lapses and the next
  claim takes over (a stored plan is resumed, a bare claim executes afresh).
- C{buzz:i:{<principal>}}: the agent's settled requestIds by settle time (a sorted set), for the
  per-agent cap (--broker-max-receipts): past it, the oldest settled receipts are deleted.
- C{buzz:settled}: pub/sub channel; the receipt key is published when a claim ends (verdict or
  release), so waiters on every instance claim again at once instead of at their next poll.

Claim, plan, completion and release are each one Lua script (C{relayd/buzz/lua/}), so a claim is
atomic (two instances cannot both execute) and a holder whose lease lapsed and was taken over cannot
store its plan. Every key a script touches is passed in C{KEYS} (docs/decisions.md REDIS-1), and a
receipt and its lease share one hash tag, so each script's keys live in one Redis Cluster slot.

Durability is Redis's: with AOF (C{appendfsync everysec} or C{always}) an acknowledged verdict
survives a Redis restart; without persistence it survives while Redis is up.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from twisted.internet import defer
from twisted.internet.interfaces import IDelayedCall
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from relayd.base.clock import Timekeeper
from relayd.buzz.core.state import (
    BUSY,
    CONFLICT,
    MAX_RECEIPTS,
    NEW,
    Claim,
    EffectLike,
    IReceiptStore,
    Receipt,
    is_read_page,
)
from relayd.storage.redis import Redis, RedisBus
from relayd.storage.redis_lua import Script, tagged

STORE = "broker receipts (Redis)"
RETENTION = 30 * 24 * 3600  # seconds a receipt is kept after its last write

_CLAIM = Script("relayd.buzz", "claim")

_STORE_PLAN = Script("relayd.buzz", "store_plan", durable=True)  # what a resumed request replays

_COMPLETE = Script("relayd.buzz", "complete", durable=True)  # the verdict answered

_RELEASE = Script("relayd.buzz", "release")
_INDEX = Script("relayd.buzz", "index")
_TRIM = Script("relayd.buzz", "trim")


@implementer(IReceiptStore)
class RedisReceipts:
    """L{IReceiptStore} on Redis (see the module docstring for the layout).

    @param apply_effects: applies an execution's agent effects to the SQLite state before its
        verdict is stored here (effects are idempotent, so a crash in between is repaired by the
        retry that resumes the plan).
    @param lease: seconds a claim holds without a verdict before another instance may take over;
        longer than any execution (several relay round trips, each bounded by the action timeout).
    """

    _log = Logger()

    def __init__(
        self,
        redis: Redis,
        clock: Timekeeper,
        apply_effects: Callable[[Sequence[EffectLike]], "defer.Deferred[None]"],
        *,
        prefix: str = "relayd:",
        lease: float = 65.0,
        bus: RedisBus | None = None,
        retention: int = RETENTION,
        max_receipts: int = MAX_RECEIPTS,
    ) -> None:
        self.redis = redis
        self.max_receipts = max(1, int(max_receipts))
        # The running trim of an agent's receipts past the cap (at most one at a time), for tests.
        self.trimming: defer.Deferred[None] | None = None
        self.clock = clock
        self.retention = max(1, int(retention))
        self.apply_effects = apply_effects
        self.prefix = prefix.encode("utf-8")
        self.lease_ms = max(1, int(lease * 1000))
        # A lease names its holder: this store's claims are recognisably its own, so one left
        # behind by a fault here (Redis gone before the release) does not block this instance.
        self.instance = os.urandom(8).hex().encode("ascii")
        self._serial = 0
        self._tokens: dict[tuple[str, str], bytes] = {}
        self._waiters: dict[bytes, list[defer.Deferred[None]]] = {}
        self.channel = self.prefix + b"buzz:settled"
        self.bus = bus if bus is not None else redis.bus()
        self.bus.subscribe(self.channel, self._settled)

    # --- keys

    def _keys(self, principal: str, request_id: str) -> tuple[bytes, bytes]:
        # The receipt and its lease are used by one script together: one hash tag, one Cluster slot.
        tail = tagged(f"{principal}:{request_id}".encode())
        return self.prefix + b"buzz:r:" + tail, self.prefix + b"buzz:l:" + tail

    def _token(self, principal: str, request_id: str) -> bytes:
        self._serial += 1
        token = self.instance + b":%d" % self._serial
        self._tokens[(principal, request_id)] = token
        return token

    # --- IReceiptStore

    def receipt(self, principal: str, request_id: str) -> "defer.Deferred[Receipt | None]":
        rkey, _ = self._keys(principal, request_id)

        def build(r: list[Any]) -> Receipt | None:
            if r[0] is None:
                return None
            return Receipt(bytes(r[0]), r[1].decode("ascii"), r[2], r[3])

        return self.redis.execute(STORE, "HMGET", rkey, "d", "s", "v", "p").addCallback(build)

    def claim(self, principal: str, request_id: str, digest: bytes) -> "defer.Deferred[Claim]":
        rkey, lkey = self._keys(principal, request_id)
        token = self._token(principal, request_id)
        args = [digest, token, self.lease_ms, self.instance, self.retention]

        def build(r: list[Any]) -> Claim:
            status = r[0].decode("ascii")
            if status == "new":
                return NEW
            if status == "conflict" or status == "busy":
                self._tokens.pop((principal, request_id), None)
                return CONFLICT if status == "conflict" else BUSY
            if status == "done":
                self._tokens.pop((principal, request_id), None)
                return Claim("done", response=r[1])
            return Claim("resume", plan=r[1])

        def forget(f: Any) -> Any:
            self._tokens.pop((principal, request_id), None)
            return f

        return _CLAIM(self.redis, STORE, [rkey, lkey], args).addCallbacks(build, forget)

    def wait(self, principal: str, request_id: str, timeout: float) -> "defer.Deferred[None]":
        rkey, _ = self._keys(principal, request_id)
        d: defer.Deferred[None] = defer.Deferred()
        waiters = self._waiters.setdefault(rkey, [])
        waiters.append(d)
        timer: IDelayedCall = self.clock.call_later(timeout, self._wake_one, rkey, d)
        return self.clock.cancel_when(d, timer)

    def release(self, principal: str, request_id: str) -> "defer.Deferred[None]":
        token = self._tokens.pop((principal, request_id), None)
        if token is None:
            return defer.succeed(None)
        rkey, lkey = self._keys(principal, request_id)
        return _RELEASE(self.redis, STORE, [rkey, lkey], [token, self.channel]).addCallback(lambda _: None)

    def store_plan(self, principal: str, request_id: str, digest: bytes, plan: bytes) -> "defer.Deferred[None]":
        rkey, lkey = self._keys(principal, request_id)
        token = self._tokens.get((principal, request_id), b"")
        return _STORE_PLAN(self.redis, STORE, [rkey, lkey], [digest, plan, token, self.retention]).addCallback(
            lambda _: None
        )

    def complete(
        self, principal: str, request_id: str, digest: bytes, response: bytes, effects: Sequence[EffectLike]
    ) -> "defer.Deferred[bytes]":
        return defer.Deferred.fromCoroutine(self._complete(principal, request_id, digest, response, effects))

    async def _complete(
        self, principal: str, request_id: str, digest: bytes, response: bytes, effects: Sequence[EffectLike]
    ) -> bytes:
        if effects:
            await self.apply_effects(effects)
        rkey, lkey = self._keys(principal, request_id)
        token = self._tokens.get((principal, request_id), b"")
        stored = await _COMPLETE(
            self.redis,
            STORE,
            [rkey, lkey],
            [digest, response, token, self.retention, b"1" if is_read_page(response) else b"0", self.channel],
        )
        self._tokens.pop((principal, request_id), None)
        await self._index(principal, request_id)
        return bytes(stored)

    # --- the per-agent cap (docs/decisions.md B-12)

    def _index_key(self, principal: str) -> bytes:
        return self.prefix + b"buzz:i:" + tagged(principal.encode())

    async def _index(self, principal: str, request_id: str) -> None:
        """Index the settled receipt under its agent; past the cap, trim the oldest in the background.

        The verdict is already stored: a failure here costs only the bound, so it is logged, never
        answered (the agent's index is rebuilt by its next settled requests).
        """
        try:
            now_ms = int(self.clock.seconds() * 1000)
            args = [now_ms, request_id.encode(), self.retention, self.max_receipts]
            oldest = await _INDEX(self.redis, STORE, [self._index_key(principal)], args)
        except Exception as e:
            self._log.warn("could not index a broker receipt for the per-agent cap: {why}", why=str(e))
            return
        if oldest and self.trimming is None:
            self.trimming = defer.Deferred.fromCoroutine(self._trim(principal, [bytes(r) for r in oldest]))
            self.trimming.addBoth(self._trimmed)

    async def _trim(self, principal: str, request_ids: list[bytes]) -> None:
        """Delete the settled ones of C{request_ids} (one script each: a receipt and its lease share
        a Cluster slot that the agent's index does not), then take them out of the index."""
        gone = []
        for rid in request_ids:
            rkey, lkey = self._keys(principal, rid.decode())
            if await _TRIM(self.redis, STORE, [rkey, lkey]):
                gone.append(rid)
        if gone:
            await self.redis.execute(STORE, "ZREM", self._index_key(principal), *gone)

    def _trimmed(self, result: Any) -> None:
        self.trimming = None
        if isinstance(result, Failure):
            self._log.warn("broker receipt trim failed: {why}", why=result.getErrorMessage())

    # --- notifications

    def _settled(self, rkey: bytes) -> None:
        for d in self._waiters.pop(rkey, []):
            if not d.called:
                d.callback(None)

    def _wake_one(self, rkey: bytes, d: defer.Deferred[None]) -> None:
        waiters = self._waiters.get(rkey)
        if waiters is not None and d in waiters:
            waiters.remove(d)
            if not waiters:
                del self._waiters[rkey]
        if not d.called:
            d.callback(None)

    def close(self) -> "defer.Deferred[None]":
        """Wake every waiter (they claim again and answer). The bus is the Redis client's to close."""
        waiters, self._waiters = self._waiters, {}
        for ds in waiters.values():
            for d in ds:
                if not d.called:
                    d.callback(None)
        return defer.succeed(None)
