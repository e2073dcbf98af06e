"""Issue 6 acceptance 1 (AEP part): a scrape of the metrics listener after AEP traffic shows the series
with the right values. The relay and the metrics listener run in-process on real loopback ports."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from typing import Any

import prometheus_client
import treq
from prometheus_client.parser import text_string_to_metric_families
from twisted.internet import reactor
from twisted.trial.unittest import TestCase
from twisted.web.client import HTTPConnectionPool

import relayd
from relayd import tap
from relayd.base import metrics
from relayd.base.clock import Timekeeper
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

# Every relayd series as operators see it (docs/deployment.md): name -> type, labels, help. The plumbing
# declares the first group (relayd/base/metrics.py), each wing its own (relayd/<wing>/metrics.py); a change
# here breaks dashboards and alerts.
PLUMBING_SERIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "relayd_info": ("gauge", ("version",), "Always 1; the version label says which relayd runs"),
    "relayd_connections": (
        "gauge", ("relay", "transport"), "Open client connections by relay and transport (sse, ws, longpoll)"
    ),
    "relayd_http_connections": (
        "gauge", ("relay",), "Open HTTP connections per relay listener (every transport but WebSocket)"
    ),
    "relayd_http_connections_waiting": (
        "gauge",
        ("relay",),
        "New HTTP connections (and WebSocket subscriptions) waiting for their turn to start (a storm is started a "
        "slice per reactor turn), per relay",
    ),
    "relayd_store_errors": ("counter", ("relay", "operation"), "Failures of a relay's store, by operation"),
    "relayd_http_requests": ("counter", ("relay", "code"), "HTTP requests answered, by relay and status code"),
    "relayd_http_connections_refused": (
        "counter",
        ("relay",),
        "HTTP connections refused (503) because their client holds more than --max-client-connections, by relay",
    ),
}
WING_SERIES: dict[str, tuple[str, tuple[str, ...], str]] = {
    # relayd/aep/metrics.py
    "relayd_sessions": ("gauge", ("relay",), "Sessions held (AEP: buffered sessions; MCP: registered sessions)"),
    "relayd_subscribers": ("gauge", ("relay",), "Live subscriptions (AEP: SSE streams and WebSocket subscriptions)"),
    "relayd_events_ingested": ("counter", ("relay",), "Events accepted by a relay"),
    "relayd_events_delivered": (
        "counter", ("relay",), "Live events handed to matching subscribers (one per subscriber)"
    ),
    "relayd_events_dropped": (
        "counter",
        ("relay", "reason"),
        "Events not delivered: slow-consumer (skipped for a lagging consumer), cut-off (discarded with a consumer "
        "cut off for backpressure), unroutable (a command no emitter could take), queue-full (MCP), unreadable "
        "(stored by an older relayd in a form this one refuses)",
    ),
    "relayd_ingest_refused": (
        "counter", ("relay", "reason"), "Ingest requests or messages refused, by the error code answered"
    ),
    "relayd_replays": (
        "counter", ("relay", "outcome"), "Resumes served from history, by outcome (complete, exhausted, failed)"
    ),
    "relayd_replayed_events": ("counter", ("relay",), "Events sent from history by resumes"),
    "relayd_fanout_seconds": (
        "histogram",
        ("relay",),
        "Time to hand one ingested batch to every matching subscriber's queue (not the network write)",
    ),
    # relayd/mcp/metrics.py
    "relayd_mcp_evictions": (
        "counter",
        ("kind",),
        "MCP sessions ended while idle to make room for a new one at a bound: kind session (a tunnel session "
        "without readers) or client (an endpoint client session)",
    ),
    "relayd_mcp_frames": (
        "counter",
        ("direction",),
        "MCP frames relayed: inbound (agent to page, POST inbox) and outbound (page to agents, POST outbox)",
    ),
    # relayd/buzz/metrics.py
    "relayd_broker_actions": ("counter", ("action", "status"), "Broker actions answered, by action and verdict status"),
    "relayd_nostr_relay_connections": ("gauge", ("state",), "Broker connections to the Nostr relay by state"),
}


def _families(text: str) -> dict[str, tuple[str, str]]:
    """relayd's series in an exposition: name -> type, help."""
    return {
        family.name: (family.type, family.documentation)
        for family in text_string_to_metric_families(text)
        if family.name.startswith("relayd_")
    }


