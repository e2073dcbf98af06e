"""HTTP-level attacks on every listener of a real relayd (AEP, MCP, broker, metrics), generic to all
wings: generated request lines, header sets and body framings, bodies that stop early, pipelining, a
client that never reads. Each is judged by the harness's invariants (tests/hostile/harness.py).

The named regression tests pin the plumbing defects these attacks found (relayd/web/site.py).
"""

from __future__ import annotations

import json
import re
import socket
import uuid
from itertools import pairwise
from typing import Any
from urllib.parse import quote

from hypothesis import assume, given
from hypothesis import strategies as st
from twisted.internet.defer import Deferred, gatherResults
from twisted.trial.unittest import TestCase

from tests.buzz.harness import request_wire
from tests.hostile.harness import DEADLINE, MAX_BODY, SETTINGS, TOKEN, WINGS, Target, hostile, in_thread, judge, request
from tests.hostile.strategies import PATHS, POSTS, chunked, header_attacks, request_lines, tokens, wings
from tests.support.aep import event, ndjson
from tests.support.raw import Answer


def _ok(target: Target, wing: str, answer: Answer, **kw: Any) -> None:
    judge(answer, **kw)
    target.check_now(wing)


class GeneratedAttacks(TestCase):
    """Hypothesis-generated malformed requests, each followed by the invariants on its listener."""

    timeout = 240

    async def test_request_lines(self) -> None:
        target = await hostile(self)

        @SETTINGS
        @given(attack=request_lines())
        def attack(attack: tuple[str, bytes, bool]) -> None:
            wing, data, head = attack
            _ok(target, wing, target.exchange(wing, data, heads=int(head)))

        await in_thread(attack)

    async def test_header_sets_and_framing(self) -> None:
        target = await hostile(self)

        @SETTINGS
        @given(attack=header_attacks(credentials={"broker": target.credential.encode()}))
        def attack(attack: tuple[str, bytes, bool]) -> None:
            wing, data, complete = attack
            # An unfinished request is broken off by the client: no answer is then a documented end.
            answer = target.exchange(wing, data, half_close=not complete)
            _ok(target, wing, answer, silent_close=not complete)

        await in_thread(attack)

    async def test_valid_requests_in_any_framing_and_pieces(self) -> None:
        """A request each wing accepts, with its body by length, in chunks of any size, or after
        C{Expect: 100-continue}, and the bytes cut into TCP segments anywhere: the same success."""
        target = await hostile(self)

        @SETTINGS
        @given(
            wing=wings,
            framing=st.sampled_from(["length", "chunked", "continue"]),
            sizes=st.lists(st.integers(1, 40), max_size=6),
            cuts=st.lists(st.integers(0, 1200), max_size=8),
        )
        def attack(wing: str, framing: str, sizes: list[int], cuts: list[int]) -> None:
            unique = str(uuid.uuid4())
            method, path, headers, body, status = _valid(target, wing, unique)
            if framing == "chunked":
                headers.append((b"Transfer-Encoding", b"chunked"))
                body = chunked(body, sizes)
            else:
                headers.append((b"Content-Length", b"%d" % len(body)))
                if framing == "continue":
                    headers.append((b"Expect", b"100-continue"))
            data = request(method, path, headers, body, length=False)
            edges = sorted({min(cut, len(data)) for cut in cuts} | {0, len(data)})
            answer = target.exchange(wing, [data[a:b] for a, b in pairwise(edges)])
            _ok(target, wing, answer)
            assert answer.responses[0].status == status, answer.describe()
            if wing == "broker":
                assert json.loads(answer.responses[0].body)["status"] == "succeeded", answer.describe()
            if wing == "aep":  # nothing acknowledged is lost: both events are held
                assert _held(target, unique) == [b"id: %s:0:0" % unique.encode(), b"id: %s:0:1" % unique.encode()]

        await in_thread(attack)

    async def test_unknown_methods_get_a_json_405_with_allow(self) -> None:
        target = await hostile(self)
        # wing: (path, credential header, the methods it takes, the error word of the wing's style)
        routes = {
            "broker": (b"/v1/action", b"Bearer " + target.credential.encode(), b"POST", "method_not_allowed"),
            "aep": (b"/events", b"Bearer " + TOKEN.encode(), b"GET, HEAD, POST", "method-not-allowed"),
            "mcp": (b"/register", b"", b"POST, OPTIONS", "method_not_allowed"),
        }

        @SETTINGS
        @given(wing=st.sampled_from(sorted(routes)),
               method=st.sampled_from([b"GET", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"TRACE", b"FOO"]) | tokens)
        def attack(wing: str, method: bytes) -> None:
            path, credential, allow, error = routes[wing]
            assume(method not in allow.split(b", "))
            headers = [(b"Authorization", credential)] if credential else []
            answer = target.exchange(wing, request(method, path, headers),
                                     heads=int(method == b"HEAD"))
            _ok(target, wing, answer)
            response = answer.responses[0]
            assert (response.status, response.header(b"allow")) == (405, allow), answer.describe()
            assert method == b"HEAD" or json.loads(response.body)["error"] == error

        await in_thread(attack)

    async def test_pipelined_requests(self) -> None:
        target = await hostile(self)
        simple = st.tuples(st.sampled_from([b"GET", b"HEAD", b"POST", b"FOO", b"OPTIONS"]), st.booleans())

        @SETTINGS
        @given(wing=wings, steps=st.lists(simple, min_size=2, max_size=6), data=st.data())
        def attack(wing: str, steps: list[tuple[bytes, bool]], data: Any) -> None:
            pieces = []
            for method, broken in steps:
                path = data.draw(st.sampled_from(PATHS[wing]))
                body = b"{}" if method == b"POST" else b""
                piece = request(method, path, [(b"Authorization", b"Bearer " + TOKEN.encode())], body, close=False)
                if broken:  # a header line without a colon: the server answers 400 and closes
                    piece = piece.replace(b"\r\n\r\n", b"\r\nno colon here\r\n\r\n", 1)
                pieces.append(piece)
            heads = [method == b"HEAD" for method, _ in steps]
            answer = target.exchange(wing, b"".join(pieces), responses=len(pieces), heads=heads)
            _ok(target, wing, answer, expected=len(pieces))
            statuses = [r.status for r in answer.responses]
            first_broken = next((i for i, (_, broken) in enumerate(steps) if broken), None)
            if first_broken is not None:  # everything before it answered, it got 400, nothing after
                self.assertEqual(len(statuses), first_broken + 1, answer.describe())
                self.assertEqual(statuses[-1], 400, answer.describe())

        await in_thread(attack)


