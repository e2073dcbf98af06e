"""Security (acceptance 6), service construction (item 41), admin CLI, key custody."""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import tempfile

from twisted.logger import globalLogPublisher
from twisted.trial import unittest

from relayd.base.clock import Timekeeper
from relayd.base.config import ConfigError, resolve
from relayd.buzz import nostr
from relayd.buzz.config import SETTINGS
from relayd.buzz.core import keys
from relayd.buzz.core.state import StateDB
from relayd.buzz.service import make_service
from relayd.cli import broker as admin
from tests.buzz.harness import BrokerUnderTest, new_channel, temp_dir
from tests.support.cases import cases, expand
from tests.support.nostr import NostrRelay, shared_nostr_relay


def settings(**flags: object) -> object:
    return resolve(SETTINGS, {k.replace("_", "-"): v for k, v in flags.items()}, {})


class AdminIssueChannelScope(unittest.TestCase):
    """C{broker issue} names the channels of a credential whose actions act in channels."""

    def setUp(self) -> None:
        self.dir = os.path.join(tempfile.mkdtemp(prefix="relayd-admin-"), "state")
        self.addCleanup(shutil.rmtree, os.path.dirname(self.dir))

    def issue(self, *args: str) -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = admin.main(["issue", "--state-dir", self.dir, "--agent", "scoped", *args], stdout=out, stderr=err)
        return code, out.getvalue(), err.getvalue()

    def listed(self) -> list[dict[str, object]]:
        out = io.StringIO()
        assert admin.main(["list", "--state-dir", self.dir], stdout=out) == 0
        return [json.loads(line) for line in out.getvalue().splitlines()]

    def test_no_channel_with_the_default_actions_is_a_usage_error(self) -> None:
        code, out, err = self.issue()
        self.assertEqual((code, out), (2, ""))
        self.assertEqual(
            err,
            "relayd-admin broker issue: error: --channel is required for agents.create, agents.delete, agents.update, "
            "channel.read, message.post, message.reply, reaction.add (repeat it for each channel); without a "
            "channel, --actions may only name profile.set,storage.address\n",
        )
        self.assertEqual(self.listed(), [])  # nothing issued, no agent minted
        db = StateDB.in_dir(self.dir)
        self.addCleanup(db.close)
        self.assertEqual(db.agents(), [])

    def test_one_channel_action_without_a_channel_is_named(self) -> None:
        code, _, err = self.issue("--actions", "profile.set,channel.read")
        self.assertEqual(code, 2)
        self.assertIn("--channel is required for channel.read (", err)
        self.assertEqual(self.listed(), [])

    def test_one_channel_is_enough_and_channels_repeat(self) -> None:
        one, two = new_channel(), new_channel()
        self.assertEqual(self.issue("--channel", one)[0], 0)
        self.assertEqual(self.issue("--channel", one, "--channel", two.upper())[0], 0)
        self.assertEqual(sorted(row["channels"] for row in self.listed()), sorted([[one], sorted([one, two])]))

    def test_channel_less_actions_need_no_channel(self) -> None:
        code, out, err = self.issue("--actions", "profile.set,storage.address")
        self.assertEqual(code, 0)
        self.assertNotIn(": error:", err)  # (a fresh state directory: only the new-state warning)
        self.assertEqual(set(json.loads(out)), {"credential", "agentPubkey"})
        (row,) = self.listed()
        self.assertEqual(row["channels"], [])


