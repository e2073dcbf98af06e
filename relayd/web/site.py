"""A C{Site} that caps bodies, keeps no access log of query strings, and can close what it served."""

from __future__ import annotations

import weakref
from typing import Any

from twisted.internet.interfaces import IAddress
from twisted.logger import Logger
from twisted.web.resource import IResource
from twisted.web.server import Site

from relayd.web.body import BodyLimit, LimitedRequest


class RelaySite(Site):
    """The site of one wing's listener.

    It tracks its connections (weakly: a WebSocket upgrade hands the transport to autobahn, which
    then owns it) so that shutdown can close long-lived HTTP responses that C{stopListening} leaves
    open, and it never writes the twisted.web access log, whose lines would carry query-string
    tokens (C{access_token}).
    """

    requestFactory = LimitedRequest
    _log = Logger()

    def __init__(self, resource: IResource, *, body_limit: BodyLimit | None = None, **kw: Any) -> None:
        super().__init__(resource, **kw)
        self.body_limit = body_limit
        self._protocols: weakref.WeakSet[Any] = weakref.WeakSet()

    def buildProtocol(self, addr: IAddress) -> Any:
        protocol = super().buildProtocol(addr)
        self._protocols.add(protocol)
        return protocol

    def log(self, request: Any) -> None:
        """No twisted.web access log (it would record query strings); wings log what they need."""

    def open_connections(self) -> int:
        """How many HTTP connections this site still serves."""
        return sum(1 for p in list(self._protocols) if _connected(p))

    def close_connections(self, abort: bool = False) -> None:
        """Close every connection (politely, or C{abort} without flushing)."""
        for protocol in list(self._protocols):
            transport = _transport(protocol)
            if transport is None or not _connected(protocol):
                continue
            if abort:
                transport.abortConnection()
            else:
                transport.loseConnection()


def _transport(protocol: Any) -> Any:
    # Site protocols wrap the HTTPChannel (which holds the transport) in a generic proxy.
    return getattr(getattr(protocol, "_channel", protocol), "transport", None)


def _connected(protocol: Any) -> bool:
    transport = _transport(protocol)
    return transport is not None and bool(getattr(transport, "connected", False))
