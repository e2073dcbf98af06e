"""An in-process broker pointed at a real relay, an HTTP client for it, and an independent verifier."""

from __future__ import annotations

import io
import json
import os
import uuid
from typing import Any

import treq
from twisted.internet import defer, reactor
from twisted.web.client import HTTPConnectionPool

from relayd.buzz import admin, contract, nostr
from relayd.buzz.service import BrokerService
from relayd.buzz.state import StateDB
from relayd.clock import Clock


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
        self.port = 0
        self.pool = HTTPConnectionPool(reactor, persistent=False)

    async def start(self) -> None:
        with open(self.kek_file) as f:
            kek = bytes.fromhex(f.read().strip())
        self.service = BrokerService(
            listen=["tcp:0:interface=127.0.0.1"],
            relay_url=self.relay_url,
            auth_url=self.auth_url,
            db=StateDB.in_dir(self.state_dir),
            kek=kek,
            reactor=reactor,
            clock=Clock(reactor),
            timeout=self.timeout,
            **self.kw,
        )
        self.service.startService()
        (port,) = await self.service.ports()
        self.port = port.getHost().port

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stopService()
            self.service = None

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
