"""Host behaviour through POST /v1/action: paging, idempotency, authentication and authorization."""

from __future__ import annotations

import io
import itertools
import json
import os
import socket
import tempfile
import time
import uuid

from twisted.internet import defer, threads
from twisted.trial import unittest

from relayd.buzz.core import contract
from tests.buzz.harness import BrokerUnderTest, new_channel, ok
from tests.support.nostr import shared_nostr_relay


def body(action: str, args: dict, rid: str | None = None) -> bytes:
    return contract.freeze(contract.build_request(action, args, rid or f"r-{uuid.uuid4()}"))


def _headers_only(port: int, head: bytes, wait: float = 10.0) -> bytes:
    """Send C{head} (a request's headers, no body) and read until the server closes or C{wait} passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(head)
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except TimeoutError:
            pass
        return received


class HostTests(unittest.TestCase):
    timeout = 240

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        self.tmp = tempfile.mkdtemp(prefix="relayd-broker-")
        self.state = os.path.join(self.tmp, "state")
        await self._start()
        self.channel = new_channel()
        self.alice = self.broker.issue(f"alice-{self.channel[:8]}", "--channel", self.channel)
        self.cred = self.alice["credential"]

    async def _start(self, **kw: object) -> None:
        self.broker = BrokerUnderTest(self.state, self.relay.url, **kw)  # type: ignore[attr-defined]
        await self.broker.start()

    async def tearDown(self) -> None:
        await self.broker.stop()

    def relay_count(self, **f: object) -> int:
        return len(self.relay.events(**f))  # type: ignore[attr-defined]

    # --- paging

    async def test_page_through_250_messages_sharing_one_second(self) -> None:
        await self.broker.stop()
        fixed = int(time.time()) - 5
        posted: list[str] = []
        await self._start(now=lambda: fixed + (0 if len(posted) < 180 else 1))
        for i in range(250):
            out = ok(await self.broker.call(self.cred, "message.post", {"channelId": self.channel, "content": f"m{i}"}))
            posted.append(out["eventId"])
        seen: list[str] = []
        pages = 0
        cursor = None
        while True:
            args: dict = {"channelId": self.channel, "limit": 100}
            if cursor:
                args["cursor"] = cursor
            page = ok(await self.broker.call(self.cred, "channel.read", args))
            pages += 1
            assert len(page["messages"]) <= 100
            keys = [(-m["created_at"], m["id"]) for m in page["messages"]]
            assert keys == sorted(keys)
            seen += [m["id"] for m in page["messages"]]
            cursor = page.get("nextCursor")
            if cursor is None:
                break
        assert pages == 3
        assert len(seen) == len(set(seen)) == 250
        assert set(seen) == set(posted)
        # default page is 100
        first = ok(await self.broker.call(self.cred, "channel.read", {"channelId": self.channel}))
        assert len(first["messages"]) == 100 and "nextCursor" in first

    async def test_cursor_is_bound_to_principal_channel_and_filter(self) -> None:
        for i in range(3):
            ok(await self.broker.call(self.cred, "message.post", {"channelId": self.channel, "content": f"m{i}"}))
        page = ok(await self.broker.call(self.cred, "channel.read", {"channelId": self.channel, "limit": 1}))
        cur = page["nextCursor"]
        bob = self.broker.issue(f"bob-{self.channel[:8]}", "--channel", self.channel)
        for cred, args in (
            (bob["credential"], {"channelId": self.channel, "cursor": cur}),
            (self.cred, {"channelId": self.channel, "cursor": cur, "mentionsOnly": True}),
            (self.cred, {"channelId": self.channel, "cursor": cur[:-2] + ("AA" if not cur.endswith("AA") else "BB")}),
            (self.cred, {"channelId": self.channel, "cursor": "c1.forged.cursor"}),
        ):
            r = await self.broker.call(cred, "channel.read", args)
            assert r["status"] == "failed" and r["error"]["code"] == "invalid_request", r
        again = ok(await self.broker.call(self.cred, "channel.read", {"channelId": self.channel, "cursor": cur, "limit": 1}))
        assert again["messages"][0]["id"] != page["messages"][0]["id"]

    # --- idempotency (items 39, 40 and acceptance 4)

    async def test_replay_and_conflict(self) -> None:
        rid = "req-replay-1"
        b = body("message.post", {"channelId": self.channel, "content": "once"}, rid)
        s1, d1 = await self.broker.post(b, self.cred)
        before = self.relay_count(pubkey=self.alice["agentPubkey"])
        s2, d2 = await self.broker.post(b, self.cred)
        assert s1 == s2 == 200
        first, second = json.loads(d1), json.loads(d2)
        assert first["status"] == "succeeded" and "replayed" not in first
        assert second.pop("replayed") is True and second == first
        assert d2 == d1[:-1] + b',"replayed":true}'
        assert self.relay_count(pubkey=self.alice["agentPubkey"]) == before
        other = body("message.post", {"channelId": self.channel, "content": "different"}, rid)
        s3, d3 = await self.broker.post(other, self.cred)
        conflict = json.loads(d3)
        assert s3 == 200 and conflict["status"] == "failed" and conflict["error"]["code"] == "request_id_conflict"
        # same requestId under another principal is an independent request
        bob = self.broker.issue(f"bob-{self.channel[:8]}", "--channel", self.channel)
        _, d4 = await self.broker.post(other, bob["credential"])
        assert json.loads(d4)["status"] == "succeeded" and "replayed" not in json.loads(d4)

    async def test_verdict_frozen_even_if_authority_changes(self) -> None:
        rid = "req-frozen"
        b = body("channel.read", {"channelId": self.channel}, rid)
        _, d1 = await self.broker.post(b, self.cred)
        # a second credential for the same agent with no read permission replays the recorded verdict
        narrow = self.broker.issue(self.alice["agentPubkey"], "--actions", "message.post", "--channel", self.channel)
        _, d2 = await self.broker.post(b, narrow["credential"])
        assert json.loads(d2)["replayed"] is True and json.loads(d2)["status"] == "succeeded"
        assert json.loads(d1)["status"] == "succeeded"

    async def test_ten_concurrent_identical_requests_execute_once(self) -> None:
        b = body("message.post", {"channelId": self.channel, "content": "concurrent"}, "req-concurrent")
        before = self.relay_count(pubkey=self.alice["agentPubkey"])
        results = await defer.gatherResults([defer.ensureDeferred(self.broker.post(b, self.cred)) for _ in range(10)])
        assert all(s == 200 for s, _ in results)
        parsed = [json.loads(d) for _, d in results]
        assert sum(1 for p in parsed if "replayed" not in p) == 1
        assert sum(1 for p in parsed if p.get("replayed") is True) == 9
        assert len({p["outcome"]["eventId"] for p in parsed}) == 1
        assert self.relay_count(pubkey=self.alice["agentPubkey"]) == before + 1

    async def test_receipt_survives_restart(self) -> None:
        b = body("message.post", {"channelId": self.channel, "content": "durable"}, "req-durable")
        _, d1 = await self.broker.post(b, self.cred)
        await self.broker.stop()
        await self._start()
        _, d2 = await self.broker.post(b, self.cred)
        assert d2 == d1[:-1] + b',"replayed":true}'

    # --- authentication and errors before dispatch (items 38, decisions 1-2)

    async def test_unknown_or_malformed_credential_is_a_verdict(self) -> None:
        b = body("message.post", {"channelId": self.channel, "content": "x"}, "req-unauth")
        for headers in (
            {b"authorization": [b"Bearer bzh_unknown"]},
            {b"authorization": [b"bearer " + self.cred.encode()]},
            {b"authorization": [b"Bearer  " + self.cred.encode()]},
            {b"authorization": [b"Bearer " + self.cred.encode(), b"Bearer " + self.cred.encode()]},
            {},
        ):
            status, data = await self.broker.post(b, None, headers)
            resp = contract.parse_response(data, contract.parse_request(b))
            assert status == 200 and resp.status == "failed" and resp.code == "unauthenticated", headers

    async def test_uncorrelatable_bodies_answer_400(self) -> None:
        for raw in (b"not json", b"[]", b'{"requestId":"has space"}', b'{"requestId":"a","requestId":"a"}', b"\xff\xfe"):
            status, data = await self.broker.post(raw, self.cred)
            assert status == 400 and json.loads(data)["error"] == "invalid_request", raw

    async def test_validation_codes_are_correlated_verdicts(self) -> None:
        base = json.loads(body("message.post", {"channelId": self.channel, "content": "x"}, "req-v"))
        for i, (mutate, code) in enumerate((
            (lambda t: t.update(protocolVersion=2), "unsupported_protocol_version"),
            (lambda t: t.update(action="sign"), "unknown_action"),
            (lambda t: t.update(actionVersion=2), "unsupported_action_version"),
            (lambda t: t["args"].update(secretKey="x"), "invalid_request"),
            (lambda t: t["args"].update(mentions=None), "invalid_request"),
        )):
            tree = json.loads(json.dumps(base))
            mutate(tree)
            tree["requestId"] = f"req-v{i}"  # each verdict is recorded: one requestId per bytes
            status, data = await self.broker.post(json.dumps(tree).encode(), self.cred)
            resp = contract.parse_response(data)
            assert status == 200 and resp.request_id == f"req-v{i}" and resp.code == code and resp.status == "failed"

    async def test_oversize_body_is_413(self) -> None:
        await self.broker.stop()
        await self._start(max_body=1024)
        status, _ = await self.broker.post(b'{"requestId":"x","pad":"' + b"a" * 4096 + b'"}', self.cred)
        assert status == 413

    # --- authorization (acceptance 6)

    async def test_channel_scope_and_action_set(self) -> None:
        elsewhere = new_channel()
        r = await self.broker.call(self.cred, "message.post", {"channelId": elsewhere, "content": "x"})
        assert r["error"]["code"] == "unauthorized"
        r = await self.broker.call(self.cred, "channel.read", {"channelId": elsewhere})
        assert r["error"]["code"] == "unauthorized"
        reader = self.broker.issue(f"reader-{self.channel[:8]}", "--channel", self.channel, "--actions", "channel.read")
        r = await self.broker.call(reader["credential"], "message.post", {"channelId": self.channel, "content": "x"})
        assert r["error"]["code"] == "unauthorized"
        ok(await self.broker.call(reader["credential"], "channel.read", {"channelId": self.channel}))
        r = await self.broker.call(reader["credential"], "agents.create", {"channelId": self.channel, "displayName": "a", "systemPrompt": "p"})
        assert r["error"]["code"] == "unauthorized"

    async def test_revoked_credential_is_unauthenticated(self) -> None:
        import io

        from relayd.cli import broker as admin

        out = io.StringIO()
        assert admin.main(["revoke", "--state-dir", self.state, "--agent", self.alice["agentPubkey"]], stdout=out) == 0
        r = await self.broker.call(self.cred, "channel.read", {"channelId": self.channel})
        assert r["error"]["code"] == "unauthenticated"

    async def test_a_refused_credential_is_answered_before_a_large_body_is_sent(self) -> None:
        """Issue 22: the headers of a 1 MiB action with no, an unknown or a revoked credential get a
        401 at once, over a real socket, and the body is never sent (nor waited for)."""
        revoked = self.broker.issue(f"gone-{self.channel[:8]}", "--channel", self.channel)
        from relayd.cli import broker as admin

        assert admin.main(["revoke", "--state-dir", self.state, "--agent", revoked["agentPubkey"]], stdout=io.StringIO()) == 0
        refused = (b"", b"Authorization: Bearer bzh_unknown\r\n", b"Authorization: Bearer " + revoked["credential"].encode() + b"\r\n")
        for auth, framing in itertools.product(refused, (b"Content-Length: 1048576", b"Transfer-Encoding: chunked")):
            head = (
                b"POST /v1/action HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                + auth
                + b"Expect: 100-continue\r\n" + framing + b"\r\n\r\n"
            )
            answer = await threads.deferToThread(_headers_only, self.broker.port, head)
            status_line, _, rest = answer.partition(b"\r\n")
            assert status_line == b"HTTP/1.1 401 Unauthorized", (auth, framing, answer)
            head_block, _, payload = rest.partition(b"\r\n\r\n")
            headers = head_block.lower().split(b"\r\n")
            assert b"www-authenticate: bearer" in headers and b"cache-control: no-store" in headers, headers
            assert json.loads(payload)["error"] == "unauthenticated"
        # A valid credential's headers are not refused: the broker waits for the body (no answer yet).
        head = (
            b"POST /v1/action HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + self.cred.encode() + b"\r\nContent-Length: 1048576\r\n\r\n"
        )
        assert await threads.deferToThread(_headers_only, self.broker.port, head, 0.5) == b""

    async def test_reactions_can_be_disabled(self) -> None:
        await self.broker.stop()
        await self._start(reactions_enabled=False)
        r = await self.broker.call(self.cred, "reaction.add", {"channelId": self.channel, "targetEventId": "ab" * 32, "reaction": "+"})
        assert r["status"] == "failed" and r["error"]["code"] == "unsupported"

    # --- metrics (docs/deployment.md lists the broker's series)

    async def test_actions_and_relay_connections_are_counted(self) -> None:
        from relayd.buzz import metrics

        def count(action: str, status: str) -> float:
            value = metrics.REGISTRY.get_sample_value("relayd_broker_actions_total", {"action": action, "status": status})
            return value or 0.0

        before = count("message.post", "succeeded"), count("channel.read", "failed"), count("unknown", "rejected")
        b = body("message.post", {"channelId": self.channel, "content": "counted"})
        await self.broker.post(b, self.cred)
        await self.broker.post(b, self.cred)  # a replay counts too
        await self.broker.call(self.cred, "channel.read", {"channelId": new_channel()})  # unauthorized
        await self.broker.post(b"not json", self.cred)
        after = count("message.post", "succeeded"), count("channel.read", "failed"), count("unknown", "rejected")
        assert [a - b for a, b in zip(after, before, strict=True)] == [2, 1, 1]
        assert metrics.nostr_connections.value(state="ready") >= 1
