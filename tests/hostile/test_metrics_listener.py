"""The metrics listener (``--metrics-listen``) of a real relayd under the hostile attacks: generated
methods, paths, request lines and header sets, and ``HEAD /metrics``. It has no authentication and
serves one read-only document: ``GET``/``HEAD /metrics`` answer 200, any other method a JSON 405
naming ``GET, HEAD``, any other path 404; every refusal is counted in its own series."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CONTENT_TYPE_LATEST
from twisted.trial.unittest import TestCase

from tests.hostile.harness import SETTINGS, hostile, in_thread, judge, request
from tests.hostile.strategies import header_attacks, request_lines, targets, tokens
from tests.support.metrics import parse, value

METRICS = st.just("metrics")
TYPE = CONTENT_TYPE_LATEST.encode()


class MetricsListener(TestCase):
    timeout = 120

    async def test_head_metrics_is_get_without_the_body(self) -> None:
        target = await hostile(self)
        got = await target.send("metrics", request(b"GET", b"/metrics"))
        head = await target.send("metrics", request(b"HEAD", b"/metrics"), heads=1)
        for answer in (got, head):
            judge(answer)
            self.assertEqual(answer.responses[0].status, 200)
            self.assertEqual(answer.responses[0].header(b"content-type"), TYPE)
        self.assertEqual((head.responses[0].body, head.rest), (b"", b""))
        # The same document, less a few bytes of counters that moved in between. (trial's
        # assertAlmostEqual has a delta argument but ignores it: the bound is spelled out.)
        length = int(head.responses[0].header(b"content-length"))
        self.assertLessEqual(abs(length - len(got.responses[0].body)), 200)

    async def test_methods(self) -> None:
        target = await hostile(self)

        @SETTINGS
        @given(method=tokens | st.sampled_from([b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"TRACE"]))
        def attack(method: bytes) -> None:
            head = method == b"HEAD"
            answer = target.exchange("metrics", request(method, b"/metrics"), heads=int(head))
            judge(answer)
            response = answer.responses[0]
            if method in (b"GET", b"HEAD"):
                assert response.status == 200, answer.describe()
            else:
                assert (response.status, response.header(b"allow")) == (405, b"GET, HEAD"), answer.describe()
                assert json.loads(response.body) == {"error": "method_not_allowed"}
            target.check_now("metrics")

        await in_thread(attack)

    async def test_paths(self) -> None:
        target = await hostile(self)

        @SETTINGS
        @given(path=targets("metrics"))
        def attack(path: bytes) -> None:
            answer = target.exchange("metrics", request(b"GET", path))
            judge(answer)
            status = answer.responses[0].status
            if _origin_form(path).split(b"?", 1)[0] == b"/metrics":
                assert status == 200, answer.describe()
            else:
                assert status in (400, 404, 405, 431), answer.describe()  # 405: GET * (OPTIONS only)
            target.check_now("metrics")

        await in_thread(attack)

    async def test_request_lines_and_headers(self) -> None:
        target = await hostile(self)

        # (request, is HEAD, complete)
        lines = request_lines(METRICS).map(lambda t: (t[1], t[2], True))
        headers = header_attacks(METRICS).map(lambda t: (t[1], False, t[2]))

        @SETTINGS
        @given(attack=lines | headers)
        def attack(attack: tuple[bytes, bool, bool]) -> None:
            data, head, complete = attack
            answer = target.exchange("metrics", data, heads=int(head), half_close=not complete)
            judge(answer, silent_close=not complete)
            for response in answer.responses:
                assert response.status in (200, 400, 404, 405, 408, 413, 431), answer.describe()
            target.check_now("metrics")

        await in_thread(attack)

    async def test_refusals_are_counted(self) -> None:
        """Answers the channel writes itself (400, 431) count in relayd_http_requests_total too."""
        target = await hostile(self)

        async def scrape() -> dict:
            answer = await target.send("metrics", request(b"GET", b"/metrics"))
            return parse(answer.responses[0].body.decode())

        before = await scrape()
        for data in (b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n", request(b"GET", b"/metrics", [(b"X", b"a" * 20000)]),
                     request(b"PUT", b"/metrics")):  # fmt: skip
            judge(await target.send("metrics", data))
        after = await scrape()
        for code in ("400", "431", "405"):
            grown = value(after, "relayd_http_requests_total", relay="metrics", code=code) - value(
                before, "relayd_http_requests_total", relay="metrics", code=code
            )
            self.assertEqual(grown, 1, code)


def _origin_form(target: bytes) -> bytes:
    """The path an absolute-form target (RFC 9112 3.2.2: C{http://relay/metrics}) names; others as they are."""
    scheme, sep, rest = target.partition(b"://")
    if sep and scheme.lower() in (b"http", b"https"):
        return b"/" + rest.partition(b"/")[2]
    return target
