"""A POST to any MCP route whose token is missing or wrong is answered at the end of its headers:
the relay never waits for (nor buffers) a body it will refuse. In memory: the headers are one read
into relayd's own channel, and the answer is there when that read returns (no body ever sent)."""

from __future__ import annotations

from tests.support.inmemory import InMemoryMcpCase, Reply
from tests.support.mcp import TOKEN

SESSION = "earlytok"
DECLARED = 200_000  # under the 256 KiB cap: only the token can refuse it before it arrives


def _headers_only(target: str, token: str | None) -> bytes:
    """A POST's request line and headers declaring a body that is never sent."""
    lines = [f"POST {target} HTTP/1.1", "Host: localhost", "Content-Type: application/json",
             "Accept: application/json, text/event-stream", f"Content-Length: {DECLARED}"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class TokenBeforeBody(InMemoryMcpCase):
    def setUp(self) -> None:
        super().setUp()
        self.register(SESSION)

    def answers_without_body(self, target: str, token: str | None) -> list[Reply]:
        """The answers to a POST's headers, written before any of its body."""
        connection = self.wing.connect()
        connection.send(_headers_only(f"{self.prefix}{target}", token))
        return connection.replies()

    def test_wrong_token_is_refused_before_the_body_on_every_post_route(self) -> None:
        for route, status in (("mcp", 401), ("messages?sessionId=x", 401), ("inbox", 401), ("outbox", 401)):
            answers = self.answers_without_body(f"/{SESSION}/{route}", "wrong_token_" + "x" * 20)
            assert [a.code for a in answers] == [status], (route, answers)

    def test_missing_token_is_refused_before_the_body(self) -> None:
        for route in ("mcp", "messages?sessionId=x", "inbox", "outbox"):
            answers = self.answers_without_body(f"/{SESSION}/{route}", None)
            assert [a.code for a in answers] == [401], (route, answers)

    def test_gone_session_is_410_before_the_body(self) -> None:
        answers = self.answers_without_body("/nosuchsession/mcp", TOKEN)
        assert [a.code for a in answers] == [410], answers

    def test_good_token_reads_the_body(self) -> None:
        # The right token: the relay waits for the body (no answer before it arrives).
        connection = self.wing.connect()
        connection.send(_headers_only(f"{self.prefix}/{SESSION}/mcp", TOKEN))
        assert connection.received() == b"" and not connection.closed
