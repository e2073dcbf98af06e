"""A C{Site} that caps bodies, keeps no access log of query strings, and can close what it served."""

from __future__ import annotations

import weakref
from typing import Any

from twisted.internet.interfaces import IAddress
from twisted.logger import Logger
from twisted.web.http import HTTPChannel, _GenericHTTPChannelProtocol
from twisted.web.resource import IResource
from twisted.web.server import Site

from relayd.web.body import BodyLimit, LimitedRequest


_HEADERS_TOO_LARGE = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
)


class RelayChannel(HTTPChannel):
    """An C{HTTPChannel} that answers a request line or header block over 16 KiB with C{431}.

    Twisted would drop the connection without a word (a line over C{MAX_LENGTH}) or answer C{400};
    a client that bounds long query strings (the AEP SDK's C{from} budget) needs a 4xx it can read.
    """

    def lineLengthExceeded(self, line: bytes) -> None:
        self._refuse_header_fields()

    def lineReceived(self, line: bytes) -> None:
        if self._receivedHeaderSize + len(line) > self.totalHeadersSize:
            self._refuse_header_fields()
            return
        super().lineReceived(line)

    def _refuse_header_fields(self) -> None:
        if self.transport is not None:
            self.transport.write(_HEADERS_TOO_LARGE)
        self.loseConnection()


def _relay_channel(site: Site) -> _GenericHTTPChannelProtocol:
    return _GenericHTTPChannelProtocol(RelayChannel())


class RelaySite(Site):
    """The site of one wing's listener.

    It tracks its connections (weakly: a WebSocket upgrade hands the transport to autobahn, which
    then owns it) so that shutdown can close long-lived HTTP responses that C{stopListening} leaves
    open, and it never writes the twisted.web access log, whose lines would carry query-string
    tokens (C{access_token}).
    """

    requestFactory = LimitedRequest
    protocol = _relay_channel
    _log = Logger()

    def __init__(self, resource: IResource, *, body_limit: BodyLimit | None = None, **kw: Any) -> None:
        # relayd takes no HTML form posts; Twisted's form parsing runs every POST's content type
        # through the email package, about a third of a small POST's CPU.
        kw.setdefault("parsePOSTFormSubmission", False)
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
