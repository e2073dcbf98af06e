"""Hostile input at the Buzz broker: its HTTP surface, the JSON it reads, and its event clock.

Every test talks to real things: the PyPI nostr-relay of tests/support/nostr.py (NIP-42 on), and either a real
``twistd -n relayd --broker-nostr-relay ...`` process (the HTTP surface, the property test) or the
in-process broker the broker's own tests use (where the clock must be held still: two requests
in one second).
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import tempfile
import time
from typing import Any

import treq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import reactor, threads
from twisted.trial import unittest
from twisted.web.client import HTTPConnectionPool
from twisted.web.http import PotentialDataLoss

from relayd.buzz.core import contract
from relayd.buzz.http import UNAUTHENTICATED_BODY_LIMIT
from tests.buzz.harness import ARGS, BrokerUnderTest, issue, new_channel
from tests.support.nostr import NostrRelay, shared_nostr_relay
from tests.support.twistd import RelaydProcess

JSON = [b"application/json"]
MAX_DEPTH = 32  # docs/broker.md: JSON nesting
MAX_ERROR = 512  # docs/broker.md: error messages
_rids = itertools.count()


def envelope(action: str, args: dict[str, Any], rid: str, /, **members: Any) -> dict[str, Any]:
    """A request envelope as a client would write it (not validated: tests break it on purpose)."""
    tree = {"type": "broker_request", "protocolVersion": 1, "requestId": rid, "actionVersion": 1, "action": action}
    tree["args"] = args
    tree.update(members)
    return tree


def wire(tree: Any) -> bytes:
    """JSON with every non-ASCII character escaped: a lone surrogate goes out as C{\\ud800}."""
    return json.dumps(tree, separators=(",", ":")).encode("ascii")


def post_body(channel: str, content: str, rid: str) -> bytes:
    return contract.freeze(contract.build_request("message.post", {"channelId": channel, "content": content}, rid))


def verdict(data: bytes, rid: str) -> contract.Response:
    """The strict reader a conforming agent uses; the verdict must correlate with C{rid}."""
    resp = contract.parse_response(data)
    assert resp.request_id == rid, (resp, rid)
    return resp


# --- defect: two requests, one event ----------------------------------------------------------


class TwoRequestsTwoMessages(unittest.TestCase):
    """Identical content posted twice in one second (different requestIds) is two events on the relay."""

    timeout = 60
    relay: NostrRelay

    def setUp(self) -> None:
        self.relay = shared_nostr_relay()

    async def test_identical_posts_in_one_second_are_two_events_across_a_restart(self) -> None:
        state = os.path.join(tempfile.mkdtemp(prefix="relayd-hostile-broker-"), "state")
        second = int(time.time()) - 30  # the clock held still: every request lands in this second
        broker = BrokerUnderTest(state, self.relay.url, now=lambda: second)
        await broker.start()
        self.addCleanup(lambda: broker.stop())
        channel = new_channel()
        alice = broker.issue(f"alice-{channel[:8]}", "--channel", channel)
        cred = alice["credential"]
        first, again = post_body(channel, "same words", "twice-1"), post_body(channel, "same words", "twice-2")
        s1, d1 = await broker.post(first, cred)
        s2, d2 = await broker.post(again, cred)
        assert s1 == s2 == 200
        v1, v2 = verdict(d1, "twice-1"), verdict(d2, "twice-2")
        assert v1.status == v2.status == "succeeded", (d1, d2)
        assert v1.outcome is not None and v2.outcome is not None
        assert v1.outcome["eventId"] != v2.outcome["eventId"]
        assert (v1.outcome["createdAt"], v2.outcome["createdAt"]) == (second, second + 1)

        def held() -> set[str]:
            return {e["id"] for e in self.relay.events(pubkey=alice["agentPubkey"]) if e["content"] == "same words"}

        assert held() == {v1.outcome["eventId"], v2.outcome["eventId"]}
        # A replay is still the recorded verdict, byte for byte, and publishes nothing.
        _, replay = await broker.post(first, cred)
        assert replay == d1[:-1] + b',"replayed":true}'
        # A restart on the same state directory, clock still held: the clock is durable.
        await broker.stop()
        broker = BrokerUnderTest(state, self.relay.url, now=lambda: second)
        await broker.start()
        _, d3 = await broker.post(post_body(channel, "same words", "twice-3"), cred)
        v3 = verdict(d3, "twice-3")
        assert v3.status == "succeeded" and v3.outcome is not None, d3
        assert v3.outcome["createdAt"] == second + 2
        assert held() == {v1.outcome["eventId"], v2.outcome["eventId"], v3.outcome["eventId"]}
        _, replay2 = await broker.post(again, cred)  # found in the store now, not the cache
        assert replay2 == d2[:-1] + b',"replayed":true}'
        assert len(held()) == 3


# --- the HTTP surface of a real twistd broker -------------------------------------------------


class BrokerSurface(unittest.TestCase):
    """C{POST /v1/action} of a real C{twistd -n relayd} broker, with one credential and channel.

    Every test ends by stopping the process: it must exit 0 with no traceback in its log.
    """

    timeout = 90

    async def setUp(self) -> None:
        self.relay = shared_nostr_relay()
        state = os.path.join(tempfile.mkdtemp(prefix="relayd-hostile-twistd-"), "state")
        os.makedirs(state)
        kek = os.path.join(state, "test.kek")
        with open(kek, "w") as f:
            f.write(os.urandom(32).hex())
        self.channel = new_channel()
        self.alice = issue(state, "--agent", "alice", "--channel", self.channel, kek_file=kek)
        self.cred = self.alice["credential"]
        options = [
            "--no-aep", "--no-mcp",
            "--broker-nostr-relay", self.relay.url,
            "--broker-listen", "tcp:0:interface=127.0.0.1",
            "--broker-state-dir", state, "--broker-kek-file", kek,
        ]  # fmt: skip
        self.proc = await RelaydProcess.start(options, wait_for=("broker",))
        self.addCleanup(self._stop)  # trial runs cleanups before tearDown
        self.port = self.proc.port("broker")
        self.http = HTTPConnectionPool(reactor, persistent=False)

    async def _stop(self) -> None:
        """SIGTERM: the broker drains and exits 0, and nothing it logged is a traceback."""
        status = await self.proc.terminate()
        log = self.proc.log
        for marker in (b"Traceback", b"Unhandled Error", b"#critical]"):
            assert marker not in log, log.decode("utf-8", "replace")[-4000:]
        assert status == 0, log.decode("utf-8", "replace")[-3000:]

    async def request(
        self, method: bytes, path: str, body: bytes = b"", headers: dict[bytes, list[bytes]] | None = None
    ) -> tuple[int, Any, bytes]:
        h: dict[bytes, list[bytes]] = {b"content-type": JSON, b"authorization": [b"Bearer " + self.cred.encode()]}
        h.update(headers or {})
        h = {k: v for k, v in h.items() if v}
        response = await treq.request(method.decode(), f"http://127.0.0.1:{self.port}{path}", data=body, headers=h, pool=self.http)
        try:
            content = await response.content()
        except PotentialDataLoss:
            content = b""  # the HTTP parser's own 400 (no length, connection closed)
        return response.code, response.headers, content

    def body(self, rid: str, **members: Any) -> bytes:
        return wire(envelope("message.post", {"channelId": self.channel, "content": rid}, rid, **members))

    async def test_only_the_exact_path_exists_and_others_get_json_404(self) -> None:
        ok, _, data = await self.request(b"POST", "/v1/action", self.body("exact"))
        assert ok == 200 and verdict(data, "exact").status == "succeeded", data
        for path in ("/v1/action/", "/v1/action//", "//v1/action", "/v1/./action", "/v1/%61ction", "/v1", "/", "/healthz/"):
            for method in (b"POST", b"GET", b"HEAD"):
                status, headers, data = await self.request(method, path, self.body(f"p-{next(_rids)}"))
                assert status == 404, (method, path, status, data)
                assert headers.getRawHeaders(b"content-type") == JSON
                assert data == (b"" if method == b"HEAD" else b'{"error":"not_found","message":"the broker serves only POST /v1/action and GET /healthz"}')
        # Nothing was posted through the paths refused (the only message is "exact").
        assert [e["content"] for e in self.relay.events(pubkey=self.alice["agentPubkey"])] == ["exact"]

    async def test_other_methods_get_json_405_with_allow(self) -> None:
        for method in (b"GET", b"HEAD", b"PUT", b"DELETE", b"PATCH", b"OPTIONS"):
            status, headers, data = await self.request(method, "/v1/action", self.body(f"m-{next(_rids)}"))
            assert status == 405, (method, status, data)
            assert headers.getRawHeaders(b"allow") == [b"POST"]
            assert headers.getRawHeaders(b"content-type") == JSON
            if method == b"HEAD":
                assert data == b"" and headers.getRawHeaders(b"content-length") == [b"71"]
            else:
                assert json.loads(data) == {"error": "method_not_allowed", "message": "/v1/action accepts only POST"}

    async def test_content_type_must_be_application_json(self) -> None:
        refused: list[list[bytes]] = [
            [], [b"text/plain"], [b"application/x-www-form-urlencoded"], [b"application/jsonx"],
            [b"application/json-seq"], [b"application/json, text/plain"], [b"application/json", b"application/json"],
            [b"json"], [b"application/\xffjson"], [b"\x7f"],
        ]  # fmt: skip
        for content_type in refused:
            rid = f"ct-{next(_rids)}"
            status, headers, data = await self.request(b"POST", "/v1/action", self.body(rid), {b"content-type": content_type})
            assert status == 415, (content_type, status, data)
            assert headers.getRawHeaders(b"accept-post") == JSON
            assert json.loads(data)["error"] == "unsupported_media_type"
        status, headers, data = await self.request(
            b"POST", "/v1/action", self.body("gz"), {b"content-encoding": [b"gzip"]}
        )
        assert status == 415 and headers.getRawHeaders(b"accept-encoding") == [b"identity"], (status, data)
        accepted: list[list[bytes]] = [
            [b"APPLICATION/JSON"], [b"application/json; charset=utf-8"], [b"Application/Json ;charset=\"UTF-8\""],
            [b"application/json\t;\tq=1"],
        ]  # fmt: skip
        for content_type in accepted:
            rid = f"ok-{next(_rids)}"
            status, _, data = await self.request(b"POST", "/v1/action", self.body(rid), {b"content-type": content_type})
            assert status == 200 and verdict(data, rid).status == "succeeded", (content_type, status, data)
        status, _, data = await self.request(b"POST", "/v1/action", self.body("id"), {b"content-encoding": [b"identity"]})
        assert status == 200 and verdict(data, "id").status == "succeeded", data

    async def test_integers_of_any_size_get_a_correlated_verdict(self) -> None:
        for digits in (20, 41, 4300, 4301, 100_000):
            for sign in ("", "-"):
                rid = f"int-{next(_rids)}"
                tree = envelope("channel.read", {"channelId": self.channel, "limit": 0}, rid)
                data = contract.dumps(tree).replace(b'"limit":0', b'"limit":' + sign.encode() + b"9" * digits)
                status, _, answer = await self.request(b"POST", "/v1/action", data)
                assert status == 200, (digits, status, answer)
                resp = verdict(answer, rid)
                assert (resp.code, resp.message) == ("invalid_request", "args.limit must be between 1 and 500")
        # A huge protocolVersion is an unsupported version, as 70000 is.
        for version in (b"70000", b"9" * 5000):
            rid = f"pv-{next(_rids)}"
            data = self.body(rid).replace(b'"protocolVersion":1', b'"protocolVersion":' + version)
            status, _, answer = await self.request(b"POST", "/v1/action", data)
            assert status == 200 and verdict(answer, rid).code == "unsupported_protocol_version", answer

    async def test_errors_quote_a_bounded_part_of_member_names(self) -> None:
        huge = "k" * 1_500_000
        cases = [
            envelope("message.post", {"channelId": self.channel, "content": "x"}, "n-top", **{huge: 1}),
            envelope("message.post", {"channelId": self.channel, "content": "x", huge: 1}, "n-args"),
            envelope("message.post", {"channelId": self.channel, "content": "x", "deep": {huge: {"\n" * 300: None}}}, "n-null"),
        ]
        for tree in cases:
            rid = tree["requestId"]
            status, _, answer = await self.request(b"POST", "/v1/action", contract.dumps(tree))
            assert status == 200, answer[:300]
            resp = verdict(answer, rid)
            assert resp.code == "invalid_request" and resp.message is not None
            assert len(answer) < 1024 and len(resp.message) <= MAX_ERROR, len(answer)
        half = huge[: len(huge) // 2]
        repeated = self.body("n-dup").replace(b'"args":', ('"' + half + '":1,"' + half + '":2,"args":').encode())
        status, _, answer = await self.request(b"POST", "/v1/action", repeated)
        resp = verdict(answer, "n-dup")
        assert status == 200 and resp.code == "invalid_request" and len(answer) < 1024, answer[:300]
        assert resp.message is not None and resp.message.startswith("$ repeats key 'kkkk")

    async def test_any_json_value_for_the_action_gets_a_verdict(self) -> None:
        for value in ([], {}, [1, [2]], {"a": []}, 1.5, None, True, "\ud800"):
            rid = f"act-{next(_rids)}"
            status, _, answer = await self.request(b"POST", "/v1/action", self.body(rid, action=value))
            assert status == 200, (value, status, answer)
            assert verdict(answer, rid).code in ("invalid_request", "unknown_action"), answer

    async def test_nesting_at_any_depth_gets_an_answer_and_never_a_fault(self) -> None:
        for depth in (31, 33, 200, 900, 930, 940, 950, 960, 970, 990, 5000, 100_000):
            rid = f"deep-{next(_rids)}"
            nested = b"[" * depth + b"null" + b"]" * depth
            data = self.body(rid).replace(b'"args":', b'"extra":' + nested + b',"args":')
            status, _, answer = await self.request(b"POST", "/v1/action", data)
            if status == 400:
                assert depth > MAX_DEPTH and json.loads(answer) == {
                    "error": "invalid_request",
                    "message": "request body nests too deeply to decode",
                }, (depth, answer)
                continue
            assert status == 200, (depth, status, answer)
            resp = verdict(answer, rid)
            assert resp.code == "invalid_request", (depth, answer)
            expected = "nests deeper than 32 levels" if depth >= MAX_DEPTH else "is null"
            assert resp.message is not None and resp.message.endswith(expected), (depth, resp.message)

    async def test_unicode_anywhere_gets_a_verdict_and_is_never_echoed(self) -> None:
        nasty = ["\ud800", "\udfff", "\x00", "\ufeff", "\n", "\r\n", "\u2028", "\u0085", "\u202e", "😀"]
        for s in nasty:
            # in a channel id and a member name: refused, correlated (each recorded under its own requestId)
            for field in ("channel", "member"):
                rid = f"u-{next(_rids)}"
                if field == "channel":
                    tree = envelope("message.post", {"channelId": self.channel[:8] + s + self.channel[8:], "content": "x"}, rid)
                else:
                    tree = envelope("message.post", {"channelId": self.channel, "content": "x", "k" + s: 1}, rid)
                status, _, answer = await self.request(b"POST", "/v1/action", wire(tree))
                assert status == 200 and verdict(answer, rid).code == "invalid_request", (s, answer)
            rid = f"u-{next(_rids)}"
            # in the requestId: not correlatable, 400
            status, _, answer = await self.request(b"POST", "/v1/action", wire(envelope("x", {}, "r" + s)))
            assert status == 400 and json.loads(answer)["error"] == "invalid_request", (s, answer)
            # in the credential (a header value cannot hold NUL or a line break: HTTP 400 from the
            # HTTP parser, RFC 9110 5.5, tested below): unauthenticated
            if not set(s) & set("\x00\r\n"):
                header = ("Bearer " + self.cred[:-1] + s).encode("utf-8", "surrogatepass")
                status, _, answer = await self.request(b"POST", "/v1/action", self.body(rid), {b"authorization": [header]})
                assert status == 200 and verdict(answer, rid).code == "unauthenticated", (s, answer)
        # NUL in a header value is refused by the HTTP parser itself (RFC 9110 5.5)
        status, _, _ = await self.request(b"POST", "/v1/action", self.body("nul"), {b"authorization": [b"Bearer \x00" + self.cred.encode()]})
        assert status == 400
        # A body that is not UTF-8 (an unpaired surrogate written raw) or starts with a BOM is not JSON.
        raw = self.body("raw").replace(b"raw", "\ud800".encode("utf-8", "surrogatepass"))
        at = raw.index("\ud800".encode("utf-8", "surrogatepass"))
        for data, fault in ((raw, f"not valid UTF-8 at byte {at}"),
                            (b"\xef\xbb\xbf" + self.body("bom"), "byte order mark at byte 0 (JSON text has none)")):
            status, _, answer = await self.request(b"POST", "/v1/action", data)
            assert status == 400 and json.loads(answer)["message"] == f"request body is not valid JSON: {fault}", answer
        # content is published verbatim: NUL, BOM and line breaks are content like any other
        rid = f"u-{next(_rids)}"
        text = "a\x00b\ufeffc\nd\r\ne\u2028f"
        data = wire(envelope("message.post", {"channelId": self.channel, "content": text}, rid))
        status, _, answer = await self.request(b"POST", "/v1/action", data)
        assert status == 200 and verdict(answer, rid).status in ("succeeded", "failed"), answer

    async def test_an_unauthenticated_body_is_not_validated(self) -> None:
        """Pin: without a valid credential, a malformed body with a requestId is `unauthenticated`."""
        rid = "unauth"
        data = wire(envelope("nope", {"x": [None] * 3}, rid, extra=1))
        for auth in ([], [b"Bearer bzh_wrong"], [b"bearer " + self.cred.encode()], [b"Bearer " + self.cred.encode()] * 2):
            status, _, answer = await self.request(b"POST", "/v1/action", data, {b"authorization": auth})
            assert status == 200 and verdict(answer, rid).code == "unauthenticated", (auth, answer)

    # --- the property ---------------------------------------------------------------------------

    async def test_property_malformed_requests_always_get_a_bounded_answer(self) -> None:
        """Hypothesis: whatever the body and headers of a POST /v1/action, an answer arrives,
        it is never a 5xx, it is JSON of the documented shape, and the log holds no traceback."""
        run = _property(self.port, self.cred, self.channel)
        await threads.deferToThread(run)


# --- the property test's generators ---------------------------------------------------------

_NASTY = ["\ud800", "\udfff", "\x00", "\ufeff", "\n", "\r\n", "\u2028", "\u0085", "\t", " ", "\u3000", '"', "\\", "😀", "\u202e"]
_MEMBERS = sorted({"type", "protocolVersion", "requestId", "actionVersion", "action", "args"} | {k for a in ARGS.values() for k in a})
_texts = st.lists(st.sampled_from(_NASTY) | st.text(max_size=4), max_size=6).map("".join)
_long = st.sampled_from([128, 129, 256, 257, 65_536, 65_537]).map(lambda n: "x" * n)
_keys = _texts | st.sampled_from(_MEMBERS) | _long


class Raw(str):
    """A JSON number literal, written as it is (Python cannot print integers of 4,300+ digits)."""


class Obj(list):  # type: ignore[type-arg]
    """A JSON object as (key, value) pairs, so a key can repeat."""


_numbers = st.one_of(
    st.integers(-(10**30), 10**30).map(str),
    st.builds(lambda sign, digit, n: sign + digit * n, st.sampled_from(["", "-"]), st.sampled_from("19"), st.integers(1, 6000)),
    st.builds(
        lambda i, frac, exp: f"{i}.{frac}e{exp}",
        st.integers(-5, 5),
        st.integers(0, 10**20),
        st.integers(-(10**6), 10**6),
    ),
    st.sampled_from(["0", "-0", "1e999", "-1e999", "1E+2", "0.0", "1.0", "5e-324", "1e-99999", "500", "501", "65535"]),
).map(Raw)
# One time in five (hypothesis favours the first of a sampled list, and small integers, when it
# generates: a bare st.integers() == 0 would be far more frequent than it reads).
_rarely = st.sampled_from([False, False, False, False, True])
_leaves = st.one_of(st.none(), st.booleans(), _numbers, _texts, _long)
_values = st.recursive(
    _leaves, lambda kids: st.lists(kids, max_size=4) | st.lists(st.tuples(_keys, kids), max_size=4).map(Obj), max_leaves=12
)


def _render(v: Any, raw_utf8: bool) -> str:
    if isinstance(v, Raw):
        return str(v)
    if v is None or isinstance(v, (bool, int)):
        return json.dumps(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=not raw_utf8)
    if isinstance(v, Obj):
        return "{" + ",".join(_render(k, raw_utf8) + ":" + _render(x, raw_utf8) for k, x in v) + "}"
    return "[" + ",".join(_render(x, raw_utf8) for x in v) + "]"


def _obj(tree: dict[str, Any]) -> Obj:
    return Obj((k, _obj(v) if isinstance(v, dict) else v) for k, v in tree.items())


def _objects(v: Any) -> list[Obj]:
    """Every object in a tree (to mutate one)."""
    found: list[Obj] = []
    if isinstance(v, Obj):
        found.append(v)
        for _, x in v:
            found += _objects(x)
    elif isinstance(v, list):
        for x in v:
            found += _objects(x)
    return found


def _exchange(port: int, headers: list[tuple[bytes, bytes]], body: bytes) -> tuple[int, bytes]:
    """One POST /v1/action over a blocking connection (headers exactly as given); an answer must come."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/action", skip_accept_encoding=True)
        for name, value in headers:
            conn.putheader(name, value)
        conn.putheader(b"content-length", b"%d" % len(body))
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _property(port: int, cred: str, channel: str) -> Any:
    bearer = b"Bearer " + cred.encode()
    header_bytes = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
    authorizations = st.one_of(
        st.just([bearer]),
        st.just([]),
        st.just([bearer, bearer]),
        header_bytes.map(lambda b: [b"Bearer " + b]),
        header_bytes.map(lambda b: [bearer + b]),
        header_bytes.map(lambda b: [b]),
        st.just([b"bearer " + cred.encode()]),
    )
    content_types = st.one_of(
        st.just([b"application/json"]),
        st.sampled_from([[b"application/json; charset=utf-8"], [b"APPLICATION/JSON"], [b"application/json;;;x"]]),
        st.just([]),
        st.just([b"application/json", b"application/json"]),
        header_bytes.map(lambda b: [b]),
        header_bytes.map(lambda b: [b"application/json;" + b]),
    )

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )
    @given(st.data())
    def check(data: st.DataObject) -> None:
        action = data.draw(st.sampled_from(sorted(ARGS)), "action")
        args = json.loads(json.dumps(ARGS[action]))
        if "channelId" in args:
            args["channelId"] = channel
        rid = f"hyp-{next(_rids)}"
        tree = _obj(envelope(action, args, rid))
        touched_rid = False
        for _ in range(data.draw(st.integers(0, 3), "mutations")):
            target = data.draw(st.sampled_from(_objects(tree)))
            how = data.draw(st.sampled_from(["set", "add", "drop", "dup", "deep"]))
            if how == "add" or not target:
                target.append((data.draw(_keys), data.draw(_values)))
                continue
            i = data.draw(st.integers(0, len(target) - 1))
            key = target[i][0]
            touched_rid |= target is tree and key == "requestId"
            if how == "set":
                target[i] = (key, data.draw(_values))
            elif how == "drop":
                del target[i]
            elif how == "dup":
                target.append((key, data.draw(_values)))
            else:
                depth = data.draw(st.integers(1, 1500))
                target[i] = (key, Raw("[" * depth + _render(target[i][1], False) + "]" * depth))
        raw_utf8 = data.draw(_rarely, "raw_utf8")  # a lone surrogate then makes invalid UTF-8
        body = _render(tree, raw_utf8).encode("utf-8", "surrogatepass")
        if data.draw(_rarely, "binary"):
            body = data.draw(st.binary(max_size=200), "binary body")
            touched_rid = True
        # Mostly the right headers, so that most bodies reach the contract's reader.
        auth = data.draw(authorizations, "authorization") if data.draw(_rarely) else [bearer]
        content_type = data.draw(content_types, "content-type") if data.draw(_rarely) else [b"application/json"]
        headers = [(b"authorization", v) for v in auth] + [(b"content-type", v) for v in content_type]
        status, answer = _exchange(port, headers, body)
        if any(b"\x00" in value for _, value in headers):
            assert status == 400, (status, answer[:500])  # the HTTP parser's own refusal (RFC 9110 5.5)
            return
        assert status in (200, 400, 401, 415), (status, answer[:500])
        if status != 200:
            refusal = json.loads(answer)
            assert set(refusal) == {"error", "message"} and len(refusal["message"]) <= MAX_ERROR, refusal
            expected = {415: "unsupported_media_type", 401: "unauthenticated"}.get(status, "invalid_request")
            assert refusal["error"] == expected, refusal
            # A refused credential is answered unread only for a body too large to read for a verdict.
            assert status != 401 or (auth != [bearer] and len(body) > UNAUTHENTICATED_BODY_LIMIT), (auth, len(body))
            return
        resp = contract.parse_response(answer)  # the strict reader: a well-formed verdict
        if not touched_rid:
            assert resp.request_id == rid, (resp, rid)
        if resp.status != "succeeded":
            assert resp.message is not None and len(resp.message) <= MAX_ERROR and len(answer) < 2048, answer[:500]

    return check
