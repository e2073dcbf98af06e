"""L{read_simple_post} recognises the plainest POST and declines everything else, limits included."""

from __future__ import annotations

import re

from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.resource import Resource

from relayd.web import simple_post
from relayd.web.answers import Answer
from relayd.web.simple_post import SimplePost, SimplePosts, read_simple_post
from relayd.web.site import RelaySite
from tests.support.raw import connect_raw


def _events(post: SimplePost) -> None:
    return None


PATHS = {b"/events": _events}  # (the handlers a read looks its target up in)
BODY = b'{"a":1}\n'


def post(*headers: bytes, body: bytes = BODY, line: bytes = b"POST /events HTTP/1.1", length: bool = True) -> bytes:
    fields = [b"host: relay", *headers]
    if length:
        fields.append(b"content-length: %d" % len(body))
    return line + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n" + body


def read(data: bytes, max_header_bytes: int = 16384, max_fields: int = 500, max_length_digits: int = 18) -> object:
    return read_simple_post(
        data, PATHS, max_header_bytes=max_header_bytes, max_fields=max_fields, max_length_digits=max_length_digits
    )


class Recognised(TestCase):
    def test_a_plain_post_is_read_with_its_headers_and_body(self) -> None:
        found = read(post(b"Content-Type: application/x-ndjson", b"AEP-Version:  0.1\t"))
        assert found is not None
        self.assertEqual(found.path, b"/events")  # type: ignore[attr-defined]
        self.assertEqual(found.body, BODY)  # type: ignore[attr-defined]
        self.assertEqual(
            found.headers,  # type: ignore[attr-defined]
            {b"host": b"relay", b"content-type": b"application/x-ndjson", b"aep-version": b"0.1",
             b"content-length": b"8"},
        )

    def test_keep_alive_and_an_empty_body_are_plain(self) -> None:
        self.assertIsNotNone(read(post(b"Connection: Keep-Alive")))
        self.assertIsNotNone(read(post(body=b"")))

    def test_a_post_that_closes_its_connection_is_plain_and_says_so(self) -> None:
        # twisted.web keeps an HTTP/1.1 connection unless told to close, and never an HTTP/1.0 one.
        cases = [
            (post(), b"HTTP/1.1", False),
            (post(b"Connection: close"), b"HTTP/1.1", True),
            (post(b"Connection: CLOSE"), b"HTTP/1.1", True),
            (post(line=b"POST /events HTTP/1.0"), b"HTTP/1.0", True),
            (post(b"Connection: keep-alive", line=b"POST /events HTTP/1.0"), b"HTTP/1.0", True),
        ]
        for data, version, close in cases:
            found = read(data)
            assert found is not None, data
            self.assertEqual((found.version, found.close), (version, close), data)

    def test_the_limits_hold_exactly_at_their_value(self) -> None:
        data = post()  # request line, three header lines
        block = data.index(b"\r\n\r\n") + 2
        self.assertIsNotNone(read(data, max_header_bytes=block))
        self.assertIsNone(read(data, max_header_bytes=block - 1))
        self.assertIsNotNone(read(data, max_fields=2))
        self.assertIsNone(read(data, max_fields=1))
        self.assertIsNotNone(read(data, max_length_digits=1))
        self.assertIsNone(read(post(body=b"x" * 10), max_length_digits=1))


class Declined(TestCase):
    def test_another_method_version_or_target(self) -> None:
        for line in (b"PUT /events HTTP/1.1", b"POST /events HTTP/0.9", b"POST /events HTTP/2", b"POST /events?x=1 HTTP/1.1",
                     b"POST /events/ HTTP/1.1", b"POST  /events HTTP/1.1", b"POST http://relay/events HTTP/1.1"):
            self.assertIsNone(read(post(line=line)), line)

    def test_a_body_not_all_there_or_with_bytes_after_it(self) -> None:
        data = post()
        self.assertIsNone(read(data[:-1]))
        self.assertIsNone(read(data + b"P"))
        self.assertIsNone(read(data + data))  # pipelined: twisted.web reads them one at a time
        self.assertIsNone(read(data[: data.index(b"\r\n\r\n")]))  # the headers not yet ended

    def test_framing_and_connection_headers_are_left_to_twisted_web(self) -> None:
        for header in (b"Transfer-Encoding: chunked", b"Expect: 100-continue", b"Connection: close, upgrade",
                       b"Connection: upgrade", b"Upgrade: websocket", b"TE: trailers"):
            self.assertIsNone(read(post(header)), header)

    def test_no_length_or_an_unusual_one(self) -> None:
        self.assertIsNone(read(post(length=False)))
        for value in (b"+8", b"8 8", b"0x8", b"-8", b"", "８".encode()):
            data = post(b"content-length: " + value, length=False)
            self.assertIsNone(read(data), value)

    def test_repeated_folded_or_malformed_headers(self) -> None:
        self.assertIsNone(read(post(b"aep-version: 0.1", b"AEP-Version: 0.1")))
        self.assertIsNone(read(post(b"content-length: 8")))  # twice, with the one post() adds
        self.assertIsNone(read(post(b"x-a: 1", b" folded")))
        self.assertIsNone(read(post(b"x a: 1")))
        self.assertIsNone(read(post(b"x-a : 1")))
        self.assertIsNone(read(post(b"no colon")))
        self.assertIsNone(read(post(b": empty name")))

    def test_a_bare_line_feed_or_carriage_return_in_the_headers(self) -> None:
        self.assertIsNone(read(post(b"x-a: 1\nx-b: 2")))
        self.assertIsNone(read(post(b"x-a: 1\rx-b: 2")))
        bare = b"POST /events HTTP/1.1\r\nhost: relay\ncontent-length: 8\r\n\r\n" + BODY
        self.assertIsNone(read(bare))


