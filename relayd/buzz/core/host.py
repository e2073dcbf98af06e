"""The broker host pipeline: authenticate -> validate -> idempotency -> authorize -> execute -> verdict.
(Over 600 lines, for a reason: the pipeline's steps and the settling of an indeterminate plan are
the decisions below, read top to bottom in one place; the operations themselves are
L{relayd.buzz.core.operations}, the state L{relayd.buzz.core.state}.)

Decisions (docs/decisions.md, "Buzz broker host"):
 1. A body that is not JSON or has no usable requestId answers HTTP 400; every other refusal is a
    correlated C{failed} verdict with HTTP 200 (unauthenticated, then validation, then authorization).
 3. Receipts are keyed on (agent identity of the credential, requestId) and hold the SHA-256 of
    the received bytes; same digest replays (C{replayed: true}), a different one is a conflict.
    Concurrent duplicates wait for the first execution and then replay it: in this process on an
    in-memory gate, across instances on the receipt store's claim.
 4. Writes store the signed events before sending. Relay OK (incl. C{duplicate:}) -> succeeded;
    OK false on the first event -> failed/action_failed; no answer, or a refusal after an accepted
    event -> indeterminate/outcome_unknown with the plan kept (and, once an event is accepted, its
    effects applied), so a retry of the same bytes resends the identical events.
 A plan that can no longer be sent (superseded, a signer deleted, its credential revoked or
    expired, an event refused as C{invalid:}) settles from what the relay holds of its events
    (L{BrokerHost._settle_from_relay}; docs/broker.md, "How an indeterminate verdict settles").
Every correlated verdict reached once the credential is known is recorded (validation refusals,
version codes, a foreign cursor, a relay unreachable before dispatch included), so the same
requestId with other bytes is always a conflict and never a later execution. Not recorded:
C{unauthenticated} (no principal to key it on), C{request_id_conflict} (the key holds the original),
and a fault of the store itself (it cannot hold the verdict).

A retry is answered before anything else is looked at: once the credential is known, the SHA-256
of the body finds the settled verdict in a cache of recent verdicts, so a replay costs neither JSON
parsing nor validation nor a store lookup. That is equivalent to the full pipeline: the same
bytes carry the same requestId, so they have the same recorded verdict. A retry the
cache does not hold (after a restart, or first seen by another instance) takes the full pipeline
and finds the verdict through the store's claim. (Asking the store by digest on every request
would cost each new request a read and an index.)

Over 600 lines, for a reason: this is one pipeline whose every exit records a verdict; its stages
(authenticate, idempotency, execute, settle from the relay) are read together to see that a client
told an outcome can always get the same one back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from twisted.internet import defer
from twisted.logger import Logger

from relayd.base.errors import OutcomeUnknown, StoreUnavailable
from relayd.buzz import metrics
from relayd.buzz.core import contract
from relayd.buzz.core.keys import SealError
from relayd.buzz.core.operations import (
    ActionFailed,
    Context,
    InvalidArgs,
    Operations,
    Plan,
    Unauthorized,
    Unsupported,
)
from relayd.buzz.core.state import (
    Agent,
    Claim,
    Credential,
    IAgentStore,
    ICredentialStore,
    IReceiptStore,
)
from relayd.buzz.nostr_upstream import ConnectionLost, NotConnected, QueryClosed, UpstreamError, UpstreamTimeout

CHANNEL_ACTIONS = frozenset({"channel.read", "message.post", "message.reply", "reaction.add", "agents.create"})
_BEARER = b"Bearer "
_MAX_MESSAGE = 300
_WAIT_STEP = 0.5  # a waiter for another instance re-checks at least this often (a missed notification)
_STATUS = b'"status":"'
_OUTAGE_LOG_INTERVAL = 60.0
_ACTIONS = frozenset(contract.ACTIONS)
_INVALID = "invalid:"  # a relay's refusal that sending again never changes (NIP-01 machine prefix)
_counters: dict[tuple[str, str], Any] = {}


def _count(action: str, status: str) -> None:
    """One answered action on relayd_broker_actions_total (label children cached: labels() is slow)."""
    counter = _counters.get((action, status))
    if counter is None:
        counter = _counters[(action, status)] = metrics.broker_actions.labels(action=action, status=status)
    counter.inc()


def verdict_status(data: bytes) -> str:
    """The status of a verdict the host wrote (its first C{"status":"} member; a requestId's quotes are escaped)."""
    i = data.find(_STATUS)
    if i < 0:
        return "unknown"
    i += len(_STATUS)
    return data[i : data.find(b'"', i)].decode("ascii", "replace")


def credential_hash(credential: str | bytes) -> str:
    """How a credential is stored: SHA-256 hex of its text."""
    data = credential.encode("utf-8") if isinstance(credential, str) else credential
    return hashlib.sha256(data).hexdigest()


def _safe(message: str) -> str:
    """Operator-facing text from a relay or exception, bounded and single-line."""
    return " ".join(message.split())[:_MAX_MESSAGE] or "no detail"


class VerdictCache:
    """Settled verdicts by (principal, body digest), least recently used out first.

    A settled verdict never changes, so a cached one is right on every instance; the bounds keep
    large read pages from holding much memory.
    """

    def __init__(self, max_entries: int = 4096, max_bytes: int = 16 * 1024 * 1024, max_item: int = 256 * 1024) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.max_item = max_item
        self._items: OrderedDict[tuple[str, bytes], tuple[bytes, str]] = OrderedDict()
        self._bytes = 0

    def get(self, principal: str, digest: bytes) -> tuple[bytes, str] | None:
        """(verdict bytes, action) of a settled request, if held."""
        key = (principal, digest)
        entry = self._items.get(key)
        if entry is not None:
            self._items.move_to_end(key)
        return entry

    def put(self, principal: str, digest: bytes, data: bytes, action: str) -> None:
        if len(data) > self.max_item:
            return
        key = (principal, digest)
        old = self._items.pop(key, None)
        if old is not None:
            self._bytes -= len(old[0])
        self._items[key] = (data, action)
        self._bytes += len(data)
        while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
            _, gone = self._items.popitem(last=False)
            self._bytes -= len(gone[0])


class BrokerHost:
    """Turns one HTTP request (authorization header values + body bytes) into (status, body)."""

    _log = Logger()

    def __init__(
        self,
        credentials: ICredentialStore,
        agents: IAgentStore,
        receipts: IReceiptStore,
        operations: Operations,
        *,
        max_agent_depth: int = 4,
        busy_wait: float | None = None,
        relay_outage: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.credentials = credentials
        # Why the upstream relay is known to be down (the health watcher's last check), or None.
        self.relay_outage = relay_outage
        self.agents = agents
        self.receipts = receipts
        self.ops = operations
        self.max_agent_depth = max_agent_depth
        # How long a duplicate waits for another instance's execution before answering indeterminate.
        self.busy_wait = operations.timeout if busy_wait is None else busy_wait
        self.verdicts = VerdictCache()
        self._outage_logged: dict[str, float] = {}
        self._inflight: dict[tuple[str, str], defer.Deferred[None]] = {}
        self._active = 0
        self._idle: list[defer.Deferred[None]] = []

    # --- drain support

    @property
    def active(self) -> int:
        """Requests being handled right now."""
        return self._active

    def wait_idle(self) -> defer.Deferred[None]:
        """Fires when no request is in flight."""
        if self._active == 0:
            return defer.succeed(None)
        d: defer.Deferred[None] = defer.Deferred()
        self._idle.append(d)
        return d

    def handle(self, authorization: Sequence[bytes] | None, body: bytes) -> defer.Deferred[tuple[int, bytes]]:
        """Answer a request; never fails (faults become verdicts).

        When every store answers at once (a replay from the cache or SQLite), the Deferred has
        already fired on return, so the caller can answer in the same reactor turn.
        """
        self._active += 1
        d = defer.Deferred.fromCoroutine(self._handle(authorization, body))
        if d.called:
            self._done()
        else:
            d.addBoth(self._done_with)
        return d

    def _done_with(self, result: Any) -> Any:
        self._done()
        return result

    def _done(self) -> None:
        self._active -= 1
        if self._active == 0 and self._idle:
            idle, self._idle = self._idle, []
            for w in idle:
                w.callback(None)

    async def _handle(self, authorization: Sequence[bytes] | None, body: bytes) -> tuple[int, bytes]:
        # The credential is checked first: until it is known, the body is only decoded, to read the
        # requestId an `unauthenticated` verdict must carry; it is neither hashed nor validated.
        digest = b""
        who = fault = None
        try:
            who = await self._authenticate(authorization)
            if who is not None:
                digest = hashlib.sha256(body).digest()
                replay = self.verdicts.get(who.agent.pubkey, digest)
                if replay is not None:
                    data = contract.mark_replayed(replay[0])
                    _count(replay[1], verdict_status(data))
                    return 200, data
        except Exception as e:
            fault = e
        try:
            rid, tree = contract.parse_request_body(body)
        except contract.RequestIdError as e:
            _count("unknown", "rejected")
            return 400, contract.dumps({"error": "invalid_request", "message": e.message})
        action = tree.get("action")
        if type(action) is not str or action not in _ACTIONS:  # any JSON value: [] is not hashable
            action = "unknown"
        code, data = await self._verdict_for(rid, tree, who, digest, fault)
        _count(action, verdict_status(data))
        return code, data

    async def _verdict_for(
        self, rid: str, tree: Any, who: Caller | None, digest: bytes, fault: Exception | None
    ) -> tuple[int, bytes]:
        try:
            if fault is not None:
                raise fault
            return 200, await self._correlated(rid, tree, who, digest)
        except OutcomeUnknown as e:
            # The store was sent a write (a claim, a plan, a verdict, an agent's effects) and did not
            # answer: it may have done it. Never "nothing happened": the same bytes find out.
            self._outage(e, rid)
            why = f"no answer from the {e.store} store, which may have recorded this request; retry the same bytes"
            return 200, _verdict(contract.indeterminate(rid, "internal", why))
        except StoreUnavailable as e:
            # Before dispatch: say so at once, never hang.
            self._outage(e, rid)
            return 200, _verdict(contract.failed(rid, "internal", f"the {e.store} store is unavailable; retry later"))
        except Exception:
            self._log.failure("broker fault before dispatch (requestId {rid})", rid=rid)
            return 200, _verdict(contract.failed(rid, "internal", "internal host fault"))

    def _outage(self, e: StoreUnavailable, rid: str) -> None:
        """One warning per store outage (at most one a minute), not one per refused request."""
        now = self.ops.pool.clock.seconds()
        if now - self._outage_logged.get(e.store, -1e9) >= _OUTAGE_LOG_INTERVAL:
            self._outage_logged[e.store] = now
            self._log.warn(
                "broker store {store} unavailable (first refused: requestId {rid}); refusing with internal until it returns",
                store=e.store,
                rid=rid,
            )

    def refused_at_once(self, authorization: Sequence[bytes] | None) -> bool:
        """Whether the stores, answering at once, refuse the credential in C{authorization} (asked
        at the end of the headers, before the body is read: L{relayd.buzz.http}). C{False} when
        they accept it, fail, or cannot tell without waiting: the request then takes the pipeline."""
        outcome: list[Any] = []
        defer.Deferred.fromCoroutine(self._authenticate(authorization)).addBoth(outcome.append)
        return bool(outcome) and outcome[0] is None

    async def _authenticate(self, authorization: Sequence[bytes] | None) -> Caller | None:
        if not authorization or len(authorization) != 1 or not authorization[0].startswith(_BEARER):
            return None
        token = authorization[0][len(_BEARER) :]
        if not token or len(token) > 512:
            return None
        hashed = credential_hash(token)
        cred = await self.credentials.credential(hashed)
        if cred is None or cred.revoked or cred.expired(self.ops.now()):
            return None
        agent = await self.agents.agent(cred.agent_pubkey)
        if agent is None or agent.deleted or agent.sealed_key is None:
            return None
        return Caller(cred, agent, hashed)

    async def _correlated(
        self, rid: str, tree: Any, who: Caller | None, digest: bytes
    ) -> bytes:
        if who is None:
            return _verdict(contract.failed(rid, "unauthenticated", "credential missing, malformed or rejected"))
        refusal: contract.Response | None = None
        try:
            req = contract.validate_request(tree)
        except contract.ContractError as e:
            # Recorded like every correlated verdict: these bytes keep this answer, and other
            # bytes with the same requestId are a conflict, never a later execution.
            refusal = contract.failed(rid, e.code, e.message)
        key = (who.agent.pubkey, rid)
        # One execution per key at a time in this process: later duplicates wait, then find the receipt.
        while key in self._inflight:
            await _wait(self._inflight[key])
        gate: defer.Deferred[None] = defer.Deferred()
        self._inflight[key] = gate
        try:
            if refusal is not None:
                return await self._refuse(who.agent.pubkey, rid, digest, refusal)
            return await self._idempotent(who, req, digest)
        finally:
            del self._inflight[key]
            gate.callback(None)

    async def _refuse(self, principal: str, rid: str, digest: bytes, resp: contract.Response) -> bytes:
        """Record a refusal reached before execution (or answer what is on record for these bytes)."""
        found = await self._lookup(principal, rid, digest, "unknown")
        if isinstance(found, bytes):
            return found
        settled: list[bytes] = []
        try:
            return await self._settle(principal, rid, digest, resp, [], settled, "unknown")
        finally:
            if not settled:
                await self.receipts.release(principal, rid)

    async def _lookup(self, principal: str, rid: str, digest: bytes, action: str) -> bytes | Claim:
        """The answer already due for these bytes (busy elsewhere, conflict, replay), or the claim to execute."""
        claim = await self._claim(principal, rid, digest)
        if claim is None:
            return _verdict(
                contract.indeterminate(
                    rid, "outcome_unknown", "another broker instance is still executing this request; retry the same bytes"
                )
            )
        if claim.status == "conflict":
            return _verdict(contract.failed(rid, "request_id_conflict", "requestId was already used with different bytes"))
        if claim.status == "done":
            assert claim.response is not None
            self.verdicts.put(principal, digest, claim.response, action)
            return contract.mark_replayed(claim.response)
        return claim

    async def _claim(self, principal: str, rid: str, digest: bytes) -> Claim | None:
        """The claim on (principal, rid), waiting while another instance executes it; None at the deadline."""
        clock = self.ops.pool.clock
        deadline = clock.seconds() + self.busy_wait
        while True:
            claim = await self.receipts.claim(principal, rid, digest)
            if claim.status != "busy":
                return claim
            remaining = deadline - clock.seconds()
            if remaining <= 0:
                return None
            await self.receipts.wait(principal, rid, min(remaining, _WAIT_STEP))

    async def _idempotent(self, who: Caller, req: contract.Request, digest: bytes) -> bytes:
        rid = req.request_id
        principal = who.agent.pubkey
        found = await self._lookup(principal, rid, digest, req.action)
        if isinstance(found, bytes):
            return found
        claim = found
        settled: list[bytes] = []
        try:
            if claim.status == "resume":
                assert claim.plan is not None
                return await self._execute(who, rid, digest, Plan.from_bytes(claim.plan), settled, resumed=True)
            return await self._run(who, req, digest, settled)
        finally:
            if not settled:
                # No verdict: let a retry (here or on another instance) run at once, a stored plan kept.
                try:
                    await self.receipts.release(principal, rid)
                except Exception as e:
                    self._log.info("could not release the claim on {rid}: {why}", rid=rid, why=str(e))

    async def _run(self, who: Caller, req: contract.Request, digest: bytes, settled: list[bytes]) -> bytes:
        rid = req.request_id
        cred, agent = who.credential, who.agent
        principal = agent.pubkey
        denial = self._authorize(cred, agent, req)
        if denial is not None:
            return await self._settle(principal, rid, digest, contract.failed(rid, "unauthorized", denial), [], settled, req.action)
        resp: contract.Response | None = None  # a failure the relay never saw
        outage = self.relay_outage()
        if outage is not None:
            # /healthz already says degraded: answer now, as the relay would fail it after the
            # action's whole timeout. Nothing was signed: recorded like every "relay unavailable".
            resp = contract.failed(rid, "internal", "relay unavailable: " + _safe(outage))
            return await self._settle(principal, rid, digest, resp, [], settled, req.action)
        try:
            ctx = Context(agent, self.ops.signer_for(agent), cred.channels)
            plan = await self.ops.run(ctx, req)
        except Unauthorized as e:
            return await self._settle(principal, rid, digest, contract.failed(rid, "unauthorized", str(e)), [], settled, req.action)
        except Unsupported as e:
            return await self._settle(principal, rid, digest, contract.failed(rid, "unsupported", str(e)), [], settled, req.action)
        except ActionFailed as e:
            return await self._settle(principal, rid, digest, contract.failed(rid, "action_failed", str(e)), [], settled, req.action)
        except InvalidArgs as e:
            resp = contract.failed(rid, "invalid_request", str(e))
        except QueryClosed as e:
            resp = contract.failed(rid, "action_failed", "relay refused the read: " + _safe(str(e)))
        except UpstreamError as e:
            # Nothing was signed for publication yet: nothing happened, and the verdict is recorded
            # like every other (a retry after the outage takes a new requestId).
            resp = contract.failed(rid, "internal", "relay unavailable: " + _safe(str(e)))
        except SealError:
            self._log.error("a sealed key of {agent} does not open under this key-encryption key", agent=agent.pubkey)
            resp = contract.failed(rid, "internal", "key custody fault")
        if resp is not None:
            return await self._settle(principal, rid, digest, resp, [], settled, req.action)
        if not plan.events:
            return await self._settle(
                principal, rid, digest, contract.succeeded(rid, req.action, plan.outcome), plan.effects, settled, req.action
            )
        plan.credential = who.credential_hash
        await self.receipts.store_plan(principal, rid, digest, plan.to_bytes())
        return await self._execute(who, rid, digest, plan, settled)

    def _authorize(self, cred: Credential, agent: Agent, req: contract.Request) -> str | None:
        if req.action not in cred.actions:
            return f"{req.action} is not permitted for this session"
        if req.action in CHANNEL_ACTIONS and req.args["channelId"] not in cred.channels:
            return "this session may not act in that channel"
        if req.action == "agents.create" and agent.depth + 1 > self.max_agent_depth:
            return f"agent ownership chains are limited to depth {self.max_agent_depth}"
        return None

    async def _settle(
        self,
        principal: str,
        rid: str,
        digest: bytes,
        resp: contract.Response,
        effects: list[dict[str, Any]],
        settled: list[bytes],
        action: str,
    ) -> bytes:
        """Record a verdict (with its effects) and answer the one on record."""
        data = await self.receipts.complete(principal, rid, digest, _verdict(resp), effects)
        settled.append(data)
        self.verdicts.put(principal, digest, data, action)
        return data

    async def _execute(
        self, who: Caller, rid: str, digest: bytes, plan: Plan, settled: list[bytes], resumed: bool = False
    ) -> bytes:
        """Publish a stored plan's events in order and settle the verdict.

        Events may be out by now, so a fault here is C{indeterminate} (C{failed} promises nothing
        happened); the plan stays stored and a retry of the same bytes resends it.
        """
        try:
            return await self._publish(who, rid, digest, plan, settled, resumed)
        except StoreUnavailable as e:
            self._outage(e, rid)
            why = f"the {e.store} store is unavailable; retry the same bytes"
        except Exception:
            self._log.failure("broker fault mid-execution (requestId {rid})", rid=rid)
            why = "internal host fault during execution; retry the same bytes"
        return _verdict(contract.indeterminate(rid, "internal", why))

    async def _publish(
        self, who: Caller, rid: str, digest: bytes, plan: Plan, settled: list[bytes], resumed: bool
    ) -> bytes:
        """Send the plan's events in order; the verdict says exactly how many the relay holds.

        C{failed} only while no event of the plan can be on the relay: the first event refused on
        this (first) attempt, or a signing identity gone before anything was sent. Once an event
        is accepted, the plan's local effects are applied at once (the host is never older than
        the relay: a created agent's key is kept, a rename is the host's name too) and any later
        fault is C{indeterminate} with the plan kept, so a retry of the same bytes finishes it.

        A plan that can no longer be sent is settled from the relay instead (L{_settle_from_relay}):
        a resumed plan (a retry of an earlier C{indeterminate}) superseded by newer state
        (L{Operations.superseded}: it would roll an agent back or revive a deleted one) or made
        under a credential since revoked or expired; a signing identity gone after something may
        have been sent; an event the relay refuses as C{invalid:} after something may have been sent.
        """
        principal = who.agent.pubkey
        if resumed:
            why = await self.ops.superseded(plan) or await self._credential_gone(plan)
            if why is not None:
                return await self._settle_from_relay(who, rid, digest, plan, settled, why)
        total = len(plan.events)
        done = 0
        for item in plan.events:
            try:
                signer = await self.ops.signer_by_pubkey(item["by"], plan)
            except (ActionFailed, Unauthorized):
                if done == 0 and not resumed:
                    resp = contract.failed(rid, "action_failed", "the signing identity was deleted before anything was published")
                    return await self._settle(principal, rid, digest, resp, [], settled, plan.action)
                why = "a signing identity was deleted after this request was planned"
                return await self._settle_from_relay(who, rid, digest, plan, settled, why, done)
            conn = self.ops.pool.connection(signer)
            try:
                accepted, message = await conn.publish(item["event"], self.ops.timeout)
            except (NotConnected, ConnectionLost, UpstreamTimeout) as e:
                self._log.info("outcome unknown for {rid}: {why}", rid=rid, why=str(e))
                await self._partial(plan, done)
                why = f"event {done + 1} of {total} unconfirmed: {_safe(str(e))}" if total > 1 else _safe(str(e))
                return _verdict(contract.indeterminate(rid, "outcome_unknown", why + "; retry the same bytes"))
            if not accepted:
                if done == 0 and not resumed:
                    resp = contract.failed(rid, "action_failed", "relay refused the event: " + _safe(message))
                    return await self._settle(principal, rid, digest, resp, [], settled, plan.action)
                if message.startswith(_INVALID):
                    # Cut shorter than other relay messages: a partial verdict also names two event ids.
                    why = f"the relay refuses event {done + 1} of {total} as invalid ({_safe(message)[:100]})"
                    return await self._settle_from_relay(who, rid, digest, plan, settled, why, done)
                await self._partial(plan, done)
                return _verdict(
                    contract.indeterminate(
                        rid,
                        "outcome_unknown",
                        f"the relay confirmed {done} of {total} events of this request and refused event {done + 1}: "
                        + _safe(message)
                        + "; retry the same bytes",
                    )
                )
            done += 1
        return await self._succeeded(principal, rid, digest, plan, settled)

    async def _succeeded(self, principal: str, rid: str, digest: bytes, plan: Plan, settled: list[bytes]) -> bytes:
        data = await self._settle(
            principal, rid, digest, contract.succeeded(rid, plan.action, plan.outcome), plan.effects, settled, plan.action
        )
        for effect in plan.effects:
            if effect["op"] == "delete_agent":
                self.ops.forget(effect["pubkey"])
        return data

    async def _credential_gone(self, plan: Plan) -> str | None:
        """Why the credential that made C{plan} may no longer act (C{None}: it still may)."""
        if not plan.credential:
            return None
        cred = await self.credentials.credential(plan.credential)
        if cred is None or cred.revoked:
            return "the credential that made this request was revoked"
        if cred.expired(self.ops.now()):
            return "the credential that made this request has expired"
        return None

    async def _settle_from_relay(
        self, who: Caller, rid: str, digest: bytes, plan: Plan, settled: list[bytes], why: str, confirmed: int = 0
    ) -> bytes:
        """Settle a plan that can no longer be sent by asking the relay which of its events landed
        (L{Operations.landed}, as the requester): all of them C{succeeded}, none C{failed}, some a
        recorded C{indeterminate} that names them; the relay not answering leaves it C{indeterminate},
        unrecorded, for a later retry to settle. C{confirmed}: events the relay accepted in this attempt.
        """
        total = len(plan.events)
        try:
            landed = await self.ops.landed(self.ops.signer_for(who.agent), plan, confirmed)
        except UpstreamError as e:
            self._log.info("cannot settle {rid} from the relay: {why}", rid=rid, why=str(e))
            await self._partial(plan, confirmed)
            return _verdict(
                contract.indeterminate(
                    rid,
                    "outcome_unknown",
                    f"this request can no longer be sent ({why}) and the relay could not be asked which of its events "
                    f"it holds: {_safe(str(e))}; retry the same bytes",
                )
            )
        count = sum(landed)
        if count == total:
            return await self._succeeded(who.agent.pubkey, rid, digest, plan, settled)
        if count == 0:
            resp = contract.failed(
                rid, "action_failed", f"nothing of this request is on the relay and it can no longer be sent: {why}"
            )
            return await self._settle(who.agent.pubkey, rid, digest, resp, [], settled, plan.action)
        await self._partial(plan, count)
        held = ", ".join(f"{i + 1} ({item['event']['id']})" for i, item in enumerate(plan.events) if landed[i])
        missing = ", ".join(f"{i + 1} ({item['event']['id']})" for i, item in enumerate(plan.events) if not landed[i])
        resp = contract.indeterminate(
            rid,
            "outcome_unknown",
            f"partly done: the relay holds event {held} of {total} of this request but not event {missing}, "
            f"and it can no longer be sent: {why}",
        )
        return await self._settle(who.agent.pubkey, rid, digest, resp, [], settled, plan.action)

    async def _partial(self, plan: Plan, done: int) -> None:
        """Some events of a plan are on the relay: apply its effects now (they never roll back newer state)."""
        if done and plan.effects:
            await self.agents.apply_effects(plan.effects)


@dataclass(frozen=True)
class Caller:
    """An authenticated request's credential, the agent it is bound to, and the credential's SHA-256."""

    credential: Credential
    agent: Agent
    credential_hash: str


def _verdict(resp: contract.Response) -> bytes:
    return contract.serialize_response(resp)


def _wait(gate: defer.Deferred[None]) -> defer.Deferred[None]:
    d: defer.Deferred[None] = defer.Deferred()

    def fire(result: Any) -> Any:
        d.callback(None)
        return result

    gate.addBoth(fire)
    return d