def _valid(target: Target, wing: str, unique: str) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes, int]:
    """(method, path, headers, body, status) of a request C{wing} accepts, naming C{unique}."""
    if wing == "aep":
        headers = [(b"Authorization", b"Bearer " + TOKEN.encode()), (b"aep-version", b"0.1"),
                   (b"content-type", b"application/x-ndjson")]  # fmt: skip
        return b"POST", b"/events", headers, ndjson(event(unique, 0), event(unique, 1, "turn.started")), 202
    if wing == "mcp":
        body = json.dumps({"session": unique, "token": "t" * 32}).encode()
        return b"POST", b"/register", [(b"content-type", b"application/json")], body, 200
    if wing == "broker":
        body = json.dumps(request_wire("channel.read", {"channelId": target.channel}, rid=unique)).encode()
        headers = [(b"Authorization", b"Bearer " + target.credential.encode()), (b"content-type", b"application/json")]
        return b"POST", b"/v1/action", headers, body, 200
    return b"GET", b"/metrics", [], b"", 200


def _held(target: Target, session: str) -> list[bytes]:
    """The C{id:} lines the AEP relay replays for C{session}."""
    query = quote(json.dumps([{"session": session}]))
    answer = target.exchange("aep", request(b"GET", f"/stream?live=0&from={query}".encode(),
                                            [(b"Authorization", b"Bearer " + TOKEN.encode())]))
    _ok(target, "aep", answer)
    return [line for line in answer.responses[0].body.split(b"\n") if line.startswith(b"id: ")]


def _error(answer: Answer) -> Any:
    response = answer.responses[0]
    assert response.header(b"content-type") == b"application/json", response.headers
    return json.loads(response.body)


