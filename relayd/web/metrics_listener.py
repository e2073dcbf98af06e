"""The metrics listener: C{GET /metrics} in Prometheus text format on its own endpoints (--metrics-listen).

The registry lives in L{relayd.base.metrics}, which knows nothing of HTTP (the plumbing's series beside
it, each wing's in its own C{metrics} module); this module serves it. The web plumbing imports
L{relayd.base.metrics}, never the other way round (a contract in pyproject.toml).
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from twisted.web.server import Request

from relayd.base.clock import Timekeeper
from relayd.base.metrics import REGISTRY
from relayd.base.reactor import IReactor
from relayd.process.settings import DEFAULT_SITE_SETTINGS, SiteSettings
from relayd.web.answers import Answer
from relayd.web.listen import HTTPWingService
from relayd.web.request import BodyLimit
from relayd.web.routes import RoutedResource, RouteTable
from relayd.web.site import RelaySite
from relayd.wing import DEFAULT_GRACE

_TOO_LARGE = Answer(413, b"request body too large\n", ((b"content-type", b"text/plain; charset=utf-8"),))


class MetricsResource(RoutedResource):
    """C{GET /metrics}: the registry in Prometheus text format (synapse's form, no thread pool); the
    route table's JSON 404 and 405 for the rest."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        table = RouteTable()
        table.add("/metrics", {"GET": self.metrics})
        super().__init__(table)
        self.registry = registry

    def metrics(self, request: Request) -> Answer:
        headers = ((b"content-type", CONTENT_TYPE_LATEST.encode("ascii")), (b"cache-control", b"no-store"))
        return Answer(200, generate_latest(self.registry), headers)


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
    resource = MetricsResource()
    relay_site = RelaySite(
        resource, body_limit=BodyLimit(64 * 1024, _too_large), settings=site, relay="metrics",
        clock=clock, health_paths=frozenset({b"/metrics"}),
    )
    return HTTPWingService("metrics", relay_site, listen, reactor, clock, grace=grace)


def _too_large(request: Request) -> Answer:
    return _TOO_LARGE
