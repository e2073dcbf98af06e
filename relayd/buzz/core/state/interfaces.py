"""The stores the broker host uses, as zope interfaces: credentials, agents, receipts.

L{relayd.buzz.core.state.threaded.SQLiteState} provides all three on the state directory's SQLite
database; L{relayd.buzz.redis.state.RedisReceipts} provides L{IReceiptStore} on Redis for several
instances. Every method answers a C{Deferred}; one that has already fired lets the host answer in
the same reactor turn.
"""

from __future__ import annotations

from typing import Sequence

from twisted.internet import defer
from zope.interface import Interface

from relayd.buzz.core.state.effects import EffectLike
from relayd.buzz.core.state.records import Agent, Claim, Credential, Receipt


class ICredentialStore(Interface):
    def credential(hash: str) -> "defer.Deferred[Credential | None]":
        """The credential whose SHA-256 hex is C{hash}, revoked or not."""


class IAgentStore(Interface):
    def agent(pubkey: str) -> "defer.Deferred[Agent | None]":
        """The agent with this public key (deleted ones included)."""

    def agents_named(owner: str, name: str) -> "defer.Deferred[list[Agent]]":
        """Live agents of C{owner} called C{name}."""

    def children(owner: str) -> "defer.Deferred[int]":
        """How many live managed agents C{owner} owns."""

    def apply_effects(effects: Sequence[EffectLike]) -> "defer.Deferred[None]":
        """Apply an execution's local effects (agents created, updated, deleted) in one transaction.

        Idempotent: a retry that resumes a plan may apply the same effects again.
        """

    def stamp(pubkey: str, digest: bytes, now: int, after: int, strict: bool) -> "defer.Deferred[int]":
        """The C{created_at} for a new event of identity C{pubkey}, durably handed out once.

        C{digest} (C{records.STAMP_DIGEST_BYTES} bytes) identifies the event's kind, tags and content. The answer is at
        least C{now}, more than C{after}, never below one handed out before for this identity, and
        never the second of an earlier event with the same digest: two events of one identity
        never share an id, even across restarts and processes sharing the state. With C{strict},
        the answer is also later than every second handed out before for this identity (an
        agent record: so records of one owner are totally ordered by C{created_at}).
        """


class IReceiptStore(Interface):
    """Idempotency receipts and the pending signed events of executions, keyed by (principal, requestId).

    The caller serialises its own duplicates in process; C{claim} makes duplicates on other
    instances sharing the store wait, so each request executes once.
    """

    def receipt(principal: str, request_id: str) -> "defer.Deferred[Receipt | None]":
        """The receipt for (principal, requestId), if any."""

    def claim(principal: str, request_id: str, digest: bytes) -> "defer.Deferred[Claim]":
        """Look the request up and, when it needs executing, take the claim to execute it."""

    def wait(principal: str, request_id: str, timeout: float) -> "defer.Deferred[None]":
        """Fires when a claim held elsewhere may have ended (settled, released, lapsed), or after C{timeout}."""

    def release(principal: str, request_id: str) -> "defer.Deferred[None]":
        """Give a claim up without a verdict: a stored plan stays for a retry to resend; a bare claim goes."""

    def store_plan(principal: str, request_id: str, digest: bytes, plan: bytes) -> "defer.Deferred[None]":
        """Durably store the signed events and effects of an execution before anything is sent."""

    def complete(
        principal: str, request_id: str, digest: bytes, response: bytes, effects: Sequence[EffectLike]
    ) -> "defer.Deferred[bytes]":
        """Apply C{effects}, store the verdict (replacing a plan) and end the claim.

        Fires with the verdict on record: C{response}, or one another instance settled first.
        """
