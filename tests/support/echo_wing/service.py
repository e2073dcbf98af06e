"""The echo wing's make_wing: a site answering C{GET /} with C{echo}, on the plumbing."""

from __future__ import annotations

from twisted.web.resource import Resource
from twisted.web.server import Request

from relayd.base.config import Resolved
from relayd.web.listen import HTTPWingService
from relayd.web.site import RelaySite
from relayd.wing import Plumbing
from tests.support.echo_wing.config import EchoConfig


class Echo(Resource):
    isLeaf = True

    def render_GET(self, request: Request) -> bytes:
        request.setHeader(b"content-type", b"text/plain")
        return b"echo\n"


def configured(settings: Resolved) -> EchoConfig | None:
    """The echo wing's configuration, or C{None} without C{--echo-listen} (it refuses nothing)."""
    return EchoConfig.from_settings(settings)


def make_wing(plumbing: Plumbing, settings: Resolved) -> HTTPWingService | None:
    """The echo wing, or C{None} without C{--echo-listen}."""
    config = configured(settings)
    if config is None:
        return None
    site = RelaySite(Echo(), settings=plumbing.site, relay="echo")
    return HTTPWingService("echo", site, list(config.listen), plumbing.reactor, plumbing.clock, grace=plumbing.grace)
