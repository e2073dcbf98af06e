"""One tools/call through the standard endpoint does each per-request step once per HTTP request.

The token is checked once (hashed once, compared once with the session's): the client's POST at
admission and the page's answer on C{outbox} at the end of its headers; the frame's post to the
store neither hashes nor compares it again (relayd.mcp.core.tunnel.Pass). The CORS headers are set
once, though a POST's route is prepared both at the end of its headers and when it is rendered.
The memory store's answers make no Deferred for the coroutines of the round trip (the client's
admission and forward, the page's outbox); a store that waits still answers through one.
"""

from __future__ import annotations

import hmac
from types import SimpleNamespace
from typing import Any

from twisted.internet.defer import Deferred

from relayd.base import coroutine as coroutine_module
from relayd.mcp.core import store as store_module
from relayd.mcp.core import tunnel as tunnel_module
from relayd.mcp.core.tokens import token_hash
from relayd.mcp.core.tunnel import Refused
from relayd.process.cors import OriginPolicy
from tests.support.inmemory import InMemoryEndpointCase
from tests.support.mcp import SESSION, TOKEN


class OneCheckPerRequest(InMemoryEndpointCase):
    silent = frozenset({"tools/call"})

    def count_checks(self) -> list[str]:
        """From now on, every token the tunnel hashes ("hash") and every hash the memory store
        compares with a session's ("compare")."""
        seen: list[str] = []

        def hashing(token: str) -> str:
            seen.append("hash")
            return token_hash(token)

        def comparing(a: str, b: str) -> bool:
            seen.append("compare")
            return hmac.compare_digest(a, b)

        self.patch(tunnel_module, "token_hash", hashing)
        self.patch(store_module, "hmac", SimpleNamespace(compare_digest=comparing))
        return seen

    def call(self, sid: str, n: int) -> Any:
        answered = self.send_mcp({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "t"}}, sid=sid)
        self.settle()
        seen = self.page.seen[-1]
        assert seen["method"] == "tools/call"
        self.page.send({"jsonrpc": "2.0", "id": seen["id"], "result": {"n": n}})
        self.settle()
        return answered.reply()

    def test_a_round_trip_checks_the_token_once_per_request(self) -> None:
        sid = self.initialize()
        checked = self.count_checks()
        reply = self.call(sid, 7)
        assert reply.code == 200 and reply.json()["result"] == {"n": 7}
        # The client's POST at admission, the page's outbox POST at the end of its headers.
        assert checked == ["hash", "compare", "hash", "compare"]

    def test_the_memory_store_s_check_makes_no_deferred(self) -> None:
        # The memory store answers in the call: the check of each request's token is its answer
        # itself, not a Deferred made and fired per request (TunnelRelay.check_at_once).
        sid = self.initialize()
        deferred: list[object] = []
        check_session = store_module.MemoryStore.check_session

        def counting(store: Any, *args: Any) -> Any:
            deferred.append(args)
            return check_session(store, *args)

        self.patch(store_module.MemoryStore, "check_session", counting)
        checked = self.count_checks()
        reply = self.call(sid, 9)
        assert reply.code == 200 and reply.json()["result"] == {"n": 9}
        assert checked == ["hash", "compare", "hash", "compare"]  # (still checked, once per request)
        assert deferred == []

    def test_the_memory_store_s_round_trip_makes_no_fired_deferred(self) -> None:
        # The client's admission and forward and the page's outbox run to their end in the call
        # (relayd.base.coroutine.run_now), and the store's first step of each frame's post answers
        # in the call (start_inbox_now, start_outbox_now): no fired Deferred made and read back.
        sid = self.initialize()
        fired: list[object] = []
        succeed = coroutine_module.succeed

        def counting(value: object) -> Any:
            fired.append(value)
            return succeed(value)

        self.patch(coroutine_module, "succeed", counting)
        self.patch(store_module, "succeed", counting)
        reply = self.call(sid, 10)
        assert reply.code == 200 and reply.json()["result"] == {"n": 10}
        assert fired == []

    def test_an_outbox_post_whose_store_waits_is_answered_once_it_has(self) -> None:
        # A store that answers later (Redis): the page's outbox POST is answered when it has, with
        # the bytes of an answer given at once.
        sid = self.initialize()
        at_once = self.open_outbox(sid, 11)
        later: list[Deferred[Any]] = []
        start_outbox = store_module.MemoryStore.start_outbox

        def waiting(store: Any, *args: Any) -> Any:
            d: Deferred[Any] = Deferred()
            later.append(d)
            return d.addCallback(lambda _: start_outbox(store, *args))  # (its fired Deferred chained)

        self.patch(store_module.MemoryStore, "start_outbox", waiting)
        self.patch(self.tunnel, "_start_outbox_now", None)  # (as a store answering later has none)
        waited = self.open_outbox(sid, 12)
        assert waited.received() == b"" and len(later) == 1
        later[0].callback(None)
        self.settle()
        assert waited.reply().code == 200
        assert waited.received() == at_once.received()

    def open_outbox(self, sid: str, n: int) -> Any:
        """The page's outbox POST answering tools/call C{n} (sent now, on C{sid}), on its connection."""
        self.send_mcp({"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": {"name": "t"}}, sid=sid)
        self.settle()
        seen = self.page.seen[-1]
        body = b'{"jsonrpc":"2.0","id":%s,"result":{}}' % str(seen["id"]).encode()
        return self.wing.open("POST", f"{self.prefix}/{SESSION}/outbox?token={TOKEN}", body, {"content-type": "application/json"})

    def test_a_round_trip_sets_the_cors_headers_once_per_request(self) -> None:
        sid = self.initialize()
        applied: list[object] = []
        apply = OriginPolicy.apply

        def counting(policy: OriginPolicy, request: Any) -> None:
            applied.append(request)
            apply(policy, request)

        self.patch(OriginPolicy, "apply", counting)
        reply = self.call(sid, 8)
        assert reply.code == 200 and reply.header("access-control-allow-origin") == "*"
        assert len(applied) == 2 and applied[0] is not applied[1]  # the client's POST, the page's

    def test_a_session_changed_meanwhile_is_checked_again(self) -> None:
        # Another session registered between the check and the post: the post compares the token.
        checked = self.count_checks()
        passed = self.tunnel.token_pass(SESSION, TOKEN)
        self.tunnel.check(SESSION, TOKEN, passed).addCallback(self.assertIsNone)
        self.register("other-session")
        del checked[:]
        self.tunnel.outbox(SESSION, TOKEN, b'{"jsonrpc":"2.0","method":"notifications/x"}', passed)
        assert checked == ["compare"]  # (the pass's hash, compared again)

    def test_a_pass_does_not_outlive_its_session(self) -> None:
        # Ended and registered again with another token between the check and the post: refused.
        passed = self.tunnel.token_pass(SESSION, TOKEN)
        self.tunnel.check(SESSION, TOKEN, passed).addCallback(self.assertIsNone)
        self.tunnel.drop_session(SESSION)
        self.register(SESSION, "another_token_0123456789abcdef")
        failed: list[Any] = []
        self.tunnel.outbox(SESSION, TOKEN, b'{"jsonrpc":"2.0","method":"notifications/x"}', passed).addErrback(
            failed.append
        )
        assert failed and isinstance(failed[0].value, Refused)
        assert failed[0].value.reason == "invalid_token_or_frame"
