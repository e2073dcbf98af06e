"""Tunnel-relay-level cases of mcp-relay.md §9 (C, S, R, core parts of P, PHP) and the core decisions.

The tunnel relay runs over a memory store on a fake clock, with recording sinks for its streams, so every
Deferred has fired when a call returns (L{TunnelCase}).
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.internet import task
from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.mcp.core.frames import FRAMES_DROPPED, parse_frame
from relayd.mcp.core.polls import parse_wait_ms
from relayd.mcp.core.store import INBOUND, OUTBOUND, MemoryStore
from relayd.mcp.core.tunnel import Refused, TunnelConfig, TunnelRelay
from tests.support.cases import cases, expand
from tests.support.mcp import RecordingSink

TOKEN = "tok_abcdefghijklmnopqrstuvwxyz01"
SESSION = "sess"


def fired(d: Deferred[Any]) -> Any:
    """The result of an already-fired Deferred (the memory store never waits); raises its failure.

    For setting up outside a test method; tests read results with successResultOf/failureResultOf."""
    out: list[Any] = []
    d.addBoth(out.append)
    assert out, "Deferred has not fired"
    if isinstance(out[0], Failure):
        out[0].raiseException()
    return out[0]


def make_tunnel(**config: Any) -> tuple[TunnelRelay, task.Clock, MemoryStore]:
    """A tunnel relay over a memory store on a fake clock (at epoch 1_700_000_000 s), session C{sess} registered."""
    reactor = task.Clock()
    reactor.advance(1_700_000_000)
    store = MemoryStore()
    tunnel = TunnelRelay(store, Timekeeper(reactor), TunnelConfig(**config))
    fired(tunnel.register(SESSION, TOKEN))
    return tunnel, reactor, store


def frames_of(result: Any) -> list[Any]:
    """Parsed frames of a poll result."""
    return [json.loads(json.loads(f)) for f in result.frames]


class TunnelCase(TestCase):
    """A TestCase for the tunnel relay over a memory store, where every Deferred has fired on return."""

    def refusal(self, d: Deferred[Any]) -> str:
        """The reason of an already-fired refusal (fails the test on a result or another error)."""
        return self.failureResultOf(d, Refused).value.reason

    def open_sse(self, tunnel: TunnelRelay, direction: str = OUTBOUND, label: str | None = None) -> RecordingSink:
        """A recording sink subscribed to session C{sess} in C{direction}, as C{label}."""
        sink = RecordingSink()
        self.successResultOf(tunnel.open_stream(SESSION, TOKEN, direction, label, sink))
        return sink


def req(id_: object, method: str = "tools/call") -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id_, "method": method}).encode()


def res(id_: object, result: object = None) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id_, "result": result if result is not None else {"ok": id_}}).encode()


NOTE = b'{"jsonrpc":"2.0","method":"notifications/message","params":{}}'


@expand
class FrameValidation(TunnelCase):
    """C: what the tunnel relay accepts as a JSON-RPC frame, from either side."""

    def test_c1_valid_request_accepted(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.successResultOf(tunnel.inbox(SESSION, TOKEN, b'{"jsonrpc":"2.0","id":1,"method":"tools/call"}')) is None

    def test_c2_substring_jsonrpc_rejected(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.refusal(tunnel.inbox(SESSION, TOKEN, b'garbage "jsonrpc" garbage')) == "invalid_token_or_frame"

    @cases(notifications_peer_joined="notifications/peer_joined", notifications_peer_left="notifications/peer_left")
    def test_c3_forged_presence_rejected_from_both_sides(self, method: str) -> None:
        tunnel, _, _ = make_tunnel()
        frame = json.dumps({"jsonrpc": "2.0", "method": method, "params": {}}).encode()
        assert self.refusal(tunnel.inbox(SESSION, TOKEN, frame)) == "invalid_token_or_frame"
        assert self.refusal(tunnel.outbox(SESSION, TOKEN, frame)) == "invalid_token_or_frame"

    def test_c4_jsonrpc_1_rejected(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.refusal(tunnel.inbox(SESSION, TOKEN, b'{"jsonrpc":"1.0","id":1,"method":"x"}')) == "invalid_token_or_frame"

    def test_c5_wrong_token_rejected(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.refusal(tunnel.inbox(SESSION, "wrong-token-wrong-token", req(1))) == "invalid_token_or_frame"

    @cases(
        batch=(b'[{"jsonrpc":"2.0","id":1,"method":"a"},{"jsonrpc":"2.0","method":"b"}]', True),
        empty_batch=(b"[]", False),
        batch_with_a_number=(b'[{"jsonrpc":"2.0","id":1,"method":"a"}, 3]', False),
        null_id_result=(b'{"jsonrpc":"2.0","id":null,"result":1}', True),
        result_and_error=(b'{"jsonrpc":"2.0","id":1,"result":1,"error":{}}', False),
        id_only=(b'{"jsonrpc":"2.0","id":1}', False),
        result_without_id=(b'{"jsonrpc":"2.0","result":1}', False),
        error_with_odd_method=(b'{"jsonrpc":"2.0","method":5,"id":1,"error":{}}', True),
        empty_body=(b"", False),
        json_null=(b"null", False),
        nan=(b'{"jsonrpc":"2.0","id":1,"result":NaN}', False),
        huge_integer_id=(b'{"jsonrpc":"2.0","id":123456789012345678901234567890,"result":1}', True),
    )
    def test_frame_validation_rules(self, body: bytes, ok: bool) -> None:
        assert (parse_frame(body) is not None) is ok


class GoneVersusBadToken(TunnelCase):
    """S: a session that is gone is told apart from a wrong token."""

    def test_s1_live_session_good_token(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.successResultOf(tunnel.check(SESSION, TOKEN)) is None

    def test_s2_wrong_token_live_session(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.successResultOf(tunnel.check(SESSION, "wrong-token-wrong-token")) == "invalid_token"

    def test_s3_never_registered_is_gone(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.successResultOf(tunnel.check("nope", TOKEN)) == "session_gone"

    def test_s4_dropped_session_is_gone(self) -> None:
        tunnel, _, _ = make_tunnel()
        self.successResultOf(tunnel.drop_session(SESSION))
        assert self.successResultOf(tunnel.check(SESSION, TOKEN)) == "session_gone"

    def test_s5_empty_id_or_token_is_invalid_token(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.successResultOf(tunnel.check("", TOKEN)) == "invalid_token"
        assert self.successResultOf(tunnel.check(SESSION, "")) == "invalid_token"

    def test_s6_validate_is_boolean(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.successResultOf(tunnel.validate(SESSION, TOKEN)) is True
        assert self.successResultOf(tunnel.validate(SESSION, "wrong-token-wrong-token")) is False
        assert self.successResultOf(tunnel.validate("nope", TOKEN)) is False


class ReplyRouting(TunnelCase):
    """R and decision 6: a reply reaches only the client that asked."""

    def test_r1_reply_reaches_only_the_asker(self) -> None:
        tunnel, _, _ = make_tunnel()
        alice, mallory = self.open_sse(tunnel, label="alice"), self.open_sse(tunnel, label="mallory")
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(7), "alice"))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(7)))
        assert [m["id"] for m in alice.messages()] == [7]
        assert mallory.messages() == []

    def test_r2_notification_reaches_everyone(self) -> None:
        tunnel, _, _ = make_tunnel()
        alice, bob = self.open_sse(tunnel, label="alice"), self.open_sse(tunnel, label="bob")
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, NOTE))
        assert len(alice.messages()) == 1 and len(bob.messages()) == 1

    def test_r3_uncorrelated_reply_reaches_nobody_when_labelled(self) -> None:
        tunnel, _, _ = make_tunnel()
        alice = self.open_sse(tunnel, label="alice")
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(999)))
        assert alice.messages() == []

    def test_r4_each_gets_their_own_reply_in_reverse_order(self) -> None:
        tunnel, _, _ = make_tunnel()
        alice, bob = self.open_sse(tunnel, label="alice"), self.open_sse(tunnel, label="bob")
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1), "alice"))
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(2), "bob"))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(2)))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(1)))
        assert [m["id"] for m in alice.messages()] == [1]
        assert [m["id"] for m in bob.messages()] == [2]

    def test_r5_labelled_request_reaches_unlabelled_page(self) -> None:
        tunnel, _, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(3), "alice"))
        assert [m["id"] for m in page.messages()] == [3]

    def test_r6_correlation_consumed_once(self) -> None:
        tunnel, _, _ = make_tunnel()
        alice = self.open_sse(tunnel, label="alice")
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(7), "alice"))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(7)))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(7)))
        assert len(alice.messages()) == 1

    def test_legacy_mode_broadcasts_replies(self) -> None:
        tunnel, _, _ = make_tunnel()
        a, b = self.open_sse(tunnel), self.open_sse(tunnel)
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1)))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(1)))
        assert len(a.messages()) == 1 and len(b.messages()) == 1

    def test_decision6_colliding_ids_each_get_their_own_reply(self) -> None:
        """Two labelled clients both send id 1 before either is answered; each gets its own reply."""
        tunnel, _, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        alice, bob = self.open_sse(tunnel, label="alice"), self.open_sse(tunnel, label="bob")
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1), "alice"))
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1), "bob"))
        seen = [m for m in page.messages() if "id" in m]  # not the peer_joined notifications
        assert seen[0]["id"] == 1 and seen[1]["id"] != 1  # the second was rewritten for the page
        # The page answers in reverse order, echoing the ids it saw.
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(seen[1]["id"], {"for": "bob"})))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(seen[0]["id"], {"for": "alice"})))
        assert alice.messages() == [{"jsonrpc": "2.0", "id": 1, "result": {"for": "alice"}}]
        assert bob.messages() == [{"jsonrpc": "2.0", "id": 1, "result": {"for": "bob"}}]

    def test_decision6_unlabelled_request_colliding_with_a_labelled_one_is_rewritten(self) -> None:
        """An unlabelled agent reusing the id of alice's pending request: the page sees two ids, and
        the answer to the unlabelled request can never be taken for alice's."""
        tunnel, _, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        alice = self.open_sse(tunnel, label="alice")
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1), "alice"))
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1)))
        seen = [m["id"] for m in page.messages() if "id" in m]  # not the peer_joined notification
        assert seen[0] == 1 and seen[1] != 1, seen
        # The page answers the unlabelled request first: it is not alice's, so it reaches nobody
        # (a labelled reader exists); alice then gets her own answer.
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(seen[1], {"for": "anonymous"})))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(seen[0], {"for": "alice"})))
        assert alice.messages() == [{"jsonrpc": "2.0", "id": 1, "result": {"for": "alice"}}]

    def test_decision6_empty_client_label_counts_as_none(self) -> None:
        tunnel, _, _ = make_tunnel()
        anon = self.open_sse(tunnel, label=None)
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1)))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(1)))
        assert len(anon.messages()) == 1  # legacy broadcast: nobody is labelled

    def test_numeric_and_string_ids_do_not_collide(self) -> None:
        tunnel, _, _ = make_tunnel()
        alice, bob = self.open_sse(tunnel, label="alice"), self.open_sse(tunnel, label="bob")
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1), "alice"))
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req("1"), "bob"))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res("1")))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, res(1)))
        assert [m["id"] for m in alice.messages()] == [1]
        assert [m["id"] for m in bob.messages()] == ["1"]

    def test_correlations_bounded_per_session(self) -> None:
        tunnel, _, store = make_tunnel(correlations_per_session=3)
        for i in range(10):
            self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(i), "alice"))
        assert list(store.correlations[SESSION]) == [b"7", b"8", b"9"]


