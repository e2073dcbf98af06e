"""An indeterminate request that can no longer be sent settles from the relay (issue 22, acceptance 3).

A plan answered C{indeterminate} (an event's publish unconfirmed) that a retry may not send again (a
signing identity deleted, the plan superseded, the credential that made it revoked, an event the
relay refuses as C{invalid:}) is settled by asking the relay which of its signed events it holds:
all of them C{succeeded}, none C{failed}, some a recorded C{indeterminate} naming them; a relay that
cannot be asked leaves it C{indeterminate} for a later retry. Each settled verdict is recorded and
replays byte for byte, on the SQLite and on the Redis receipt store.

The broker talks to the real relay (PyPI nostr-relay) through the fault proxy; the relay's own
database is the independent view of what landed.
"""

from __future__ import annotations

import io
import time
from typing import Any

from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial import unittest

from relayd.buzz import nostr
from relayd.buzz.core.host import credential_hash
from relayd.buzz.core.operations import evidence_filters, on_relay
from relayd.cli import broker as admin
from tests.buzz.harness import ok
from tests.buzz.test_faults import FaultCase
from tests.support.fault_relay import kind
from tests.support.redis import shared_redis

OWNER = nostr.Signer((11).to_bytes(32, "big"))
AGENT = nostr.Signer((12).to_bytes(32, "big"))
T = 1_800_000_000


def record(created_at: int, content: str = "{}") -> dict[str, Any]:
    return OWNER.sign(nostr.KIND_MANAGED_AGENT, [["d", AGENT.pubkey], ["p", AGENT.pubkey]], content, created_at)


def deletion(created_at: int, tags: list[list[str]], by: nostr.Signer = OWNER) -> dict[str, Any]:
    return by.sign(nostr.KIND_DELETION, tags, "", created_at)


class WhatLanded(unittest.TestCase):
    """The classification of a plan's events from what one REQ found (relayd.buzz.core.operations.on_relay)."""

    profile = AGENT.sign(0, [], '{"name":"x"}', T)
    rec = record(T + 1)
    address = f"{nostr.KIND_MANAGED_AGENT}:{OWNER.pubkey}:{AGENT.pubkey}"

    def test_events_held_landed_and_so_did_every_one_sent_before(self) -> None:
        assert on_relay([self.profile, self.rec], [self.profile, self.rec]) == [True, True]
        # The record is held, so the profile was accepted before it was sent (since replaced, say).
        assert on_relay([self.profile, self.rec], [self.rec]) == [True, True]
        assert on_relay([self.profile, self.rec], [self.profile]) == [True, False]
        assert on_relay([self.profile, self.rec], []) == [False, False]
        assert on_relay([self.profile, self.rec], [], confirmed=1) == [True, False]

    def test_replaced_or_deleted_since_counts_as_landed(self) -> None:
        newer = record(T + 5, '{"newer":1}')
        assert on_relay([self.rec], [newer]) == [True]
        assert on_relay([self.rec], [deletion(T + 9, [["a", self.address]])]) == [True]
        assert on_relay([self.rec], [deletion(T + 9, [["e", self.rec["id"]]])]) == [True]
        # In the same second the lower id is kept (NIP-01).
        same = record(T + 1, '{"same second":1}')
        assert on_relay([self.rec], [same]) == [same["id"] < self.rec["id"]]

    def test_what_is_no_evidence(self) -> None:
        older = record(T - 5)
        assert on_relay([self.rec], [older]) == [False]
        # A deletion of the address before the event's time does not cover it.
        assert on_relay([self.rec], [deletion(T, [["a", self.address]])]) == [False]
        # NIP-09: only the author may delete.
        assert on_relay([self.rec], [deletion(T + 9, [["e", self.rec["id"]]], by=AGENT)]) == [False]
        # An event that does not verify is nothing.
        forged = dict(self.rec, sig="00" * 64)
        assert on_relay([self.rec], [forged]) == [False]

    def test_an_event_not_on_the_relay_means_no_later_one_was_sent(self) -> None:
        # The record's address was deleted since, but the profile before it never landed: the
        # record was never sent (the host sends it only once the profile is accepted).
        assert on_relay([self.profile, self.rec], [deletion(T + 9, [["a", self.address]])]) == [False, False]

    def test_one_req_asks_for_the_events_their_deletions_and_their_addresses(self) -> None:
        filters = evidence_filters([self.profile, self.rec])
        ids = [self.profile["id"], self.rec["id"]]
        authors = sorted({OWNER.pubkey, AGENT.pubkey})
        assert filters == [
            {"ids": ids},
            {"kinds": [5], "authors": authors, "#e": ids},
            {"kinds": [5], "authors": authors, "#a": sorted([f"0:{AGENT.pubkey}:", self.address])},
            {"kinds": [0], "authors": [AGENT.pubkey]},
            {"kinds": [nostr.KIND_MANAGED_AGENT], "authors": [OWNER.pubkey], "#d": [AGENT.pubkey]},
        ]


