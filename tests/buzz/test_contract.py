"""The contract checks, items 1-37 (docs/broker.md "HTTP" and "The nine actions"), against relayd.buzz.core.contract."""

from __future__ import annotations

import json
from typing import Any

from twisted.trial import unittest

from relayd.buzz import nostr
from relayd.buzz.core import contract as c
from tests.buzz.harness import (
    ARGS,
    CHANNEL,
    EVENT,
    OUTCOMES,
    PUBKEY,
    READ_EVENT,
    RID,
    error_wire,
    member_paths,
    request_wire,
    set_path,
    success_wire,
)
from tests.support.cases import cases, expand


def req_bytes(tree: Any) -> bytes:
    return json.dumps(tree).encode()


def parse_req(tree: Any) -> c.Request:
    return c.parse_request(req_bytes(tree))


class ContractCase(unittest.TestCase):
    """The checks every section uses: a request or response the contract must refuse."""

    def rejects_req(self, tree: Any, code: str = "invalid_request") -> None:
        with self.assertRaises(c.ContractError) as info:
            parse_req(tree)
        assert info.exception.code == code, info.exception.message

    def rejects_resp(self, tree: Any, request: c.Request | None = None) -> None:
        data = tree if isinstance(tree, bytes) else json.dumps(tree).encode()
        with self.assertRaises(c.MalformedResponse):
            c.parse_response(data, request)

    def _bad(self, action: str, args: dict[str, Any], fragment: str = "") -> None:
        """Building C{action} with C{args} is refused, with C{fragment} in the message."""
        with self.assertRaises(c.ContractError) as info:
            c.build_request(action, args, RID)
        assert fragment in info.exception.message


# --- schema.rs -------------------------------------------------------------------------------


def _all_requests() -> list[dict[str, Any]]:
    return [request_wire(a) for a in c.ACTIONS] + [
        request_wire("agents.update", {**ARGS["agents.update"], "target": {"name": "x"}})
    ]


def _all_responses() -> list[dict[str, Any]]:
    return [success_wire(a, replayed=True) for a in c.ACTIONS] + [
        error_wire("failed", "action_failed", replayed=True),
        error_wire("indeterminate", "outcome_unknown", replayed=True),
    ]


BAD_NAMES = [
    "channel.write",
    "agents.exfiltrate",
    "",
    "channel.read ",
    "sign",
    "sign_event",
    "publish",
    "nip44.encrypt",
    "nip44.decrypt",
    "nip42.auth",
    "nip98.auth",
    "keys.export",
    "identity.nsec",
    "presence.set",
    "typing.set",
]


