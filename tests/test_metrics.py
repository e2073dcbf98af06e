"""Issue 6 acceptance 1 (AEP part): a scrape of the metrics listener after AEP traffic shows the series
with the right values. The relay and the metrics listener run in-process on real loopback ports."""

from __future__ import annotations

import json

import prometheus_client
from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from relayd import metrics
from relayd.clock import Clock
from relayd.web import metrics_listener
from tests.support.aep import AEPRelay, event, ndjson
from tests.support.mcp import TOKEN as MCP_TOKEN
from tests.support.mcp import McpRelayCase
from tests.support.metrics import delta, names, scrape, value
from tests.support.sse import SSEClient
from tests.support.ws import WSClient

SERIES = {
    "relayd_info",
    "relayd_connections",
    "relayd_sessions",
    "relayd_subscribers",
    "relayd_events_ingested_total",
    "relayd_events_delivered_total",
    "relayd_events_dropped_total",
    "relayd_ingest_refused_total",
    "relayd_replays_total",
    "relayd_replayed_events_total",
    "relayd_fanout_seconds_count",
    "relayd_fanout_seconds_bucket",
    "relayd_http_requests_total",
    "process_resident_memory_bytes",
}


class MetricsOverAEP(TestCase):
    timeout = 30

    async def setUp(self) -> None:  # type: ignore[override]
        self.relay = await AEPRelay.start()
        self.addCleanup(self.relay.stop)
        self.service = metrics_listener.make_service(["tcp:0:interface=127.0.0.1"], reactor, Clock(reactor))
        self.service.startService()
        self.addCleanup(self.service.stopService)
        (port,) = await self.service.ports()
        self.url = f"http://127.0.0.1:{port.getHost().port}/metrics"
        self.clients: list = []
        self.addCleanup(self._close_clients)

    async def _close_clients(self) -> None:
        for client in self.clients:
            await client.close()

    async def test_series_and_values_after_traffic(self) -> None:
        before, response = await scrape(self.url)
        self.assertEqual(response.code, 200)
        self.assertIn(b"text/plain", response.headers.getRawHeaders(b"content-type")[0])

        live = await SSEClient.connect(self.relay.url + '/stream?filter={"session":"S"}')
        self.clients.append(live)
        ws = await WSClient.connect(self.relay.ws_url)
        self.clients.append(ws)
        await ws.hello(role="both", identity={"agent": "watcher"})
        ws.send({"type": "subscribe", "id": "w", "filter": {"session": "S"}})
        self.assertEqual((await ws.recv())["type"], "subscribed")

        r, _ = await self.relay.post(event("S", 0), event("S", 1, "turn.started"), event("S", 2, "turn.ended"))
        self.assertEqual(r.code, 202)
        for _ in range(3):
            await live.next_event()
            await ws.recv()
        # refusals: unparseable, invalid envelope, wrong media type
        r, _ = await self.relay.request("POST", "/events", b"{nope\n", {"aep-version": "0.1", "content-type": "application/x-ndjson"})
        self.assertEqual(r.code, 400)
        r, _ = await self.relay.request("POST", "/events", ndjson({"aep": "0.1"}), {"aep-version": "0.1", "content-type": "application/x-ndjson"})
        self.assertEqual(r.code, 400)
        r, _ = await self.relay.request("POST", "/events", b"x", {"aep-version": "0.1", "content-type": "text/plain"})
        self.assertEqual(r.code, 415)
        # a resume from S:0:0 replays two events; one from far back is exhausted only with a trimmed buffer
        resumed = await SSEClient.connect(
            self.relay.url + "/stream?from=" + json.dumps([{"session": "S", "epoch": 0, "seq": 0}])
        )
        self.clients.append(resumed)
        self.assertEqual((await resumed.next_event()).id, "S:0:1")
        self.assertEqual((await resumed.next_event()).id, "S:0:2")
        # a command on a relay without a token is refused toward its sender: unroutable
        ws.send(event("S", None, "control.pause", id="c1"))
        refusal = await ws.recv()
        self.assertEqual(refusal["code"], "unauthorized")  # refused before routing: no audit copy

        after, _ = await scrape(self.url)
        missing = SERIES - names(after)
        self.assertEqual(missing, set())
        self.assertEqual(value(after, "relayd_connections", relay="aep", transport="sse"), 2)
        self.assertEqual(value(after, "relayd_connections", relay="aep", transport="ws"), 1)
        self.assertEqual(value(after, "relayd_sessions", relay="aep"), 1)
        self.assertEqual(value(after, "relayd_subscribers", relay="aep"), 3)  # two streams, one WS subscription
        self.assertEqual(delta(before, after, "relayd_events_ingested_total", relay="aep"), 4)  # 3 + the command
        self.assertEqual(delta(before, after, "relayd_events_delivered_total", relay="aep"), 6)  # 3 x (SSE + WS)
        self.assertEqual(delta(before, after, "relayd_events_dropped_total", relay="aep", reason="unroutable"), 1)
        self.assertEqual(delta(before, after, "relayd_ingest_refused_total", relay="aep", reason="invalid-json"), 1)
        self.assertEqual(delta(before, after, "relayd_ingest_refused_total", relay="aep", reason="invalid-event"), 1)
        self.assertEqual(
            delta(before, after, "relayd_ingest_refused_total", relay="aep", reason="unsupported-media-type"), 1
        )
        self.assertEqual(delta(before, after, "relayd_replays_total", relay="aep", outcome="complete"), 1)
        self.assertEqual(delta(before, after, "relayd_replayed_events_total", relay="aep"), 2)
        self.assertEqual(delta(before, after, "relayd_fanout_seconds_count", relay="aep"), 2)  # one POST, one WS message
        self.assertEqual(delta(before, after, "relayd_http_requests_total", relay="aep", code="202"), 1)
        self.assertEqual(delta(before, after, "relayd_http_requests_total", relay="aep", code="400"), 2)
        self.assertEqual(delta(before, after, "relayd_http_requests_total", relay="aep", code="101"), 1)
        self.assertGreater(value(after, "process_resident_memory_bytes"), 0)

    async def test_levels_fall_to_zero_when_the_relay_stops(self) -> None:
        stream = await SSEClient.connect(self.relay.url + "/stream")
        self.clients.append(stream)
        during, _ = await scrape(self.url)
        self.assertEqual(value(during, "relayd_connections", relay="aep", transport="sse"), 1)
        await self.relay.stop()
        after, _ = await scrape(self.url)
        self.assertEqual(value(after, "relayd_connections", relay="aep", transport="sse"), 0)
        self.assertEqual(value(after, "relayd_subscribers", relay="aep"), 0)

    async def test_only_metrics_path_is_served(self) -> None:
        _, response = await scrape(self.url.replace("/metrics", "/other"))
        self.assertEqual(response.code, 404)


