"""Fault injection: every verdict agrees with what the real relay holds, and a retry converges.

The broker talks to the real relay (PyPI nostr-relay, NIP-42 on) through the fault proxy of tests/support/nostr.py, a proxy
that refuses, drops OKs, closes connections or throttles on a script. After each fault the test
reads the real relay's database (an independent view) and the broker's own state.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Callable

from twisted.trial import unittest

from relayd.buzz import nostr
from relayd.buzz.core.state import StateDB
from tests.buzz.harness import BrokerUnderTest, new_channel, ok
from tests.support.fault_relay import kind, start_fault_relay
from tests.support.nostr import REQUIRE_MEMBERSHIP, shared_nostr_relay, start_nostr_relay


class FaultCase(unittest.TestCase):
    """A broker behind a fault proxy in front of the session's real relay."""

    timeout = 120
    action_timeout = 4.0

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        self.tmp = tempfile.mkdtemp(prefix="relayd-faults-")
        self.proxy = start_fault_relay(self, self.relay.url)
        self.broker = BrokerUnderTest(
            os.path.join(self.tmp, "state"),
            self.proxy.proxy_url,
            timeout=self.action_timeout,
            auth_url=self.relay.url,
            **self.broker_options(),
        )
        await self.broker.start()
        await self.broker_ready()
        self.channel = new_channel()
        self.alice = self.broker.issue(f"alice-{self.channel[:8]}", "--channel", self.channel)
        self.cred = self.alice["credential"]
        # One action through the proxy before any fault: the relay (started with the session,
        # possibly still starting) is serving, and the requester's connection is up.
        # Retried with the same bytes while the relay is not up yet (each try waits the action timeout).
        for _ in range(30):
            r = await self.send("message.post", {"channelId": self.channel, "content": "setup"}, f"setup-{self.channel}")
            if r["status"] != "indeterminate":
                break
        ok(r)

    async def tearDown(self) -> None:
        await self.broker.stop()
        await self.proxy.stop()

    def broker_options(self) -> dict[str, Any]:
        """More BrokerService options for a subclass (a Redis receipt store, say)."""
        return {}

    async def broker_ready(self) -> None:
        """Wait for what a subclass's broker needs before the first action."""

    async def send(self, action: str, args: dict[str, Any], rid: str) -> dict[str, Any]:
        """Send the frozen bytes of one request (the same bytes on every call with this rid)."""
        return await self.broker.call(self.cred, action, args, rid)

    def on_relay(self, **filters: Any) -> list[dict[str, Any]]:
        return self.relay.events(**filters)

    def host_agent(self, pubkey: str) -> Any:
        db = StateDB.in_dir(self.broker.state_dir)
        try:
            return db.agent(pubkey)
        finally:
            db.close()

    def receipt(self, rid: str) -> Any:
        db = StateDB.in_dir(self.broker.state_dir)
        try:
            return db.receipt(self.alice["agentPubkey"], rid)
        finally:
            db.close()

    def create_args(self, name: str = "helper") -> dict[str, Any]:
        return {"channelId": self.channel, "displayName": name, "systemPrompt": "Be helpful."}

    async def create(self, name: str = "helper") -> str:
        out = ok(await self.send("agents.create", self.create_args(name), f"c-{name}-{time.monotonic_ns()}"))
        return str(out["agentPubkey"])

    def record(self, agent: str) -> dict[str, Any]:
        """The newest 30177 record of C{agent} the relay holds (the relay keeps one per address)."""
        recs = [e for e in self.on_relay(kind=nostr.KIND_MANAGED_AGENT) if ["d", agent] in e["tags"]]
        assert recs, "no 30177 record on the relay"
        return max(recs, key=lambda e: e["created_at"])