class Presence(TunnelCase):
    """Outbound subscribers are announced to the page (peer_joined/peer_left)."""

    def test_outbound_subscriber_announced_to_page_and_left_on_close(self) -> None:
        tunnel, reactor, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        agent = RecordingSink()
        handle = self.successResultOf(tunnel.open_stream(SESSION, TOKEN, OUTBOUND, None, agent))
        joined = page.messages()[0]
        assert joined == {
            "jsonrpc": "2.0",
            "method": "notifications/peer_joined",
            "params": {"subscriberId": handle.record.id, "ts": int(reactor.seconds() * 1000)},
        }
        assert page.events[0].startswith(
            b'event: mcp\ndata: {"jsonrpc":"2.0","method":"notifications/peer_joined","params":{"subscriberId":'
        )
        self.successResultOf(tunnel.close_stream(handle.record))
        assert page.messages()[1]["method"] == "notifications/peer_left"
        assert page.messages()[1]["params"]["subscriberId"] == handle.record.id

    def test_inbound_subscribers_make_no_presence(self) -> None:
        tunnel, _, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        self.open_sse(tunnel, INBOUND)
        assert page.messages() == []


@expand
class Poll(TunnelCase):
    """P at tunnel level: parking, timeouts, subscriber ids."""

    @cases(
        **{
            "None-20000": (None, 20000),
            "0-0": ("0", 0),
            "1500-1500": ("1500", 1500),
            "999999-25000": ("999999", 25000),
            "minus5-0": ("-5", 0),
            "abc-0": ("abc", 0),
            "empty-0": ("", 0),
            "1500ms-1500": ("1500ms", 1500),
            "1e3-1": ("1e3", 1),
        }
    )
    def test_p4_wait_clamping(self, raw: str | None, expected: int) -> None:
        assert parse_wait_ms(raw) == expected

    def test_poll_parks_until_a_frame_arrives(self) -> None:
        tunnel, reactor, _ = make_tunnel()
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        d = tunnel.poll(SESSION, TOKEN, INBOUND, 10_000, first.subscriber)
        assert not d.called and tunnel.parked_polls() == 1
        reactor.advance(0.1)
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1, "tools/list")))
        result = self.successResultOf(d)
        assert [f["method"] for f in frames_of(result)] == ["tools/list"]
        assert tunnel.parked_polls() == 0 and not reactor.getDelayedCalls()

    def test_p6_poll_times_out_empty(self) -> None:
        tunnel, reactor, _ = make_tunnel()
        d = tunnel.poll(SESSION, TOKEN, INBOUND, 150)
        reactor.advance(0.14)
        assert not d.called
        reactor.advance(0.02)
        assert self.successResultOf(d).frames == []

    def test_p7_abort_takes_nothing_and_frames_stay_queued(self) -> None:
        tunnel, reactor, _ = make_tunnel()
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        d = tunnel.poll(SESSION, TOKEN, INBOUND, 10_000, first.subscriber)
        reactor.advance(0.1)
        d.cancel()
        d.addErrback(lambda f: None)
        assert tunnel.parked_polls() == 0 and not reactor.getDelayedCalls()
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1)))
        again = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0, first.subscriber))
        assert again.subscriber == first.subscriber and len(again.frames) == 1

    def test_put_back_restores_frames_at_the_head(self) -> None:
        tunnel, _, _ = make_tunnel()
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1)))
        taken = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0, first.subscriber))
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(2)))
        self.successResultOf(tunnel.put_back(taken))
        again = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0, first.subscriber))
        assert [f["id"] for f in frames_of(again)] == [1, 2]

    def test_p11_same_subscriber_announced_once(self) -> None:
        tunnel, _, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0))
        for _ in range(2):
            self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0, first.subscriber))
        assert [m["params"]["subscriberId"] for m in page.messages()] == [first.subscriber]

    def test_p13_sse_id_is_never_adopted(self) -> None:
        tunnel, _, _ = make_tunnel()
        handle = self.successResultOf(tunnel.open_stream(SESSION, TOKEN, OUTBOUND, None, RecordingSink()))
        result = self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0, handle.record.id))
        assert result.subscriber != handle.record.id and result.created

    def test_unknown_id_is_adopted_and_uppercase_ignored(self) -> None:
        tunnel, _, _ = make_tunnel()
        result = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0, "0123456789abcdef"))
        assert result.subscriber == "0123456789abcdef" and result.created
        other = self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0, "0123456789abcdef"))
        assert other.subscriber == "0123456789abcdef"  # the same id may live in both directions
        upper = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0, "0123456789ABCDEF"))
        assert upper.subscriber != "0123456789ABCDEF"

    def test_label_set_only_at_creation(self) -> None:
        tunnel, _, store = make_tunnel()
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0, None, "alice"))
        self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0, first.subscriber, "mallory"))
        assert store.subs[SESSION][OUTBOUND][first.subscriber].label == "alice"

    def test_concurrent_polls_first_takes_all(self) -> None:
        tunnel, _, _ = make_tunnel()
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        d1 = tunnel.poll(SESSION, TOKEN, INBOUND, 10_000, first.subscriber)
        d2 = tunnel.poll(SESSION, TOKEN, INBOUND, 10_000, first.subscriber)
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1)))
        assert len(self.successResultOf(d1).frames) + len(self.successResultOf(d2).frames) == 1

    def test_p15_unregister_releases_parked_poll_with_200_then_410(self) -> None:
        tunnel, reactor, _ = make_tunnel()
        d = tunnel.poll(SESSION, TOKEN, OUTBOUND, 10_000)
        assert self.successResultOf(tunnel.unregister(SESSION, TOKEN)) is False
        assert self.successResultOf(d).frames == []
        assert self.refusal(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0)) == "session_gone"
        assert not reactor.getDelayedCalls()

    def test_p16_idle_poller_dropped_with_peer_left(self) -> None:
        tunnel, reactor, _ = make_tunnel(reap_interval_ms=1000, poll_idle_ms=60_000)
        tunnel.start()
        page = self.open_sse(tunnel, INBOUND)
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0))
        for _ in range(30):
            reactor.advance(1)
        assert [m["method"] for m in page.messages()] == ["notifications/peer_joined"]
        for _ in range(40):
            reactor.advance(1)
        assert [m["method"] for m in page.messages()][-1] == "notifications/peer_left"
        assert page.messages()[-1]["params"]["subscriberId"] == first.subscriber
        again = self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0, first.subscriber))
        assert again.created and again.subscriber == first.subscriber
        assert page.messages()[-1]["method"] == "notifications/peer_joined"
        tunnel.stop()

    def test_p17_parked_poller_is_never_pruned(self) -> None:
        """Scaled: idle window 10 s, reaper every 1 s, a poll parked for 25 s is not pruned meanwhile."""
        tunnel, reactor, _ = make_tunnel(reap_interval_ms=1000, poll_idle_ms=10_000)
        tunnel.start()
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0))
        d = tunnel.poll(SESSION, TOKEN, OUTBOUND, 25_000, first.subscriber)
        for _ in range(24):
            reactor.advance(1)
        assert not d.called
        reactor.advance(1)
        assert self.successResultOf(d).frames == []
        again = self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0, first.subscriber))
        assert not again.created
        tunnel.stop()


