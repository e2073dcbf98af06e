"""Broker state shared with `relayd-admin broker` and other instances while relayd runs (issue 22).

A credential issued while relayd runs works on its first request and a revoked one is refused on
its next, on every instance sharing the state directory; no state file is ever deleted under
relayd (its SQLite locks hold: nothing opens and closes a descriptor of the database beside
SQLite's own); SIGKILL of relayd or of the tool leaves a database that opens with every change the
tool reported and every verdict relayd answered.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import sys
import tempfile
import uuid
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.task import deferLater
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from relayd.buzz.core import contract
from relayd.buzz.core.host import credential_hash
from relayd.buzz.core.state import DB_FILE_NAME, SQLiteState, StateDB
from tests.support.command import Command
from tests.support.nostr import shared_nostr_relay
from tests.support.redis import RedisServer
from tests.support.twistd import RelaydProcess


def deleted_files(pid: int, directory: str) -> list[str]:
    """The files under C{directory} that process C{pid} holds open although they are deleted."""
    held = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith(directory + os.sep) and target.endswith(" (deleted)"):
            held.append(target)
    return held


def body(rid: str, channel: str, content: str) -> bytes:
    return contract.freeze(contract.build_request("message.post", {"channelId": channel, "content": content}, rid))


# `relayd-admin broker ARGS` killed with SIGKILL at a point of its write: "before-commit" inside its
# first transaction, "after-report" once it has printed its result, before its connection closes.
# (A fault injected in the tool's own process: a kill at an exact point cannot be caused otherwise.)
_KILLED_ADMIN = """
import os, signal, sys
from relayd.buzz.core import state
from relayd.cli import broker as admin

def die(*_):
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[1] == "before-commit":
    transaction = state.StateDB._tx
    state.StateDB._tx = lambda self, f: transaction(self, lambda c: (f(c), die()))
else:
    state.StateDB.close = die
sys.exit(admin.main(sys.argv[2:]))
"""


class StateDirectory:
    """A state directory with its key-encryption key, and `relayd-admin broker` run on it as an operator does."""

    def __init__(self, case: TestCase) -> None:
        self.root = tempfile.mkdtemp(prefix="relayd-shared-state-")
        case.addCleanup(shutil.rmtree, self.root, ignore_errors=True)
        self.path = os.path.join(self.root, "state")
        os.makedirs(self.path, mode=0o700)
        self.kek = os.path.join(self.root, "kek")
        with open(self.kek, "w") as f:
            f.write(os.urandom(32).hex())

    def argv(self, command: str, *args: str) -> list[str]:
        return [command, "--state-dir", self.path, "--kek-file", self.kek, *args]

    async def admin(self, command: str, *args: str) -> list[dict[str, Any]]:
        tool = Command.admin("broker", *self.argv(command, *args))
        assert await tool.finished() == 0, tool.stderr
        return [json.loads(line) for line in tool.stdout.decode().splitlines()]

    async def killed_admin(self, point: str, command: str, *args: str) -> Command:
        tool = Command.start([sys.executable, "-c", _KILLED_ADMIN, point, *self.argv(command, *args)])
        assert await tool.finished() == -9, (tool.status, tool.stderr)
        return tool

    def broker_options(self, relay_url: str, *extra: str) -> list[str]:
        return [
            "--no-aep", "--no-mcp",
            "--broker-nostr-relay", relay_url,
            "--broker-listen", "tcp:0:interface=127.0.0.1",
            "--broker-state-dir", self.path, "--broker-kek-file", self.kek,
            *extra,
        ]  # fmt: skip


class Client:
    """Actions to a real relayd's broker, read back as JSON."""

    def __init__(self) -> None:
        self.http = HTTPConnectionPool(reactor, persistent=False)

    async def post(self, proc: RelaydProcess, credential: str, data: bytes) -> dict[str, Any]:
        response = await treq.post(
            f"http://127.0.0.1:{proc.port('broker')}/v1/action",
            data=data,
            headers={"authorization": ["Bearer " + credential], "content-type": ["application/json"]},
            pool=self.http,
        )
        assert response.code == 200, response.code
        return json.loads(await treq.content(response))

    async def until_redis(self, proc: RelaydProcess, credential: str, data: bytes) -> dict[str, Any]:
        """Send until the process's Redis client is up: 'store unavailable' promises nothing was done."""
        for _ in range(300):
            verdict = await self.post(proc, credential, data)
            if verdict.get("error", {}).get("code") != "internal":
                return verdict
            await deferLater(reactor, 0.02, lambda: None)  # polling another process's connection
        raise AssertionError(f"broker never reached Redis: {verdict}")


def assert_refused(verdict: dict[str, Any]) -> None:
    assert verdict["status"] == "failed" and verdict["error"]["code"] == "unauthenticated", verdict
    assert "replayed" not in verdict, verdict


class OneProcessTwoConnections(TestCase):
    """The daemon's reactor and worker connections keep their locks while another process comes and goes."""

    timeout = 30

    async def test_another_process_closing_deletes_no_file_and_its_commits_are_seen(self) -> None:
        state = StateDirectory(self)
        sqlite = SQLiteState(StateDB.in_dir(state.path), reactor)
        self.addCleanup(sqlite.close)
        await sqlite.prune(0)  # opens the worker thread's connection, as relayd's first sweep does
        (issued,) = await state.admin("issue", "--agent", "a", "--channel", str(uuid.uuid4()))
        assert deleted_files(os.getpid(), state.path) == []
        cred = await sqlite.credential(credential_hash(issued["credential"]))
        assert cred is not None and not cred.revoked
        (listing,) = await state.admin("list")
        assert await state.admin("revoke", "--id", listing["id"]) == [{"revoked": 1}]
        assert deleted_files(os.getpid(), state.path) == []
        cred = await sqlite.credential(credential_hash(issued["credential"]))
        assert cred is not None and cred.revoked