def _label_names(collector: Any) -> tuple[str, ...]:
    # prometheus_client keeps a metric's label names in _labelnames; a CallbackGauge in labelnames.
    return tuple(getattr(collector, "_labelnames", None) or getattr(collector, "labelnames", ()))


class SeriesOwners(TestCase):
    """The plumbing declares only protocol-free series; with the wings, every series is served as before."""

    timeout = 30

    def test_the_plumbing_alone_declares_only_its_own_series(self) -> None:
        # A fresh interpreter: here the wings are imported already and their series registered.
        root = os.path.dirname(os.path.dirname(os.path.abspath(relayd.__file__)))
        program = (
            "import sys; from prometheus_client import generate_latest; from relayd.base.metrics import REGISTRY; "
            "sys.stdout.write(generate_latest(REGISTRY).decode()); "
            "sys.stdout.write(' '.join(sorted(m for m in sys.modules if m.startswith('relayd'))))"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        out = subprocess.run(
            [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60, check=True
        ).stdout
        text, _, modules = out.rpartition("\n")
        self.assertEqual(_families(text + "\n"), {name: (kind, help) for name, (kind, _, help) in PLUMBING_SERIES.items()})
        self.assertEqual(modules.split(), ["relayd", "relayd.base", "relayd.base.metrics"])

    async def test_with_the_wings_every_series_is_served_as_documented(self) -> None:
        for wing in tap.WINGS:  # as the tap imports them
            importlib.import_module(f"{wing}.service")
        service = metrics_listener.make_service(["tcp:0:interface=127.0.0.1"], reactor, Timekeeper(reactor))
        service.startService()
        self.addCleanup(service.stopService)
        (port,) = await service.ports()
        pool = HTTPConnectionPool(reactor, persistent=False)
        response = await treq.get(f"http://127.0.0.1:{port.getHost().port}/metrics", pool=pool)
        text = (await treq.content(response)).decode()
        expected = {**PLUMBING_SERIES, **WING_SERIES}
        self.assertEqual(_families(text), {name: (kind, help) for name, (kind, _, help) in expected.items()})
        owners = [metrics, *(importlib.import_module(f"{wing}.metrics") for wing in tap.WINGS)]
        declared = {
            collector.name if isinstance(collector, metrics.CallbackGauge) else collector._name: _label_names(collector)
            for owner in owners
            for collector in vars(owner).values()
            if isinstance(collector, (metrics.CallbackGauge, prometheus_client.metrics.MetricWrapperBase))
        }
        self.assertEqual(declared, {name: labels for name, (_, labels, _) in expected.items()})


class MetricsOverAEP(TestCase):
    timeout = 30

    async def setUp(self) -> None:  # type: ignore[override]
        self.relay = await AEPRelay.start()
        self.addCleanup(self.relay.stop)
        self.service = metrics_listener.make_service(["tcp:0:interface=127.0.0.1"], reactor, Timekeeper(reactor))
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

    async def test_connections_waiting_for_their_turn(self) -> None:
        waiting = self.relay.wing.service.site.admission.waiting
        self.assertEqual(value((await scrape(self.url))[0], "relayd_http_connections_waiting", relay="aep"), 0)
        waiting.extend([object(), object()])  # (no turn is due: nothing takes them)
        self.addCleanup(waiting.clear)
        self.assertEqual(value((await scrape(self.url))[0], "relayd_http_connections_waiting", relay="aep"), 2)

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
        service = metrics_listener.make_service(["tcp:0:interface=127.0.0.1"], reactor, Timekeeper(reactor))
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