class RefusedSecondEvent(FaultCase):
    """Defect 1: a refusal after an accepted event is never C{failed}; the plan and the key stay."""

    async def test_create_refused_record_is_indeterminate_and_the_retry_finishes_it(self) -> None:
        self.proxy.on("refuse", kind(nostr.KIND_MANAGED_AGENT), message="blocked: not today")
        rid = "create-refused-record"
        # The relay is shared with other tests that create agents named "helper" too.
        before = {e["pubkey"] for e in self.on_relay(kind=0) if json.loads(e["content"]).get("name") == "helper"}
        r = await self.send("agents.create", self.create_args(), rid)
        assert r["status"] == "indeterminate", r
        assert r["error"]["code"] == "outcome_unknown"
        assert "1 of 2" in r["error"]["message"], r
        # The relay holds the new identity's profile; the host holds that identity and its key.
        profiles = [e for e in self.on_relay(kind=0) if json.loads(e["content"]).get("name") == "helper"]
        minted = {e["pubkey"] for e in profiles} - {self.alice["agentPubkey"]} - before
        assert len(minted) == 1
        (agent,) = minted
        held = self.host_agent(agent)
        assert held is not None and not held.deleted and held.sealed_key is not None
        assert self.receipt(rid).state == "pending"
        # The same bytes again, relay willing: the plan finishes, the verdict names the same agent.
        r2 = await self.send("agents.create", self.create_args(), rid)
        assert r2["status"] == "succeeded", r2
        assert r2["outcome"]["agentPubkey"] == agent and "replayed" not in r2
        assert self.record(agent)["pubkey"] == self.alice["agentPubkey"]
        r3 = await self.send("agents.create", self.create_args(), rid)
        assert r3.pop("replayed") is True and r3 == r2

    async def test_rename_refused_record_keeps_host_and_relay_profile_in_step(self) -> None:
        agent = await self.create()
        self.proxy.on("refuse", kind(nostr.KIND_MANAGED_AGENT))
        rid = "rename-refused-record"
        args = {"target": {"pubkey": agent}, "displayName": "renamed"}
        r = await self.send("agents.update", args, rid)
        assert r["status"] == "indeterminate" and r["error"]["code"] == "outcome_unknown", r
        names = {json.loads(e["content"])["name"] for e in self.on_relay(kind=0, pubkey=agent)}
        assert "renamed" in names
        # The host is never older than the relay: its agent already carries the new name.
        assert self.host_agent(agent).name == "renamed"
        r2 = await self.send("agents.update", args, rid)
        assert r2["status"] == "succeeded", r2
        assert json.loads(self.record(agent)["content"])["name"] == "renamed"

    async def test_refusal_of_the_first_event_is_failed_and_nothing_is_kept(self) -> None:
        self.proxy.on("refuse", kind(0))
        rid = "create-refused-profile"
        r = await self.send("agents.create", self.create_args("nobody"), rid)
        assert r["status"] == "failed" and r["error"]["code"] == "action_failed", r
        assert not [e for e in self.on_relay(kind=0) if json.loads(e["content"]).get("name") == "nobody"]
        assert not [e for e in self.on_relay(kind=nostr.KIND_MANAGED_AGENT) if e["pubkey"] == self.alice["agentPubkey"]]
        r2 = await self.send("agents.create", self.create_args("nobody"), rid)
        assert r2.pop("replayed") is True and r2 == r


