"""relayd's Prometheus metrics: the one registry, and the series that belong to no wing.

This module knows no wing. It holds the registry, the process and GC collectors, and the
protocol-free series every wing or the web plumbing reports under its relay's name
(C{relayd_info}, C{relayd_connections}, C{relayd_http_connections}, C{relayd_http_connections_waiting},
C{relayd_store_errors}, C{relayd_http_requests}). A wing declares its own series in its package's C{metrics} module,
against L{REGISTRY}, and re-exports the plumbing's ones it reports on, so the wing's code counts
through one module::

    # relayd/<wing>/metrics.py
    from relayd.base.metrics import REGISTRY, store_errors
    frames = Counter("relayd_<wing>_frames", "...", ["direction"], registry=REGISTRY)

    # relayd/<wing>/relay.py
    from relayd.<wing> import metrics
    _INBOUND = metrics.frames.labels(direction="inbound")

Hot paths bind their labelled children once at import, as above, and count per batch, not per
delivery; a count taken per request on the reactor's thread goes through
C{relayd.compat.prometheus.adder(child)}, which adds without the value's lock. Levels that already exist as state (open connections, sessions, subscribers, upstream
connection states) are never incremented and decremented: they are read at scrape time from
callbacks registered with L{CallbackGauge.watch}, usually through a L{Watching} service that lives
exactly as long as the wing.

Label values: C{relay} is the wing's relay name (the name its listener logs under); C{transport}
is C{sse}, C{ws}, C{longpoll} or C{http}.

The registry is relayd's own (not C{prometheus_client.REGISTRY}), served by
C{relayd.web.metrics_listener} on the C{--metrics-listen} endpoints.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
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

    C{watch(fn, relay="echo", transport="sse")} with every label bound: C{fn()} returns a number. With
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


# The plumbing's series: protocol-free, each with the relay's name as a label. A wing's own series
# are declared in its package (relayd/<wing>/metrics.py) against REGISTRY.

info = Gauge("relayd_info", "Always 1; the version label says which relayd runs", ["version"], registry=REGISTRY)
info.labels(version=relayd.__version__).set(1)

# Levels, read at scrape time.
connections = CallbackGauge(
    "relayd_connections", "Open client connections by relay and transport (sse, ws, longpoll)", ["relay", "transport"]
)
http_connections = CallbackGauge(
    "relayd_http_connections", "Open HTTP connections per relay listener (every transport but WebSocket)", ["relay"]
)
http_connections_waiting = CallbackGauge(
    "relayd_http_connections_waiting",
    "New HTTP connections (and WebSocket subscriptions) waiting for their turn to start (a storm is started a "
    "slice per reactor turn), per relay",
    ["relay"],
)

# Counts.
store_errors = Counter(
    "relayd_store_errors", "Failures of a relay's store, by operation", ["relay", "operation"], registry=REGISTRY
)
http_requests = Counter(
    "relayd_http_requests", "HTTP requests answered, by relay and status code", ["relay", "code"], registry=REGISTRY
)
http_connections_refused = Counter(
    "relayd_http_connections_refused",
    "HTTP connections refused (503) because their client holds more than --max-client-connections, by relay",
    ["relay"],
    registry=REGISTRY,
)

# Process-level series (RSS, open fds, CPU, GC) on relayd's registry too.
prometheus_client.ProcessCollector(registry=REGISTRY)
prometheus_client.PlatformCollector(registry=REGISTRY)
prometheus_client.GCCollector(registry=REGISTRY)


def sample(name: str, labels: Mapping[str, str] | None = None, registry: CollectorRegistry = REGISTRY) -> float:
    """The current value of one sample (0 when absent), e.g. C{sample("relayd_http_requests_total",
    {"relay": "echo", "code": "200"})}; for tests and C{relayd-admin status}."""
    value = registry.get_sample_value(name, dict(labels or {}))
    return 0.0 if value is None else value
