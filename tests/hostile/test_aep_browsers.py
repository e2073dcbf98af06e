"""A web page against an AEP relay without a token: cross-site requests (Origin) and DNS rebinding
(Host) are refused with 403 on every route, the WebSocket handshake and the simple ingest path
included; loopback names pass; --allow-host / --allow-origin widen; CORS is * only when asked."""

from __future__ import annotations

import json

from twisted.internet import threads
from twisted.trial.unittest import TestCase

from tests.support.aep import TOKEN, event, ndjson, start_relay
from tests.support.cases import cases, expand
from tests.support.raw import first_response
from tests.support.wing import start_wing

INGEST = ndjson(event("browser", 0))


def request(method: str, path: str, host: str | None, origin: str | None = None, token: str | None = None) -> bytes:
    """One raw request with exactly these C{Host} and C{Origin} headers (none when C{None}); a POST
    is kept alive, so that the simple ingest path (relayd/web/simple_post.py) is the one that answers."""
    lines = [f"{method} {path} HTTP/1.1"]
    if host is not None:
        lines.append(f"host: {host}")
    if origin is not None:
        lines.append(f"origin: {origin}")
    if token is not None:
        lines.append(f"authorization: Bearer {token}")
    if path == "/socket":
        lines += ["upgrade: websocket", "connection: Upgrade", "sec-websocket-version: 13",
                  "sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ=="]
    elif method != "POST":
        lines.append("connection: close")
    body = b""
    if method == "POST":
        body = INGEST
        lines += ["aep-version: 0.1", "content-type: application/x-ndjson", f"content-length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


ROUTES = {
    "stream": ("GET", "/stream?live=0"),
    "ingest": ("POST", "/events"),
    "socket": ("GET", "/socket"),
    "health": ("GET", "/healthz"),
    "discovery": ("GET", "/events"),
    "preflight": ("OPTIONS", "/stream"),
    "unknown": ("GET", "/nowhere"),
}

REFUSED_HOSTS = {
    "a_name": "evil.example",
    "a_name_and_port": "evil.example:8787",
    "loopback_address_as_a_label": "127.0.0.1.evil.example",
    "localhost_as_a_label": "localhost.evil.example",
    "localhost_as_a_suffix": "evillocalhost",
    "one_past_127_8": "128.0.0.1",
    "the_unspecified_address": "0.0.0.0",
    "another_ipv6_address": "[::2]:8787",
    "a_port_that_is_no_number": "localhost:80x",
    "unbracketed_ipv6": "::1",
}
ALLOWED_HOSTS = {
    "localhost": "localhost",
    "localhost_with_port": "localhost:8787",
    "upper_case": "LOCALHOST:1",
    "under_localhost": "app.localhost:5173",
    "loopback_first": "127.0.0.1",
    "loopback_last": "127.255.255.255:9",
    "ipv6_loopback": "[::1]:8787",
}
REFUSED_ORIGINS = {
    "a_site": "http://evil.example",
    "a_site_on_https": "https://evil.example:8443",
    "null": "null",
    "localhost_as_a_label": "http://localhost.evil.example",
    "one_past_127_8": "http://128.0.0.1:3000",
    "another_scheme": "file://localhost",
    "not_an_origin": "localhost",
    "with_a_path": "http://localhost:3000/",
    "with_a_query": "http://localhost?x",
    "with_credentials": "http://user@localhost",
}
ALLOWED_ORIGINS = {
    "localhost": "http://localhost:3000",
    "under_localhost": "http://app.localhost",
    "loopback_on_https": "https://127.0.0.1",
    "ipv6_loopback": "http://[::1]:5173",
}


async def answer(port: int, data: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    return await threads.deferToThread(first_response, port, data)


def port_of(relay: object) -> int:
    return int(relay.url.rsplit(":", 1)[1])  # type: ignore[attr-defined]


@expand
class WithoutAToken(TestCase):
    @cases(**ROUTES)
    async def test_a_rebinding_host_is_refused_on_every_route(self, method: str, path: str) -> None:
        relay = await start_relay(self)
        status, headers, body = await answer(port_of(relay), request(method, path, "evil.example:8787"))
        self.assertEqual(status, 403)
        self.assertEqual(headers[b"content-type"], b"application/json")
        refusal = json.loads(body)
        self.assertEqual((refusal["error"], refusal["header"]), ("host-not-allowed", "Host"))
        self.assertIn("--allow-host (env RELAYD_ALLOW_HOST)", refusal["detail"])
        self.assertNotIn(b"access-control-allow-origin", headers)
        self.assertEqual(relay.core.log.session_count(), 0)  # nothing ingested

    @cases(**ROUTES)
    async def test_a_cross_site_origin_is_refused_on_every_route(self, method: str, path: str) -> None:
        relay = await start_relay(self)
        status, _, body = await answer(port_of(relay), request(method, path, "127.0.0.1", "https://evil.example"))
        self.assertEqual(status, 403)
        refusal = json.loads(body)
        self.assertEqual((refusal["error"], refusal["header"]), ("origin-not-allowed", "Origin"))
        self.assertIn("--allow-origin (env RELAYD_ALLOW_ORIGIN)", refusal["detail"])
        self.assertEqual(relay.core.log.session_count(), 0)

    async def test_an_oversize_body_is_refused_for_its_host_before_it_is_read(self) -> None:
        relay = await start_relay(self, aep_max_body=100)
        head = (b"POST /events HTTP/1.1\r\nhost: evil.example\r\naep-version: 0.1\r\n"
                b"content-type: application/x-ndjson\r\ncontent-length: 100000\r\n\r\n")
        status, _, body = await answer(port_of(relay), head + b"x" * 1000)
        self.assertEqual((status, json.loads(body)["error"]), (403, "host-not-allowed"))

    @cases(**REFUSED_HOSTS)
    async def test_refused_host(self, host: str) -> None:
        relay = await start_relay(self)
        status, _, _ = await answer(port_of(relay), request("POST", "/events", host))
        self.assertEqual(status, 403, host)

    @cases(**ALLOWED_HOSTS)
    async def test_allowed_host(self, host: str) -> None:
        relay = await start_relay(self)
        status, _, _ = await answer(port_of(relay), request("POST", "/events", host))
        self.assertEqual(status, 202, host)

    @cases(**REFUSED_ORIGINS)
    async def test_refused_origin(self, origin: str) -> None:
        relay = await start_relay(self)
        status, _, _ = await answer(port_of(relay), request("POST", "/events", "localhost", origin))
        self.assertEqual(status, 403, origin)

    @cases(**ALLOWED_ORIGINS)
    async def test_allowed_origin_is_echoed_by_cors(self, origin: str) -> None:
        relay = await start_relay(self)
        status, headers, _ = await answer(port_of(relay), request("GET", "/stream?live=0", "localhost", origin))
        self.assertEqual(status, 200, origin)
        self.assertEqual(headers[b"access-control-allow-origin"], origin.encode())
        self.assertEqual(headers[b"vary"], b"Origin")

    async def test_no_host_and_no_origin_is_a_plain_client(self) -> None:
        relay = await start_relay(self)
        status, headers, _ = await answer(port_of(relay), b"GET /stream?live=0 HTTP/1.0\r\n\r\n")
        self.assertEqual(status, 200)
        self.assertNotIn(b"access-control-allow-origin", headers)  # CORS * only when asked for

    async def test_allow_host_widens_by_name_with_any_port(self) -> None:
        relay = await start_relay(self, allow_host=["relay.example.com,10.0.0.7", "[2001:db8::1]"])
        port = port_of(relay)
        for host in ("relay.example.com", "RELAY.example.com:443", "10.0.0.7:8787", "[2001:db8::1]:1", "localhost"):
            self.assertEqual((await answer(port, request("POST", "/events", host)))[0], 202, host)
        for host in ("other.example.com", "sub.relay.example.com", "10.0.0.8"):
            self.assertEqual((await answer(port, request("POST", "/events", host)))[0], 403, host)

    async def test_allow_host_from_the_environment(self) -> None:
        wing = await start_wing(self, "aep", {}, {"RELAYD_ALLOW_HOST": "relay.example.com"})
        status, _, _ = await answer(wing.port, request("POST", "/events", "relay.example.com"))
        self.assertEqual(status, 202)

    async def test_allow_host_star_allows_every_host(self) -> None:
        relay = await start_relay(self, allow_host=["*"])
        status, _, _ = await answer(port_of(relay), request("POST", "/events", "evil.example"))
        self.assertEqual(status, 202)

    async def test_allow_origin_widens_exactly_and_cors_echoes_it(self) -> None:
        relay = await start_relay(self, allow_origin=["https://dash.example.com"])
        port = port_of(relay)
        status, headers, _ = await answer(port, request("GET", "/stream?live=0", "localhost", "https://dash.example.com"))
        self.assertEqual((status, headers[b"access-control-allow-origin"]), (200, b"https://dash.example.com"))
        for origin in ("http://dash.example.com", "https://dash.example.com:444", "https://evil.example"):
            self.assertEqual((await answer(port, request("GET", "/stream?live=0", "localhost", origin)))[0], 403, origin)

    async def test_cors_star_only_when_asked_for(self) -> None:
        relay = await start_relay(self, allow_origin=["*"])
        status, headers, _ = await answer(port_of(relay), request("GET", "/stream?live=0", "localhost", "https://any.example"))
        self.assertEqual((status, headers[b"access-control-allow-origin"]), (200, b"*"))


class WithAToken(TestCase):
    async def test_the_token_is_the_wall_whatever_the_host_and_origin(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN)
        port = port_of(relay)
        status, headers, _ = await answer(port, request("POST", "/events", "relay.example.com", "https://evil.example"))
        self.assertEqual(status, 401)
        self.assertNotIn(b"access-control-allow-origin", headers)  # not an origin it allows
        status, _, _ = await answer(port, request("POST", "/events", "relay.example.com", "https://app.example", TOKEN))
        self.assertEqual(status, 202)