class ResumedPlans(FaultCase):
    """Defects 2 and 3: a resumed plan settles, and never overwrites newer state.

    A superseded plan is not sent again; its verdict comes from the relay (tests/buzz/test_settle.py).
    An event the relay no longer shows because a newer one replaced it, or a deletion covers it,
    counts as landed: the relay holds what it would hold had it landed, and C{failed} would invite
    the client to send the old change again under a new requestId.
    """

    async def test_pending_plan_whose_signer_was_deleted_settles_without_a_fault(self) -> None:
        agent = await self.create()
        # A rename publishes the agent's kind 0 first: its OK never comes, so the plan waits.
        self.proxy.on("drop_ok", kind(0))
        args = {"target": {"pubkey": agent}, "displayName": "renamed"}
        rid = "rename-then-delete"
        r = await self.send("agents.update", args, rid)
        assert r["status"] == "indeterminate" and r["error"]["code"] == "outcome_unknown", r
        ok(await self.send("agents.delete", {"target": {"pubkey": agent}}, "delete-it"))
        errors = self.flushLoggedErrors()
        r2 = await self.send("agents.update", args, rid)
        # The relay holds the new profile; the record, never sent, is covered by the deletion since.
        assert r2["status"] == "succeeded" and r2["outcome"]["displayName"] == "renamed", r2
        assert not self.flushLoggedErrors() and not errors
        # Settled: the same bytes replay it; the agent stays deleted and no record came back.
        r3 = await self.send("agents.update", args, rid)
        assert r3.pop("replayed") is True and r3 == r2
        assert self.host_agent(agent).deleted
        assert self.receipt(rid).state == "done"

    async def test_old_update_resumed_after_a_newer_one_does_not_roll_back(self) -> None:
        agent = await self.create()
        self.proxy.on("drop_ok", kind(nostr.KIND_MANAGED_AGENT))
        old = {"target": {"pubkey": agent}, "systemPrompt": "old prompt"}
        r = await self.send("agents.update", old, "update-old")
        assert r["status"] == "indeterminate", r
        ok(await self.send("agents.update", {"target": {"pubkey": agent}, "systemPrompt": "new prompt"}, "update-new"))
        newest = self.record(agent)
        assert json.loads(newest["content"])["system_prompt"] == "new prompt"
        held = self.host_agent(agent)
        seen = len(self.proxy.script.seen)
        r2 = await self.send("agents.update", old, "update-old")
        assert r2["status"] == "succeeded", r2  # its record landed (its OK was lost), a newer one replaced it
        assert len(self.proxy.script.seen) == seen, "a superseded plan was sent again"
        after = self.host_agent(agent)
        assert after.settings["systemPrompt"] == "new prompt"
        assert after.record_created_at == held.record_created_at == newest["created_at"]
        assert json.loads(self.record(agent)["content"])["system_prompt"] == "new prompt"

    async def test_update_resumed_after_delete_publishes_no_record(self) -> None:
        agent = await self.create()
        self.proxy.on("close_before", kind(nostr.KIND_MANAGED_AGENT))
        args = {"target": {"pubkey": agent}, "systemPrompt": "never"}
        r = await self.send("agents.update", args, "update-then-delete")
        assert r["status"] == "indeterminate", r
        ok(await self.send("agents.delete", {"target": {"pubkey": agent}}, "delete-after"))
        r2 = await self.send("agents.update", args, "update-then-delete")
        assert r2["status"] == "succeeded", r2  # the relay holds what it would had the record landed
        assert not [
            e for e in self.on_relay(kind=nostr.KIND_MANAGED_AGENT)
            if ["d", agent] in e["tags"] and "never" in e["content"]
        ]
        assert self.host_agent(agent).deleted


class EveryVerdictRecorded(FaultCase):
    """Defect 6: every correlated verdict is recorded: replays say so, other bytes are a conflict."""

    async def _raw(self, tree: dict[str, Any], cred: str | None = None) -> dict[str, Any]:
        status, data = await self.broker.post(json.dumps(tree).encode(), cred or self.cred)
        assert status == 200, (status, data)
        return dict(json.loads(data))

    def _wire(self, rid: str, action: str, args: dict[str, Any], **over: Any) -> dict[str, Any]:
        tree = {"type": "broker_request", "protocolVersion": 1, "requestId": rid, "actionVersion": 1, "action": action, "args": args}
        tree.update(over)
        return tree

    async def _recorded(self, bad: dict[str, Any], code: str) -> None:
        r = await self._raw(bad)
        assert r["status"] == "failed" and r["error"]["code"] == code, r
        again = await self._raw(bad)
        assert again.pop("replayed") is True and again == r
        # Other (valid) bytes under the same requestId never execute.
        good = self._wire(bad["requestId"], "message.post", {"channelId": self.channel, "content": "must not appear"})
        c = await self._raw(good)
        assert c["status"] == "failed" and c["error"]["code"] == "request_id_conflict", c

    async def test_invalid_request_is_recorded(self) -> None:
        await self._recorded(self._wire("bad-limit", "channel.read", {"channelId": self.channel, "limit": 0}), "invalid_request")

    async def test_version_codes_are_recorded(self) -> None:
        await self._recorded(self._wire("bad-proto", "message.post", {}, protocolVersion=2), "unsupported_protocol_version")
        await self._recorded(self._wire("bad-version", "message.post", {}, actionVersion=9), "unsupported_action_version")
        await self._recorded(self._wire("bad-action", "message.delete", {}), "unknown_action")
        assert not [e for e in self.on_relay(kind=9) if e["content"] == "must not appear"]

    async def test_foreign_cursor_is_recorded(self) -> None:
        for i in range(3):
            ok(await self.send("message.post", {"channelId": self.channel, "content": f"m{i}"}, f"post-{i}"))
        page = ok(await self.send("channel.read", {"channelId": self.channel, "limit": 1}, "read-1"))
        other = new_channel()
        bob = self.broker.issue(f"bob-{other[:8]}", "--channel", other)
        self.cred = bob["credential"]
        await self._recorded(
            self._wire("foreign-cursor", "channel.read", {"channelId": other, "cursor": page["nextCursor"]}), "invalid_request"
        )

    async def test_relay_unavailable_before_dispatch_is_recorded(self) -> None:
        other = new_channel()
        bob = self.broker.issue(f"bob-{other[:8]}", "--channel", other)
        await self.proxy.stop()  # bob's first connection finds nobody listening
        self.cred = bob["credential"]
        tree = self._wire("read-down", "channel.read", {"channelId": other})
        r = await self._raw(tree)
        assert r["status"] == "failed" and r["error"]["code"] == "internal", r
        again = await self._raw(tree)
        assert again.pop("replayed") is True and again == r