class NoSecretsInLogsOrAnswers(unittest.TestCase):
    timeout = 120
    relay: NostrRelay

    def setUp(self) -> None:
        self.relay = shared_nostr_relay()

    async def test_logs_and_responses_hold_no_secrets(self) -> None:
        seen: list[str] = []

        def observe(event: dict) -> None:
            from twisted.logger import formatEvent

            seen.append(formatEvent(event) + json.dumps({k: repr(v) for k, v in event.items()}))

        globalLogPublisher.addObserver(observe)
        tmp = tempfile.mkdtemp(prefix="relayd-sec-")
        broker = BrokerUnderTest(os.path.join(tmp, "state"), self.relay.url)
        await broker.start()
        answers: list[bytes] = []
        try:
            ch = new_channel()
            a = broker.issue("sec-alice", "--channel", ch)
            cred = a["credential"]
            for action, args in (
                ("message.post", {"channelId": ch, "content": "hello"}),
                ("message.post", {"channelId": new_channel(), "content": "out of scope"}),
                ("agents.create", {"channelId": ch, "displayName": "kid", "systemPrompt": "p"}),
                ("storage.address", {"slug": "core"}),
                ("message.reply", {"channelId": ch, "replyToEventId": "ab" * 32, "content": "x"}),
            ):
                from relayd.buzz.core import contract

                body = contract.freeze(contract.build_request(action, args, f"r-{len(answers)}"))
                answers.append((await broker.post(body, cred))[1])
            answers.append((await broker.post(b'{"requestId":"x"}', "bzh_wrong-" + cred))[1])
            answers.append((await broker.post(b"garbage", cred))[1])
            kek = open(broker.kek_file).read().strip()
            db = StateDB.in_dir(broker.state_dir)
            custody = keys.Custody(bytes.fromhex(kek))
            secrets = [cred, cred[4:], kek]
            for agent in db.agents():
                if agent.sealed_key:
                    s = custody.open(agent.sealed_key, agent.pubkey)
                    secrets += [s.hex(), s.hex().upper()]
            db.close()
            blob = "\n".join(seen) + "\n".join(x.decode("utf-8", "replace") for x in answers)
            assert len(secrets) >= 5
            for s in secrets:
                assert s not in blob
        finally:
            await broker.stop()
            globalLogPublisher.removeObserver(observe)