class Claimed(TestCase):
    """L{SimplePosts}: exact paths (no query) and the paths under a claimed prefix (with a query)."""

    def test_an_exact_path_wins_and_a_prefix_takes_what_is_under_it(self) -> None:
        posts = SimplePosts()
        self.assertFalse(posts)

        def exact(post: SimplePost) -> None:
            return None

        def claimed(post: SimplePost) -> None:
            return None

        posts[b"/s/events"] = exact
        posts.claim(b"/s/", claimed)
        self.assertTrue(posts)
        self.assertIs(posts[b"/s/events"], exact)
        self.assertIs(posts[b"/s/outbox?token=t"], claimed)
        self.assertIs(posts.get(b"/s/events?x=1"), claimed)  # (an exact path has no query)
        self.assertIsNone(posts.get(b"/t/outbox"))
        self.assertIn(b"/s/x", posts)
        self.assertNotIn(b"/other", posts)
        with self.assertRaises(KeyError):
            posts[b"/other"]
        posts.clear()
        self.assertFalse(posts)
        self.assertNotIn(b"/s/x", posts)

    def test_a_claimed_target_is_read_with_its_query(self) -> None:
        posts = SimplePosts()
        posts.claim(b"/s/", lambda post: None)
        found = read_simple_post(post(line=b"POST /s/outbox?token=t HTTP/1.1"), posts, max_header_bytes=16384,
                                 max_fields=500, max_length_digits=18)
        assert found is not None
        self.assertEqual(found.path, b"/s/outbox?token=t")
        self.assertIs(found.handler, posts.get(b"/s/outbox?token=t"))  # (looked up once, kept on the post)
        self.assertIsNone(read(post(line=b"POST /events?x=1 HTTP/1.1")))  # (an exact path: no query)


class Leaf(Resource):
    isLeaf = True

    def render_POST(self, request: object) -> bytes:
        return b"from twisted.web"


class AnsweredBySite(TestCase):
    """A L{RelaySite} answers a registered path's plain POST with its handler's answer, written as
    twisted.web writes one, and logs its access line; a declined one goes to twisted.web."""

    async def test_the_handlers_answer_is_written_as_twisted_web_would(self) -> None:
        site = RelaySite(Leaf(), relay="test")
        calls: list[bytes] = []

        def handler(post: SimplePost) -> Answer | None:
            calls.append(post.body)
            if post.body == b"decline":
                return None
            if post.body == b"boom":
                raise RuntimeError("a handler's fault")
            return Answer(201, b"{}", [(b"content-type", b"application/json"), (b"x-relay-thing", b"1")])

        site.simple_posts[b"/events"] = handler
        client = await connect_raw(self, site)
        client.transport.write(post(body=b"answer"))
        await client.wait_for(b"{}")
        head, _, body = client.received.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.assertEqual(lines[0], b"HTTP/1.1 201 Created")
        self.assertEqual([line.split(b":")[0] for line in lines[1:]],
                         [b"Server", b"Date", b"Content-Type", b"X-Relay-Thing", b"Content-Length"])
        self.assertIn(b"Content-Length: 2", lines)
        self.assertEqual(body, b"{}")
        client.transport.write(post(body=b"decline"))
        await client.wait_for(b"from twisted.web")
        client.received = b""
        client.transport.write(post(body=b"boom"))  # logged, then twisted.web's path answers
        await client.wait_for(b"from twisted.web")
        self.assertEqual(calls, [b"answer", b"decline", b"boom"])
        self.assertEqual(len(self.flushLoggedErrors(RuntimeError)), 1)

    async def test_a_bare_line_feed_after_a_plain_post_is_refused_at_once(self) -> None:
        # (a read that was one plain POST skips the channel's bare line feed check: the next read,
        # which is not one, is checked)
        site = RelaySite(Leaf(), relay="test")
        site.simple_posts[b"/events"] = lambda post: Answer(202, b"{}")
        client = await connect_raw(self, site)
        client.transport.write(post())
        await client.wait_for(b"{}")
        client.received = b""
        client.transport.write(b"POST /events HTTP/1.1\nHost: x\n")  # (no answer until the line ends: a hang)
        await client.wait_for(b"HTTP/1.1 400 ").addTimeout(5, reactor)