@expand
class Schema(ContractCase):
    def test_01_fixtures_cover_all_nine_actions_unique_names(self) -> None:
        assert len(set(c.ACTIONS)) == len(c.ACTIONS) == 9
        assert set(ARGS) == set(OUTCOMES) == set(c.ACTIONS) == set(c.ARGS) == set(c.OUTCOMES)

    @cases(**{a: a for a in c.ACTIONS})
    def test_02_every_action_round_trips_in_a_request(self, action: str) -> None:
        req = c.build_request(action, ARGS[action], RID)
        wire = json.loads(c.freeze(req))
        assert wire["type"] == "broker_request"
        assert wire["protocolVersion"] == 1 and wire["actionVersion"] == 1
        assert wire["requestId"] == RID and wire["action"] == action
        assert isinstance(wire["args"], dict)
        again = c.parse_request(c.freeze(req))
        assert again == req
        assert c.freeze(again) == c.freeze(req)

    @cases(**{a: a for a in c.ACTIONS})
    def test_03_every_outcome_round_trips_in_a_succeeded_response(self, action: str) -> None:
        resp = c.succeeded(RID, action, c.OUTCOMES[action].parse(OUTCOMES[action], "outcome"))
        wire = json.loads(c.serialize_response(resp))
        assert wire["status"] == "succeeded" and wire["action"] == action
        assert "error" not in wire and "replayed" not in wire
        assert c.parse_response(c.serialize_response(resp)) == resp

    def test_04_args_of_another_action_rejected(self) -> None:
        self.rejects_req(request_wire("agents.delete", {"channelId": CHANNEL, "content": "hi"}))

    def test_05_response_strictness(self) -> None:
        ok = success_wire("message.post")
        fail = error_wire("failed", "action_failed")
        ind = error_wire("indeterminate", "outcome_unknown")
        c.parse_response(json.dumps(ok).encode())
        for base in (ok, fail):
            for extra in ("hostNote", "secretKey", "credential"):
                self.rejects_resp({**base, extra: "x"})
        self.rejects_resp({**ok, "error": {"code": "internal", "message": "x"}})
        for base in (fail, ind):
            self.rejects_resp({**base, "action": "message.post", "outcome": OUTCOMES["message.post"]})
        self.rejects_resp({k: v for k, v in ok.items() if k != "outcome"})
        self.rejects_resp({k: v for k, v in fail.items() if k != "error"})
        for status in ("succeeded_partially", "pending", "SUCCEEDED", ""):
            self.rejects_resp({**ok, "status": status})
            self.rejects_resp({**fail, "status": status})
        self.rejects_resp(set_path(ok, ("outcome", "extra"), 1))
        self.rejects_resp(set_path(fail, ("error", "extra"), 1))

    @cases(first=False, replayed=True)
    def test_06_reader_accepts_exactly_writer_output(self, replayed: bool) -> None:
        responses = [
            c.Response(RID, "succeeded", action=a, outcome=c.OUTCOMES[a].parse(OUTCOMES[a], "o"), replayed=replayed)
            for a in c.ACTIONS
        ]
        responses.append(c.Response(RID, "failed", code="action_failed", message="m", replayed=replayed))
        responses.append(c.Response(RID, "indeterminate", code="outcome_unknown", message="m", replayed=replayed))
        for r in responses:
            data = c.dumps(r.to_wire())
            assert c.parse_response(data) == r
            assert ("replayed" in json.loads(data)) is replayed

    def test_07_request_strictness(self) -> None:
        for extra in ("hostNote", "secretKey", "onBehalfOf", "envVars"):
            self.rejects_req({**request_wire("message.post"), extra: "x"})
            self.rejects_req(request_wire("message.post", {**ARGS["message.post"], extra: "x"}))
        self.rejects_req({**request_wire("message.post"), "outcome": {}})
        for missing in ("type", "protocolVersion", "actionVersion", "args"):
            tree = request_wire("message.post")
            del tree[missing]
            self.rejects_req(tree)
        tree = request_wire("message.post")
        del tree["requestId"]
        with self.assertRaises(c.RequestIdError):
            parse_req(tree)

    def test_08_null_anywhere_rejected(self) -> None:
        checked = 0
        for tree in _all_requests():
            for path in member_paths(tree):
                bad = set_path(tree, path, None)
                with self.assertRaises(c.ContractError):
                    parse_req(bad)
                checked += 1
        for tree in _all_responses():
            for path in member_paths(tree):
                self.rejects_resp(set_path(tree, path, None))
                checked += 1
        assert checked > 100
        self.rejects_resp(set_path(success_wire("channel.read"), ("outcome", "messages", 0, "id"), None))
        self.rejects_req(request_wire("channel.read", {"channelId": CHANNEL, "mentionsOnly": None}))
        self.rejects_resp({**success_wire("message.post"), "replayed": None})

    def test_09_status_incompatible_member_as_null_rejected(self) -> None:
        self.rejects_resp({**success_wire("message.post"), "error": None})
        for status, code in (("failed", "action_failed"), ("indeterminate", "outcome_unknown")):
            base = error_wire(status, code)
            self.rejects_resp({**base, "action": None})
            self.rejects_resp({**base, "outcome": None})
            self.rejects_resp({**base, "action": None, "outcome": None})

    @cases(**{(n.strip() or "empty") + ("_trailing_space" if n.endswith(" ") else ""): n for n in BAD_NAMES})
    def test_10_only_the_nine_names_resolve(self, name: str) -> None:
        tree = request_wire("message.post")
        tree["action"] = name
        self.rejects_req(tree, "unknown_action")
        self.rejects_resp({**success_wire("message.post"), "action": name})

    def test_11_versions_and_types(self) -> None:
        for v in (0, 2, 999):
            self.rejects_req({**request_wire("message.post"), "protocolVersion": v}, "unsupported_protocol_version")
            self.rejects_resp({**success_wire("message.post"), "protocolVersion": v})
        self.rejects_req({**request_wire("message.post"), "actionVersion": 7}, "unsupported_action_version")
        self.rejects_req({**request_wire("message.post"), "type": "broker_result"})
        self.rejects_resp({**success_wire("message.post"), "type": "broker_request"})

    @cases(
        empty=("", False),
        space=("has space", False),
        newline=("has\nnewline", False),
        delete=("has\u007fdel", False),
        punctuation=("req/1-a.b:c", True),
        length_128=("a" * 128, True),
        length_129=("a" * 129, False),
    )
    def test_12_request_id_grammar(self, rid: str, ok: bool) -> None:
        tree = request_wire("message.post", rid=rid)
        if ok:
            assert parse_req(tree).request_id == rid
            c.parse_response({**success_wire("message.post"), "requestId": rid})
        else:
            with self.assertRaises(c.RequestIdError):
                parse_req(tree)
            self.rejects_resp({**success_wire("message.post"), "requestId": rid})

    def test_13_duplicate_keys_rejected(self) -> None:
        outcome_dup = (
            b'{"type":"broker_result","protocolVersion":1,"requestId":"r","status":"succeeded",'
            b'"action":"agents.delete","outcome":{"agentPubkey":"' + PUBKEY.encode() + b'",'
            b'"displayName":"a","displayName":"b"}}'
        )
        self.rejects_resp(outcome_dup)
        assert c.parse_response(outcome_dup.replace(b'"displayName":"a",', b""))
        top_dup = (
            b'{"type":"broker_request","protocolVersion":1,"requestId":"r","requestId":"r",'
            b'"actionVersion":1,"action":"storage.address","args":{"slug":"core"}}'
        )
        with self.assertRaises(c.RequestIdError):
            c.parse_request(top_dup)
        assert c.parse_request(top_dup.replace(b'"requestId":"r",', b"", 1)).action == "storage.address"
        action_dup = top_dup.replace(b'"requestId":"r","requestId":"r"', b'"requestId":"r","action":"x"')
        with self.assertRaises(c.ContractError):
            c.parse_request(action_dup)
        err_dup = (
            b'{"type":"broker_result","protocolVersion":1,"requestId":"r","status":"failed",'
            b'"error":{"code":"internal","message":"a","message":"b"}}'
        )
        self.rejects_resp(err_dup)
        assert c.parse_response(err_dup.replace(b'"message":"a",', b""))
        target_dup = (
            b'{"type":"broker_request","protocolVersion":1,"requestId":"r","actionVersion":1,'
            b'"action":"agents.delete","args":{"target":{"name":"a"},"target":{"name":"b"}}}'
        )
        with self.assertRaises(c.ContractError):
            c.parse_request(target_dup)
        assert c.parse_request(target_dup.replace(b'"target":{"name":"a"},', b""))