@expand
class ServiceKeysAndAdmin(unittest.TestCase):
    """Service construction, key custody and the admin CLI."""

    def test_no_relay_url_means_no_service_and_one_log_line(self) -> None:
        seen: list[dict] = []
        globalLogPublisher.addObserver(seen.append)
        try:
            assert make_service(settings(), None, Timekeeper(None)) is None  # type: ignore[arg-type]
        finally:
            globalLogPublisher.removeObserver(seen.append)
        lines = [e for e in seen if "broker" in str(e.get("log_format", "")).lower()]
        assert len(lines) == 1 and "--broker-nostr-relay" in lines[0]["log_format"]

    @cases(
        default_interface="tcp:8789",
        any_ipv4="tcp:8789:interface=0.0.0.0",
        lan_address="tcp:8789:interface=192.168.1.10",
        any_ipv6="tcp6:8789:interface=\\:\\:",
    )
    def test_non_loopback_plain_listener_refused(self, listen: str) -> None:
        tmp_path = temp_dir(self)
        s = settings(broker_nostr_relay="ws://127.0.0.1:1", broker_listen=[listen], broker_state_dir=tmp_path)
        with self.assertRaises(ConfigError) as info:
            make_service(s, None, Timekeeper(None))  # type: ignore[arg-type]
        assert "--broker-listen" in str(info.exception)

    def test_loopback_and_tls_listeners_accepted(self) -> None:
        tmp_path = temp_dir(self)
        from twisted.internet import reactor

        for listen in ("tcp:0:interface=127.0.0.1", "tcp6:0:interface=\\:\\:1", "unix:/tmp/relayd-broker-test.sock"):
            s = settings(broker_nostr_relay="ws://127.0.0.1:1", broker_listen=[listen], broker_state_dir=tmp_path)
            svc = make_service(s, reactor, Timekeeper(reactor))
            assert svc is not None
            svc.state.db.close()  # type: ignore[attr-defined]

    def test_kek_generated_0600_on_first_start_and_reused(self) -> None:
        tmp_path = temp_dir(self)
        d = os.path.join(tmp_path, "st")
        k1 = keys.load_kek(d)
        path = os.path.join(d, keys.KEK_FILE_NAME)
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert keys.load_kek(d) == k1
        with self.assertRaises(keys.KEKError) as info:
            keys.load_kek(d, kek_env="zz")
        assert "RELAYD_BROKER_KEK" in str(info.exception) and "zz" not in str(info.exception)

    def test_sealed_keys_do_not_open_without_the_kek(self) -> None:
        d = temp_dir(self)
        kek_file = os.path.join(d, "kek")
        with open(kek_file, "w") as f:
            f.write(os.urandom(32).hex())
        key_file = os.path.join(d, "agent.key")
        secret = nostr.generate_secret()
        with open(key_file, "w") as f:
            f.write(secret.hex())
        out = io.StringIO()
        assert admin.main(["issue", "--state-dir", d, "--kek-file", kek_file, "--agent", "a", "--secret-key-file", key_file, "--channel", new_channel()], stdout=out) == 0
        issued = json.loads(out.getvalue())
        raw = open(os.path.join(d, "broker.sqlite3"), "rb").read()
        for path in os.listdir(d):
            if path.startswith("broker.sqlite3"):
                raw += open(os.path.join(d, path), "rb").read()
        assert secret not in raw and secret.hex().encode() not in raw
        assert issued["credential"].encode() not in raw
        db = StateDB.in_dir(d)
        agent = db.agent(issued["agentPubkey"])
        db.close()
        assert agent is not None and agent.sealed_key is not None
        with self.assertRaises(keys.SealError):
            keys.Custody(os.urandom(32)).open(agent.sealed_key, agent.pubkey)
        right = keys.Custody(bytes.fromhex(open(kek_file).read()))
        assert right.open(agent.sealed_key, agent.pubkey) == secret
        with self.assertRaises(keys.SealError):  # bound to its identity
            right.open(agent.sealed_key, nostr.Signer(nostr.generate_secret()).pubkey)

    def test_issue_into_a_new_state_says_where_relayd_must_look(self) -> None:
        """Issuing from another directory than relayd's (the default state is relative) used to make a
        new state silently, and a credential relayd never sees: the tool now says so, once."""
        d = os.path.join(temp_dir(self), "relayd-state")
        err = io.StringIO()
        assert admin.main(["issue", "--state-dir", d, "--agent", "a", "--channel", new_channel()], stdout=io.StringIO(), stderr=err) == 0
        assert err.getvalue() == (
            f"relayd-admin broker issue: warning: {os.path.abspath(d)!r} held no broker state: a new one was created "
            f"there; relayd accepts this credential only if it runs with --broker-state-dir {os.path.abspath(d)}\n"
        )
        again = io.StringIO()
        assert admin.main(["issue", "--state-dir", d, "--agent", "b", "--channel", new_channel()], stdout=io.StringIO(), stderr=again) == 0
        assert again.getvalue() == ""

    def test_admin_issue_list_revoke(self) -> None:
        d = temp_dir(self)
        ch = new_channel()
        key_file = os.path.join(d, "nsec.txt")
        import nostr_sdk

        k = nostr_sdk.Keys.generate()
        with open(key_file, "w") as f:
            f.write(k.secret_key().to_bech32())
        out = io.StringIO()
        assert admin.main(["issue", "--state-dir", d, "--agent", "n", "--secret-key-file", key_file, "--channel", ch.upper(), "--actions", "message.post,channel.read"], stdout=out) == 0
        issued = json.loads(out.getvalue())
        assert set(issued) == {"credential", "agentPubkey"}
        assert issued["agentPubkey"] == k.public_key().to_hex()
        assert issued["credential"].startswith("bzh_") and len(issued["credential"]) == 47
        listing = io.StringIO()
        assert admin.main(["list", "--state-dir", d], stdout=listing) == 0
        text = listing.getvalue()
        assert issued["credential"] not in text and k.secret_key().to_hex() not in text
        (row,) = [json.loads(line) for line in text.splitlines()]
        assert row["channels"] == [ch] and row["actions"] == ["channel.read", "message.post"] and not row["revoked"]
        assert admin.main(["revoke", "--state-dir", d, "--id", row["id"]], stdout=io.StringIO()) == 0
        listing = io.StringIO()
        admin.main(["list", "--state-dir", d], stdout=listing)
        assert json.loads(listing.getvalue())["revoked"] is True
        err = io.StringIO()
        assert admin.main(["issue", "--state-dir", d, "--agent", "x", "--actions", "sign"], stdout=io.StringIO(), stderr=err) == 2
        assert admin.main(["issue", "--state-dir", d, "--agent", "x", "--channel", "nope"], stdout=io.StringIO(), stderr=err) == 2
        bad_key = os.path.join(d, "bad.key")
        with open(bad_key, "w") as f:
            f.write("ff" * 32)  # above the group order
        err = io.StringIO()
        assert admin.main(["issue", "--state-dir", d, "--agent", "x", "--secret-key-file", bad_key, "--channel", ch], stdout=io.StringIO(), stderr=err) == 2
        assert err.getvalue().startswith("relayd-admin broker issue: error: --secret-key-file: ")
        assert "ff" * 32 not in err.getvalue()
