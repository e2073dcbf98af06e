"""A POST to any MCP route whose token is missing or wrong is answered at the end of its headers:
the relay never waits for (nor buffers) a body it will refuse."""

from __future__ import annotations

from twisted.internet import threads

from tests.support.mcp import TOKEN, McpRelayCase
from tests.support.raw import exchange

SESSION = "earlytok"
DECLARED = 200_000  # under the 256 KiB cap: only the token can refuse it before it arrives


def _headers_only(target: str, token: str | None) -> bytes:
    """A POST's request line and headers declaring a body that is never sent."""
    lines = [f"POST {target} HTTP/1.1", "Host: localhost", "Content-Type: application/json",
             "Accept: application/json, text/event-stream", f"Content-Length: {DECLARED}"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class TokenBeforeBody(McpRelayCase):
    async def setUp(self) -> None:  # type: ignore[override]
        await super().setUp()
        await self.register(SESSION)

    async def answer_without_body(self, route: str, token: str | None) -> tuple[int, bytes]:
        target = f"{self.prefix}/{SESSION}/{route}"
        # The relay answers and closes without the body; a relay that waited for it would say
        # nothing within the exchange's timeout (far shorter than the body timeout).
        answer = await threads.deferToThread(exchange, self.port, _headers_only(target, token), timeout=4.0)
        assert len(answer.responses) == 1, (route, token, answer.rest[:200], answer.elapsed)
        response = answer.responses[0]
        return response.status, response.body

    async def test_wrong_token_is_refused_before_the_body_on_every_post_route(self) -> None:
        for route, status in (("mcp", 401), ("messages?sessionId=x", 401), ("inbox", 401), ("outbox", 401)):
            got, body = await self.answer_without_body(route, "wrong_token_" + "x" * 20)
            assert got == status, (route, got, body)

    async def test_missing_token_is_refused_before_the_body(self) -> None:
        for route in ("mcp", "messages?sessionId=x", "inbox", "outbox"):
            got, body = await self.answer_without_body(route, None)
            assert got == 401, (route, got, body)

    async def test_gone_session_is_410_before_the_body(self) -> None:
        target = f"{self.prefix}/nosuchsession/mcp"
        answer = await threads.deferToThread(exchange, self.port, _headers_only(target, TOKEN), timeout=4.0)
        assert [r.status for r in answer.responses] == [410], answer.rest[:200]

    async def test_good_token_reads_the_body(self) -> None:
        # The right token: the relay waits for the body (no answer before it arrives).
        target = f"{self.prefix}/{SESSION}/mcp"
        answer = await threads.deferToThread(exchange, self.port, _headers_only(target, TOKEN), timeout=1.0)
        assert answer.responses == [] and not answer.closed