# --- wire_schema.rs ---------------------------------------------------------------------------

EXPECTED_ARGS = {
    "channel.read": "channelId,cursor,limit,mentionsOnly,rootEventId",
    "message.post": "channelId,content,mentions",
    "message.reply": "channelId,content,mentions,replyToEventId",
    "reaction.add": "channelId,reaction,targetEventId",
    "profile.set": "about,displayName,picture",
    "storage.address": "slug",
    "agents.create": "channelId,displayName,model,provider,respondTo,runtime,systemPrompt",
    "agents.update": "displayName,model,provider,respondTo,runtime,systemPrompt,target",
    "agents.delete": "target",
}
EXPECTED_OUTCOMES = {
    "channel.read": "messages,nextCursor",
    "message.post": "createdAt,eventId,kind",
    "message.reply": "createdAt,eventId,kind",
    "reaction.add": "createdAt,eventId,kind",
    "profile.set": "createdAt,eventId,kind",
    "storage.address": "authorPubkey,dTag,kind",
    "agents.create": "agentPubkey,channelId,displayName",
    "agents.update": "agentPubkey,displayName,updatedFields",
    "agents.delete": "agentPubkey,displayName",
}


@expand
class WireSchema(ContractCase):
    def test_14_exact_member_sets(self) -> None:
        assert ",".join(sorted(c.REQUEST_MEMBERS)) == "action,actionVersion,args,protocolVersion,requestId,type"
        full_ok = c.Response(RID, "succeeded", "message.post", OUTCOMES["message.post"]).to_wire(replayed=True)
        assert ",".join(sorted(full_ok)) == "action,outcome,protocolVersion,replayed,requestId,status,type"
        for status in ("failed", "indeterminate"):
            w = c.Response(RID, status, code="internal", message="m").to_wire(replayed=True)
            assert ",".join(sorted(w)) == "error,protocolVersion,replayed,requestId,status,type"
            assert ",".join(sorted(w["error"])) == "code,message"
        all_names: set[str] = set(c.REQUEST_MEMBERS) | set(full_ok) | {"code", "message"}
        for action in c.ACTIONS:
            assert ",".join(sorted(c.ARGS[action].members)) == EXPECTED_ARGS[action]
            assert ",".join(sorted(c.OUTCOMES[action].members)) == EXPECTED_OUTCOMES[action]
            all_names |= c.ARGS[action].members | c.OUTCOMES[action].members
        all_names |= c.EVENT_MEMBERS | {"pubkey", "name"}
        for name in all_names:
            for bad in ("secret", "private", "nsec", "seckey", "credential", "token"):
                assert bad not in name.lower()

    def test_15_no_authority_or_secret_members(self) -> None:
        assert len(request_wire("message.post")) == 6
        for extra in ("ownerPubkey", "onBehalfOf", "envVars", "secretKey"):
            self.rejects_req(request_wire("agents.create", {**ARGS["agents.create"], extra: PUBKEY}))
        self.rejects_req(request_wire("channel.read", {"channelId": CHANNEL, "mentionsOf": PUBKEY}))
        self.rejects_req(request_wire("profile.set", {"displayName": "x", "pubkey": PUBKEY}))
        for extra in ("nsec", "secretKey", "seckey", "credential"):
            self.rejects_resp(set_path(success_wire("agents.create"), ("outcome", extra), "x"))

    def test_16_siblings_of_action_args_or_outcome_rejected(self) -> None:
        for extra in ("secretKey", "nsec", "outcome", "unexpected"):
            self.rejects_req({**request_wire("message.post"), extra: {}})
        for extra in ("secretKey", "nsec", "args", "unexpected"):
            self.rejects_resp({**success_wire("message.post"), extra: {}})

    @cases(
        not_hex="nothex", hex_40="a" * 40, hex_66="a" * 66, nsec="nsec1deadbeef", all_f="f" * 64, zeros_then_5="0" * 63 + "5"
    )
    def test_17_pubkey_rejections(self, bad: str) -> None:
        self.rejects_req(request_wire("message.post", {"channelId": CHANNEL, "content": "x", "mentions": [bad]}))

    def test_17_pubkey_uppercase_normalised(self) -> None:
        req = parse_req(request_wire("message.post", {"channelId": CHANNEL, "content": "x", "mentions": [PUBKEY.upper()]}))
        assert req.args["mentions"] == [PUBKEY]
        built = c.build_request("agents.delete", {"target": {"pubkey": PUBKEY.upper()}}, RID)
        assert built.args["target"]["pubkey"] == PUBKEY