class AdminWhileRelaydRuns(TestCase):
    """Acceptance 1 on one real `twistd -n relayd`: issue, list and revoke take effect on the next request."""

    timeout = 90

    async def test_issue_list_revoke_take_effect_at_once_and_no_state_file_is_deleted(self) -> None:
        relay = shared_nostr_relay()
        state = StateDirectory(self)
        client = Client()
        proc = await RelaydProcess.start_for(self, state.broker_options(relay.url), wait_for=("broker",))
        pid = proc.transport.pid
        channel = str(uuid.uuid4())
        (issued,) = await state.admin("issue", "--agent", "alice", "--channel", channel)
        first = await client.post(proc, issued["credential"], body("r1", channel, "first"))
        assert first["status"] == "succeeded", first
        (other,) = await state.admin("issue", "--agent", "alice", "--channel", channel)
        listing = await state.admin("list")
        assert deleted_files(pid, state.path) == []
        second = await client.post(proc, other["credential"], body("r2", channel, "second"))
        assert second["status"] == "succeeded", second
        (row,) = [r for r in listing if r["id"] == credential_hash(issued["credential"])[:16]]
        assert await state.admin("revoke", "--id", row["id"]) == [{"revoked": 1}]
        assert_refused(await client.post(proc, issued["credential"], body("r3", channel, "after revoke")))
        assert_refused(await client.post(proc, issued["credential"], body("r1", channel, "first")))  # a replay too
        assert (await client.post(proc, other["credential"], body("r4", channel, "still")))["status"] == "succeeded"
        await state.admin("list")
        assert deleted_files(pid, state.path) == []
        assert await proc.terminate() == 0


class TwoInstancesOneStateDirectory(TestCase):
    """Acceptance 1 on two real `twistd -n relayd` sharing one state directory and one redis-server."""

    timeout = 120

    async def test_issue_and_revoke_take_effect_on_both_and_no_state_file_is_deleted(self) -> None:
        relay = shared_nostr_relay()
        redis = RedisServer.start()
        self.addCleanup(redis.cleanup)
        state = StateDirectory(self)
        client = Client()
        options = state.broker_options(relay.url, "--redis", redis.url)
        procs = [await RelaydProcess.start_for(self, options, wait_for=("broker",)) for _ in range(2)]
        channel = str(uuid.uuid4())
        (issued,) = await state.admin("issue", "--agent", "alice", "--channel", channel)
        for i, proc in enumerate(procs):
            verdict = await client.until_redis(proc, issued["credential"], body(f"r{i}", channel, f"on {i}"))
            assert verdict["status"] == "succeeded", verdict
        assert len(await state.admin("list")) == 1
        for proc in procs:
            assert deleted_files(proc.transport.pid, state.path) == []
        assert await state.admin("revoke", "--agent", "alice") == [{"revoked": 1}]
        for i, proc in enumerate(procs):
            assert_refused(await client.post(proc, issued["credential"], body(f"after-{i}", channel, "after")))
            assert_refused(await client.post(proc, issued["credential"], body("r0", channel, "on 0")))  # a replay
            assert deleted_files(proc.transport.pid, state.path) == []
        for proc in procs:
            assert await proc.terminate() == 0


class SigkillKeepsWhatWasReported(TestCase):
    """Acceptance 2: SIGKILL of the tool mid-write and of relayd after a verdict lose nothing reported."""

    timeout = 120

    async def test_database_opens_with_every_reported_change_and_answered_actions_replay(self) -> None:
        relay = shared_nostr_relay()
        state = StateDirectory(self)
        client = Client()
        options = state.broker_options(relay.url)
        proc = await RelaydProcess.start_for(self, options, wait_for=("broker",))
        channel = str(uuid.uuid4())
        (issued,) = await state.admin("issue", "--agent", "alice", "--channel", channel)
        await state.admin("list")
        answered = body("before-kill", channel, "answered before SIGKILL")
        verdict = await client.post(proc, issued["credential"], answered)
        assert verdict["status"] == "succeeded", verdict
        # The tool killed inside its revoke transaction: nothing reported, nothing changed.
        killed = await state.killed_admin("before-commit", "revoke", "--agent", "alice")
        assert killed.stdout == b""
        # The tool killed after it reported a credential, before its connection closed.
        killed = await state.killed_admin("after-report", "issue", "--agent", "alice", "--channel", channel)
        reported = json.loads(killed.stdout)
        assert (await client.post(proc, reported["credential"], body("new", channel, "x")))["status"] == "succeeded"
        assert await proc.terminate(signal.SIGKILL) == -9

        db = sqlite3.connect(os.path.join(state.path, DB_FILE_NAME))
        try:
            assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            live = db.execute("SELECT hash FROM credentials WHERE revoked_at IS NULL").fetchall()
            expected = sorted(credential_hash(c) for c in (issued["credential"], reported["credential"]))
            assert sorted(h for (h,) in live) == expected
        finally:
            db.close()

        proc = await RelaydProcess.start_for(self, options, wait_for=("broker",))
        again = await client.post(proc, issued["credential"], answered)
        assert again.pop("replayed", None) is True and again == verdict, again
        stored = [e for e in relay.events(pubkey=issued["agentPubkey"]) if e["content"] == "answered before SIGKILL"]
        assert len(stored) == 1, stored
        assert await proc.terminate() == 0