class NoEcho(FaultCase):
    """Defect 7: an error holds no request contents (a refused runtime is not quoted back)."""

    async def test_refused_runtime_is_not_echoed(self) -> None:
        runtime = "zz" + "q" * 298  # exactly the 300-character limit: valid, but not offered
        r = await self.send("agents.create", {**self.create_args(), "runtime": runtime}, "odd-runtime")
        assert r["status"] == "failed" and r["error"]["code"] == "action_failed", r
        assert "qqqq" not in r["error"]["message"] and len(r["error"]["message"]) < 100, r


class BadConnections(FaultCase):
    """Defect 9: a connection the relay throttles is dropped after repeated failures and replaced."""

    action_timeout = 2.0

    async def test_throttled_connection_is_recycled(self) -> None:
        ok(await self.send("message.post", {"channelId": self.channel, "content": "warm"}, "warm"))
        self.proxy.on("throttle", kind(9))  # from now on this connection answers nothing
        for i in range(3):
            r = await self.send("message.post", {"channelId": self.channel, "content": f"t{i}"}, f"throttled-{i}")
            assert r["status"] == "indeterminate" and r["error"]["code"] == "outcome_unknown", r
        start = time.monotonic()
        out = ok(await self.send("message.post", {"channelId": self.channel, "content": "after"}, "after"))
        assert time.monotonic() - start < self.action_timeout
        assert [e["id"] for e in self.on_relay(kind=9) if e["content"] == "after"] == [out["eventId"]]
        # The requests the throttled connection swallowed converge on retry (same bytes, new connection).
        for i in range(3):
            r = await self.send("message.post", {"channelId": self.channel, "content": f"t{i}"}, f"throttled-{i}")
            assert r["status"] == "succeeded", r
            assert len([e for e in self.on_relay(kind=9) if e["content"] == f"t{i}"]) == 1


class AgentScope(FaultCase):
    """Defect 5: agents.update/delete stay inside the credential's channels; no agent is orphaned."""

    async def test_update_and_delete_need_the_agents_channel(self) -> None:
        agent = await self.create()  # created in self.channel
        other = new_channel()
        # The same owner, a credential for another channel only.
        narrow = self.broker.issue(self.alice["agentPubkey"], "--channel", other)
        self.cred = narrow["credential"]
        r = await self.send("agents.update", {"target": {"pubkey": agent}, "systemPrompt": "hijack"}, "narrow-update")
        assert r["status"] == "failed" and r["error"]["code"] == "unauthorized", r
        r = await self.send("agents.delete", {"target": {"name": "helper"}}, "narrow-delete")
        assert r["status"] == "failed" and r["error"]["code"] == "unauthorized", r
        held = self.host_agent(agent)
        assert not held.deleted and held.settings["systemPrompt"] == "Be helpful."
        assert "hijack" not in self.record(agent)["content"]
        # A credential that includes the agent's channel may.
        both = self.broker.issue(self.alice["agentPubkey"], "--channel", other, "--channel", self.channel)
        self.cred = both["credential"]
        ok(await self.send("agents.update", {"target": {"pubkey": agent}, "systemPrompt": "fine"}, "wide-update"))

    async def test_an_agent_with_live_children_is_not_deleted(self) -> None:
        parent = await self.create("parent")
        cred = self.broker.issue(parent, "--channel", self.channel)
        self.cred = cred["credential"]
        child = await self.create("child")
        self.cred = self.alice["credential"]
        r = await self.send("agents.delete", {"target": {"pubkey": parent}}, "delete-parent")
        assert r["status"] == "failed" and r["error"]["code"] == "action_failed", r
        assert not self.host_agent(parent).deleted
        assert not [e for e in self.on_relay(kind=nostr.KIND_DELETION) if e["pubkey"] == self.alice["agentPubkey"]]
        # Children first, then the parent: everything stays manageable through the protocol.
        self.cred = cred["credential"]
        ok(await self.send("agents.delete", {"target": {"pubkey": child}}, "delete-child"))
        self.cred = self.alice["credential"]
        ok(await self.send("agents.delete", {"target": {"pubkey": parent}}, "delete-parent-2"))
        assert self.host_agent(parent).deleted and self.host_agent(child).deleted