# read_simple_post as it checked the header block with one expression over it (each line with its
# CRLF; a NUL checked apart): what it accepts and reads must stay what this accepted and read.
_REFERENCE_BLOCK = re.compile(rb"(?:[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[^\r\n]*\r\n)*")
_REFERENCE_DECLINED = (b"transfer-encoding", b"expect", b"upgrade", b"te", b"trailer", b"http2-settings")


def reference_read(data: bytes) -> tuple[dict[bytes, bytes], bytes, bool] | None:
    """The headers, body and close the expression-checked reader read from C{data} (None: declined)."""
    line_end = data.find(b"\r\n", 0, 16384)
    if line_end < 0:
        return None
    method, _, rest = data[:line_end].partition(b" ")
    path, _, version = rest.partition(b" ")
    if method != b"POST" or version not in (b"HTTP/1.1", b"HTTP/1.0") or path not in PATHS:
        return None
    end = data.find(b"\r\n\r\n", line_end, 16384 + 2)
    if end < 0:
        return None
    block = data[line_end + 2 : end + 2]
    if _REFERENCE_BLOCK.fullmatch(block) is None or b"\x00" in block:
        return None
    headers: dict[bytes, bytes] = {}
    for line in block[:-2].split(b"\r\n") if block else []:
        name, _, value = line.partition(b":")
        name = name.lower()
        if name in headers or name in _REFERENCE_DECLINED:
            return None
        headers[name] = value.strip(b" \t")
    length = headers.get(b"content-length")
    if length is None or not length.isdigit() or len(length) > 18:
        return None
    connection = headers.get(b"connection")
    if connection is not None and connection.lower() not in (b"keep-alive", b"close"):
        return None
    body = data[end + 4 :]
    if len(body) != int(length):
        return None
    return headers, body, version != b"HTTP/1.1" or (connection is not None and connection.lower() == b"close")


class SameAsTheBlockExpression(TestCase):
    def test_every_byte_anywhere_in_the_header_block(self) -> None:
        """Each of a set of bytes that matter (line ends, NUL, white space, separators, a colon,
        non-ASCII) put at each place in a header block, or put in place of the byte there: read as
        the expression-checked reader read it, header for header."""
        base = post(b"Content-Type: application/json", b"aep-version: 0.1", b"X-A:b", b"Connection: close")
        head_end = base.index(b"\r\n\r\n")
        start = base.index(b"\r\n") + 2
        seen = 0
        for place in range(start, head_end + 4):
            for byte in (b"\r", b"\n", b"\r\n", b"\x00", b" ", b"\t", b":", b"(", b"A", b"\x7f", b"\xff", b""):
                for data in (base[:place] + byte + base[place:], base[:place] + byte + base[place + 1 :]):
                    found = read(data)
                    self.assertEqual(
                        None if found is None else (found.headers, found.body, found.close),  # type: ignore[attr-defined]
                        reference_read(data),
                        data,
                    )
                    seen += found is not None
        self.assertGreater(seen, 500)  # (read, not only declined)

    def test_names_seen_before_are_checked_as_the_first_time(self) -> None:
        """A name kept from an earlier request is still a name only when a colon follows it."""
        self.assertIsNotNone(read(post(b"X-Seen: 1")))
        self.assertIsNone(read(post(b"X-Seen")))
        self.assertIsNone(read(post(b"x-seen: 1", b"X-Seen: 2")))  # (one name, repeated)

    def test_lines_seen_before_are_read_as_the_first_time(self) -> None:
        """A whole line kept from an earlier request reads the same, repeated is still a repeat, and
        the lines kept are bounded; a length or a credential is never kept."""
        first = read(post(b"User-Agent: kept/1", b"Authorization: Bearer secret"))
        again = read(post(b"User-Agent: kept/1", b"Authorization: Bearer secret"))
        assert first is not None and again is not None
        self.assertEqual(again.headers, first.headers)  # type: ignore[attr-defined]
        self.assertEqual(again.headers[b"user-agent"], b"kept/1")  # type: ignore[attr-defined]
        self.assertIsNone(read(post(b"User-Agent: kept/1", b"User-Agent: kept/1")))
        kept = simple_post._LINES
        self.assertFalse([line for line, (name, _) in kept.items() if name in (b"authorization", b"content-length")])
        for n in range(2 * simple_post._LINES_KEPT):
            found = read(post(b"x-n: %d" % n))
            assert found is not None
            self.assertEqual(found.headers[b"x-n"], b"%d" % n)  # type: ignore[attr-defined]
            self.assertLessEqual(len(kept), simple_post._LINES_KEPT)
        long = b"x-long: " + b"v" * 300
        found = read(post(long))
        assert found is not None
        self.assertEqual(found.headers[b"x-long"], b"v" * 300)  # type: ignore[attr-defined]
        self.assertNotIn(long, kept)