class Backlog(TunnelCase):
    """PHP relay cases and decision 1: frames sent before any subscriber are kept (bounded)."""

    def test_php4_first_frame_before_any_subscriber_is_kept(self) -> None:
        tunnel, _, _ = make_tunnel()
        init = b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{}}'
        assert self.successResultOf(tunnel.inbox(SESSION, TOKEN, init)) is None
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        assert [f["method"] for f in frames_of(first)] == ["initialize"]

    def test_php5_backlog_goes_to_the_first_subscriber_only(self) -> None:
        tunnel, _, _ = make_tunnel()
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1)))
        assert len(self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0)).frames) == 1
        assert self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0)).frames == []

    def test_php6_normal_path(self) -> None:
        tunnel, _, _ = make_tunnel()
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1, "tools/list")))
        result = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0, first.subscriber))
        assert [f["method"] for f in frames_of(result)] == ["tools/list"]

    def test_decision1_backlog_capped_at_64_oldest_dropped_and_given_to_sse(self) -> None:
        tunnel, _, _ = make_tunnel()
        for i in range(70):
            self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(i)))
        handle = self.successResultOf(tunnel.open_stream(SESSION, TOKEN, INBOUND, None, RecordingSink()))
        ids = [json.loads(frame.raw)["id"] for frame in handle.backlog]
        assert ids == list(range(6, 70))

    def test_presence_is_not_backlogged(self) -> None:
        tunnel, _, _ = make_tunnel()
        self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0))
        assert self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0)).frames == []