class StateFiles(FaultCase):
    """Defect 8: the state files are private from the first start, and a destroyed key leaves no trace."""

    async def test_database_wal_and_shm_are_0600_on_first_start(self) -> None:
        ok(await self.send("message.post", {"channelId": self.channel, "content": "x"}, "mode-post"))
        db = os.path.join(self.broker.state_dir, "broker.sqlite3")
        for name in (db, db + "-wal", db + "-shm"):
            assert os.stat(name).st_mode & 0o777 == 0o600, (name, oct(os.stat(name).st_mode))

    async def test_deleted_agents_key_is_gone_from_database_and_wal(self) -> None:
        agent = await self.create()
        sealed = self.host_agent(agent).sealed_key
        assert sealed is not None
        ok(await self.send("agents.delete", {"target": {"pubkey": agent}}, "delete-scrub"))
        db = os.path.join(self.broker.state_dir, "broker.sqlite3")
        for name in (db, db + "-wal"):
            with open(name, "rb") as f:
                data = f.read()
            assert sealed not in data and sealed.hex().encode() not in data, name


class SystemdListener(unittest.TestCase):
    """Defect 8: a systemd: listener is judged by the inherited socket's own address."""

    def _check(self, host: str) -> None:
        import socket

        from relayd.buzz.service import check_listeners

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.addCleanup(sock.close)
        sock.bind((host, 0))
        sock.listen(1)
        # What systemd would have passed: Twisted reads LISTEN_FDS once, at import, so the
        # inherited-descriptor list is given the real socket's descriptor directly.
        from twisted.internet.endpoints import _SystemdParser
        from twisted.python.systemd import ListenFDs

        self.patch(_SystemdParser, "_sddaemon", ListenFDs([sock.fileno()], ["broker"]))
        check_listeners(["systemd:domain=INET:index=0"])
        check_listeners(["systemd:domain=INET:name=broker"])

    def test_inherited_socket_on_all_interfaces_is_refused(self) -> None:
        from relayd.base.config import ConfigError

        with self.assertRaises(ConfigError):
            self._check("0.0.0.0")

    def test_inherited_socket_on_loopback_is_accepted(self) -> None:
        self._check("127.0.0.1")


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


class ReceiptRetention(FaultCase):
    """Defect 4: read pages never reach the disk; receipts expire after the retention."""

    async def test_reads_of_large_messages_do_not_grow_the_state_directory(self) -> None:
        marker = "M" * 60_000
        for i in range(5):
            ok(await self.send("message.post", {"channelId": self.channel, "content": f"{i}{marker}"}, f"big-{i}"))
        before = dir_bytes(self.broker.state_dir)
        for i in range(30):
            page = ok(await self.send("channel.read", {"channelId": self.channel, "limit": 5}, f"read-{i}"))
            assert len(page["messages"]) == 5
        grown = dir_bytes(self.broker.state_dir) - before
        # 30 pages of 300 KB each (9 MB) stored nothing of the pages: what grew is WAL frames of
        # 30 small rows (a few 4 KiB pages per commit).
        assert grown < 1024 * 1024, grown
        # What a receipt holds for a read: the digest, not the page.
        r = self.receipt("read-0")
        assert r.state == "spent" and r.response is None
        # The same bytes read again (a read changes nothing); other bytes still conflict.
        again = await self.send("channel.read", {"channelId": self.channel, "limit": 5}, "read-0")
        assert again["status"] == "succeeded" and len(again["outcome"]["messages"]) == 5
        other = await self.send("channel.read", {"channelId": self.channel, "limit": 4}, "read-0")
        assert other["status"] == "failed" and other["error"]["code"] == "request_id_conflict", other

    async def test_receipts_expire_after_the_retention(self) -> None:
        ok(await self.send("message.post", {"channelId": self.channel, "content": "kept"}, "ret-post"))
        assert self.receipt("ret-post") is not None
        state = self.broker.service.state  # type: ignore[union-attr]
        now = int(time.time())
        created = state.db.conn.execute("SELECT created_at FROM receipts WHERE request_id = 'ret-post'").fetchone()[0]
        retention = 3600
        # Receipts from the set-up may be a second older on a loaded machine: those go, this one stays.
        (older,) = state.db.conn.execute("SELECT count(*) FROM receipts WHERE created_at < ?", (created,)).fetchone()
        assert await state.prune(created + retention, retention) == older  # exactly the retention old: kept
        assert self.receipt("ret-post") is not None
        assert await state.prune(created + retention + 1, retention) >= 1  # one second over: gone
        assert self.receipt("ret-post") is None
        assert now - created < 60


