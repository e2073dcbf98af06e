"""relayd.web.answers: the one hand-written response writer, and the one disconnect check."""

from __future__ import annotations

import itertools
import re
import time
from pathlib import Path

from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.http import datetimeToString
from twisted.web.test.requesthelper import DummyRequest

import relayd
from relayd.web.answers import gone, http_date, raw_response
from tests.compat.loopback import TIMEOUT, LoopbackCase

_JSON = [(b"content-type", b"application/json")]


class RawResponse(TestCase):
    def test_a_refusal_that_closes(self) -> None:
        self.assertEqual(
            raw_response(431, _JSON, b"{}", close=True),
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: 2\r\nconnection: close\r\n\r\n{}",
        )

    def test_a_head_answer_announces_the_body_it_does_not_send(self) -> None:
        self.assertEqual(
            raw_response(413, [], b"too large", close=False, head=True),
            b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 9\r\n\r\n",
        )

    def test_the_framing_headers_are_the_writers(self) -> None:
        headers = [(b"Connection", b"close"), (b"content-length", b"99"), (b"x-a", b"1")]
        self.assertEqual(
            raw_response(400, headers, b"", close=False),
            b"HTTP/1.1 400 Bad Request\r\nx-a: 1\r\ncontent-length: 0\r\n\r\n",
        )

    def test_what_twisted_web_would_write(self) -> None:
        written = raw_response(202, [(b"content-type", b"application/x-ndjson")], b"ok", close=False,
                               date=http_date(time.time()), capitalised=True)  # fmt: skip
        self.assertRegex(
            written,
            rb"\AHTTP/1\.1 202 Accepted\r\nServer: TwistedWeb/[^\r]+\r\nDate: [^\r]+ GMT\r\n"
            rb"Content-Type: application/x-ndjson\r\nContent-Length: 2\r\n\r\nok\Z",
        )

    def test_a_head_written_before_is_written_the_same(self) -> None:
        """The head of an answer seen before (kept: its headers a tuple) is the head written anew
        (headers in a list are not kept), whatever the body, the date, the close and the version."""
        headers = ((b"content-type", b"application/json"), (b"x-a", b"1"), (b"Connection", b"keep-alive"))
        for status, body in ((202, b""), (503, b'{"error":"x"}'), (431, b"{}")):
            for date, close, head, capitalised, version in itertools.product(
                (None, b"Mon, 07 Dec 2026 03:00:00 GMT", b"Mon, 07 Dec 2026 03:00:01 GMT"),
                (True, False), (True, False), (True, False), (b"HTTP/1.1", b"HTTP/1.0"),
            ):  # fmt: skip
                options = {"close": close, "head": head, "date": date, "capitalised": capitalised, "version": version}
                fresh = raw_response(status, list(headers), body, **options)  # type: ignore[arg-type]
                for _ in range(2):  # (the second from the head kept)
                    self.assertEqual(raw_response(status, headers, body, **options), fresh)  # type: ignore[arg-type]
                self.assertEqual(fresh.endswith(body), not head or not body)
                if date is not None:
                    self.assertIn(b"\r\nDate: " + date + b"\r\n", fresh)

    def test_the_date_is_twisted_web_s_for_each_second(self) -> None:
        """Formatted once per second, the value is what twisted.web formats for every moment of it:
        the moments either side of each boundary, and a clock that goes back."""
        for when in (999.999, 1000.0, 1000.5, 1000.999, 1001.0, 999.5, 1_699_999_999.999, 1_700_000_000.0):
            self.assertEqual(http_date(when), datetimeToString(when), when)

    def test_no_other_module_writes_a_status_line(self) -> None:
        """Every hand-written answer (the channel's refusals, the early answer to a body, the plain
        POST) goes through raw_response: no other module spells a status line."""
        package = Path(relayd.__file__).parent
        status_line = re.compile(rb"HTTP/1\.[01] (%d|%s|\{)")
        writers = [
            path.relative_to(package).as_posix()
            for path in package.rglob("*.py")
            if status_line.search(path.read_bytes()) and path.name != "answers.py"
        ]
        self.assertEqual(writers, [])


class Gone(LoopbackCase):
    async def test_a_client_gone_is_seen(self) -> None:
        request, client = await self.held_request()
        self.assertFalse(gone(request))
        lost = request.notifyFinish()
        client.transport.loseConnection()
        await self.assertFailure(lost.addTimeout(TIMEOUT, reactor), Exception)
        self.assertTrue(gone(request))

    async def test_a_finished_request_is_gone(self) -> None:
        request, _ = await self.held_request()
        self.assertFalse(gone(request))
        request.finish()
        self.assertTrue(gone(request))

    def test_a_request_without_a_channel_is_not_gone_until_finished(self) -> None:
        request = DummyRequest([b""])
        self.assertFalse(gone(request))
        request.finish()
        self.assertTrue(gone(request))
