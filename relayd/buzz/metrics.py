"""The broker host's metrics: the series it declares, and the plumbing's ones it reports on.

The broker's series are declared here, against relayd's one registry (L{relayd.base.metrics.REGISTRY});
the helpers it also uses are re-exported from L{relayd.base.metrics}, so broker code counts through this
one module (C{from relayd.buzz import metrics}). docs/deployment.md lists every series; their
names, labels and help texts are what operators' dashboards read.
"""

from __future__ import annotations

from prometheus_client import Counter

from relayd.base.metrics import REGISTRY, CallbackGauge, Watching

__all__ = [  # the series declared below, and the plumbing's ones re-exported
    "REGISTRY",
    "Watching",
    "broker_actions",
    "nostr_connections",
]

# A level, read at scrape time.
nostr_connections = CallbackGauge(
    "relayd_nostr_relay_connections", "Broker connections to the Nostr relay by state", ["state"]
)

# Counts.
broker_actions = Counter(
    "relayd_broker_actions", "Broker actions answered, by action and verdict status", ["action", "status"],
    registry=REGISTRY,
)