# --- validation.rs -----------------------------------------------------------------------------


def _ok(action: str, args: dict[str, Any]) -> c.Request:
    return c.build_request(action, args, RID)


def _resp(action: str, outcome: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "type": "broker_result",
            "protocolVersion": 1,
            "requestId": RID,
            "status": "succeeded",
            "action": action,
            "outcome": outcome,
        }
    ).encode()


OTHER_CHANNEL = "5df7dfa8-e919-43df-8efd-f1dcb8af7071"
OTHER_PUBKEY = nostr.Signer((9).to_bytes(32, "big")).pubkey


@expand
class Validation(ContractCase):
    def test_18_boundaries(self) -> None:
        read = {"channelId": CHANNEL}
        self._bad("channel.read", {"channelId": "not-a-uuid"})
        self._bad("channel.read", {**read, "rootEventId": "nothex"})
        _ok("channel.read", {**read, "rootEventId": EVENT})
        self._bad("channel.read", {**read, "limit": 0})
        _ok("channel.read", {**read, "limit": 500})
        self._bad("channel.read", {**read, "limit": 501})
        for bad_limit in (True, 50.0, "50", -1):
            self._bad("channel.read", {**read, "limit": bad_limit})
        self.rejects_req(request_wire("channel.read", {**read, "limit": 50.0}))
        raw = json.dumps(request_wire("channel.read", read))[:-2] + ',"limit":1e2}}'
        with self.assertRaises(c.ContractError):
            c.parse_request(raw.encode())
        self._bad("channel.read", {**read, "mentionsOnly": 1})
        self._bad("channel.read", {**read, "cursor": ""})
        self._bad("channel.read", {**read, "cursor": "has space"})
        _ok("channel.read", {**read, "cursor": "a" * 256})
        self._bad("channel.read", {**read, "cursor": "a" * 257})
        post = {"channelId": CHANNEL}
        self._bad("message.post", {**post, "content": "   "})
        _ok("message.post", {**post, "content": "a" * 65_536})
        self._bad("message.post", {**post, "content": "a" * 65_537}, "too large")
        self._bad("message.post", {**post, "content": "é" * 32_769}, "too large")  # 65,538 bytes, 32,769 chars
        keys = [nostr.Signer((i + 1).to_bytes(32, "big")).pubkey for i in range(51)]
        _ok("message.post", {**post, "content": "x", "mentions": keys[:50]})
        self._bad("message.post", {**post, "content": "x", "mentions": keys}, "too many")
        self._bad("message.post", {**post, "content": "x", "mentions": []})
        react = {"channelId": CHANNEL, "targetEventId": EVENT}
        self._bad("reaction.add", {**react, "reaction": " "})
        _ok("reaction.add", {**react, "reaction": ":shipit:"})
        _ok("reaction.add", {**react, "reaction": ":" + "a" * 64 + ":"})
        self._bad("reaction.add", {**react, "reaction": "a" * 67}, "at most 66")
        for good in ("core", "mem/broker-foundation"):
            _ok("storage.address", {"slug": good})
        for bad in ("", "Core", "secrets", "mem/Bad Slug", "mem/", "mem//a", "mem/" + "a" * 65):
            self._bad("storage.address", {"slug": bad})
        self._bad("profile.set", {}, "at least one")
        self._bad("profile.set", {"displayName": "  "})
        _ok("profile.set", {"displayName": "x" * 120})
        self._bad("profile.set", {"displayName": "x" * 121})
        self._bad("agents.update", {"target": {"pubkey": PUBKEY}}, "at least one field")
        _ok("agents.update", {"target": {"pubkey": PUBKEY}, "respondTo": "anyone"})
        self._bad("agents.update", {"target": {"pubkey": PUBKEY}, "respondTo": "allowlist"})
        self._bad("agents.delete", {"target": {"name": "  "}})
        self._bad("agents.delete", {"target": {"name": "a", "pubkey": PUBKEY}})
        self._bad("agents.delete", {"target": {}})

    def test_18_white_space_is_the_unicode_set(self) -> None:
        # U+001C-U+001F are not White_Space (Python's strip() would remove them).
        assert _ok("profile.set", {"displayName": "\x1chelper"}).args["displayName"] == "\x1chelper"
        padded = "\u3000\u2028\u0085 helper\u00a0\u202f\t"
        assert _ok("profile.set", {"displayName": padded}).args["displayName"] == "helper"

    def test_18_character_limits_count_code_points(self) -> None:
        _ok("profile.set", {"displayName": "🐝" * 120})  # 240 UTF-16 units, 480 bytes, 120 characters
        self._bad("profile.set", {"displayName": "🐝" * 121})

    def test_19_frozen_body_carries_normalised_values(self) -> None:
        assert _ok("agents.delete", {"target": {"name": "  helper  "}}).args["target"] == {"name": "helper"}
        assert _ok("reaction.add", {"channelId": CHANNEL, "targetEventId": EVENT, "reaction": "  🐝  "}).args[
            "reaction"
        ] == "🐝"
        padded = {
            "channelId": "  " + CHANNEL.upper() + " ",
            "displayName": " helper ",
            "systemPrompt": "\tBe helpful.\n",
        }
        trimmed = {"channelId": CHANNEL, "displayName": "helper", "systemPrompt": "Be helpful."}
        assert c.freeze(_ok("agents.create", padded)) == c.freeze(_ok("agents.create", trimmed))
        # content is published verbatim
        assert _ok("message.post", {"channelId": CHANNEL, "content": "  hi \n"}).args["content"] == "  hi \n"

    def test_20_correlation(self) -> None:
        create = _ok("agents.create", ARGS["agents.create"])
        c.parse_response(_resp("agents.create", OUTCOMES["agents.create"]), create)
        self.rejects_resp(_resp("agents.create", {**OUTCOMES["agents.create"], "channelId": OTHER_CHANNEL}), create)
        for action in ("agents.update", "agents.delete"):
            by_pk = _ok(action, {**ARGS[action], "target": {"pubkey": PUBKEY}})
            c.parse_response(_resp(action, OUTCOMES[action]), by_pk)
            self.rejects_resp(_resp(action, {**OUTCOMES[action], "agentPubkey": OTHER_PUBKEY}), by_pk)
        by_name = _ok("agents.delete", {"target": {"name": "helper"}})
        c.parse_response(_resp("agents.delete", {**OUTCOMES["agents.delete"], "agentPubkey": OTHER_PUBKEY}), by_name)
        post = _ok("message.post", ARGS["message.post"])
        c.parse_response(_resp("message.post", {**OUTCOMES["message.post"], "eventId": "b" * 64}), post)

    def test_21_read_events_verify_locally(self) -> None:
        resp = c.parse_response(_resp("channel.read", OUTCOMES["channel.read"]))
        ev = resp.outcome["messages"][0]  # type: ignore[index]
        assert set(ev) == c.EVENT_MEMBERS
        assert nostr.verify_event(ev)
        assert ev["pubkey"] == nostr.Signer((7).to_bytes(32, "big")).pubkey
        assert nostr.thread_position(ev["tags"]) == (EVENT, None)
        assert nostr.tag_values(ev, "p") == [PUBKEY]
        assert not nostr.verify_event({**ev, "content": "hellO"})

    def test_22_event_member_set_enforced_everywhere(self) -> None:
        for extra in ("secretKey", "nsec", "seckey", "credential", "hostNote"):
            with self.assertRaises(c.ContractError):
                c.signed_event({**READ_EVENT, extra: "x"})
            self.rejects_resp(set_path(success_wire("channel.read"), ("outcome", "messages", 0, extra), "x"))
            self.rejects_resp(set_path(success_wire("channel.read"), ("outcome", extra), "x"))
            self.rejects_resp({**success_wire("channel.read"), extra: "x"})
        for missing in c.EVENT_MEMBERS:
            ev = {k: v for k, v in READ_EVENT.items() if k != missing}
            with self.assertRaises(c.ContractError):
                c.signed_event(ev)

    def test_23_pages(self) -> None:
        c.parse_response(_resp("channel.read", {"messages": []}))
        c.parse_response(_resp("channel.read", {"messages": [READ_EVENT], "nextCursor": "c1"}))
        for bad in ("", "has space"):
            self.rejects_resp(_resp("channel.read", {"messages": [], "nextCursor": bad}))
        self.rejects_resp(_resp("channel.read", {"messages": [READ_EVENT] * 501}))

    @cases(limit_1=1, limit_2=2, limit_500=500, default=None)
    def test_24_page_held_to_effective_limit(self, limit: int | None) -> None:
        args: dict[str, Any] = {"channelId": CHANNEL}
        if limit is not None:
            args["limit"] = limit
        req = _ok("channel.read", args)
        n = limit or 100
        c.parse_response(_resp("channel.read", {"messages": [READ_EVENT] * n}), req)
        c.parse_response(_resp("channel.read", {"messages": [READ_EVENT] * (n - 1)}), req)
        self.rejects_resp(_resp("channel.read", {"messages": [READ_EVENT] * (n + 1)}), req)
        if limit is None:
            self.rejects_resp(_resp("channel.read", {"messages": [READ_EVENT] * 500}), req)

    def test_25_failures_serialize_without_outcome(self) -> None:
        f = json.loads(c.serialize_response(c.failed(RID, "action_failed", "m")))
        i = json.loads(c.serialize_response(c.indeterminate(RID, "outcome_unknown", "m")))
        assert "outcome" not in f and "action" not in f and f["error"]["code"] == "action_failed"
        assert "outcome" not in i and i["status"] == "indeterminate" and i["error"]["code"] == "outcome_unknown"

    @cases(**{f"{status}_{code}": (code, status) for status in ("failed", "indeterminate") for code in c.CODES})
    def test_26_status_code_table(self, code: str, status: str) -> None:
        allowed = {"outcome_unknown": {"indeterminate"}, "internal": {"failed", "indeterminate"}}.get(code, {"failed"})
        tree = error_wire(status, code)
        if status in allowed:
            c.parse_response(json.dumps(tree).encode())
        else:
            self.rejects_resp(tree)
            with self.assertRaises(c.MalformedResponse):
                c.serialize_response(c.Response(RID, status, code=code, message="m"))

    def test_27_replayed_is_delivery_metadata(self) -> None:
        resp = c.succeeded(RID, "message.post", OUTCOMES["message.post"])
        stored = c.serialize_response(resp)
        assert b"replayed" not in stored
        replay = c.mark_replayed(stored)
        parsed = c.parse_response(replay)
        assert parsed.replayed and json.loads(replay)["replayed"] is True
        assert {k: v for k, v in json.loads(replay).items() if k != "replayed"} == json.loads(stored)

    def test_28_request_aware_validation(self) -> None:
        read = _ok("channel.read", {"channelId": CHANNEL})
        self.rejects_resp(_resp("message.post", OUTCOMES["message.post"]), read)
        post = _ok("message.post", ARGS["message.post"])
        wrong_id = json.loads(_resp("message.post", OUTCOMES["message.post"]))
        wrong_id["requestId"] = "other"
        self.rejects_resp(wrong_id, post)
        self.rejects_resp(_resp("channel.read", {"messages": [], "nextCursor": "bad cursor"}), read)
        self.rejects_resp(_resp("message.post", {**OUTCOMES["message.post"], "eventId": "nothex"}), post)
        for req in (read, post):
            assert c.parse_response(json.dumps(error_wire("failed", "unauthorized")).encode(), req).code == "unauthorized"