class CallbackGauges(TestCase):
    def test_bound_and_free_labels_sum_across_watches(self) -> None:
        gauge = metrics.CallbackGauge("t_gauge", "test", ["relay", "state"], registry=metrics.CollectorRegistry())
        a = gauge.watch(lambda: 2, relay="x", state="up")
        b = gauge.watch(lambda: {"up": 1, "down": 4}, relay="x")
        self.assertEqual(gauge.value(relay="x", state="up"), 3)
        self.assertEqual(gauge.value(relay="x", state="down"), 4)
        a.close()
        b.close()
        self.assertEqual(gauge.value(relay="x", state="up"), 0)

    def test_two_free_labels_are_refused(self) -> None:
        gauge = metrics.CallbackGauge("t_gauge2", "test", ["a", "b"], registry=metrics.CollectorRegistry())
        self.assertRaises(ValueError, gauge.watch, lambda: {}, )
        self.assertRaises(ValueError, gauge.watch, lambda: 1, a="1", c="2")

    def test_a_failing_callback_does_not_break_the_scrape(self) -> None:
        registry = metrics.CollectorRegistry()
        gauge = metrics.CallbackGauge("t_gauge3", "test", ["a"], registry=registry)
        gauge.watch(lambda: 1 / 0, a="x")
        gauge.watch(lambda: 5, a="y")
        text = prometheus_client.generate_latest(registry).decode()
        self.assertIn('t_gauge3{a="y"} 5.0', text)
        self.flushLoggedErrors(ZeroDivisionError)


class MetricsOverMCP(McpRelayCase):
    """Issue 6 acceptance 1 (MCP part): streams, parked polls and frames in the scrape."""

    timeout = 30

    async def test_streams_polls_and_frames(self) -> None:
        service = metrics_listener.make_service(["tcp:0:interface=127.0.0.1"], reactor, Clock(reactor))
        service.startService()
        self.addCleanup(service.stopService)
        (port,) = await service.ports()
        url = f"http://127.0.0.1:{port.getHost().port}/metrics"
        before, _ = await scrape(url)
        await self.register()
        stream = await self.events(query="&direction=inbound")
        self.addCleanup(stream.close)
        reply = await self.post("/sess/inbox?token=" + MCP_TOKEN, {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        self.assertEqual(reply.code, 200)
        reply = await self.post("/sess/outbox?token=" + MCP_TOKEN, {"jsonrpc": "2.0", "id": 1, "result": {}})
        self.assertEqual(reply.code, 200)
        after, _ = await scrape(url)
        self.assertEqual(delta(before, after, "relayd_mcp_frames_total", direction="inbound"), 1)
        self.assertEqual(delta(before, after, "relayd_mcp_frames_total", direction="outbound"), 1)
        self.assertEqual(value(after, "relayd_connections", relay="mcp", transport="sse"), 1)
        self.assertEqual(value(after, "relayd_connections", relay="mcp", transport="longpoll"), 0)