# --- the matrix: every publishing operation x every fault x every event of its plan ---------------

FAULTS = ("refuse", "drop_ok", "close_before", "close_after", "throttle")
# operation -> how many events its plan publishes
PLANS = {
    "message.post": 1,
    "message.reply": 1,
    "reaction.add": 1,
    "profile.set": 1,
    "agents.create": 2,
    "agents.update": 2,  # a rename: the agent's kind 0, then the owner's record
    "agents.delete": 1,
}


def nth(n: int) -> Callable[[dict[str, Any]], bool]:
    """A matcher for the C{n}-th EVENT (0-based) the proxy sees after the rule is installed."""
    count = [0]

    def match(ev: dict[str, Any]) -> bool:
        count[0] += 1
        return count[0] == n + 1

    return match


class FaultMatrix(FaultCase):
    """Acceptance 1: for each operation and fault point, the verdict agrees with the relay, a retry
    of the same bytes converges, and the host is never older than the relay."""

    action_timeout = 2.0

    async def _prepare(self, action: str) -> dict[str, Any]:
        ch = self.channel
        if action == "message.post":
            return {"channelId": ch, "content": "matrix post"}
        if action in ("message.reply", "reaction.add"):
            target = ok(await self.send("message.post", {"channelId": ch, "content": "target"}, f"prep-{action}"))["eventId"]
            if action == "message.reply":
                return {"channelId": ch, "replyToEventId": target, "content": "matrix reply"}
            return {"channelId": ch, "targetEventId": target, "reaction": "+"}
        if action == "profile.set":
            return {"displayName": "Matrix", "about": "faults"}
        if action == "agents.create":
            return self.create_args("matrix")
        self.agent = await self.create("matrix")
        if action == "agents.update":
            return {"target": {"pubkey": self.agent}, "displayName": "matrix2", "systemPrompt": "changed"}
        return {"target": {"pubkey": self.agent}}

    def _held(self, ids: list[str]) -> set[str]:
        on = {e["id"] for e in self.on_relay()}
        return {i for i in ids if i in on}

    def _host_not_older(self, action: str, outcome: dict[str, Any] | None) -> None:
        if not action.startswith("agents."):
            return
        agent = getattr(self, "agent", None) or (outcome or {}).get("agentPubkey")
        if agent is None:
            return
        owner = self.alice["agentPubkey"]
        records = [e for e in self.on_relay(kind=nostr.KIND_MANAGED_AGENT, pubkey=owner) if ["d", agent] in e["tags"]]
        held = self.host_agent(agent)
        if records:
            newest = max(records, key=lambda e: e["created_at"])
            assert held is not None, "the relay holds a record of an agent the host does not know"
            if not held.deleted:
                assert held.record_created_at >= newest["created_at"]
                if held.record_created_at == newest["created_at"]:
                    assert json.loads(newest["content"])["name"] == held.name
        deletions = [e for e in self.on_relay(kind=nostr.KIND_DELETION, pubkey=owner) if any(agent in t[1] for t in e["tags"] if t[0] == "a")]
        if deletions:
            assert held is not None and held.deleted, "the relay holds a deletion the host has not applied"

    async def _case(self, action: str, fault: str, index: int) -> None:
        args = await self._prepare(action)
        rid = f"matrix-{action}-{fault}-{index}"
        seen_from = len(self.proxy.script.seen)
        self.proxy.on(fault, nth(index))
        first = await self.send(action, args, rid)
        ids = [e["id"] for e in self.proxy.script.seen[seen_from:]]
        held = self._held(ids)
        if first["status"] == "succeeded":
            assert held == set(ids), (first, ids, held)
        elif first["status"] == "failed":
            assert not held, ("failed, yet the relay holds", first, held)
        if first["status"] == "indeterminate":
            # Outcome unknown: the host keeps the plan (what may be on the relay), for the retry.
            assert self.receipt(rid).state == "pending"
        else:
            self._host_not_older(action, first.get("outcome"))
        self.proxy.clear()
        if first["status"] == "failed":
            again = await self.send(action, args, rid)
            assert again.pop("replayed", None) is True and again == first
            return
        verdict = first
        for _ in range(4):  # a throttled connection is replaced after 3 failures in a row
            if verdict["status"] != "indeterminate":
                break
            verdict = await self.send(action, args, rid)
        assert verdict["status"] == "succeeded", (first, verdict)
        ids = [e["id"] for e in self.proxy.script.seen[seen_from:]]
        assert self._held(ids) == set(ids), "a settled success the relay does not fully hold"
        self._host_not_older(action, verdict["outcome"])
        final = await self.send(action, args, rid)
        assert final.pop("replayed") is True and final == {k: v for k, v in verdict.items() if k != "replayed"}


