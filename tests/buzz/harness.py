"""The broker's test harness: an in-process broker pointed at a real relay (tests/support/nostr.py), an
HTTP client for it, credentials, an independent verifier, the contract's sample requests and verdicts
(docs/broker.md), and a broker in a process of its own for kill -9 tests.

Run as C{python -m tests.buzz.harness STATE_DIR RELAY_URL [CRASH_AT]}, it is that broker process
(see L{broker_process_main}).
"""

from __future__ import annotations

import copy
import io
import json
import os
import shutil
import signal
import sys
import tempfile
import uuid
from typing import Any, Iterator

import treq
from twisted.internet import defer, reactor
from twisted.web.client import HTTPConnectionPool

from relayd.base.clock import Timekeeper
from relayd.buzz import nostr
from relayd.buzz.core import contract
from relayd.buzz.core.state import StateDB
from relayd.buzz.service import BrokerService
from relayd.cli import broker as admin
from relayd.storage.cluster import redis_client
from relayd.storage.redis import Redis


def independent_verify(ev: dict[str, Any]) -> bool:
    """Verify with rust-nostr (PyPI nostr-sdk), a different implementation from relayd's own."""
    import nostr_sdk

    return bool(nostr_sdk.Event.from_json(json.dumps(ev)).verify())


def issue(state_dir: str, *args: str, kek_file: str | None = None) -> dict[str, str]:
    """Run C{relayd-admin broker issue} and return its JSON line."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["issue", "--state-dir", state_dir, *args]
    if kek_file:
        argv += ["--kek-file", kek_file]
    code = admin.main(argv, stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    return json.loads(out.getvalue())


def temp_dir(testcase: Any, prefix: str = "relayd-broker-") -> str:
    """A fresh temporary directory that C{testcase} removes in its cleanup."""
    path = tempfile.mkdtemp(prefix=prefix)
    testcase.addCleanup(shutil.rmtree, path, ignore_errors=True)
    return path


def new_channel() -> str:
    return str(uuid.uuid4())


class BrokerUnderTest:
    """A BrokerService on 127.0.0.1:0 with its own state dir and KEK file."""

    def __init__(
        self, state_dir: str, relay_url: str, *, timeout: float = 10.0, auth_url: str | None = None, **kw: Any
    ) -> None:
        self.state_dir = state_dir
        self.relay_url = relay_url
        self.auth_url = auth_url  # the relay URL signed into NIP-42 AUTH (the real relay's behind a proxy)
        self.timeout = timeout
        self.kw = kw
        os.makedirs(state_dir, exist_ok=True)
        self.kek_file = os.path.join(state_dir, "test.kek")
        if not os.path.exists(self.kek_file):
            with open(self.kek_file, "w") as f:
                f.write(os.urandom(32).hex())
        self.service: BrokerService | None = None
        self.redis: Redis | None = None  # made from redis_url=..., ours to close
        self.port = 0
        self.pool = HTTPConnectionPool(reactor, persistent=False)

    async def start(self) -> None:
        with open(self.kek_file) as f:
            kek = bytes.fromhex(f.read().strip())
        kw = dict(self.kw)
        url = kw.pop("redis_url", None)
        clock = Timekeeper(reactor)
        if url is not None:  # a broker built alone, as the tap would hand it the plumbing's client
            self.redis = redis_client(url, clock, prefix=kw.get("redis_prefix", "relayd:"))
            kw["redis"] = self.redis
        self.service = BrokerService(
            listen=["tcp:0:interface=127.0.0.1"],
            nostr_relay_url=self.relay_url,
            auth_url=self.auth_url,
            db=StateDB.in_dir(self.state_dir),
            kek=kek,
            reactor=reactor,
            clock=clock,
            timeout=self.timeout,
            **kw,
        )
        self.service.startService()
        (port,) = await self.service.ports()
        self.port = port.getHost().port

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stopService()
            self.service = None
        if self.redis is not None:
            await self.redis.close()
            self.redis = None

    def issue(self, name: str, *args: str) -> dict[str, str]:
        return issue(self.state_dir, "--agent", name, *args, kek_file=self.kek_file)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1/action"

    async def post(self, body: bytes, credential: str | None, headers: dict[bytes, list[bytes]] | None = None) -> tuple[int, bytes]:
        h: dict[bytes, list[bytes]] = {b"content-type": [b"application/json"]}
        if credential is not None:
            h[b"authorization"] = [b"Bearer " + credential.encode()]
        if headers:
            h.update(headers)
        resp = await treq.post(self.url, data=body, headers=h, pool=self.pool)
        return resp.code, await resp.content()

    async def call(self, credential: str, action: str, args: dict[str, Any], rid: str | None = None) -> dict[str, Any]:
        """Build, freeze, send, and read the answer as a conforming client does (I5)."""
        req = contract.build_request(action, args, rid or f"r-{uuid.uuid4()}")
        body = contract.freeze(req)
        status, data = await self.post(body, credential)
        assert status == 200, (status, data)
        contract.read_http_response(req, status, data)  # raises unless a correlated verdict
        return json.loads(data)


def ok(resp: dict[str, Any]) -> dict[str, Any]:
    assert resp["status"] == "succeeded", resp
    return resp["outcome"]


def signer_of(secret_hex: str) -> nostr.Signer:
    return nostr.Signer(bytes.fromhex(secret_hex))


def settle() -> defer.Deferred[None]:
    """One reactor turn."""
    d: defer.Deferred[None] = defer.Deferred()
    reactor.callLater(0, d.callback, None)
    return d


# --- the contract's sample requests and verdicts (docs/broker.md) ---------------------------------

CHANNEL = "b2c38ca8-9ec3-411e-bab5-f9deab34d52e"
PUBKEY = "a02c4e0850e5e612b4ddf95dbe2f5c56467cf27c6552203bc833ff438fb31971"
EVENT = "78d47c4f36a2d048f45b57a31d964a3ce239f0fc46162c5d7c90db2b5aa52bc6"
RID = "a9f3c2e1-0b5d-4e8a-9c71-3f2b6d8e4a10"

_FIXTURE_SIGNER = nostr.Signer((7).to_bytes(32, "big"))


def read_event() -> dict[str, Any]:
    """The read fixture: kind 9, 'hello', h/e-root/p tags, really signed."""
    return _FIXTURE_SIGNER.sign(
        9, [["h", CHANNEL], ["e", EVENT, "", "root"], ["p", PUBKEY]], "hello", 1787675388
    )


READ_EVENT = read_event()

ARGS: dict[str, dict[str, Any]] = {
    "channel.read": {
        "channelId": CHANNEL,
        "rootEventId": EVENT,
        "mentionsOnly": True,
        "cursor": "c1",
        "limit": 50,
    },
    "message.post": {"channelId": CHANNEL, "content": "hello", "mentions": [PUBKEY]},
    "message.reply": {
        "channelId": CHANNEL,
        "replyToEventId": EVENT,
        "content": "On it.",
        "mentions": [PUBKEY],
    },
    "reaction.add": {"channelId": CHANNEL, "targetEventId": EVENT, "reaction": "👍"},
    "profile.set": {"displayName": "Helper", "about": "I help.", "picture": "https://example.com/a.png"},
    "storage.address": {"slug": "mem/slice-c"},
    "agents.create": {
        "channelId": CHANNEL,
        "displayName": "helper",
        "systemPrompt": "Be helpful.",
        "runtime": "buzz-acp",
        "provider": "anthropic",
        "model": "claude-sonnet-4-5",
        "respondTo": "owner-only",
    },
    "agents.update": {
        "target": {"pubkey": PUBKEY},
        "displayName": "helper2",
        "systemPrompt": "Be brief.",
        "runtime": "buzz-acp",
        "provider": "anthropic",
        "model": "claude-sonnet-4-5",
        "respondTo": "anyone",
    },
    "agents.delete": {"target": {"name": "helper"}},
}

OUTCOMES: dict[str, dict[str, Any]] = {
    "channel.read": {"messages": [READ_EVENT], "nextCursor": "c2"},
    "message.post": {"eventId": EVENT, "kind": 9, "createdAt": 1787675471},
    "message.reply": {"eventId": EVENT, "kind": 9, "createdAt": 1787675471},
    "reaction.add": {"eventId": EVENT, "kind": 7, "createdAt": 1787675471},
    "profile.set": {"eventId": EVENT, "kind": 0, "createdAt": 1787675471},
    "storage.address": {"authorPubkey": PUBKEY, "kind": 30174, "dTag": EVENT},
    "agents.create": {"agentPubkey": PUBKEY, "displayName": "helper", "channelId": CHANNEL},
    "agents.update": {"agentPubkey": PUBKEY, "displayName": "helper2", "updatedFields": ["displayName"]},
    "agents.delete": {"agentPubkey": PUBKEY, "displayName": "helper"},
}


def request_wire(action: str, args: dict[str, Any] | None = None, rid: str = RID) -> dict[str, Any]:
    return {
        "type": "broker_request",
        "protocolVersion": 1,
        "requestId": rid,
        "actionVersion": 1,
        "action": action,
        "args": copy.deepcopy(ARGS[action] if args is None else args),
    }


def success_wire(action: str, replayed: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "broker_result",
        "protocolVersion": 1,
        "requestId": RID,
        "status": "succeeded",
        "action": action,
        "outcome": copy.deepcopy(OUTCOMES[action]),
    }
    if replayed:
        out["replayed"] = True
    return out


def error_wire(status: str, code: str, replayed: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "broker_result",
        "protocolVersion": 1,
        "requestId": RID,
        "status": status,
        "error": {"code": code, "message": "nope"},
    }
    if replayed:
        out["replayed"] = True
    return out


def member_paths(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every object-member path at any depth (including inside arrays)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield (*path, k)
            yield from member_paths(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from member_paths(v, (*path, i))


def set_path(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    tree = copy.deepcopy(tree)
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return tree


# --- a broker in a process of its own (kill -9 tests) ---------------------------------------------


def broker_process_main() -> None:
    """A broker on 127.0.0.1:0 in this process; prints C{PORT <n>} once listening.

    argv: STATE_DIR RELAY_URL [CRASH_AT]. CRASH_AT "after_store" kills the process right after the
    signed events are stored; "on_ok" kills it when the relay's OK for a published event arrives,
    before it is handled."""
    state_dir, relay_url = sys.argv[1], sys.argv[2]
    crash_at = sys.argv[3] if len(sys.argv) > 3 else ""
    from twisted.internet import reactor

    from relayd.base.clock import Timekeeper
    from relayd.buzz.core import state
    from relayd.buzz.nostr_upstream import UpstreamConnection
    from relayd.buzz.service import BrokerService

    def die(*_: object) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if crash_at == "after_store":
        original = state.SQLiteState.store_plan

        def store_plan(self, *a):  # type: ignore[no-untyped-def]
            return original(self, *a).addCallback(die)

        state.SQLiteState.store_plan = store_plan  # type: ignore[method-assign]
    elif crash_at == "on_ok":
        original_ok = UpstreamConnection._ok

        def _ok(self, event_id, accepted, message):  # type: ignore[no-untyped-def]
            if event_id:
                die()
            return original_ok(self, event_id, accepted, message)

        UpstreamConnection._ok = _ok  # type: ignore[method-assign]
    with open(os.path.join(state_dir, "test.kek")) as f:
        kek = bytes.fromhex(f.read().strip())
    svc = BrokerService(
        listen=["tcp:0:interface=127.0.0.1"],
        nostr_relay_url=relay_url,
        auth_url=None,
        db=state.StateDB.in_dir(state_dir),
        kek=kek,
        reactor=reactor,
        clock=Timekeeper(reactor),
        timeout=10.0,
    )

    def started() -> None:
        svc.startService()
        svc.ports().addCallback(lambda ports: (print(f"PORT {ports[0].getHost().port}", flush=True)))

    reactor.callWhenRunning(started)
    reactor.addSystemEventTrigger("before", "shutdown", svc.stopService)
    reactor.run()


if __name__ == "__main__":
    broker_process_main()
