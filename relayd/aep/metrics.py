"""The AEP relay's metrics: the series it declares, and the plumbing's ones it reports on.

AEP's series are declared here, against relayd's one registry (L{relayd.base.metrics.REGISTRY}); the
protocol-free series and helpers it also uses are re-exported from L{relayd.base.metrics}, so AEP code
counts through this one module (C{from relayd.aep import metrics}). docs/deployment.md lists every
series; their names, labels and help texts are what operators' dashboards read.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from relayd.base.metrics import REGISTRY, CallbackGauge, Watching, connections, store_errors

__all__ = [  # the series declared below, and the plumbing's ones re-exported
    "REGISTRY",
    "Watching",
    "connections",
    "events_delivered",
    "events_dropped",
    "events_ingested",
    "fanout_seconds",
    "ingest_refused",
    "replayed_events",
    "replays",
    "sessions",
    "store_errors",
    "subscribers",
]

# Levels, read at scrape time.
sessions = CallbackGauge("relayd_sessions", "Sessions held (AEP: buffered sessions; MCP: registered sessions)", ["relay"])
subscribers = CallbackGauge("relayd_subscribers", "Live subscriptions (AEP: SSE streams and WebSocket subscriptions)", ["relay"])

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
fanout_seconds = Histogram(
    "relayd_fanout_seconds",
    "Time to hand one ingested batch to every matching subscriber's queue (not the network write)",
    ["relay"],
    buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
    registry=REGISTRY,
)
