"""Small helpers shared by the AEP acceptance tests (relay, clients, URLs), on top of tests/support."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlencode

from twisted.trial.unittest import TestCase

from relayd.aep.envelope import envelope_error
from tests.support.aep import AEPRelay
from tests.support.sse import Message, SSEClient
from tests.support.ws import WSClient

TOKEN = "t0ken-for-tests"
AUTH = {"authorization": f"Bearer {TOKEN}"}


async def start_relay(tc: TestCase, **flags: Any) -> AEPRelay:
    """A relay stopped at the end of the test (after every client the test opens later)."""
    extra = getattr(tc, "extra_relay_flags", None)
    relay = await AEPRelay.start(**{**(extra() if extra else {}), **flags})
    tc.addCleanup(relay.stop)
    return relay


class OnRedis:
    """Mixin: the test case's relays keep their state in a real Redis (a fresh key prefix each)."""

    def extra_relay_flags(self) -> dict[str, Any]:
        import uuid

        from tests.support.redis import shared_redis

        return {"redis": shared_redis().url, "redis_prefix": f"test-{uuid.uuid4().hex[:8]}:"}


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