class SseFraming(TunnelCase):
    """Decision 4: newline-safe SSE framing, encoded once."""

    def test_decision4_multiline_frame_sent_on_one_line_and_compact_frames_pass_verbatim(self) -> None:
        tunnel, _, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        pretty = b'{\r\n  "jsonrpc": "2.0",\n  "id": 1,\r  "method": "x"\n}'
        compact_odd = b'{"jsonrpc":"2.0",   "method":"y" ,"id":2}'
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, pretty))
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, compact_odd))
        # Line breaks are whitespace between tokens in valid JSON: removed, nothing else changes.
        assert page.events[0] == b'event: mcp\ndata: {  "jsonrpc": "2.0",  "id": 1,  "method": "x"}\n\n'
        assert page.events[1] == b"event: mcp\ndata: " + compact_odd + b"\n\n"

    def test_frame_encoded_once_per_broadcast(self) -> None:
        tunnel, _, _ = make_tunnel()
        sinks = [self.open_sse(tunnel, INBOUND) for _ in range(3)]
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(1)))
        assert sinks[0].events[0] is sinks[1].events[0] is sinks[2].events[0]


class SessionLifetime(TunnelCase):
    """Decision 7: open subscribers keep a session alive; the TTL reaper ends the rest."""

    def test_ttl_reaper_expires_idle_session_and_ends_streams(self) -> None:
        tunnel, reactor, _ = make_tunnel(ttl_ms=120_000, reap_interval_ms=60_000)
        tunnel.start()
        reactor.advance(60)
        assert self.successResultOf(tunnel.check(SESSION, TOKEN)) is None  # a touch slides the TTL
        reactor.advance(120)
        assert self.successResultOf(tunnel.check(SESSION, TOKEN)) is None  # last seen 120 s ago: not strictly older
        for _ in range(4):
            reactor.advance(60)
        assert self.successResultOf(tunnel.check(SESSION, TOKEN)) == "session_gone"
        tunnel.stop()

    def test_decision7_open_stream_keeps_session_alive_and_reaper_closes_the_rest(self) -> None:
        tunnel, reactor, _ = make_tunnel(ttl_ms=120_000, reap_interval_ms=60_000)
        tunnel.start()
        page = RecordingSink()
        handle = self.successResultOf(tunnel.open_stream(SESSION, TOKEN, INBOUND, None, page))
        for _ in range(10):
            reactor.advance(60)
        assert self.successResultOf(tunnel.check(SESSION, TOKEN)) is None and not page.ended
        self.successResultOf(tunnel.close_stream(handle.record))
        for _ in range(4):
            reactor.advance(60)
        assert self.successResultOf(tunnel.check(SESSION, TOKEN)) == "session_gone"
        tunnel.stop()

    def test_reaper_ends_streams_of_expired_session_without_peer_left(self) -> None:
        tunnel, reactor, _ = make_tunnel(ttl_ms=60_000, reap_interval_ms=0)
        page = RecordingSink()
        self.successResultOf(tunnel.open_stream(SESSION, TOKEN, INBOUND, None, page))
        agent = RecordingSink()
        agent_handle = self.successResultOf(tunnel.open_stream(SESSION, TOKEN, OUTBOUND, None, agent))
        tunnel._sinks.clear()  # the streams are on "another process": nothing keeps the session alive here
        reactor.advance(61)
        self.successResultOf(tunnel.reap())
        assert self.successResultOf(tunnel.check(SESSION, TOKEN)) == "session_gone"
        self.successResultOf(tunnel.close_stream(agent_handle.record))
        assert [m["method"] for m in page.messages()] == ["notifications/peer_joined"]

    def test_unregister_ends_streams(self) -> None:
        tunnel, _, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        assert self.successResultOf(tunnel.unregister(SESSION, TOKEN)) is False
        assert page.ended
        assert self.successResultOf(tunnel.unregister(SESSION, TOKEN)) is True  # already gone
        assert self.refusal(tunnel.unregister(SESSION, "")) == "invalid_token"


