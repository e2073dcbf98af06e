"""Issue 6 acceptance 2 (and 1 under twistd): a real ``twistd -n --logger=relayd.logs.json.json_observer
relayd`` driven through successes and failures on the AEP and MCP relays (401s, bad tokens in headers
and queries, invalid bodies, oversize bodies, a PROXY-protocol client, a metrics scrape). Every line
it writes is one JSON object with the stable keys, and no token, credential or access_token value
appears anywhere."""

from __future__ import annotations

import json
import re
import signal
from typing import Any

import treq
from twisted.internet import reactor
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

from tests.support.aep import event, ndjson
from tests.support.metrics import scrape, value
from tests.support.raw import RawClient
from tests.support.sse import SSEClient
from tests.support.twistd import RelaydProcess
from tests.support.ws import WSClient

TOKEN = "aep-json-e2e-token-5f1c"
MCP_TOKEN = "tok_mcp_json_e2e_0123456789"
SECRETS = [
    TOKEN,
    MCP_TOKEN,
    "wrong-header-token-77",
    "bad-query-token-88",
    "bad-ws-token-99",
    "wrong-mcp-token-66",
    "in-body-secret-55",
]
KEYS = ["time", "level", "relay", "event", "namespace", "fields"]
ND = {"aep-version": "0.1", "content-type": "application/x-ndjson"}
AUTH = {"authorization": f"Bearer {TOKEN}"}


