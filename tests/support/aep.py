"""An AEP relay running in-process on a real loopback port (L{AEPRelay}, L{start_relay}), envelopes,
and the clients a test drives it with (L{open_sse}, L{open_ws}, L{subscribe}); the same wing in
memory (L{aep_in_memory}, L{post_in_memory}, L{stream_in_memory}, L{replay_in_memory})."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

import treq
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from relayd.aep.core.envelope import envelope_error
from tests.support.inmemory import Connection, InMemoryWing, Reply
from tests.support.redis import redis_flags
from tests.support.sse import Message, SSEClient
from tests.support.wing import Wing
from tests.support.ws import WSClient

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
    """The AEP wing in-process (a L{Wing}) and a treq client for it: C{await AEPRelay.start(**flags)};
    C{.url}, C{.ws_url}; C{await relay.stop()}. Flags are keyword arguments (C{max_body=1000})."""

    def __init__(self, wing: Wing) -> None:
        self.wing = wing
        self.service: Any = wing.service
        self.url = wing.url
        self.ws_url = f"ws://127.0.0.1:{wing.port}/socket"
        self.pool = HTTPConnectionPool(reactor, persistent=False)
        clients = wing.redis_clients()
        self.redis: Any = clients[0] if clients else None

    @classmethod
    async def start(cls, **flags: Any) -> AEPRelay:
        return cls(await Wing.start("aep", {k.replace("_", "-"): v if isinstance(v, list) else str(v) for k, v in flags.items()}))

    @property
    def core(self) -> Any:
        return self.service.relay

    async def stop(self) -> None:
        await self.wing.stop()
        await self.pool.closeCachedConnections()

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


# The AEP wing in memory (tests/support/inmemory.py): no socket, its clock advanced by the test.

INGEST = {"aep-version": "0.1", "content-type": "application/x-ndjson"}


def aep_in_memory(case: TestCase, **flags: Any) -> InMemoryWing:
    """The AEP wing in memory with C{flags} (C{aep_buffer=8}: C{--aep-buffer 8}), closed at cleanup."""
    return InMemoryWing.build(case, "aep", {k.replace("_", "-"): v if isinstance(v, list) else str(v) for k, v in flags.items()})


def post_in_memory(relay: InMemoryWing, *events: dict[str, Any], token: str | None = None) -> Reply:
    """POST C{events} as NDJSON to C{/events} (with C{token} as the bearer)."""
    headers = {**INGEST, **({"authorization": f"Bearer {token}"} if token else {})}
    return relay.post("/events", ndjson(*events), headers)


def stream_in_memory(relay: InMemoryWing, headers: dict[str, str] | None = None, **params: Any) -> Connection:
    """A C{/stream} (C{params} as L{query} takes them), with what its first turn wrote; later
    events are there after C{relay.advance(0)}."""
    connection = relay.open("GET", "/stream" + query(**params), None, headers or {})
    relay.advance(0)  # (a stream writes on its next turn)
    return connection


def replay_in_memory(relay: InMemoryWing, headers: dict[str, str] | None = None, **params: Any) -> list[Message]:
    """What a C{live=0} stream replays, to its end."""
    replay = stream_in_memory(relay, headers, live="0", **params)
    assert replay.ended(), replay.received()[:400]
    return replay.events()


# Driving a relay from a test: clients closed at the test's cleanup, and reading what they got.

TOKEN = "t0ken-for-tests"
AUTH = {"authorization": f"Bearer {TOKEN}"}


async def start_relay(tc: TestCase, **flags: Any) -> AEPRelay:
    """A relay stopped at the end of the test (after every client the test opens later); a case's
    C{extra_relay_flags()} (L{OnRedis}) come first."""
    extra = getattr(tc, "extra_relay_flags", None)
    relay = await AEPRelay.start(**{**(extra() if extra else {}), **flags})
    tc.addCleanup(relay.stop)
    return relay


class OnRedis:
    """Mixin: the test case's relays keep their state in a real Redis (a fresh key prefix each)."""

    def extra_relay_flags(self) -> dict[str, Any]:
        return redis_flags()


def query(**params: Any) -> str:
    """A query string; C{filter} and list/dict C{from} values are JSON-encoded."""
    encoded = {}
    for name, value in params.items():
        name = name.rstrip("_")  # from_ -> from
        if value is None:
            continue
        if isinstance(value, (dict, list)):
            value = json.dumps(value, separators=(",", ":"))
        encoded[name] = value
    return "?" + urlencode(encoded) if encoded else ""


async def open_sse(tc: TestCase, relay: AEPRelay, headers: dict[str, str] | None = None, **params: Any) -> SSEClient:
    client = await SSEClient.connect(relay.url + "/stream" + query(**params), headers)
    tc.addCleanup(client.close)
    return client


async def open_ws(
    tc: TestCase, relay: AEPRelay, headers: dict[str, str] | None = None, *, hello: dict[str, Any] | None = None
) -> WSClient:
    """A WebSocket client; with C{hello}, the hello exchange is done (and checked) already."""
    client = await WSClient.connect(relay.ws_url, headers)
    tc.addCleanup(client.close)
    if hello is not None:
        reply = await client.hello(**hello)
        tc.assertEqual(reply["type"], "hello", reply)
    return client


async def subscribe(tc: TestCase, client: WSClient, sub_id: Any = "s", **fields: Any) -> list[Any]:
    """Subscribe; returns what arrived after C{subscribed} up to a ping/pong sync point (the replay)."""
    if "from_" in fields:
        fields["from"] = fields.pop("from_")
    client.send({"type": "subscribe", "id": sub_id, **fields})
    reply = await client.recv()
    tc.assertEqual(reply, {"type": "subscribed", "id": sub_id})
    return await client.roundtrip()


def valid(tc: TestCase, ev: Any) -> None:
    tc.assertIsNone(envelope_error(ev), ev)


def seqs(messages: list[Message]) -> list[int]:
    return [m.json()["seq"] for m in messages if m.comment is None]


def events_of(messages: list[Message]) -> list[Message]:
    return [m for m in messages if m.comment is None]


def comments_of(messages: list[Message]) -> list[str]:
    return [m.comment for m in messages if m.comment is not None]


def serve_sockets(case: TestCase, relay: Any, clock: Any, heartbeat: float = 25.0, **options: Any) -> tuple[Any, str]:
    """C{relay}'s AEP resource served in this process on a loopback port (a real socket, closed in
    C{case}'s cleanup): its L{relayd.aep.websocket.AEPSocketFactory} (C{options} its keyword
    arguments) and the WebSocket's URL."""
    from autobahn.twisted.resource import WebSocketResource

    from relayd.aep.http import AEPResource
    from relayd.aep.websocket import AEPSocketFactory
    from relayd.web.site import RelaySite
    from relayd.web.streams.sse import SSEHub, sse_comment

    sockets = AEPSocketFactory(relay, clock, heartbeat=heartbeat, max_message=2**20, **options)
    hub = SSEHub(clock, heartbeat, sse_comment("ping"))
    site = RelaySite(AEPResource(relay, hub, max_body=2**20, max_batch=10, socket=WebSocketResource(sockets)))
    port = reactor.listenTCP(0, site, interface="127.0.0.1")
    case.addCleanup(port.stopListening)
    case.addCleanup(sockets.abort)
    return sockets, f"ws://127.0.0.1:{port.getHost().port}/socket"