class Regressions(TestCase):
    """Each failure the generated attacks found, pinned by name (fixed in relayd/web/site.py)."""

    timeout = 60

    async def _each(self, target: Target, data: bytes, **kw: Any) -> dict[str, Answer]:
        answers = {}
        for wing in WINGS:
            answers[wing] = await target.send(wing, data, **kw)
        return answers

    async def test_a_5000_digit_content_length_is_413_not_an_unhandled_error(self) -> None:
        # Python refuses int() of over 4300 digits: Twisted's parser raised, the connection dropped
        # without an answer and "Unhandled Error" was logged.
        target = await hostile(self)
        # AEP checks its auth wall and version header before the size.
        head = [(b"Authorization", b"Bearer " + TOKEN.encode()), (b"aep-version", b"0.1"),
                (b"content-type", b"application/json"), (b"Content-Length", b"9" * 5000)]
        # A path the wing does not serve is refused as such first (known from the headers alone).
        statuses = {"aep": 413, "mcp": 413, "broker": 404, "metrics": 413}  # (MCP: the size first, decision MCP-2)
        for wing, answer in (await self._each(target, request(b"POST", b"/events", head))).items():
            judge(answer)
            self.assertEqual(answer.responses[0].status, statuses[wing], (wing, answer.describe()))
        # Leading zeros are not magnitude: 4999 zeros and a 1 is a one-byte body.
        answer = await target.send("metrics", request(b"POST", b"/metrics", [(b"Content-Length", b"0" * 4999 + b"1")]) + b"x")
        judge(answer)
        self.assertEqual(answer.responses[0].status, 405, answer.describe())

    async def test_an_oversize_body_without_credentials_is_answered(self) -> None:
        # The early 413 ran the wing's answer on a request that had no args yet: AEP's auth wall
        # (?access_token=) raised AttributeError, the connection dropped, "Unhandled Error" logged.
        target = await hostile(self)
        head = [(b"aep-version", b"0.1"), (b"content-type", b"application/json"), (b"Content-Length", b"%d" % (10 * 2**20))]
        answer = await target.send("aep", request(b"POST", b"/events", head, length=False) + b"{" * 100)
        judge(answer)
        self.assertEqual(answer.responses[0].status, 401, answer.describe())
        # The query is read as for any request: the token there passes the wall, the path is /events.
        answer = await target.send("aep", request(b"POST", b"/events?access_token=" + TOKEN.encode(), head, length=False))
        judge(answer)
        self.assertEqual(answer.responses[0].status, 413, answer.describe())
        self.assertEqual(json.loads(answer.responses[0].body), {"error": "payload-too-large", "max_bytes": MAX_BODY})

    async def test_a_malformed_request_gets_a_complete_400_with_a_json_body(self) -> None:
        # Twisted wrote a bare "HTTP/1.1 400 Bad Request" with no length and no connection: close.
        target = await hostile(self)
        for data in (
            b"GET /healthz HTTP/1.1\r\nno colon\r\n\r\n",
            b"GET /he\x00lthz HTTP/1.1\r\n\r\n",
            b"GET /healthz HTTP/2.0\r\n\r\n",
            request(b"POST", b"/healthz", [(b"Content-Length", b"-1")]),
            request(b"POST", b"/healthz", [(b"Content-Length", b"2"), (b"Transfer-Encoding", b"chunked")], b"0\r\n\r\n", length=False),
        ):
            for wing, answer in (await self._each(target, data)).items():
                judge(answer)
                response = answer.responses[0]
                self.assertEqual(response.status, 400, (wing, data, answer.describe()))
                self.assertEqual(response.header(b"connection"), b"close")
                self.assertEqual(_error(answer), {"error": "bad_request"})
        # A malformed chunk is read only where the headers allow a body (else they are refused first).
        for wing in WINGS:
            _, path, headers, _, _ = _valid(target, wing, str(uuid.uuid4()))
            path = b"/healthz" if wing == "metrics" else path
            data = request(b"POST", path, [*headers, (b"Transfer-Encoding", b"chunked")], b"zz\r\nab\r\n0\r\n\r\n", length=False)
            answer = await target.send(wing, data)
            judge(answer)
            self.assertEqual(answer.responses[0].status, 400, (wing, answer.describe()))
            self.assertEqual(_error(answer), {"error": "bad_request"})
        # HEAD gets no body, even on a 400.
        answer = await target.send("aep", b"HEAD /healthz HTTP/1.1\r\nno colon\r\n\r\n", heads=1)
        judge(answer)
        self.assertEqual((answer.responses[0].status, answer.rest), (400, b""))

    async def test_more_than_500_headers_is_431_with_a_body(self) -> None:
        # Twisted answered the 501st header field with a bare 400; RFC 6585 says 431.
        target = await hostile(self)
        for count, status in ((498, 200), (499, 431), (600, 431)):  # with Host and Connection: 500 is the most
            head = request(b"GET", b"/healthz", [(b"X-H%d" % i, b"v") for i in range(count)])
            answer = await target.send("mcp", head)
            judge(answer)
            self.assertEqual(answer.responses[0].status, status, (count, answer.describe()))
        self.assertEqual(_error(answer), {"error": "header_fields_too_large", "max_bytes": 16384, "max_fields": 500})

    async def test_headers_over_16_kib_get_431_with_a_body(self) -> None:
        # The 431 had an empty body: nothing told the client which limit it had hit.
        target = await hostile(self)
        for data in (
            request(b"GET", b"/healthz", [(b"X-Big", b"a" * 20 * 1024)]),
            request(b"GET", b"/healthz?" + b"a" * 20 * 1024),
        ):
            for wing, answer in (await self._each(target, data)).items():
                judge(answer)
                self.assertEqual(answer.responses[0].status, 431, (wing, answer.describe()))
                self.assertEqual(_error(answer)["error"], "header_fields_too_large")

    async def test_an_unknown_method_is_a_json_405_with_allow(self) -> None:
        # Twisted's own dispatch answered 501 (a 5xx) to a method it had never heard of, and HTML
        # 405 to GET/POST on a resource without that method.
        target = await hostile(self)
        for wing, path, allow in (
            ("broker", b"/v1/action", b"POST"), ("broker", b"/healthz", b"GET, HEAD"), ("metrics", b"/metrics", b"GET, HEAD")
        ):
            for method in (b"FOO", b"PUT", b"DELETE", b"GET" if path == b"/v1/action" else b"POST"):
                answer = await target.send(wing, request(method, path))
                judge(answer)
                response = answer.responses[0]
                self.assertEqual((response.status, response.header(b"allow")), (405, allow), (wing, method))
                self.assertEqual(_error(answer)["error"], "method_not_allowed")

    async def test_a_path_nothing_serves_is_a_json_404(self) -> None:
        # Twisted's resource traversal answered an HTML "No Such Resource" page.
        target = await hostile(self)
        for path in (b"/", b"/healthz/", b"/v1", b"/v1/", b"/v2/action", b"/%ff"):
            answer = await target.send("broker", request(b"GET", path))
            judge(answer)
            self.assertEqual(answer.responses[0].status, 404, path)
            self.assertEqual(_error(answer)["error"], "not_found")

    async def test_timeouts_answer_408_with_a_body(self) -> None:
        # A head that never ends, and a body that stops early while the client waits.
        target = await hostile(self)
        unfinished = {
            "aep": b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Unfinished: 1",  # the head never ends
            "mcp": request(b"POST", b"/register", [(b"Content-Length", b"100")], length=False) + b"{",
            # (With its credential: without one, a chunked action is refused at the end of its headers.)
            "broker": request(b"POST", b"/v1/action", [(b"Authorization", b"Bearer " + target.credential.encode()),
                                                       (b"Transfer-Encoding", b"chunked"), (b"content-type", b"application/json")],
                              length=False) + b"10\r\nab",
            "metrics": b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n",
        }
        answers = await gatherResults(
            [Deferred.fromCoroutine(target.send(wing, data, timeout=DEADLINE + 5)) for wing, data in unfinished.items()]
        )
        for answer in answers:
            judge(answer)
            self.assertEqual(answer.responses[0].status, 408, answer.describe())
            self.assertEqual(_error(answer), {"error": "request_timeout"})
            self.assertGreaterEqual(answer.elapsed, DEADLINE * 0.9)

    async def test_a_body_broken_off_is_dropped_without_a_word(self) -> None:
        target = await hostile(self)
        for wing in WINGS:
            headers = _valid(target, wing, str(uuid.uuid4()))[2]  # what passes the checks made before the body
            data = request(b"POST", POSTS[wing], [*headers, (b"Content-Length", b"1000")], length=False) + b'{"a":'
            answer = await target.send(wing, data, half_close=True)
            judge(answer, silent_close=True)
            self.assertEqual(answer.responses, [], answer.describe())

    async def test_pipelined_requests_are_answered_in_order(self) -> None:
        target = await hostile(self)
        auth = [(b"Authorization", b"Bearer " + TOKEN.encode())]
        data = (request(b"GET", b"/healthz", auth, close=False) + request(b"GET", b"/nope", auth, close=False)
                + request(b"POST", b"/events", auth, b"{}", close=False) + request(b"GET", b"/healthz", auth))
        answer = await target.send("aep", data, responses=4)
        judge(answer, expected=4)
        self.assertEqual([r.status for r in answer.responses], [200, 404, 426, 200])
        self.assertEqual(answer.responses[-1].header(b"connection"), b"close")

    async def test_a_client_that_never_reads(self) -> None:
        """Pipelined requests from a client that reads nothing: relayd stops reading once its
        answers back up (TCP backpressure), so it neither buffers nor renders them all."""
        target = await hostile(self)
        count = 3000

        def attack() -> int:
            sock = socket.socket()
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
                sock.settimeout(10)
                sock.connect(("127.0.0.1", target.port("metrics")))
                sock.sendall(b"".join(request(b"GET", b"/metrics", close=False) for _ in range(count)))
                target.check_now()  # every listener answers while this client is stuck
                return len(re.findall(rb'metrics [^ ]+ "GET /metrics" 200', target.relayd.log))
            finally:
                sock.close()

        served = await in_thread(attack)
        # Each answer is ~7 KB: what the kernel's socket buffers take (a few MB) is rendered, then
        # relayd waits; without the pause it rendered and buffered all of them.
        self.assertLess(served, count // 2)
