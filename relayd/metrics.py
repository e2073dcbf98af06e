"""relayd's Prometheus metrics: one registry owned by relayd, every series defined here.

Wings count through the module-level objects below, for example::

    from relayd import metrics
    metrics.events_ingested.labels(relay="aep").inc(len(batch))

Hot paths bind their labelled children once at import (C{_INGESTED = metrics.events_ingested.labels(
relay="aep")}) and count per batch, not per delivery. Levels that already exist as state (open
connections, sessions, subscribers, Nostr connection states) are never incremented and decremented:
they are read at scrape time from callbacks registered with L{CallbackGauge.watch}, usually through a
L{Watching} service that lives exactly as long as the wing.

Label values in use: C{relay} is C{aep}, C{mcp} or C{broker}; C{transport} is C{sse}, C{ws},
C{longpoll} or C{http}.

The registry is relayd's own (not C{prometheus_client.REGISTRY}), served by L{MetricsResource} on the
C{--metrics-listen} endpoints.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from twisted.application.service import Service
from twisted.logger import Logger

import relayd

# One `_created` series per label set doubles the scrape for nothing an operator asks of a relay.
prometheus_client.disable_created_metrics()

REGISTRY = CollectorRegistry(auto_describe=True)
"""The registry every relayd series is registered with (and the only one served)."""

_log = Logger(namespace="relayd.metrics")


class Watch:
    """One registered callback of a L{CallbackGauge}; L{close} removes it."""

    __slots__ = ("gauge", "fn", "labels", "free")

    def __init__(self, gauge: CallbackGauge, fn: Callable[[], Any], labels: dict[str, str], free: str | None):
        self.gauge = gauge
        self.fn = fn
        self.labels = labels
        self.free = free

    def close(self) -> None:
        """Stop reporting this callback's values."""
        self.gauge._forget(self)


