"""Property tests: random bodies, query strings and WebSocket frames thrown at an in-process relay.

Whatever arrives: never a 5xx, never a dropped connection where the protocol says the connection
survives (after any bad frame post-hello a ping still gets its pong), never a dead relay (``/healthz``
still answers).

Hypothesis drives each property from a worker thread (``deferToThread``) so that it keeps its
shrinking and reporting, while the relay and the WebSocket clients live on the reactor thread; HTTP
requests are plain blocking sockets, WebSocket steps hop onto the reactor with
C{blockingCallFromThread}. Examples are derandomized (reproducible) unless
C{RELAYD_HYPOTHESIS_RANDOM} is set.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Callable
from urllib.parse import quote

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet import defer, reactor, threads
from twisted.trial.unittest import TestCase

from tests.support.aep import TOKEN, event, start_relay
from tests.support.ws import WSClient

SETTINGS = settings(
    max_examples=int(os.environ.get("RELAYD_HYPOTHESIS_EXAMPLES", "120")),
    deadline=None,
    database=None,
    derandomize=os.environ.get("RELAYD_HYPOTHESIS_RANDOM") is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_BODY = 4096
LEVELS = ("none", "metadata", "redacted", "full")

# Strategies ------------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=10
)
types = st.one_of(
    st.sampled_from(
        [
            "session.started", "tool.completed", "progress.status", "agent.heartbeat", "attention.routed",
            "control.pause", "control.attention.respond", "x.acme.control.reboot", "x.acme.foo.bar", "log.emitted",
            "control.accepted", "bad", "Upper.case", "x.y", "", ".", "a..b",
        ]
    ),
    st.text(max_size=15),
)  # fmt: skip
FIELDS = ["aep", "id", "type", "time", "source", "agent", "session", "seq", "epoch", "severity", "capture", "data",
          "subject", "cause", "run", "step", "traceparent", "acmeregion"]  # fmt: skip


@st.composite
def envelopes(draw: Callable[..., Any]) -> dict[str, Any]:
    """A valid event, then a few random mutations (deleted attributes, wrong types, odd values)."""
    session = draw(st.sampled_from(["p1", "p2", "p:3", "é"]))
    ev = event(session, draw(st.integers(0, 5)), draw(types), data=draw(json_values))
    if ev["type"].startswith("agent."):
        ev.pop("session", None)
        ev.pop("seq", None)
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(FIELDS) | st.text(max_size=6))
        if draw(st.booleans()):
            ev.pop(key, None)
        else:
            ev[key] = draw(json_values | st.sampled_from(["0.1", "info", "notice", "full", "bogus", -1, 2**64 + 1, 1.5]))
    return ev


def _dump(value: Any, ascii_only: bool) -> bytes:
    return json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")


@st.composite
def bodies(draw: Callable[..., Any]) -> bytes:
    kind = draw(st.sampled_from(["event", "value", "ndjson", "binary", "nested", "text"]))
    if kind == "event":
        return _dump(draw(envelopes()), draw(st.booleans()))
    if kind == "value":
        return _dump(draw(json_values), draw(st.booleans()))
    if kind == "ndjson":
        lines = draw(
            st.lists(
                st.one_of(
                    envelopes().map(lambda e: _dump(e, False)),
                    st.binary(max_size=20),
                    st.sampled_from([b"", b"   ", b"\r", b"{", b"null", b"[]"]),
                ),
                max_size=8,
            )
        )
        return draw(st.sampled_from([b"\n", b"\r\n"])).join(lines)
    if kind == "binary":
        return draw(st.binary(max_size=300))
    if kind == "nested":
        depth = draw(st.integers(200, 2000))
        return b'{"aep":"0.1","data":' + b"[" * depth + b"]" * depth + b"}"
    return draw(st.text(max_size=200)).encode("utf-8", "surrogatepass")


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)
header_names = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz-0123456789"), min_size=1, max_size=12)


@st.composite
def ingest_headers(draw: Callable[..., Any]) -> list[tuple[str, str]]:
    headers = []
    version = draw(st.sampled_from(["0.1", "0.1", "9.9", "", None, "0.1, 0.1"]) | header_text)
    if version is not None:
        headers.append(("aep-version", version))
    ctype = draw(
        st.sampled_from(
            ["application/json", "application/x-ndjson", "application/json; charset=utf-8", " application/x-ndjson ",
             "text/plain", "", None, "APPLICATION/JSON", "multipart/form-data; boundary=x"]
        )
        | header_text
    )  # fmt: skip
    if ctype is not None:
        headers.append(("content-type", ctype))
    auth = draw(st.sampled_from([f"Bearer {TOKEN}", f"Bearer {TOKEN}", "Bearer nope", f"bearer {TOKEN}", None]))
    if auth is not None:
        headers.append(("authorization", auth))
    for name, value in draw(st.lists(st.tuples(header_names, header_text), max_size=3)):
        if name not in ("content-length", "transfer-encoding", "host", "connection", "expect", "upgrade"):
            headers.append((name, value))
    return headers


def _json_text(value: Any) -> str:
    return json.dumps(value)


from_entries = st.fixed_dictionaries(
    {},
    optional={
        "session": st.sampled_from(["p1", "p2", "nobody"]) | json_values,
        "epoch": st.integers(-2, 2**65) | json_values,
        "seq": st.integers(-3, 10) | json_values,
    },
)
stream_params = st.fixed_dictionaries(
    {},
    optional={
        "filter": st.one_of(
            st.sampled_from(['{"session":"p1"}', '{"type":["tool.*"]}', '{"severity":{"gte":"notice"}}', "{}", "null", ""]),
            json_values.map(_json_text),
            st.text(max_size=20),
        ),
        "from": st.one_of(
            st.just("all"),
            st.lists(from_entries, max_size=4).map(_json_text),
            json_values.map(_json_text),
            st.text(max_size=20),
        ),
        "capture": st.sampled_from([*LEVELS, "", "FULL"]) | st.text(max_size=8) | st.binary(max_size=4),
        "live": st.sampled_from(["0", "1", "", "00"]) | st.text(max_size=3),
        "access_token": st.text(max_size=8),
    },
)


@st.composite
def ws_frames(draw: Callable[..., Any]) -> tuple[bytes, bool]:
    """(payload, is_binary): mostly JSON objects with protocol frame types and random fields."""
    kind = draw(st.sampled_from(["frame", "frame", "frame", "event", "json", "text", "binary"]))
    if kind == "binary":
        return draw(st.binary(max_size=64)), True
    if kind == "text":
        return draw(st.text(max_size=64)).encode("utf-8", "surrogatepass"), False
    if kind == "json":
        return _dump(draw(json_values), draw(st.booleans())), False
    if kind == "event":
        return _dump(draw(envelopes()), False), False
    frame: dict[str, Any] = {
        "type": draw(st.sampled_from(["subscribe", "unsubscribe", "roster", "ping", "pong", "hello", "zigzag"]) | json_values)
    }
    for key, values in (
        ("id", json_values),
        ("filter", st.sampled_from([{}, {"session": "p1"}, {"type": ["tool.*"]}, None]) | json_values),
        ("from", st.just("all") | st.lists(from_entries, max_size=3) | json_values),
        ("capture", st.sampled_from([*LEVELS, None]) | json_values),
        ("t", json_values),
        ("versions", st.just(["0.1"]) | json_values),
    ):
        if draw(st.booleans()):
            frame[key] = draw(values)
    return _dump(frame, draw(st.booleans())), False


# Blocking helpers (worker thread) ---------------------------------------------------------------


def http_exchange(port: int, head: bytes, body: bytes = b"") -> tuple[int | None, dict[str, str]]:
    """Send one request; the status and headers of the answer (C{None}: no answer at all)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        try:
            s.sendall(head + body)
        except OSError:
            pass  # answered (and closed) early; read what came
        data = b""
        try:
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except OSError:
            pass
    if not data.startswith(b"HTTP/1.1 "):
        return None, {}
    lines = data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return int(lines[0].split()[1]), headers