# --- identities.rs -----------------------------------------------------------------------------

SPELLINGS = [
    CHANNEL.upper(),
    CHANNEL.replace("-", ""),
    "{" + CHANNEL + "}",
    "urn:uuid:" + CHANNEL,
    CHANNEL,
]


_ID_SUFFIXES = ("channelid", "eventid", "pubkey", "dtag")


def _respell_identity_members(tree: Any) -> tuple[Any, int]:
    count = 0

    def walk(node: Any) -> Any:
        nonlocal count
        if isinstance(node, dict):
            out = {}
            for k, v in node.items():
                if isinstance(v, str) and k.lower().endswith(_ID_SUFFIXES):
                    out[k] = v.upper()
                    count += 1
                else:
                    out[k] = walk(v)
            return out
        if isinstance(node, list):
            return [walk(x) for x in node]
        return node

    return walk(tree), count


@expand
class Identities(ContractCase):
    def test_29_channel_spellings(self) -> None:
        for sp in SPELLINGS:
            req = _ok("agents.create", {**ARGS["agents.create"], "channelId": sp})
            assert req.args["channelId"] == CHANNEL
            assert parse_req(request_wire("agents.create", {**ARGS["agents.create"], "channelId": sp})).args[
                "channelId"
            ] == CHANNEL
            for echo in SPELLINGS:
                c.parse_response(_resp("agents.create", {**OUTCOMES["agents.create"], "channelId": echo}), req)
            self.rejects_resp(_resp("agents.create", {**OUTCOMES["agents.create"], "channelId": OTHER_CHANNEL}), req)
        for bad in ("{" + CHANNEL, "uuid:" + CHANNEL, "URN:UUID:" + CHANNEL, CHANNEL[:-1], "b2c38ca8-9ec3411e-bab5-f9deab34d52e"):
            self._bad("message.post", {"channelId": bad, "content": "x"})

    def test_30_identity_normalisation(self) -> None:
        req = _ok("agents.delete", {"target": {"pubkey": PUBKEY.upper()}})
        c.parse_response(_resp("agents.delete", OUTCOMES["agents.delete"]), req)
        assert _ok("reaction.add", {**ARGS["reaction.add"], "targetEventId": EVENT.upper()}).args["targetEventId"] == EVENT
        assert _ok("channel.read", {"channelId": CHANNEL, "rootEventId": EVENT.upper()}).args["rootEventId"] == EVENT
        st = c.parse_response(
            _resp("storage.address", {"authorPubkey": PUBKEY.upper(), "kind": 30174, "dTag": EVENT.upper()})
        )
        assert st.outcome == {"authorPubkey": PUBKEY, "kind": 30174, "dTag": EVENT}
        for bad in (None, "nothex", "", "a" * 40, "a" * 66):
            self.rejects_req(request_wire("channel.read", {"channelId": CHANNEL, "rootEventId": bad}))
        self.rejects_req(request_wire("channel.read", {"channelId": "not-a-uuid"}))

    def test_31_envelopes_with_secret_or_mixed_status_rejected(self) -> None:
        self.rejects_resp({**error_wire("failed", "internal"), "secretKey": "x"})
        self.rejects_resp({**success_wire("message.post"), "error": {"code": "internal", "message": "m"}})

    def test_32_identity_members_respelled_parse_back_canonical(self) -> None:
        req_count = resp_count = 0
        for action in c.ACTIONS:
            tree = request_wire(action, {**ARGS[action], "target": {"pubkey": PUBKEY}} if action.startswith("agents.u") else None)
            upper, n = _respell_identity_members(tree)
            req_count += n
            assert parse_req(upper) == parse_req(tree)
            resp = success_wire(action)
            upper, n = _respell_identity_members(resp)
            resp_count += n
            assert c.parse_response(json.dumps(upper).encode()) == c.parse_response(json.dumps(resp).encode())
        assert req_count >= 8 and resp_count >= 6


