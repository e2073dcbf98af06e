"""The broker host pipeline: authenticate -> validate -> idempotency -> authorize -> execute -> verdict.

Decisions (docs/decisions.md, "Buzz broker host"):
 1. A body that is not JSON or has no usable requestId answers HTTP 400; every other refusal is a
    correlated C{failed} verdict with HTTP 200 (unauthenticated, then validation, then authorization).
 3. Receipts are keyed on (agent identity of the credential, requestId) and hold the SHA-256 of
    the received bytes; same digest replays (C{replayed: true}), a different one is a conflict.
    Concurrent duplicates wait for the first execution and then replay it.
 4. Writes store the signed events before sending. Relay OK (incl. C{duplicate:}) -> succeeded;
    OK false -> failed/action_failed; no answer -> indeterminate/outcome_unknown with the plan kept,
    so a retry of the same bytes resends the identical events.
Validation failures and pre-dispatch faults are not recorded: they are functions of the bytes, or
promise nothing happened, so re-evaluating a retry is equivalent.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from twisted.internet import defer
from twisted.logger import Logger

from relayd.buzz import contract
from relayd.buzz.keys import SealError
from relayd.buzz.nostr_client import ConnectionLost, NotConnected, QueryClosed, RelayError, RelayTimeout
from relayd.buzz.operations import ActionFailed, Context, InvalidArgs, Operations, Plan, Unauthorized, Unsupported
from relayd.buzz.state import Agent, Credential, IAgentStore, ICredentialStore, IReceiptStore

CHANNEL_ACTIONS = frozenset({"channel.read", "message.post", "message.reply", "reaction.add", "agents.create"})
_BEARER = b"Bearer "
_MAX_MESSAGE = 300


def credential_hash(credential: str | bytes) -> str:
    """How a credential is stored: SHA-256 hex of its text."""
    data = credential.encode("utf-8") if isinstance(credential, str) else credential
    return hashlib.sha256(data).hexdigest()


def _safe(message: str) -> str:
    """Operator-facing text from a relay or exception, bounded and single-line."""
    return " ".join(message.split())[:_MAX_MESSAGE] or "no detail"


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
    ) -> None:
        self.credentials = credentials
        self.agents = agents
        self.receipts = receipts
        self.ops = operations
        self.max_agent_depth = max_agent_depth
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
        """Answer a request; never fails (faults become verdicts)."""
        self._active += 1
        d = defer.Deferred.fromCoroutine(self._handle(authorization, body))

        def done(result: Any) -> Any:
            self._active -= 1
            if self._active == 0:
                idle, self._idle = self._idle, []
                for w in idle:
                    w.callback(None)
            return result

        return d.addBoth(done)

    async def _handle(self, authorization: Sequence[bytes] | None, body: bytes) -> tuple[int, bytes]:
        try:
            rid, tree = contract.parse_request_body(body)
        except contract.RequestIdError as e:
            return 400, contract.dumps({"error": "invalid_request", "message": e.message})
        try:
            return 200, await self._correlated(rid, tree, authorization, body)
        except Exception:
            self._log.failure("broker fault before dispatch (requestId {rid})", rid=rid)
            return 200, contract.serialize_response(contract.failed(rid, "internal", "internal host fault"))

    async def _authenticate(self, authorization: Sequence[bytes] | None) -> tuple[Credential, Agent] | None:
        if not authorization or len(authorization) != 1 or not authorization[0].startswith(_BEARER):
            return None
        token = authorization[0][len(_BEARER) :]
        if not token or len(token) > 512:
            return None
        cred = await self.credentials.credential(credential_hash(token))
        if cred is None or cred.revoked:
            return None
        agent = await self.agents.agent(cred.agent_pubkey)
        if agent is None or agent.deleted or agent.sealed_key is None:
            return None
        return cred, agent

    async def _correlated(
        self, rid: str, tree: Any, authorization: Sequence[bytes] | None, body: bytes
    ) -> bytes:
        who = await self._authenticate(authorization)
        if who is None:
            return _verdict(contract.failed(rid, "unauthenticated", "credential missing, malformed or rejected"))
        cred, agent = who
        try:
            req = contract.validate_request(tree)
        except contract.ContractError as e:
            return _verdict(contract.failed(rid, e.code, e.message))
        key = (agent.pubkey, rid)
        # One execution per key at a time: later duplicates wait, then find the receipt.
        while key in self._inflight:
            await _wait(self._inflight[key])
        gate: defer.Deferred[None] = defer.Deferred()
        self._inflight[key] = gate
        try:
            return await self._idempotent(cred, agent, req, hashlib.sha256(body).digest())
        finally:
            del self._inflight[key]
            gate.callback(None)

    async def _idempotent(self, cred: Credential, agent: Agent, req: contract.Request, digest: bytes) -> bytes:
        rid = req.request_id
        receipt = await self.receipts.receipt(agent.pubkey, rid)
        if receipt is not None:
            if receipt.digest != digest:
                return _verdict(
                    contract.failed(rid, "request_id_conflict", "requestId was already used with different bytes")
                )
            if receipt.state == "done" and receipt.response is not None:
                return contract.mark_replayed(receipt.response)
            assert receipt.plan is not None
            return await self._execute(agent.pubkey, rid, Plan.from_bytes(receipt.plan))
        denial = self._authorize(cred, agent, req)
        if denial is not None:
            return await self._record(agent.pubkey, rid, digest, contract.failed(rid, "unauthorized", denial))
        try:
            ctx = Context(agent, self.ops.signer_for(agent))
            plan = await self.ops.run(ctx, req)
        except Unauthorized as e:
            return await self._record(agent.pubkey, rid, digest, contract.failed(rid, "unauthorized", str(e)))
        except Unsupported as e:
            return await self._record(agent.pubkey, rid, digest, contract.failed(rid, "unsupported", str(e)))
        except ActionFailed as e:
            return await self._record(agent.pubkey, rid, digest, contract.failed(rid, "action_failed", str(e)))
        except InvalidArgs as e:
            return _verdict(contract.failed(rid, "invalid_request", str(e)))
        except QueryClosed as e:
            return _verdict(contract.failed(rid, "action_failed", "relay refused the read: " + _safe(str(e))))
        except RelayError as e:
            # Nothing was signed for publication yet: a known no-op, not recorded, so a retry re-runs.
            return _verdict(contract.failed(rid, "internal", "relay unavailable: " + _safe(str(e))))
        except SealError:
            self._log.error("a sealed key of {agent} does not open under this key-encryption key", agent=agent.pubkey)
            return _verdict(contract.failed(rid, "internal", "key custody fault"))
        if not plan.events:
            return await self._record(
                agent.pubkey, rid, digest, contract.succeeded(rid, req.action, plan.outcome), plan.effects
            )
        await self.receipts.store_plan(agent.pubkey, rid, digest, plan.to_bytes())
        return await self._execute(agent.pubkey, rid, plan)

    def _authorize(self, cred: Credential, agent: Agent, req: contract.Request) -> str | None:
        if req.action not in cred.actions:
            return f"{req.action} is not permitted for this session"
        if req.action in CHANNEL_ACTIONS and req.args["channelId"] not in cred.channels:
            return "this session may not act in that channel"
        if req.action == "agents.create" and agent.depth + 1 > self.max_agent_depth:
            return f"agent ownership chains are limited to depth {self.max_agent_depth}"
        return None

    async def _record(
        self,
        principal: str,
        rid: str,
        digest: bytes,
        resp: contract.Response,
        effects: list[dict[str, Any]] | None = None,
    ) -> bytes:
        data = _verdict(resp)
        if effects:
            await self.receipts.store_plan(principal, rid, digest, b"{}")
            await self.receipts.complete(principal, rid, data, effects)
        else:
            await self.receipts.record(principal, rid, digest, data)
        return data

    async def _execute(self, principal: str, rid: str, plan: Plan) -> bytes:
        """Publish a stored plan's events in order and settle the verdict."""
        for item in plan.events:
            try:
                signer = await self.ops.signer_by_pubkey(item["by"], plan)
            except ActionFailed as e:
                data = _verdict(contract.failed(rid, "action_failed", str(e)))
                await _settle(self.receipts, principal, rid, data, [])
                return data
            conn = self.ops.pool.connection(signer)
            try:
                accepted, message = await conn.publish(item["event"], self.ops.timeout)
            except (NotConnected, ConnectionLost, RelayTimeout) as e:
                self._log.info("outcome unknown for {rid}: {why}", rid=rid, why=str(e))
                return _verdict(contract.indeterminate(rid, "outcome_unknown", _safe(str(e))))
            if not accepted:
                data = _verdict(contract.failed(rid, "action_failed", "relay refused the event: " + _safe(message)))
                await _settle(self.receipts, principal, rid, data, [])
                return data
        data = _verdict(contract.succeeded(rid, plan.action, plan.outcome))
        await _settle(self.receipts, principal, rid, data, plan.effects)
        for effect in plan.effects:
            if effect["op"] == "delete_agent":
                self.ops.forget(effect["pubkey"])
        return data


async def _settle(receipts: IReceiptStore, principal: str, rid: str, data: bytes, effects: list[dict[str, Any]]) -> None:
    await receipts.complete(principal, rid, data, effects)


def _verdict(resp: contract.Response) -> bytes:
    return contract.serialize_response(resp)


def _wait(gate: defer.Deferred[None]) -> defer.Deferred[None]:
    d: defer.Deferred[None] = defer.Deferred()
    gate.addBoth(lambda r: (d.callback(None), r)[1])
    return d
