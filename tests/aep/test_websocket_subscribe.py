"""A WebSocket subscribe's filter is judged as C{GET /stream} judges it (one policy: relayd.aep.core.filters)."""

from __future__ import annotations

from twisted.trial.unittest import TestCase

from tests.support.aep import comments_of, open_sse, open_ws, start_relay

TYPO = 'filter key "sesion" is an extension attribute, not "session": it matches only events carrying "sesion"'


class SubscribeFilterKeys(TestCase):
    async def test_a_key_spelled_like_a_core_attribute_is_named_as_the_stream_names_it(self) -> None:
        """`sesion` is a legal extension-attribute filter (AEP's grammar), so it subscribes; the
        C{subscribed} frame says what the SSE stream says in a comment."""
        relay = await start_relay(self)
        client = await open_ws(self, relay, hello={"role": "consumer"})
        client.send({"type": "subscribe", "id": "typo", "filter": {"sesion": "S"}})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "typo", "warnings": [TYPO]})
        client.send({"type": "subscribe", "id": "plain", "filter": {"session": "S", "team": "x"}})
        self.assertEqual(await client.recv(), {"type": "subscribed", "id": "plain"})

        stream = await open_sse(self, relay, filter={"sesion": "S"}, live="0")
        self.assertIn(TYPO, comments_of(await stream.read_until_end()))

    async def test_an_unknown_key_is_refused_naming_it_as_the_stream_refuses_it(self) -> None:
        relay = await start_relay(self)
        stream = await open_sse(self, relay, filter={"NotAnAttr": 1})
        self.assertEqual(stream.code, 400)
        refusal = stream.refusal.decode()
        client = await open_ws(self, relay, hello={"role": "consumer"})
        client.send({"type": "subscribe", "id": "bad", "filter": {"NotAnAttr": 1}})
        reply = await client.recv()
        self.assertEqual(
            reply, {"type": "error", "id": "bad", "code": "invalid-filter", "detail": "unknown filter key: NotAnAttr"}
        )
        self.assertIn(reply["detail"], refusal)
        self.assertEqual(await client.roundtrip(), [])  # the connection stays open