class BoundedMemory(TunnelCase):
    """Decision 9: queues, buffered bytes and sessions are bounded."""

    def test_decision9_poller_that_never_reads_is_bounded_and_told_what_it_lost(self) -> None:
        tunnel, _, store = make_tunnel(queue_max_frames=10)
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        for i in range(1000):
            self.successResultOf(tunnel.inbox(SESSION, TOKEN, req(i)))
        assert store.max_queue_items_seen == 10
        frames = frames_of(self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0, first.subscriber)))
        assert frames[0] == {"jsonrpc": "2.0", "method": FRAMES_DROPPED, "params": {"count": 990}}
        assert [f["id"] for f in frames[1:]] == list(range(990, 1000))

    def test_decision9_queue_byte_bound(self) -> None:
        tunnel, _, store = make_tunnel(queue_max_bytes=2000)
        self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        big = json.dumps({"jsonrpc": "2.0", "method": "n", "params": {"x": "y" * 500}}).encode()
        for _ in range(100):
            self.successResultOf(tunnel.inbox(SESSION, TOKEN, big))
        (queue,) = store.queues.values()
        assert queue.bytes <= 2000 and len(queue.items) <= 3

    def test_decision9_session_cap(self) -> None:
        tunnel, _, _ = make_tunnel(max_sessions=2)
        self.successResultOf(tunnel.register("second", TOKEN))
        self.open_sse(tunnel, INBOUND)
        self.successResultOf(tunnel.open_stream("second", TOKEN, OUTBOUND, None, RecordingSink()))
        assert self.refusal(tunnel.register("third", TOKEN)) == "too_many_sessions"  # both have readers
        self.successResultOf(tunnel.register("second", TOKEN))  # re-register of an existing session is not a new one

    def test_at_the_session_cap_the_least_recently_seen_session_without_readers_ends(self) -> None:
        tunnel, reactor, store = make_tunnel(max_sessions=3)
        self.successResultOf(tunnel.register("read", TOKEN))
        reader = RecordingSink()
        self.successResultOf(tunnel.open_stream("read", TOKEN, INBOUND, None, reader))
        reactor.advance(1)
        self.successResultOf(tunnel.register("idle", TOKEN))  # exactly at the cap: nothing ends
        assert sorted(store.sessions) == ["idle", "read", SESSION]
        reactor.advance(1)
        self.successResultOf(tunnel.check("sess", TOKEN))  # seen after "idle" was
        self.successResultOf(tunnel.register("fresh", TOKEN))  # one over: "idle" ends, not "read" (a reader)
        assert sorted(store.sessions) == ["fresh", "read", SESSION]
        assert self.successResultOf(tunnel.check("idle", TOKEN)) == "session_gone"
        assert not reader.ended

    def test_sessions_per_address_end_that_addresses_oldest_without_readers_first(self) -> None:
        tunnel, reactor, store = make_tunnel(sessions_per_address=2)
        for name in ("a-one", "a-two"):
            self.successResultOf(tunnel.register(name, TOKEN, "192.0.2.1"))
            reactor.advance(1)
        self.successResultOf(tunnel.register("b-one", TOKEN, "192.0.2.2"))
        self.successResultOf(tunnel.register("a-three", TOKEN, "192.0.2.1"))  # one over for that address
        assert sorted(store.sessions) == ["a-three", "a-two", "b-one", SESSION]
        for name in ("a-two", "a-three"):
            self.successResultOf(tunnel.open_stream(name, TOKEN, INBOUND, None, RecordingSink()))
        assert self.refusal(tunnel.register("a-four", TOKEN, "192.0.2.1")) == "too_many_sessions"
        self.successResultOf(tunnel.register("b-two", TOKEN, "192.0.2.2"))  # another address is not held up
        self.successResultOf(tunnel.register("anonymous", TOKEN))  # no address: only the total counts
        assert sorted(store.sessions) == ["a-three", "a-two", "anonymous", "b-one", "b-two", SESSION]
        assert store.owned == {"192.0.2.1": {"a-two", "a-three"}, "192.0.2.2": {"b-one", "b-two"}}

    def test_readers_per_session_are_capped(self) -> None:
        # A poll without subscriber= makes a new reader: unbounded, a client could make millions.
        tunnel, _, _ = make_tunnel(max_subscribers=3)
        self.open_sse(tunnel, OUTBOUND)
        first = self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0))
        self.successResultOf(tunnel.poll(SESSION, TOKEN, OUTBOUND, 0))  # exactly at the cap
        assert self.refusal(tunnel.poll(SESSION, TOKEN, INBOUND, 0)) == "too_many_subscribers"
        assert self.refusal(tunnel.open_stream(SESSION, TOKEN, INBOUND, None, RecordingSink())) == "too_many_subscribers"
        self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0, first.subscriber))  # an existing one polls on