def request_head(method: str, target: str, headers: list[tuple[str, str]], length: int | None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", "Host: localhost", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in headers]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def healthz(port: int) -> int | None:
    return http_exchange(port, request_head("GET", "/healthz", [], None))[0]


def on_reactor(f: Callable[..., Any], *args: Any) -> Any:
    """Run coroutine function C{f} on the reactor thread and wait for its result."""
    return threads.blockingCallFromThread(reactor, lambda: defer.ensureDeferred(f(*args)))


class Properties(TestCase):
    timeout = 120

    async def test_random_ingest_bodies_and_headers(self) -> None:
        relay = await start_relay(self, aep_token=TOKEN, aep_max_body=MAX_BODY, aep_max_batch=5)
        port = int(relay.url.rsplit(":", 1)[1])

        @SETTINGS
        @given(
            body=bodies(),
            headers=ingest_headers(),
            method=st.sampled_from(["POST", "POST", "POST", "PUT", "GET", "OPTIONS"]),
            path=st.sampled_from(["/events", "/events", "/events", "/socket", "/stream", "/healthz", "/events/"]),
        )
        def never_5xx(body: bytes, headers: list[tuple[str, str]], method: str, path: str) -> None:
            status, answer = http_exchange(port, request_head(method, path, headers, len(body)), body)
            assert status is not None, "no answer"
            assert status < 500, (status, answer)
            if (method, path) == ("POST", "/events") and status in (202, 400, 413, 415, 426):
                # (the scheme in any case: RFC 7235)
                authorized = any(n == "authorization" and v.lower() == f"bearer {TOKEN}".lower() and v[7:] == TOKEN
                                 for n, v in headers)
                assert authorized, status
            assert healthz(port) == 200

        await threads.deferToThread(never_5xx)

    async def test_random_stream_queries(self) -> None:
        relay = await start_relay(self, allow_origin=["*"])
        port = int(relay.url.rsplit(":", 1)[1])
        await relay.post(*[event(s, i) for s in ("p1", "p2") for i in range(3)])

        @SETTINGS
        @given(
            params=stream_params,
            raw=st.none() | st.binary(max_size=40),
            last_event_id=st.none() | st.sampled_from(["p1:0:1", "p1:0", "x:y:z"]) | header_text,
        )
        def refusals_are_400_with_cors(params: dict[str, str | bytes], raw: bytes | None, last_event_id: str | None) -> None:
            params = {k: v if isinstance(v, bytes) else v.encode("utf-8", "surrogatepass") for k, v in params.items()}
            query = "&".join(f"{quote(k)}={quote(v)}" for k, v in params.items())
            if raw is not None:
                query += "&" + quote(raw, safe="=&")
            headers = [] if last_event_id is None else [("last-event-id", last_event_id)]
            status, answer = http_exchange(port, request_head("GET", "/stream?" + query, headers, None))
            assert status in (200, 400), (status, answer)
            assert answer.get("access-control-allow-origin") == "*"
            if status == 200:
                assert answer["content-type"] == "text/event-stream"
            capture = params.get("capture", b"").decode("utf-8", "replace")
            if raw is None and capture not in ("", *LEVELS):
                assert status == 400, capture  # decision AEP 6
            assert healthz(port) == 200

        await threads.deferToThread(refusals_are_400_with_cors)

    async def test_random_websocket_frames(self) -> None:
        relay = await start_relay(self)

        async def exchange(before: tuple[bytes, bool] | None, after: tuple[bytes, bool]) -> None:
            client = await WSClient.connect(relay.ws_url)
            try:
                await self.frames(client, before, after)
            finally:
                await client.close()

        @SETTINGS
        @given(before=st.none() | ws_frames(), after=ws_frames())
        def connection_survives(before: tuple[bytes, bool] | None, after: tuple[bytes, bool]) -> None:
            on_reactor(exchange, before, after)

        await threads.deferToThread(connection_survives)
        response, _ = await relay.get("/healthz")
        self.assertEqual(response.code, 200)

    async def frames(self, client: WSClient, before: tuple[bytes, bool] | None, after: tuple[bytes, bool]) -> None:
        """One random frame before hello (the relay may close, but only as the protocol says), then
        a hello, then one random frame after it: the connection must survive it unless it was binary."""
        greeted = False
        if before is not None:
            payload, binary = before
            client.send_raw(payload, binary)
            reply = await client.recv()
            if reply is None:
                raise AssertionError(f"closed without a word: {client.close_code}")
            if binary:
                self.assertEqual(reply["code"], "binary-unsupported")
                self.assertEqual((await client.closed)[0], 1003)
                return
            greeted = reply.get("type") == "hello"  # the random frame was a valid hello
            if not greeted:
                self.assertEqual(reply["type"], "error", reply)
                if reply["code"] in ("hello-required", "version-unsupported", "bad-hello"):
                    self.assertEqual((await client.closed)[0], 1002)
                    return
                self.assertEqual(reply["code"], "bad-json")  # unparseable: answered, still open
        if not greeted:
            reply = await client.hello()
            self.assertEqual(reply["type"], "hello", reply)
        payload, binary = after
        client.send_raw(payload, binary)
        if binary:
            self.assertEqual((await client.recv())["code"], "binary-unsupported")
            self.assertEqual((await client.closed)[0], 1003)
            return
        replies = await client.roundtrip()  # the connection survived
        try:
            msg = json.loads(payload)
        except ValueError:
            msg = None
        if isinstance(msg, dict) and msg.get("type") in ("subscribe", "unsubscribe", "roster"):
            # Every one of these is answered, with its id, whatever else it carries.
            answers = [r for r in replies if r.get("type") in ("subscribed", "unsubscribed", "roster", "error")]
            self.assertTrue(answers, (msg, replies))
            self.assertEqual(answers[0].get("id"), msg.get("id"), (msg, replies))


class KnownHazards(TestCase):
    """Fixed examples of inputs that once took the relay down or hung a client."""

    async def test_deeply_nested_json_is_refused_not_fatal(self) -> None:
        relay = await start_relay(self)
        deep = b"{\"a\":" * 100_000 + b"1" + b"}" * 100_000  # crashed orjson (a segfault) at ~60k levels
        for body, ctype in ((deep, "application/json"), (b"[" * 200_000 + b"]" * 200_000, "application/x-ndjson")):
            response, content = await relay.request("POST", "/events", body, {"aep-version": "0.1", "content-type": ctype})
            self.assertEqual(response.code, 400)
            self.assertEqual(json.loads(content)["error"], "invalid-json")
        shallow_enough = json.dumps(event("deep", 0, data=json.loads("[" * 250 + "]" * 250))).encode()
        response, _ = await relay.request("POST", "/events", shallow_enough, {"aep-version": "0.1", "content-type": "application/json"})
        self.assertEqual(response.code, 202)
        client = await WSClient.connect(relay.ws_url)
        self.addCleanup(client.close)
        await client.hello()
        client.send_raw(deep)
        self.assertEqual((await client.recv())["code"], "bad-json")
        self.assertEqual(await client.roundtrip(), [])
        response, _ = await relay.get("/healthz")
        self.assertEqual(response.code, 200)
