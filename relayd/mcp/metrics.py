"""The MCP tunnel relay's metrics: the series it declares, and the plumbing's ones it reports on.

MCP's series are declared here, against relayd's one registry (L{relayd.base.metrics.REGISTRY}); the
protocol-free series and helpers it also uses are re-exported from L{relayd.base.metrics}, so MCP code
counts through this one module (C{from relayd.mcp import metrics}). docs/deployment.md lists every
series; their names, labels and help texts are what operators' dashboards read.
"""

from __future__ import annotations

from prometheus_client import Counter

from relayd.base.metrics import REGISTRY, Watching, connections

__all__ = [  # the series declared below, and the plumbing's ones re-exported
    "REGISTRY",
    "Watching",
    "connections",
    "mcp_evictions",
    "mcp_frames",
]

mcp_frames = Counter(
    "relayd_mcp_frames",
    "MCP frames relayed: inbound (agent to page, POST inbox) and outbound (page to agents, POST outbox)",
    ["direction"],
    registry=REGISTRY,
)

mcp_evictions = Counter(
    "relayd_mcp_evictions",
    "MCP sessions ended while idle to make room for a new one at a bound: kind session (a tunnel session "
    "without readers) or client (an endpoint client session)",
    ["kind"],
    registry=REGISTRY,
)
