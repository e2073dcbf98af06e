"""An AEP relay running in-process on a real loopback port, and small helpers to drive it."""

from __future__ import annotations

import json
from typing import Any

import treq
from twisted.internet import reactor
from twisted.web.client import HTTPConnectionPool

from relayd.aep.config import SETTINGS
from relayd.aep.service import make_service
from relayd.clock import Clock
from relayd.config import resolve
from relayd.redis_config import SETTINGS as REDIS_SETTINGS

TIMEOUT = 5.0


def event(session: str = "S", seq: int | None = 0, type: str = "session.started", **extra: Any) -> dict[str, Any]:
    """A valid envelope (sequenced unless C{seq} is None)."""
    ev: dict[str, Any] = {
        "aep": "0.1",
        "id": extra.pop("id", f"{session}-{seq}-{type}"),
        "type": type,
        "time": "2026-11-29T00:00:00Z",
        "source": extra.pop("source", f"aep://test/agent/a/session/{session}"),
        "agent": extra.pop("agent", "a"),
    }
    if session is not None and not type.startswith("agent."):
        ev["session"] = session
    if seq is not None:
        ev["seq"] = seq
    ev.update(extra)
    return ev


def ndjson(*events: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in events)


async def wait_until(condition: Any, timeout: float = 5.0) -> None:
    """Poll C{condition} (a connection being made by another component) until it holds."""
    from twisted.internet.task import deferLater

    waited = 0.0
    while not condition():
        if waited > timeout:
            raise AssertionError("condition not reached")
        await deferLater(reactor, 0.01, lambda: None)
        waited += 0.01


class AEPRelay:
    """C{await AEPRelay.start(**flags)}; C{.url}; C{await relay.stop()}."""

    def __init__(self) -> None:
        self.service: Any = None
        self.url = ""
        self.ws_url = ""
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        self.redis: Any = None

    @classmethod
    async def start(cls, **flags: Any) -> AEPRelay:
        relay = cls()
        given = {"aep-listen": ["tcp:0:interface=127.0.0.1"]}
        given.update({k.replace("_", "-"): str(v) for k, v in flags.items()})
        settings = resolve([*REDIS_SETTINGS, *SETTINGS], given, {})
        relay.service = make_service(settings, reactor, Clock(reactor))
        relay.service.startService()
        ports = await relay.service.ports()
        port = ports[0].getHost().port
        redis = getattr(relay.core.log, "redis", None)
        if redis is not None:
            relay.redis = redis
            await wait_until(lambda: redis.connected)
            for bus in redis._buses:
                await bus.ready
        relay.url = f"http://127.0.0.1:{port}"
        relay.ws_url = f"ws://127.0.0.1:{port}/socket"
        return relay

    @property
    def core(self) -> Any:
        return self.service.relay

    async def stop(self) -> None:
        await self.service.stopService()
        await self.pool.closeCachedConnections()
        if self.redis is not None:
            await self.redis.close()

    async def request(self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[Any, bytes]:
        d = treq.request(method, self.url + path, data=body, headers=headers or {}, pool=self.pool)
        d.addTimeout(TIMEOUT, reactor)
        response = await d
        content = await treq.content(response)
        return response, content

    async def post(self, *events: dict[str, Any], headers: dict[str, str] | None = None, token: str | None = None) -> tuple[Any, bytes]:
        h = {"aep-version": "0.1", "content-type": "application/x-ndjson"}
        if token:
            h["authorization"] = f"Bearer {token}"
        h.update(headers or {})
        return await self.request("POST", "/events", ndjson(*events), h)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[Any, bytes]:
        return await self.request("GET", path, None, headers)