class CallbackGauge(Collector):
    """A gauge whose values are read from callbacks when Prometheus scrapes.

    C{watch(fn, relay="aep", transport="sse")} with every label bound: C{fn()} returns a number. With
    one label left free, C{fn()} returns a mapping from that label's value to a number (e.g.
    C{{"ready": 2, "connecting": 1}} for a C{state} label). Callbacks reporting the same label set are
    summed, so two relays of one kind in one process (tests) add up.
    """

    def __init__(
        self, name: str, documentation: str, labelnames: Iterable[str], registry: CollectorRegistry = REGISTRY
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._watches: list[Watch] = []
        registry.register(self)

    def watch(self, fn: Callable[[], Any], **labels: str) -> Watch:
        """Report C{fn()} under C{labels} at every scrape until the returned L{Watch} is closed."""
        unknown = set(labels) - set(self.labelnames)
        if unknown:
            raise ValueError(f"{self.name} has no label {sorted(unknown)}")
        free = [name for name in self.labelnames if name not in labels]
        if len(free) > 1:
            raise ValueError(f"{self.name}: bind all labels but one ({free} are free)")
        watch = Watch(self, fn, dict(labels), free[0] if free else None)
        self._watches.append(watch)
        return watch

    def _forget(self, watch: Watch) -> None:
        if watch in self._watches:
            self._watches.remove(watch)

    def value(self, **labels: str) -> float:
        """The current value for one fully bound label set (0 if nothing reports it); for tests."""
        key = tuple(labels[name] for name in self.labelnames)
        return self._totals().get(key, 0.0)

    def _totals(self) -> dict[tuple[str, ...], float]:
        totals: dict[tuple[str, ...], float] = {}
        for watch in list(self._watches):
            try:
                result = watch.fn()
            except Exception:
                # A broken callback must not break the scrape of every other series.
                _log.failure("metrics callback for {name} failed", name=self.name)
                continue
            if watch.free is None:
                items: Iterable[tuple[str | None, Any]] = [(None, result)]
            else:
                items = dict(result).items()
            for free_value, number in items:
                labels = dict(watch.labels)
                if watch.free is not None:
                    labels[watch.free] = str(free_value)
                key = tuple(labels[name] for name in self.labelnames)
                totals[key] = totals.get(key, 0.0) + float(number)
        return totals

    def describe(self) -> Iterable[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterable[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, total in sorted(self._totals().items()):
            family.add_metric(list(key), total)
        yield family


class Watching(Service):
    """Scrape-time callbacks that live as long as their parent service (registered at start, closed at stop)."""

    def __init__(self) -> None:
        self._specs: list[tuple[CallbackGauge, Callable[[], Any], dict[str, str]]] = []
        self._active: list[Watch] = []

    def add(self, gauge: CallbackGauge, fn: Callable[[], Any], **labels: str) -> Watching:
        """Report C{fn()} on C{gauge} under C{labels} while running; returns C{self} for chaining."""
        self._specs.append((gauge, fn, labels))
        if self.running:
            self._active.append(gauge.watch(fn, **labels))
        return self

    def startService(self) -> None:
        super().startService()
        self._active = [gauge.watch(fn, **labels) for gauge, fn, labels in self._specs]

    def stopService(self) -> None:
        super().stopService()
        for watch in self._active:
            watch.close()
        self._active = []


# The series ----------------------------------------------------------------------------------------

info = Gauge("relayd_info", "Always 1; the version label says which relayd runs", ["version"], registry=REGISTRY)
info.labels(version=relayd.__version__).set(1)

# Levels, read at scrape time.
connections = CallbackGauge(
    "relayd_connections", "Open client connections by relay and transport (sse, ws, longpoll)", ["relay", "transport"]
)
http_connections = CallbackGauge(
    "relayd_http_connections", "Open HTTP connections per relay listener (every transport but WebSocket)", ["relay"]
)
sessions = CallbackGauge("relayd_sessions", "Sessions held (AEP: buffered sessions; MCP: registered sessions)", ["relay"])
subscribers = CallbackGauge("relayd_subscribers", "Live subscriptions (AEP: SSE streams and WebSocket subscriptions)", ["relay"])
nostr_connections = CallbackGauge(
    "relayd_nostr_relay_connections", "Broker connections to the Nostr relay by state", ["state"]
)

# Counts.
events_ingested = Counter("relayd_events_ingested", "Events accepted by a relay", ["relay"], registry=REGISTRY)
events_delivered = Counter(
    "relayd_events_delivered", "Live events handed to matching subscribers (one per subscriber)", ["relay"], registry=REGISTRY
)
events_dropped = Counter(
    "relayd_events_dropped",
    "Events not delivered: slow-consumer (skipped for a lagging consumer), cut-off (discarded with a consumer "
    "cut off for backpressure), unroutable (a command no emitter could take), queue-full (MCP), unreadable "
    "(stored by an older relayd in a form this one refuses)",
    ["relay", "reason"],
    registry=REGISTRY,
)
ingest_refused = Counter(
    "relayd_ingest_refused",
    "Ingest requests or messages refused, by the error code answered",
    ["relay", "reason"],
    registry=REGISTRY,
)
replays = Counter(
    "relayd_replays", "Resumes served from history, by outcome (complete, exhausted, failed)", ["relay", "outcome"],
    registry=REGISTRY,
)
replayed_events = Counter("relayd_replayed_events", "Events sent from history by resumes", ["relay"], registry=REGISTRY)
store_errors = Counter(
    "relayd_store_errors", "Failures of a relay's store, by operation", ["relay", "operation"], registry=REGISTRY
)
fanout_seconds = Histogram(
    "relayd_fanout_seconds",
    "Time to hand one ingested batch to every matching subscriber's queue (not the network write)",
    ["relay"],
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
    registry=REGISTRY,
)
mcp_frames = Counter(
    "relayd_mcp_frames",
    "MCP frames relayed: inbound (agent to page, POST inbox) and outbound (page to agents, POST outbox)",
    ["direction"],
    registry=REGISTRY,
)
broker_actions = Counter(
    "relayd_broker_actions", "Broker actions answered, by action and verdict status", ["action", "status"],
    registry=REGISTRY,
)
http_requests = Counter(
    "relayd_http_requests", "HTTP requests answered, by relay and status code", ["relay", "code"], registry=REGISTRY
)

# Process-level series (RSS, open fds, CPU, GC) on relayd's registry too.
prometheus_client.ProcessCollector(registry=REGISTRY)
prometheus_client.PlatformCollector(registry=REGISTRY)
prometheus_client.GCCollector(registry=REGISTRY)


def sample(name: str, labels: Mapping[str, str] | None = None, registry: CollectorRegistry = REGISTRY) -> float:
    """The current value of one sample (0 when absent), e.g. C{sample("relayd_events_ingested_total",
    {"relay": "aep"})}; for tests and C{relayd-admin status}."""
    value = registry.get_sample_value(name, dict(labels or {}))
    return 0.0 if value is None else value