def _matrix_test(action: str, fault: str, index: int) -> Callable[[FaultMatrix], Any]:
    async def test(self: FaultMatrix) -> None:
        await self._case(action, fault, index)

    test.__name__ = f"test_{action.replace('.', '_')}_{fault}_at_event_{index + 1}"
    return test


for _action, _events in PLANS.items():
    for _fault in FAULTS:
        for _index in range(_events):
            _t = _matrix_test(_action, _fault, _index)
            setattr(FaultMatrix, _t.__name__, _t)


class CredentialExpiry(FaultCase):
    """`relayd-admin broker issue --expires`: checked on every request, shown by `list`."""

    async def test_expired_credential_is_unauthenticated_from_that_second(self) -> None:
        import io

        from relayd.cli import broker as admin

        clock = [time.time()]
        self.broker.service.ops.now = lambda: clock[0]  # type: ignore[union-attr]
        short = self.broker.issue(self.alice["agentPubkey"], "--channel", self.channel, "--expires", "60s")
        expires = int(short["expiresAt"])
        self.cred = short["credential"]
        clock[0] = expires - 1  # one second before: served
        ok(await self.send("message.post", {"channelId": self.channel, "content": "in time"}, "exp-1"))
        clock[0] = expires  # exactly the expiry: refused, even the replay of a recorded verdict
        for rid in ("exp-1", "exp-2"):
            r = await self.send("message.post", {"channelId": self.channel, "content": "in time"}, rid)
            assert r["status"] == "failed" and r["error"]["code"] == "unauthenticated", r
        out = io.StringIO()
        assert admin.main(["list", "--state-dir", self.broker.state_dir], stdout=out, stderr=io.StringIO()) == 0
        rows = [json.loads(line) for line in out.getvalue().splitlines()]
        mine = [row for row in rows if row["expiresAt"] == expires]
        assert len(mine) == 1 and mine[0]["agentPubkey"] == self.alice["agentPubkey"]
        assert all(row["expiresAt"] is None for row in rows if row is not mine[0])

    def test_expires_must_be_a_future_time(self) -> None:
        import io

        from relayd.cli import broker as admin

        for bad in ("0s", "yesterday", "2020-01-01T00:00:00Z", "2099-01-01T00:00:00", "-5d"):
            err = io.StringIO()
            argv = ["issue", "--state-dir", self.broker.state_dir, "--kek-file", self.broker.kek_file,
                    "--agent", "x", "--channel", self.channel, "--expires", bad]
            assert admin.main(argv, stdout=io.StringIO(), stderr=err) == 2, bad
            assert "--expires" in err.getvalue()
        assert admin.parse_expires("2099-01-01T00:00:00Z", time.time()) == 4070908800
        assert admin.parse_expires("7d", 1000.0) == 1000 + 7 * 86400


