"""L{PlainRequest}'s headers read and set as twisted.web's request reads and sets them: names in any
case, the lower-cased ones remembered (relayd.web.plain_request._LOWER) and no other."""

from __future__ import annotations

from twisted.trial.unittest import TestCase
from twisted.web.http import parse_qs

from relayd.web import plain_request
from relayd.web.plain_request import PlainRequest, query_args
from relayd.web.simple_post import SimplePost


def request() -> PlainRequest:
    return PlainRequest(SimplePost(b"/s/outbox?token=t", {b"origin": b"https://a.example", b"x-thing": b"1"}, b"{}"))


class Names(TestCase):
    def test_a_name_in_any_case_is_read_and_set_lower_cased(self) -> None:
        for _ in range(2):  # (the second time after the first was remembered, or not)
            made = request()
            self.assertEqual(made.getHeader(b"Origin"), b"https://a.example")
            self.assertEqual(made.getHeader(b"origin"), b"https://a.example")
            self.assertEqual(made.requestHeaders.getRawHeaders(b"X-Thing"), [b"1"])
            self.assertTrue(made.requestHeaders.hasHeader(b"X-THING"))
            made.setHeader(b"Content-Type", b"application/json")
            made.responseHeaders.setRawHeaders(b"X-Answer", [b"2"])
            made.responseHeaders.setRawHeaders(b"x-answer", [b"3"])  # (the same name: its place kept)
            made.setHeader(b"content-type", b"text/plain")
            self.assertEqual(made.responseHeaders.getRawHeaders(b"Content-Type"), [b"text/plain"])
            self.assertTrue(made.responseHeaders.hasHeader(b"X-ANSWER"))
            self.assertEqual(made.responseHeaders.lines(), ((b"content-type", b"text/plain"), (b"x-answer", b"3")))

    def test_only_lower_cased_names_are_remembered(self) -> None:
        made = request()
        made.setHeader(b"X-Mixed-Case", b"1")
        made.getHeader(b"X-Other-Mixed")
        made.setHeader(b"x-lower-one", b"1")
        self.assertNotIn(b"X-Mixed-Case", plain_request._LOWER)
        self.assertNotIn(b"X-Other-Mixed", plain_request._LOWER)
        self.assertIn(b"x-lower-one", plain_request._LOWER)

    def test_the_names_remembered_are_bounded(self) -> None:
        self.patch(plain_request, "_LOWER", set())
        made = request()
        for n in range(plain_request._LOWER_KEPT + 10):
            made.setHeader(b"x-name-%d" % n, b"1")
        self.assertEqual(len(plain_request._LOWER), plain_request._LOWER_KEPT)
        self.assertEqual(made.responseHeaders.getRawHeaders(b"x-name-%d" % (plain_request._LOWER_KEPT + 9)), [b"1"])


class Query(TestCase):
    def test_the_arguments_are_read_as_twisted_web_reads_them(self) -> None:
        queries = [
            b"token=abc", b"token=", b"token", b"=x", b"token=a=b", b"a=1&b=2", b"a=1;b=2", b"a=1&a=2",
            b"token=a%20b", b"token=a+b", b"to%6Ben=x", b"a+b=c", b"&", b";", b"token=abc&", b"x=%zz",
            b"direction=outbound&token=t", b"token=\xff\xfe",
        ]  # fmt: skip
        for query in queries:
            self.assertEqual(query_args(query), parse_qs(query, 1), query)
