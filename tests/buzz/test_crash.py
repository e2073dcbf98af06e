"""Crash safety (acceptance 5): kill -9 mid-action, and a relay that goes away and comes back."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from twisted.internet import defer, protocol, reactor
from twisted.trial import unittest
from twisted.web.client import ResponseNeverReceived

from relayd.buzz.core import contract
from tests.buzz.harness import BrokerUnderTest, independent_verify, issue, new_channel
from tests.support.nostr import REPO, NostrRelay, start_nostr_relay


class _BrokerProcess(protocol.ProcessProtocol):
    def __init__(self) -> None:
        self.port: defer.Deferred[int] = defer.Deferred()
        self.ended: defer.Deferred[int] = defer.Deferred()
        self.buf = b""

    def outReceived(self, data: bytes) -> None:
        self.buf += data
        if not self.port.called and b"\n" in self.buf:
            for line in self.buf.splitlines():
                if line.startswith(b"PORT "):
                    self.port.callback(int(line[5:]))
                    break

    def processEnded(self, reason: object) -> None:
        code = getattr(getattr(reason, "value", None), "signal", None) or getattr(getattr(reason, "value", None), "exitCode", 0)
        if not self.port.called:
            self.port.errback(RuntimeError(f"broker exited early: {self.buf!r}"))
        self.ended.callback(code)


def spawn(state_dir: str, relay_url: str, crash_at: str = "") -> _BrokerProcess:
    proto = _BrokerProcess()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    args = [sys.executable, "-m", "tests.buzz.harness", state_dir, relay_url] + ([crash_at] if crash_at else [])
    reactor.spawnProcess(proto, sys.executable, args, env=env, childFDs={0: "w", 1: "r", 2: 2})
    return proto


class CrashTests(unittest.TestCase):
    timeout = 120

    def setUp(self) -> None:
        self.relay: NostrRelay = start_nostr_relay(self)  # its own: a test stops and restarts it
        self.tmp = tempfile.mkdtemp(prefix="relayd-crash-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)
        self.state = os.path.join(self.tmp, "state")
        os.makedirs(self.state)
        with open(os.path.join(self.state, "test.kek"), "w") as f:
            f.write(os.urandom(32).hex())
        self.channel = new_channel()
        self.alice = issue(self.state, "--agent", "alice", "--channel", self.channel, kek_file=os.path.join(self.state, "test.kek"))

    async def _kill9_then_retry(self, crash_at: str) -> None:
        content = f"crash test {crash_at}"
        b = contract.freeze(contract.build_request("message.post", {"channelId": self.channel, "content": content}, f"req-{crash_at}"))
        helper = BrokerUnderTest(self.state, self.relay.url)  # reused for its HTTP client
        doomed = spawn(self.state, self.relay.url, crash_at)
        helper.port = await doomed.port
        with self.assertRaises(ResponseNeverReceived):  # the connection dies with the process: no verdict
            await helper.post(b, self.alice["credential"])
        assert await doomed.ended == 9
        survivor = spawn(self.state, self.relay.url)
        helper.port = await survivor.port
        try:
            status, data = await helper.post(b, self.alice["credential"])
            resp = contract.read_http_response(contract.parse_request(b), status, data)
            assert resp.status == "succeeded" and not resp.replayed, data
            stored = [e for e in self.relay.events(pubkey=self.alice["agentPubkey"]) if e["content"] == content]
            assert len(stored) == 1 and stored[0]["id"] == resp.outcome["eventId"]  # type: ignore[index]
            assert independent_verify(stored[0])
            # and now it is a recorded verdict
            _, again = await helper.post(b, self.alice["credential"])
            assert json.loads(again)["replayed"] is True
        finally:
            survivor.transport.signalProcess("TERM")
            await survivor.ended

    async def _read_once_the_relay_is_up(self, broker: BrokerUnderTest) -> None:
        """The relay may still be booting (alembic, uvicorn) on a loaded machine: a read answered
        "relay unavailable" promises nothing happened, so read again until the connection is up."""
        for _ in range(20):
            first = await broker.call(self.alice["credential"], "channel.read", {"channelId": self.channel})
            if first["status"] == "succeeded":
                return
            assert first["error"]["code"] == "internal", first
        raise AssertionError(f"the relay never answered a read: {first}")

    async def test_kill9_after_relay_stored_event_before_ok_handled(self) -> None:
        await self._kill9_then_retry("on_ok")

    async def test_kill9_after_event_stored_before_send(self) -> None:
        await self._kill9_then_retry("after_store")

    async def test_relay_known_down_is_failed_at_once_then_a_new_request_succeeds_once(self) -> None:
        """Once the health watcher has seen the relay go (/healthz degraded), an action is answered at
        once, failed/internal "relay unavailable" (nothing signed or sent; recorded, so the same bytes
        replay it); a new request after the relay is back is done once."""
        broker = BrokerUnderTest(self.state, self.relay.url, timeout=5.0)
        await broker.start()
        try:
            cred = self.alice["credential"]
            await self._read_once_the_relay_is_up(broker)
            assert broker.service is not None
            upstream = broker.service.upstream
            gone = upstream.next_outcome()
            self.relay.stop()
            assert await gone is False  # the watcher saw the relay go
            b = contract.freeze(contract.build_request("message.post", {"channelId": self.channel, "content": "while down"}, "req-down"))
            started = time.monotonic()
            _, data = await broker.post(b, cred)
            assert time.monotonic() - started < 5.0  # not the action's timeout
            resp = contract.parse_response(data, contract.parse_request(b))
            assert (resp.status, resp.code) == ("failed", "internal"), data
            assert json.loads(data)["error"]["message"].startswith("relay unavailable: the upstream relay has been unreachable"), data
            _, again = await broker.post(b, cred)
            assert json.loads(again)["replayed"] is True and json.loads(again)["status"] == "failed"
            back = upstream.next_outcome()
            self.relay.start()
            while not await back:  # the watcher looks again (an action asks it to, at most once a second)
                back = upstream.next_outcome()
            after = await broker.call(cred, "message.post", {"channelId": self.channel, "content": "after"})
            assert after["status"] == "succeeded", after
            assert [e["content"] for e in self.relay.events(pubkey=self.alice["agentPubkey"])].count("after") == 1
            assert not [e for e in self.relay.events() if e["content"] == "while down"]
        finally:
            await broker.stop()

    async def test_relay_down_is_indeterminate_then_retry_succeeds_once(self) -> None:
        """An action that reaches the relay before the health watcher has seen it go (a race this
        test cannot win on purpose: the watcher is told nothing) is indeterminate, and the same bytes
        finish it once the relay is back."""
        broker = BrokerUnderTest(self.state, self.relay.url, timeout=1.5)
        await broker.start()
        assert broker.service is not None
        broker.service.host.relay_outage = lambda: None
        try:
            cred = self.alice["credential"]
            await self._read_once_the_relay_is_up(broker)
            self.relay.stop()
            b = contract.freeze(contract.build_request("message.post", {"channelId": self.channel, "content": "while down"}, "req-down"))
            started = time.monotonic()
            _, data = await broker.post(b, cred)
            elapsed = time.monotonic() - started
            resp = contract.parse_response(data, contract.parse_request(b))
            assert resp.status == "indeterminate" and resp.code == "outcome_unknown", data
            assert elapsed < 1.5 + 1.0
            self.relay.start()
            # The relay needs a moment to boot (its socket already queues us): a caller reconciles an
            # indeterminate verdict by retrying the identical bytes, which is what this loop does.
            for _ in range(20):
                _, data = await broker.post(b, cred)
                resp = contract.parse_response(data, contract.parse_request(b))
                if resp.status != "indeterminate":
                    break
            assert resp.status == "succeeded", data
            stored = [e for e in self.relay.events(pubkey=self.alice["agentPubkey"]) if e["content"] == "while down"]
            assert len(stored) == 1
            # a retry after success replays, and the relay still holds one event
            _, data = await broker.post(b, cred)
            assert json.loads(data)["replayed"] is True
            assert len([e for e in self.relay.events() if e["content"] == "while down"]) == 1
        finally:
            await broker.stop()
