"""One tools/call through the standard endpoint is parsed once on its way to the page and its
answer once on its way back (relayd hands the parsed frame along, never its SSE bytes to re-read)."""

from __future__ import annotations

from typing import Any

import orjson

from relayd.base import jsoncodec
from tests.support.inmemory import InMemoryEndpointCase


class _CountingOrjson:
    """orjson as relayd.base.jsoncodec sees it, recording what it parses."""

    def __init__(self) -> None:
        self.parsed: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(orjson, name)

    def loads(self, data: Any) -> Any:
        self.parsed.append(bytes(data))
        return orjson.loads(data)


class ParsedOnce(InMemoryEndpointCase):
    silent = frozenset({"tools/call"})

    def test_a_tools_call_and_its_answer_are_each_parsed_once(self) -> None:
        sid = self.initialize()
        counting = _CountingOrjson()
        self.patch(jsoncodec, "orjson", counting)
        call = {"jsonrpc": "2.0", "id": 9, "method": "tools/call", "params": {"name": "call-marker-1"}}
        answered = self.send_mcp(call, sid=sid)
        self.settle()
        seen = self.page.seen[2]  # peer_joined, initialize, this call
        assert seen["params"]["name"] == "call-marker-1"
        self.page.send({"jsonrpc": "2.0", "id": seen["id"], "result": {"marker": "answer-marker-1"}})
        self.settle()
        reply = answered.reply()
        assert reply.code == 200 and reply.json()["result"] == {"marker": "answer-marker-1"}
        assert [p for p in counting.parsed if b"call-marker-1" in p] == [
            b'{"jsonrpc":"2.0","id":9,"method":"tools/call","params":{"name":"call-marker-1"}}'
        ]
        assert len([p for p in counting.parsed if b"answer-marker-1" in p]) == 1
