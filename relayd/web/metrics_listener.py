"""The metrics listener: C{GET /metrics} in Prometheus text format on its own endpoints (--metrics-listen).

The registry lives in L{relayd.base.metrics}, which knows nothing of HTTP (the plumbing's series beside
it, each wing's in its own C{metrics} module); this module serves it. The web plumbing imports
L{relayd.base.metrics}, never the other way round (a contract in pyproject.toml).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.web.resource import Resource
from twisted.web.server import Request

from relayd.base.clock import Timekeeper
from relayd.base.metrics import REGISTRY
from relayd.base.reactor import IReactor
from relayd.process.settings import DEFAULT_SITE_SETTINGS, SiteSettings
from relayd.web.body import BodyLimit
from relayd.web.service import HTTPWingService
from relayd.web.site import RelaySite
from relayd.wing import DEFAULT_GRACE


class MetricsResource(Resource):
    """C{GET /metrics}: the registry in Prometheus text format (synapse's form, no thread pool)."""

    isLeaf = True

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__()
        self.registry = registry

    def render_GET(self, request: Request) -> bytes:
        if request.path != b"/metrics":
            request.setResponseCode(404)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            return b"metrics are served at /metrics\n"
        body = generate_latest(self.registry)
        request.setHeader(b"content-type", CONTENT_TYPE_LATEST.encode("ascii"))
        request.setHeader(b"cache-control", b"no-store")
        return body


def make_service(
    listen: list[str],
    reactor: IReactor,
    clock: Timekeeper,
    *,
    site: SiteSettings = DEFAULT_SITE_SETTINGS,
    grace: float = DEFAULT_GRACE,
) -> HTTPWingService:
    """The metrics listener: an C{HTTPWingService} named C{metrics} serving L{MetricsResource},
    its site built with the process's site settings and its shutdown with its grace."""
    relay_site = RelaySite(
        MetricsResource(), body_limit=BodyLimit(64 * 1024, _too_large), settings=site, relay="metrics", clock=clock,
        health_paths=frozenset({b"/metrics"}),
    )
    return HTTPWingService("metrics", relay_site, listen, reactor, clock, grace=grace)


def _too_large(request: Any) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    return 413, [(b"content-type", b"text/plain; charset=utf-8")], b"request body too large\n"
