"""The nine operations through POST /v1/action against a real relay (PyPI nostr-relay, NIP-42 on)."""

from __future__ import annotations

import json
import os
import tempfile

from twisted.trial import unittest

from relayd.buzz import nostr
from relayd.buzz.core import contract
from tests.buzz.harness import BrokerUnderTest, independent_verify, new_channel, ok
from tests.support.nostr import shared_nostr_relay


class OperationsTests(unittest.TestCase):
    timeout = 120

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        self.tmp = tempfile.mkdtemp(prefix="relayd-broker-")
        self.broker = BrokerUnderTest(os.path.join(self.tmp, "state"), self.relay.url)
        await self.broker.start()
        self.channel = new_channel()
        self.alice = self.broker.issue(f"alice-{self.channel[:8]}", "--channel", self.channel)

    async def tearDown(self) -> None:
        await self.broker.stop()

    async def test_post_and_read_back(self) -> None:
        out = ok(await self.broker.call(self.alice["credential"], "message.post", {"channelId": self.channel, "content": "hello"}))
        assert out["kind"] == 9
        page = ok(await self.broker.call(self.alice["credential"], "channel.read", {"channelId": self.channel}))
        assert [m["id"] for m in page["messages"]] == [out["eventId"]]
        ev = page["messages"][0]
        assert set(ev) == contract.EVENT_MEMBERS
        assert ev["pubkey"] == self.alice["agentPubkey"]
        assert ev["tags"] == [["h", self.channel]]
        assert independent_verify(ev) and nostr.verify_event(ev)
        assert "nextCursor" not in page

    def _all_verify(self) -> None:
        """Every event on the relay authored by an identity of this test verifies with nostr-sdk."""
        mine = {self.alice["agentPubkey"]} | getattr(self, "extra_authors", set())
        events = [e for e in self.relay.events() if e["pubkey"] in mine]  # type: ignore[attr-defined]
        assert events
        for ev in events:
            assert independent_verify(ev), ev

    async def test_reply_to_a_reply_derives_the_root(self) -> None:
        cred = self.alice["credential"]
        root = ok(await self.broker.call(cred, "message.post", {"channelId": self.channel, "content": "root"}))["eventId"]
        r1 = ok(await self.broker.call(cred, "message.reply", {"channelId": self.channel, "replyToEventId": root, "content": "r1"}))["eventId"]
        r2 = ok(await self.broker.call(cred, "message.reply", {"channelId": self.channel, "replyToEventId": r1.upper(), "content": "r2", "mentions": [self.alice["agentPubkey"]]}))["eventId"]
        page = ok(await self.broker.call(cred, "channel.read", {"channelId": self.channel}))
        by_id = {m["id"]: m for m in page["messages"]}
        assert by_id[r1]["tags"] == [["h", self.channel], ["e", root, "", "reply"]]
        assert by_id[r2]["tags"] == [
            ["h", self.channel], ["e", root, "", "root"], ["e", r1, "", "reply"], ["p", self.alice["agentPubkey"]]
        ]
        assert nostr.thread_root_for_reply(by_id[r2]) == root
        # the thread read holds the root and both replies, newest first
        thread = ok(await self.broker.call(cred, "channel.read", {"channelId": self.channel, "rootEventId": root}))
        assert {m["id"] for m in thread["messages"]} == {root, r1, r2}
        other = ok(await self.broker.call(cred, "message.post", {"channelId": self.channel, "content": "unrelated"}))
        thread = ok(await self.broker.call(cred, "channel.read", {"channelId": self.channel, "rootEventId": root}))
        assert other["eventId"] not in {m["id"] for m in thread["messages"]}
        self._all_verify()

    async def test_reply_to_unknown_or_foreign_parent_fails(self) -> None:
        cred = self.alice["credential"]
        r = await self.broker.call(cred, "message.reply", {"channelId": self.channel, "replyToEventId": "ab" * 32, "content": "x"})
        assert r["status"] == "failed" and r["error"]["code"] == "action_failed"
        other = new_channel()
        bob = self.broker.issue(f"bob-{other[:8]}", "--channel", other, "--channel", self.channel)
        theirs = ok(await self.broker.call(bob["credential"], "message.post", {"channelId": other, "content": "x"}))["eventId"]
        r = await self.broker.call(cred, "message.reply", {"channelId": self.channel, "replyToEventId": theirs, "content": "x"})
        assert r["error"]["code"] == "action_failed" and "different channel" in r["error"]["message"]

    async def test_react(self) -> None:
        cred = self.alice["credential"]
        target = ok(await self.broker.call(cred, "message.post", {"channelId": self.channel, "content": "like me"}))["eventId"]
        out = ok(await self.broker.call(cred, "reaction.add", {"channelId": self.channel, "targetEventId": target, "reaction": " 👍 "}))
        assert out["kind"] == 7
        (ev,) = self.relay.events(id=out["eventId"])  # type: ignore[attr-defined]
        assert ev["content"] == "👍"
        assert ev["tags"] == [["e", target], ["p", self.alice["agentPubkey"]], ["k", "9"], ["h", self.channel]]
        self._all_verify()

    async def test_profile_set_twice_merges(self) -> None:
        cred = self.alice["credential"]
        first = ok(await self.broker.call(cred, "profile.set", {"displayName": "Alice", "about": "first about", "picture": "https://example.com/a.png"}))
        second = ok(await self.broker.call(cred, "profile.set", {"about": "second about"}))
        assert second["createdAt"] > first["createdAt"] and second["kind"] == 0
        (ev,) = self.relay.events(id=second["eventId"])  # type: ignore[attr-defined]
        assert json.loads(ev["content"]) == {
            "name": "Alice", "display_name": "Alice", "about": "second about", "picture": "https://example.com/a.png"
        }
        self._all_verify()

    async def test_storage_address_vectors(self) -> None:
        key_file = os.path.join(self.tmp, "agent.key")
        with open(key_file, "w") as f:
            f.write("00" * 31 + "01\n")
        owner = "c6047f9441ed7d6d3045406e95c07cd85c778e4b8cef3ca7abac09b95c709ee5"
        vec = self.broker.issue("vector-agent", "--secret-key-file", key_file, "--owner", owner, "--actions", "storage.address")
        assert vec["agentPubkey"] == nostr.Signer((1).to_bytes(32, "big")).pubkey
        expected = {
            "core": "bdc233238ffe52e272b44cc233c8f33a2bc510b08be04495b225964283be4a90",
            "mem/example": "72d4f9629106451505d7d341ea85bb3ebad4f654fcfd2aad100d5a35f8a85cba",
            "mem/notes/2026-05-12": "31651571a312780cfdc1f0b706b682ac9f3f51a053e8dca76fe57710bae5a4d4",
        }
        for slug, d in expected.items():
            out = ok(await self.broker.call(vec["credential"], "storage.address", {"slug": f"  {slug} "}))
            assert out == {"authorPubkey": vec["agentPubkey"], "kind": 30174, "dTag": d}

    async def test_storage_address_for_an_admin_minted_key(self) -> None:
        owner = nostr.Signer(nostr.generate_secret())
        minted = self.broker.issue("minted-agent", "--owner", owner.pubkey, "--actions", "storage.address")
        out = ok(await self.broker.call(minted["credential"], "storage.address", {"slug": "mem/slice-c"}))
        # The owner derives the same address from its side of the conversation key.
        assert out["dTag"] == nostr.d_tag(owner.conversation_key(minted["agentPubkey"]), "mem/slice-c")
        no_owner = await self.broker.call(self.alice["credential"], "storage.address", {"slug": "core"})
        assert no_owner["error"]["code"] == "action_failed"

    async def test_agents_create_update_delete(self) -> None:
        cred = self.alice["credential"]
        created = ok(await self.broker.call(cred, "agents.create", {
            "channelId": self.channel.upper(), "displayName": " helper ", "systemPrompt": "Be helpful.",
            "runtime": "buzz-acp", "provider": "anthropic", "model": "claude-sonnet-4-5",
        }))
        agent_pk = created["agentPubkey"]
        assert created == {"agentPubkey": agent_pk, "displayName": "helper", "channelId": self.channel}
        self.extra_authors = {agent_pk}
        (profile,) = self.relay.events(pubkey=agent_pk, kind=0)  # type: ignore[attr-defined]
        assert json.loads(profile["content"])["display_name"] == "helper"
        (record,) = self.relay.events(pubkey=self.alice["agentPubkey"], kind=30177)  # type: ignore[attr-defined]
        assert ["d", agent_pk] in record["tags"]
        public = json.loads(record["content"])
        assert public["respond_to"] == "owner-only" and public["name"] == "helper"
        assert not any(k in json.dumps(public).lower() for k in ("nsec", "secret", "seckey"))
        # the created agent acts with its own credential
        helper = self.broker.issue(agent_pk, "--channel", self.channel)
        assert helper["agentPubkey"] == agent_pk
        said = ok(await self.broker.call(helper["credential"], "message.post", {"channelId": self.channel, "content": "hi, I am helper"}))
        (ev,) = self.relay.events(id=said["eventId"])  # type: ignore[attr-defined]
        assert ev["pubkey"] == agent_pk
        # storage.address for a managed agent: the owner is its creator
        addr = ok(await self.broker.call(helper["credential"], "storage.address", {"slug": "core"}))
        assert addr["authorPubkey"] == agent_pk
        # update by name
        upd = ok(await self.broker.call(cred, "agents.update", {"target": {"name": "helper"}, "displayName": "helper2", "respondTo": "anyone", "model": "claude-sonnet-4-5"}))
        assert upd == {"agentPubkey": agent_pk, "displayName": "helper2", "updatedFields": ["displayName", "respondTo"]}
        profiles = self.relay.events(pubkey=agent_pk, kind=0)  # type: ignore[attr-defined]
        newest = max(profiles, key=lambda e: e["created_at"])
        assert json.loads(newest["content"])["display_name"] == "helper2"
        same = ok(await self.broker.call(cred, "agents.update", {"target": {"pubkey": agent_pk}, "respondTo": "anyone"}))
        assert same["updatedFields"] == []
        # someone else cannot touch it
        bob = self.broker.issue(f"bob-{self.channel[:8]}", "--channel", self.channel)
        denied = await self.broker.call(bob["credential"], "agents.delete", {"target": {"pubkey": agent_pk}})
        assert denied["error"]["code"] == "unauthorized"
        # delete: NIP-09 deletion by the owner, key destroyed, credential dead
        gone = ok(await self.broker.call(cred, "agents.delete", {"target": {"pubkey": agent_pk}}))
        assert gone == {"agentPubkey": agent_pk, "displayName": "helper2"}
        (deletion,) = self.relay.events(pubkey=self.alice["agentPubkey"], kind=5)  # type: ignore[attr-defined]
        assert ["a", f"30177:{self.alice['agentPubkey']}:{agent_pk}"] in deletion["tags"]
        after = await self.broker.call(helper["credential"], "message.post", {"channelId": self.channel, "content": "still here?"})
        assert after["error"]["code"] == "unauthenticated"
        self._all_verify()

    async def test_agent_depth_is_capped(self) -> None:
        await self.broker.stop()
        self.broker = BrokerUnderTest(self.broker.state_dir, self.relay.url, max_agent_depth=1)  # type: ignore[attr-defined]
        await self.broker.start()
        cred = self.alice["credential"]
        child = ok(await self.broker.call(cred, "agents.create", {"channelId": self.channel, "displayName": "c1", "systemPrompt": "p"}))
        child_cred = self.broker.issue(child["agentPubkey"], "--channel", self.channel)["credential"]
        grandchild = await self.broker.call(child_cred, "agents.create", {"channelId": self.channel, "displayName": "c2", "systemPrompt": "p"})
        assert grandchild["error"]["code"] == "unauthorized"
        bad_runtime = await self.broker.call(cred, "agents.create", {"channelId": self.channel, "displayName": "c3", "systemPrompt": "p", "runtime": "nope"})
        assert bad_runtime["error"]["code"] == "action_failed"

    async def test_mentions_only(self) -> None:
        bob = self.broker.issue(f"bob-{self.channel[:8]}", "--channel", self.channel)
        cred = self.alice["credential"]
        ok(await self.broker.call(cred, "message.post", {"channelId": self.channel, "content": "no mention"}))
        m1 = ok(await self.broker.call(cred, "message.post", {"channelId": self.channel, "content": "hey bob", "mentions": [bob["agentPubkey"]]}))
        m2 = ok(await self.broker.call(cred, "message.post", {"channelId": self.channel, "content": "bob again", "mentions": [bob["agentPubkey"].upper(), bob["agentPubkey"]]}))
        feed = ok(await self.broker.call(bob["credential"], "channel.read", {"channelId": self.channel, "mentionsOnly": True}))
        assert {m["id"] for m in feed["messages"]} == {m1["eventId"], m2["eventId"]}
        (ev,) = [m for m in feed["messages"] if m["id"] == m2["eventId"]]
        assert ev["tags"].count(["p", bob["agentPubkey"]]) == 1
        mine = ok(await self.broker.call(cred, "channel.read", {"channelId": self.channel, "mentionsOnly": True}))
        assert mine["messages"] == []

    async def test_64_kib_content(self) -> None:
        content = "é" * 32_768  # 65,536 bytes
        out = ok(await self.broker.call(self.alice["credential"], "message.post", {"channelId": self.channel, "content": content}))
        (ev,) = self.relay.events(id=out["eventId"])  # type: ignore[attr-defined]
        assert ev["content"] == content
        self._all_verify()