class Register(TunnelCase):
    """Register rules and drain."""

    def test_register_rules(self) -> None:
        tunnel, _, _ = make_tunnel()
        assert self.refusal(tunnel.register("a/b!", TOKEN)) == "invalid_session_id"
        assert self.refusal(tunnel.register("abc", TOKEN)) == "invalid_session_id"
        assert self.refusal(tunnel.register("x" * 65, TOKEN)) == "invalid_session_id"
        assert self.refusal(tunnel.register("okay", "short")) == "invalid_token"
        assert self.refusal(tunnel.register("okay", "t" * 129)) == "invalid_token"
        assert self.refusal(tunnel.register(SESSION, "another-token-entirely")) == "session_taken"
        assert self.successResultOf(tunnel.register(SESSION, TOKEN)) is None
        # An astral character counts two UTF-16 units, as JavaScript's .length does.
        assert self.successResultOf(tunnel.register("astral", "\U0001f600" * 8)) is None
        assert self.refusal(tunnel.register("astral2", "\U0001f600" * 65)) == "invalid_token"

    def test_drain_ends_streams_and_answers_polls(self) -> None:
        tunnel, _, _ = make_tunnel()
        page = self.open_sse(tunnel, INBOUND)
        d = tunnel.poll(SESSION, TOKEN, OUTBOUND, 10_000)
        tunnel.drain()
        assert page.ended and self.successResultOf(d).frames == []
        assert tunnel.open_streams() == 0 and tunnel.parked_polls() == 0