class SettleFromRelay(FaultCase):
    """Acceptance 3 on the SQLite receipt store."""

    action_timeout = 3.0

    async def replayed(self, action: str, args: dict[str, Any], rid: str, verdict: dict[str, Any]) -> None:
        """The same bytes again answer the settled verdict, marked replayed, and execute nothing."""
        seen = len(self.proxy.script.seen)
        again = await self.send(action, args, rid)
        assert again.pop("replayed") is True and again == verdict, (again, verdict)
        assert len(self.proxy.script.seen) == seen, "a replay sent events"

    async def receipt_state(self, rid: str) -> str | None:
        receipt = self.receipt(rid)
        return None if receipt is None else str(receipt.state)

    async def settled(self, rid: str) -> None:
        assert await self.receipt_state(rid) == "done"

    async def pending(self, rid: str) -> None:
        assert await self.receipt_state(rid) == "pending"

    async def created_then_deleted(self, fault: str, event_kind: int, rid: str) -> tuple[dict[str, Any], str]:
        """An agents.create answered indeterminate (C{fault} on its event of C{event_kind}), then the
        created agent deleted: its request can no longer be sent."""
        args = self.create_args(f"settle-{rid}")
        self.proxy.on(fault, kind(event_kind))
        r = await self.send("agents.create", args, rid)
        assert r["status"] == "indeterminate" and r["error"]["code"] == "outcome_unknown", r
        await self.pending(rid)
        self.proxy.clear()
        agent = [e for e in self.proxy.script.seen if e["kind"] == 0][-1]["pubkey"]
        ok(await self.send("agents.delete", {"target": {"pubkey": agent}}, f"delete-{rid}"))
        return args, agent

    async def test_signer_deleted_events_on_the_relay_succeeds(self) -> None:
        # The profile is confirmed, the owner's record reaches the relay but its OK is lost.
        args, agent = await self.created_then_deleted("drop_ok", nostr.KIND_MANAGED_AGENT, "settle-landed")
        r = await self.send("agents.create", args, "settle-landed")
        assert r["status"] == "succeeded", r
        assert r["outcome"] == {"agentPubkey": agent, "displayName": args["displayName"], "channelId": self.channel}
        await self.settled("settle-landed")
        await self.replayed("agents.create", args, "settle-landed", r)
        assert self.host_agent(agent).deleted  # the settled create revives nothing

    async def test_signer_deleted_nothing_on_the_relay_fails(self) -> None:
        agent = await self.create("settle-nothing")
        # A rename publishes the agent's kind 0 first: the connection drops instead, nothing is sent.
        self.proxy.on("close_before", kind(0))
        args = {"target": {"pubkey": agent}, "displayName": "never-renamed"}
        r = await self.send("agents.update", args, "settle-nothing")
        assert r["status"] == "indeterminate" and r["error"]["code"] == "outcome_unknown", r
        self.proxy.clear()
        ok(await self.send("agents.delete", {"target": {"pubkey": agent}}, "delete-settle-nothing"))
        r2 = await self.send("agents.update", args, "settle-nothing")
        assert r2["status"] == "failed" and r2["error"]["code"] == "action_failed", r2
        message = r2["error"]["message"]
        assert message.startswith("nothing of this request is on the relay and it can no longer be sent: "), message
        assert "deleted" in message, message
        await self.settled("settle-nothing")
        await self.replayed("agents.update", args, "settle-nothing", r2)
        assert not [e for e in self.on_relay(kind=0, pubkey=agent) if "never-renamed" in e["content"]]
        assert not [e for e in self.on_relay(kind=nostr.KIND_MANAGED_AGENT) if "never-renamed" in e["content"]]

    async def test_revoked_credential_one_of_two_events_landed_is_a_recorded_partial_verdict(self) -> None:
        # The new agent's profile reaches the relay, its OK is lost; the owner's record is never sent.
        args = self.create_args("settle-partial")
        self.proxy.on("drop_ok", kind(0))
        r = await self.send("agents.create", args, "settle-partial")
        assert r["status"] == "indeterminate", r
        self.proxy.clear()
        profile = [e for e in self.proxy.script.seen if e["kind"] == 0][-1]
        # The credential that made the plan is revoked; the agent retries under a new one.
        fresh = self.broker.issue(self.alice["agentPubkey"], "--channel", self.channel)
        out = io.StringIO()
        revoke = ["revoke", "--state-dir", self.broker.state_dir, "--id", credential_hash(self.cred)[:16]]
        assert admin.main(revoke, stdout=out, stderr=io.StringIO()) == 0, out.getvalue()
        self.cred = fresh["credential"]
        seen = len(self.proxy.script.seen)
        r2 = await self.send("agents.create", args, "settle-partial")
        assert len(self.proxy.script.seen) == seen, "a plan of a revoked credential was sent again"
        assert r2["status"] == "indeterminate" and r2["error"]["code"] == "outcome_unknown", r2
        message = r2["error"]["message"]
        assert f"event 1 ({profile['id']}) of 2" in message, message
        assert "not event 2 (" in message and "revoked" in message, message
        await self.settled("settle-partial")
        await self.replayed("agents.create", args, "settle-partial", r2)
        # What the relay holds agrees: the profile, and no record of the agent.
        assert [e["id"] for e in self.on_relay(kind=0, pubkey=profile["pubkey"])] == [profile["id"]]
        assert not [e for e in self.on_relay(kind=nostr.KIND_MANAGED_AGENT) if ["d", profile["pubkey"]] in e["tags"]]
        # The host is not older than the relay: it holds the identity whose profile is out.
        held = self.host_agent(profile["pubkey"])
        assert held is not None and held.sealed_key is not None

    async def test_expired_credential_settles_without_sending_again(self) -> None:
        clock = [time.time()]
        self.broker.service.ops.now = lambda: clock[0]  # type: ignore[union-attr]
        short = self.broker.issue(self.alice["agentPubkey"], "--channel", self.channel, "--expires", "60s")
        self.cred = short["credential"]
        content = f"settle-expired {self.channel}"  # the relay is shared with other tests
        args = {"channelId": self.channel, "content": content}
        self.proxy.on("drop_ok", kind(9))
        r = await self.send("message.post", args, "settle-expired")
        assert r["status"] == "indeterminate", r
        self.proxy.clear()
        clock[0] = int(short["expiresAt"])
        self.cred = self.broker.issue(self.alice["agentPubkey"], "--channel", self.channel)["credential"]
        seen = len(self.proxy.script.seen)
        r2 = await self.send("message.post", args, "settle-expired")
        assert len(self.proxy.script.seen) == seen, "a plan of an expired credential was sent again"
        assert r2["status"] == "succeeded", r2
        assert [e["id"] for e in self.on_relay(kind=9) if e["content"] == content] == [r2["outcome"]["eventId"]]
        await self.settled("settle-expired")
        await self.replayed("message.post", args, "settle-expired", r2)

    async def test_a_relay_that_cannot_be_asked_keeps_it_indeterminate_and_a_later_retry_settles(self) -> None:
        args, agent = await self.created_then_deleted("drop_ok", nostr.KIND_MANAGED_AGENT, "settle-later")
        self.proxy.refuse_reads = "error: reads refused by the fault script"
        r = await self.send("agents.create", args, "settle-later")
        assert r["status"] == "indeterminate" and r["error"]["code"] == "outcome_unknown", r
        assert "could not be asked" in r["error"]["message"], r
        rid = "settle-later"
        await self.pending(rid)
        self.proxy.refuse_reads = None
        r2 = await self.send("agents.create", args, rid)
        assert r2["status"] == "succeeded" and r2["outcome"]["agentPubkey"] == agent, r2
        await self.settled(rid)
        await self.replayed("agents.create", args, rid, r2)

    async def test_an_invalid_refusal_after_an_accepted_event_settles_at_once(self) -> None:
        """C{invalid:} never changes on a retry: the first attempt settles from the relay."""
        args = self.create_args("settle-invalid")
        self.proxy.on("refuse", kind(nostr.KIND_MANAGED_AGENT), message="invalid: refused by the fault script")
        r = await self.send("agents.create", args, "settle-invalid")
        assert r["status"] == "indeterminate" and r["error"]["code"] == "outcome_unknown", r
        assert r["error"]["message"].startswith("partly done: the relay holds event 1 ("), r
        assert "refuses event 2 of 2 as invalid" in r["error"]["message"], r
        await self.settled("settle-invalid")
        await self.replayed("agents.create", args, "settle-invalid", r)


class SettleFromRelayOnRedis(SettleFromRelay):
    """The same, with the receipts (and so the settled verdicts) in a real Redis."""

    def broker_options(self) -> dict[str, Any]:
        return {"redis_url": shared_redis().url, "redis_prefix": f"settle:{id(self)}:"}

    async def broker_ready(self) -> None:
        service = self.broker.service
        assert service is not None and service.redis is not None
        for _ in range(500):
            if service.redis.connected and service.redis_receipts.bus.connected:
                return
            await deferLater(reactor, 0.01, lambda: None)  # polling a connection being made (bounded)
        raise AssertionError("the broker did not connect to Redis")

    async def receipt_state(self, rid: str) -> str | None:
        service = self.broker.service
        assert service is not None and service.redis_receipts is not None
        receipt = await service.redis_receipts.receipt(self.alice["agentPubkey"], rid)
        return None if receipt is None else str(receipt.state)