class JSONLogs(TestCase):
    timeout = 60

    async def test_json_lines_and_no_secrets_through_successes_and_failures(self) -> None:
        proc = await RelaydProcess.start_for(
            self,
            [
                "--aep-listen", "tcp:0:interface=127.0.0.1",
                "--aep-listen", "haproxy:tcp:0:interface=127.0.0.1",
                "--mcp-listen", "tcp:0:interface=127.0.0.1",
                "--metrics-listen", "tcp:0:interface=127.0.0.1",
                "--aep-max-body", "4096",
            ],
            env={"AEP_TOKEN": TOKEN},
            wait_for=(),
            twistd_options=["--logger=relayd.logs.json.json_observer"],
        )
        await proc.wait_for(rb"relayd ready")
        aep, proxied = [int(p) for p in re.findall(rb'aep listening on https?://[^\s"]+:(\d+)', proc.log)]
        (mcp,) = [int(p) for p in re.findall(rb'mcp listening on https?://[^\s"]+:(\d+)', proc.log)]
        (metrics_port,) = [int(p) for p in re.findall(rb'metrics listening on https?://[^\s"]+:(\d+)', proc.log)]
        base, mcp_base = f"http://127.0.0.1:{aep}", f"http://127.0.0.1:{mcp}"
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)

        async def call(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> int:
            d = treq.request(method, url, data=body, headers=headers or {}, pool=pool)
            d.addTimeout(10, reactor)
            response = await d
            await treq.content(response)
            return response.code

        # AEP: refusals of credentials
        self.assertEqual(await call("GET", base + "/stream", headers={"authorization": "Bearer wrong-header-token-77"}), 401)
        self.assertEqual(await call("GET", base + "/stream?access_token=bad-query-token-88"), 401)
        self.assertEqual(await call("GET", base + "/socket?access_token=bad-ws-token-99"), 401)
        with self.assertRaises(ConnectionError):
            await WSClient.connect(f"ws://127.0.0.1:{aep}/socket?access_token=bad-ws-token-99")
        # AEP: refusals of bodies, with valid credentials
        self.assertEqual(await call("POST", base + "/events", b"{not json\n", {**AUTH, **ND}), 400)
        bad = ndjson({"aep": "0.1", "id": "x", "token": "in-body-secret-55"})
        self.assertEqual(await call("POST", base + f"/events?access_token={TOKEN}", bad, ND), 400)
        big = ndjson(*[event("S", i, data={"pad": "x" * 400}) for i in range(20)])
        self.assertEqual(await call("POST", base + "/events", big, {**AUTH, **ND}), 413)
        self.assertEqual(await call("POST", base + "/events", ndjson(event("S", 0)), {**AUTH, "content-type": "application/x-ndjson"}), 426)
        # AEP: the happy paths, credentials in the query as browsers send them
        stream = await SSEClient.connect(base + f"/stream?access_token={TOKEN}&filter=" + '{"session":"S"}')
        ws = await WSClient.connect(f"ws://127.0.0.1:{aep}/socket?access_token={TOKEN}")
        await ws.hello(role="emitter", identity={"agent": "json-e2e"})
        ws.send(event("S", 0, data={"token": "in-body-secret-55"}))
        self.assertEqual((await stream.next_event()).id, "S:0:0")
        self.assertEqual(await call("POST", base + "/events", ndjson(event("S", 1)), {**AUTH, **ND}), 202)
        self.assertEqual((await stream.next_event()).id, "S:0:1")
        # a PROXY-protocol client: its source address reaches the access line
        raw = RawClient()
        await connectProtocol(TCP4ClientEndpoint(reactor, "127.0.0.1", proxied), raw)
        raw.transport.write(
            b"PROXY TCP4 198.51.100.23 127.0.0.1 40000 8787\r\n"
            b"GET /healthz?access_token=" + TOKEN.encode() + b" HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        await raw.closed
        self.assertIn(b'"sessions"', raw.received)  # the query token authorised the counts

        # MCP: register, refusals with a wrong token, a frame relayed with the right one
        register = json.dumps({"session": "sess1", "token": MCP_TOKEN}).encode()
        self.assertEqual(await call("POST", mcp_base + "/register", register, {"content-type": "application/json"}), 200)
        frame = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}).encode()
        self.assertEqual(await call("POST", mcp_base + "/sess1/inbox?token=wrong-mcp-token-66", frame, {"content-type": "application/json"}), 401)
        self.assertEqual(await call("GET", mcp_base + "/sess1/events?token=wrong-mcp-token-66&direction=inbound"), 401)
        page = await SSEClient.connect(mcp_base + f"/sess1/events?token={MCP_TOKEN}&direction=inbound")
        self.assertEqual(page.code, 200)
        self.assertEqual(await call("POST", mcp_base + f"/sess1/inbox?token={MCP_TOKEN}", frame, {"content-type": "application/json"}), 200)
        while True:
            message = await page.next()
            assert message is not None
            if message.event == "mcp" and '"tools/list"' in (message.data or ""):
                break

        # the metrics listener under twistd: every relay's sites are counted
        samples, response = await scrape(f"http://127.0.0.1:{metrics_port}/metrics", pool)
        self.assertEqual(response.code, 200)
        self.assertGreaterEqual(value(samples, "relayd_http_requests_total", relay="aep", code="401"), 3)
        self.assertEqual(value(samples, "relayd_http_requests_total", relay="aep", code="413"), 1)
        self.assertEqual(value(samples, "relayd_http_requests_total", relay="mcp", code="401"), 2)
        self.assertEqual(value(samples, "relayd_events_ingested_total", relay="aep"), 2)
        self.assertEqual(value(samples, "relayd_connections", relay="aep", transport="sse"), 1)
        self.assertEqual(value(samples, "relayd_connections", relay="aep", transport="ws"), 1)
        self.assertGreaterEqual(value(samples, "relayd_http_connections", relay="mcp"), 1)
        self.assertEqual(value(samples, "relayd_http_connections", relay="metrics"), 1)

        status = await proc.terminate(signal.SIGTERM)
        await stream.read_until_end()
        await page.read_until_end()
        await ws.closed
        self.assertEqual(status, 0)

        records = self.records(proc.log)
        for secret in SECRETS:
            self.assertNotIn(secret.encode(), proc.log, secret)
        access = [r for r in records if r["namespace"] == "relayd.access"]
        self.assertTrue(all("?" not in r["fields"]["path"] for r in access))
        statuses = {(r["relay"], r["fields"]["path"], r["fields"]["status"]) for r in access}
        for expected in [
            ("aep", "/stream", 401), ("aep", "/socket", 401), ("aep", "/events", 400), ("aep", "/events", 413),
            ("aep", "/events", 426), ("aep", "/events", 202), ("aep", "/socket", 101), ("aep", "/stream", 200),
            ("mcp", "/register", 200), ("mcp", "/sess1/inbox", 401), ("mcp", "/sess1/events", 200),
            ("metrics", "/metrics", 200),
        ]:
            self.assertIn(expected, statuses)
        proxied_lines = [r for r in access if r["fields"]["peer"] == "198.51.100.23"]
        self.assertEqual([(r["fields"]["path"], r["fields"]["status"]) for r in proxied_lines], [("/healthz", 200)])
        self.assertIn("relayd ready: metrics, aep, mcp", [r["event"] for r in records])

    def records(self, log: bytes) -> list[dict[str, Any]]:
        """Every line as JSON, checked for the stable keys."""
        records = []
        for number, line in enumerate(log.decode("utf-8").splitlines(), 1):
            self.assertTrue(line.strip(), f"blank line {number}")
            try:
                record = json.loads(line)
            except ValueError:
                self.fail(f"line {number} is not JSON: {line!r}")
            self.assertEqual(list(record)[:6], KEYS, line)
            self.assertIn(record["level"], ("debug", "info", "warning", "error", "critical"))
            self.assertTrue(record["time"].endswith("Z"))
            records.append(record)
        return records