# --- client.rs ---------------------------------------------------------------------------------


@expand
class Client(ContractCase):
    def test_33_prepared_body_is_frozen(self) -> None:
        req = _ok("message.reply", ARGS["message.reply"])
        body = c.freeze(req)
        assert body == c.freeze(req) and c.parse_request(body) == req
        with self.assertRaises(c.ContractError):
            c.build_request("message.post", ARGS["message.post"], RID, protocol_version=99)

    def test_34_code_strings_in_order(self) -> None:
        assert ",".join(c.CODES) == (
            "invalid_request,unsupported_protocol_version,unknown_action,unsupported_action_version,"
            "unsupported,unauthenticated,unauthorized,request_id_conflict,action_failed,outcome_unknown,internal"
        )

    def test_35_refusals_are_verdicts_transport_failures_are_not(self) -> None:
        req = _ok("message.post", ARGS["message.post"])
        for code in ("unauthorized", "unauthenticated"):
            v = c.read_http_response(req, 200, json.dumps(error_wire("failed", code)).encode())
            assert v.status == "failed" and v.code == code
        # a valid envelope is the answer whatever the status line says
        assert c.read_http_response(req, 401, json.dumps(error_wire("failed", "unauthenticated")).encode())
        for status, body in ((401, b"Unauthorized"), (502, b""), (404, b"<html>"), (200, b'{"type":"broker_result"}')):
            with self.assertRaises(c.TransportError):
                c.read_http_response(req, status, body)

    def test_36_client_turns_bad_answers_into_malformed(self) -> None:
        read = _ok("channel.read", {"channelId": CHANNEL})
        for body in (
            _resp("message.post", OUTCOMES["message.post"]),
            _resp("channel.read", {"messages": [], "nextCursor": "bad cursor"}),
            json.dumps(error_wire("indeterminate", "unauthenticated")).encode(),
        ):
            with self.assertRaises(c.TransportError):
                c.read_http_response(read, 200, body)

    def test_37_extra_keys_never_reach_the_caller(self) -> None:
        read = _ok("channel.read", {"channelId": CHANNEL})
        for tree in (
            {**success_wire("channel.read"), "extra": 1},
            set_path(success_wire("channel.read"), ("outcome", "extra"), 1),
            set_path(success_wire("channel.read"), ("outcome", "messages", 0, "extra"), 1),
            {**success_wire("channel.read"), "error": {"code": "internal", "message": "m"}},
        ):
            with self.assertRaises(c.TransportError):
                c.read_http_response(read, 200, json.dumps(tree).encode())

    def test_lone_surrogates_and_bad_utf8_rejected(self) -> None:
        raw = json.dumps(request_wire("message.post")).replace('"hello"', '"\\ud800"').encode()
        with self.assertRaises(c.ContractError):
            c.parse_request(raw)
        with self.assertRaises(c.RequestIdError):
            c.parse_request(b'{"requestId":"r","x":"\xff"}')
        self.rejects_resp(json.dumps(success_wire("agents.delete")).replace('"helper"', '"\\udfff"').encode())

    def test_non_finite_numbers_rejected(self) -> None:
        with self.assertRaises(c.RequestIdError):
            c.parse_request(b'{"requestId":"r","protocolVersion":NaN}')
