"""Issue 6 acceptance 2, broker part: a real ``twistd -n --logger=relayd.logs.json.json_observer relayd``
acting for an agent on a real Nostr relay, through successes and failures. Every line is one JSON
object, and no credential, secret key or key-encryption key appears anywhere in it."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid

import treq
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.buzz.harness import issue, request_wire
from tests.support.nostr import NostrRelay
from tests.support.skips import require_module
from tests.support.twistd import RelaydProcess

KEYS = ["time", "level", "relay", "event", "namespace", "fields"]


class BrokerJSONLogs(TestCase):
    timeout = 90

    def setUp(self) -> None:
        # A Nostr relay of this test's own: the broker publishes to it (skips without nostr-relay, fails under CI).
        require_module("nostr_relay", "needs a real Nostr relay")
        workdir = tempfile.mkdtemp(prefix="relayd-nostr-")
        self.addCleanup(shutil.rmtree, workdir, ignore_errors=True)
        self.relay = NostrRelay(workdir)
        self.relay.start()
        self.addCleanup(self.relay.stop)

    async def test_json_lines_and_no_secrets(self) -> None:
        state = tempfile.mkdtemp(prefix="relayd-broker-logs-")
        kek = os.urandom(32).hex()
        kek_file = os.path.join(state, "kek")
        with open(kek_file, "w") as f:
            f.write(kek)
        secret_key = os.urandom(32).hex()
        key_file = os.path.join(state, "agent.key")
        with open(key_file, "w") as f:
            f.write(secret_key)
        channel = str(uuid.uuid4())
        issued = issue(state, "--agent", "logger", "--channel", channel, "--secret-key-file", key_file,
                       kek_file=kek_file)
        credential = issued["credential"]

        proc = await RelaydProcess.start_for(
            self,
            ["--no-aep", "--no-mcp", "--broker-listen", "tcp:0:interface=127.0.0.1",
             "--broker-nostr-relay", self.relay.url, "--broker-state-dir", state,
             "--broker-kek-file", kek_file],
            wait_for=("broker",),
            twistd_options=["--logger=relayd.logs.json.json_observer"],
        )
        url = f"http://127.0.0.1:{proc.port('broker')}/v1/action"
        pool = HTTPConnectionPool(reactor, persistent=False)

        async def act(body: object, token: str | None) -> tuple[int, dict]:
            headers = {"content-type": "application/json"}
            if token is not None:
                headers["authorization"] = f"Bearer {token}"
            response = await treq.post(url, data=json.dumps(body).encode(), headers=headers, pool=pool)
            return response.code, json.loads(await treq.content(response))

        post = request_wire("message.post", {"channelId": channel, "content": "hello from the log test"},
                            rid=str(uuid.uuid4()))
        code, verdict = await act(post, credential)
        self.assertEqual((code, verdict["status"]), (200, "succeeded"), verdict)
        code, verdict = await act(post, credential)  # a replay
        self.assertTrue(verdict.get("replayed"), verdict)
        code, verdict = await act(request_wire("channel.read", {"channelId": channel}, rid=str(uuid.uuid4())),
                                  credential + "x")  # an unknown credential
        self.assertEqual(verdict["error"]["code"], "unauthenticated")
        code, verdict = await act(
            request_wire("channel.read", {"channelId": str(uuid.uuid4())}, rid=str(uuid.uuid4())), credential
        )  # outside the credential's channel scope
        self.assertEqual(verdict["error"]["code"], "unauthorized")
        code, _ = await act({"not": "a request"}, credential)
        self.assertEqual(code, 400)

        self.assertEqual(await proc.terminate(), 0)
        lines = [line for line in proc.log.decode().splitlines() if line.strip()]
        self.assertGreater(len(lines), 5)
        for line in lines:
            record = json.loads(line)  # every line is one JSON object
            self.assertEqual(list(record)[: len(KEYS)], KEYS, line)
        text = proc.log.decode()
        for secret in (credential, kek, secret_key):
            self.assertNotIn(secret, text)
        self.assertIn('"POST /v1/action"', text.replace('\\"', '"'))  # the access log is there