class OwnerAttestation(unittest.TestCase):
    """NIP-OA: an agent relayd creates is admitted by a members-only relay through its owner's attestation."""

    timeout = 120

    async def setUp(self) -> None:
        self.relay = start_nostr_relay(self, REQUIRE_MEMBERSHIP)  # its own: the test writes its members
        tmp = tempfile.mkdtemp(prefix="relayd-oa-")
        self.broker = BrokerUnderTest(os.path.join(tmp, "state"), self.relay.url)
        await self.broker.start()
        self.channel = new_channel()
        self.owner = self.broker.issue("owner", "--channel", self.channel)
        with open(self.relay.members_file, "w") as f:
            f.write(self.owner["agentPubkey"] + "\n")

    async def tearDown(self) -> None:
        await self.broker.stop()

    async def test_created_agent_authenticates_through_its_owner(self) -> None:
        owner = self.owner["agentPubkey"]
        out = ok(await self.broker.call(self.owner["credential"], "agents.create", {
            "channelId": self.channel, "displayName": "attested", "systemPrompt": "x"}))
        agent = out["agentPubkey"]
        # The relay admitted the new identity: its kind 0 is stored, signed by it.
        assert [e for e in self.relay.events(kind=0) if e["pubkey"] == agent]
        db = StateDB.in_dir(self.broker.state_dir)
        try:
            held = db.agent(agent)
        finally:
            db.close()
        tag = list(held.attestation)
        assert tag[:3] == ["auth", owner, ""] and nostr.verify_attestation(tag, agent)
        # Checked independently of relayd's code: BIP-340 over SHA-256("nostr:agent-auth:<agent>:").
        import hashlib

        from coincurve import PublicKeyXOnly

        digest = hashlib.sha256(f"nostr:agent-auth:{agent}:".encode()).digest()
        assert PublicKeyXOnly(bytes.fromhex(owner)).verify(bytes.fromhex(tag[3]), digest)
        # It acts as itself in the members-only relay through a credential of its own.
        cred = self.broker.issue(agent, "--channel", self.channel)
        post = ok(await self.broker.call(cred["credential"], "message.post", {"channelId": self.channel, "content": "attested hello"}))
        assert [e["id"] for e in self.relay.events(kind=9) if e["pubkey"] == agent] == [post["eventId"]]
        # A tampered attestation does not verify; nor does one for another key or self-attestation.
        assert not nostr.verify_attestation([*tag[:3], "00" * 64], agent)
        assert not nostr.verify_attestation(tag, owner)
        with self.assertRaises(ValueError):
            nostr.owner_attestation(nostr.Signer(b"\x01" * 32), nostr.Signer(b"\x01" * 32).pubkey)

    async def test_the_relay_refuses_an_identity_nobody_attests(self) -> None:
        stranger = self.broker.issue("stranger", "--channel", self.channel)
        r = await self.broker.call(stranger["credential"], "message.post", {"channelId": self.channel, "content": "let me in"})
        # This relay refuses (or drops the connection of) an identity it does not admit.
        assert r["status"] in ("failed", "indeterminate"), r
        assert not [e for e in self.relay.events() if e["pubkey"] == stranger["agentPubkey"]]


class WalBound(unittest.TestCase):
    """Defect 4: the WAL does not grow without end; a checkpoint over the limit truncates it."""

    def test_checkpoint_truncates_a_wal_over_the_limit(self) -> None:
        from relayd.buzz.core.state import sqlite

        d = tempfile.mkdtemp(prefix="relayd-wal-")
        db = StateDB.in_dir(d)
        self.addCleanup(db.close)
        db.conn.execute("PRAGMA wal_autocheckpoint=0")
        wal = db.path + "-wal"
        self.patch(sqlite, "WAL_LIMIT", 256 * 1024)
        for i in range(200):  # ~800 KB of plans: over the limit
            db.store_plan("p" * 64, f"r{i}", b"d" * 32, b"x" * 4000)
        assert os.path.getsize(wal) > sqlite.WAL_LIMIT
        db.checkpoint()
        assert os.path.getsize(wal) <= sqlite.WAL_LIMIT
        # Under the limit, a checkpoint leaves the WAL to be reused, not truncated.
        db.store_plan("p" * 64, "small", b"d" * 32, b"x")
        size = os.path.getsize(wal)
        db.checkpoint()
        assert os.path.getsize(wal) == size