# Hostile values: total parsing and writing, the bound on bytes held for absent readers ---------------


class HostileValues(TunnelCase):
    """Whatever a client sends, the tunnel relay answers with a result or a refusal, never an exception."""

    def test_wait_is_total_over_any_text(self) -> None:
        for raw, expected in [("9" * 5000, 25000), ("-" + "9" * 5000, 0), ("0" * 5000 + "7", 7), ("+7", 7),
                              ("\u0663", 0), (" \t12", 12), ("\ufffd", 0), ("-0", 0), ("25000", 25000)]:
            self.assertEqual(parse_wait_ms(raw), expected, raw[:12])

        @settings(max_examples=300, deadline=None, database=None)
        @given(st.text(st.characters(exclude_categories=())))
        def total(text: str) -> None:
            self.assertIn(parse_wait_ms(text), range(0, 25001))

        total()

    def test_lone_surrogates_and_huge_numbers_in_ids_are_routed(self) -> None:
        tunnel, _, _ = make_tunnel()
        agent = self.open_sse(tunnel, OUTBOUND, label="a")
        other = self.open_sse(tunnel, OUTBOUND, label="b")
        for label in ("a", "b"):  # the same id from two clients: the second is rewritten
            self.successResultOf(tunnel.inbox(SESSION, TOKEN, b'{"jsonrpc":"2.0","id":"\\ud800","method":"m"}', label))
        (first, second) = [json.loads(json.loads(f)) for f in self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0)).frames]
        self.assertEqual(first["id"], "\ud800")
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, json.dumps({"jsonrpc": "2.0", "id": second["id"], "result": 2}).encode()))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, b'{"jsonrpc":"2.0","id":"\\ud800","result":1}'))
        self.assertEqual([(m["id"], m["result"]) for m in agent.messages()[-1:]], [("\ud800", 1)])
        self.assertEqual([(m["id"], m["result"]) for m in other.messages()[-1:]], [("\ud800", 2)])
        for number in (b"9" * 5000, b"1e400", b"-1e400", b"123456789012345678901234567890"):
            self.successResultOf(tunnel.inbox(SESSION, TOKEN, b'{"jsonrpc":"2.0","id":' + number + b',"method":"m"}', "a"))

    def test_ids_nested_too_deep_to_write_are_refused_not_raised(self) -> None:
        tunnel, _, _ = make_tunnel()
        deep = b"[" * 1000 + b"]" * 1000  # read (orjson allows 1024 levels), too deep to write back
        request = b'{"jsonrpc":"2.0","method":"m","id":' + deep + b"}"
        self.assertEqual(self.refusal(tunnel.inbox(SESSION, TOKEN, request, "a")), "invalid_token_or_frame")
        response = b'{"jsonrpc":"2.0","result":1,"id":' + deep + b"}"
        self.assertEqual(self.refusal(tunnel.outbox(SESSION, TOKEN, response)), "invalid_token_or_frame")
        shallow = b"[" * 300 + b"]" * 300  # deeper than orjson writes, not than the json module does
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, b'{"jsonrpc":"2.0","method":"m","id":' + shallow + b"}", "a"))

    def test_sse_event_keeps_every_value_and_loses_only_line_breaks(self) -> None:
        raw = b'{"jsonrpc":"2.0",\r\n"method":"m",\n"params":[1e400,"\\ud800",123456789012345678901234567890]\r}'
        frame = parse_frame(raw)
        assert frame is not None
        self.assertEqual(frame.sse, b"event: mcp\ndata: " + raw.translate(None, b"\r\n") + b"\n\n")

    def test_buffered_bound_is_checked_before_storing(self) -> None:
        note = b'{"jsonrpc":"2.0","method":"m","params":"' + b"x" * 58 + b'"}'  # 100 bytes
        tunnel, _, store = make_tunnel(max_buffered_bytes=250)
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, note))
        self.successResultOf(tunnel.outbox(SESSION, TOKEN, note[:-14] + b'"}'))  # 88: 188 held
        self.assertEqual(self.refusal(tunnel.inbox(SESSION, TOKEN, note)), "buffer_full")  # 288 > 250
        self.successResultOf(tunnel.inbox(SESSION, TOKEN, note[:-40] + b'"}'))  # 62: exactly 250
        self.assertEqual(store.buffered, 250)
        self.assertEqual(self.refusal(tunnel.inbox(SESSION, TOKEN, b'{"jsonrpc":"2.0","method":"m"}')), "buffer_full")
        self.assertEqual(len(self.successResultOf(tunnel.poll(SESSION, TOKEN, INBOUND, 0)).frames), 2)
        self.assertEqual(store.buffered, 88)
