"""The nine operations through POST /v1/action against a real relay (PyPI nostr-relay, NIP-42 on)."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from twisted.trial import unittest

from relayd.buzz import contract, nostr
from tests.buzz.harness import BrokerUnderTest, independent_verify, new_channel, ok


@pytest.mark.usefixtures("relay_for_class")
class OperationsTests(unittest.TestCase):
    timeout = 120
    relay: object

    async def setUp(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="relayd-broker-")
        self.broker = BrokerUnderTest(os.path.join(self.tmp, "state"), self.relay.url)  # type: ignore[attr-defined]
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
