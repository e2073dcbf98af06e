"""The site of every relayd listener: its connections (counted per client, closed on shutdown), the
client's address, and the access line (never a query string). Its channel is relayd.web.channel's,
its requests relayd.web.request's."""

from __future__ import annotations

import re
import weakref
from typing import Any, Callable

from twisted.internet.interfaces import IAddress
from twisted.logger import Logger
from twisted.web.resource import IResource, Resource
from twisted.web.server import Site

from relayd.base import metrics
from relayd.base.clock import Timekeeper
from relayd.base.reactor import installed
from relayd.compat.prometheus import adder
from relayd.compat.web import built_channel, channel_of, channel_protocol, close_after
from relayd.logs.access_log import access_logger
from relayd.process.settings import DEFAULT_SITE_SETTINGS, HEALTH_RESERVE, SiteSettings
from relayd.web.admission import Admission
from relayd.web.answers import Answer, json_answer, write_answer
from relayd.web.channel import RelayChannel
from relayd.web.request import BodyLimit, ChannelSite, RelayRequest, host_of
from relayd.web.simple_post import SimplePosts

_MAX_SHARED_ADDRESSES = 64


class _Crowded(Resource):
    """The answer to a client over its connection cap (its connection then closes)."""

    isLeaf = True

    def __init__(self, answer: Answer) -> None:
        super().__init__()
        self.answer = answer

    def render(self, request: Any) -> bytes:
        request.setHeader(b"connection", b"close")
        close_after(request)
        return write_answer(request, self.answer)


def _relay_channel(site: Site) -> Any:
    return channel_protocol(RelayChannel())


class RelaySite(ChannelSite):
    """The site of one wing's listener.

    It tracks its connections (weakly: a WebSocket upgrade hands the transport to autobahn, which
    then owns it) so that shutdown can close long-lived HTTP responses that C{stopListening} leaves
    open. It never writes the twisted.web access log, whose lines would carry query-string tokens
    (C{access_token}); it logs its own line per request instead (L{access}): method, path without
    the query, status, bytes, peer.

    Everything it is configured with is given at construction: C{relay}, the name in access-log
    lines and metrics, and C{settings} (L{SiteSettings}), whose values become the attributes
    below (C{idle_timeout} is Twisted's C{timeOut}).

    @ivar relay: the relay named in access-log lines and metrics.
    @ivar trust_forwarded_for: see L{SiteSettings}.
    @ivar header_timeout: see L{SiteSettings}.
    @ivar body_timeout: see L{SiteSettings}.
    @ivar access_log: see L{SiteSettings}.
    """

    requestFactory = RelayRequest
    protocol = _relay_channel
    _log = Logger()
    noisy = False  # no "Starting factory" lines per listener

    def __init__(
        self,
        resource: IResource,
        *,
        body_limit: BodyLimit | None = None,
        settings: SiteSettings = DEFAULT_SITE_SETTINGS,
        relay: str | None = None,
        clock: Timekeeper | None = None,
        health_paths: frozenset[bytes] = frozenset(),
        **kw: Any,
    ) -> None:
        # relayd takes no HTML form posts; Twisted's form parsing runs every POST's content type
        # through the email package, about a third of a small POST's CPU.
        kw.setdefault("parsePOSTFormSubmission", False)
        # Its timers (deadlines, Twisted's idle timeout) and durations run on the clock: the wing's,
        # or one on the reactor handed in (a test's task.Clock) or the installed one.
        if clock is None:
            reactor = kw.get("reactor")
            clock = Timekeeper(reactor if reactor is not None else installed())
        kw["reactor"] = clock.reactor
        self.clock = clock
        super().__init__(resource, **kw)
        self.body_limit = body_limit
        self.relay: str | None = relay
        self.settings = settings
        self.trust_forwarded_for: int = settings.trust_forwarded_for
        self.header_timeout: float | None = settings.header_timeout
        self.body_timeout: float | None = settings.body_timeout
        self.timeOut = settings.idle_timeout
        self.access_log: bool = settings.access_log
        self.max_client_connections: int = settings.max_client_connections
        self.health_paths = health_paths
        self.too_many_connections = json_answer(
            503, b'{"error":"too_many_connections","max_per_client":%d}' % self.max_client_connections
        )
        self._crowded = _Crowded(self.too_many_connections)
        self._clients: dict[str, int] = {}  # open connections per client, under the cap
        self._protocols: weakref.WeakSet[Any] = weakref.WeakSet()
        # Paths (and prefixes) whose plain POSTs the wing answers itself, beside twisted.web
        # (relayd.web.simple_post): the handler answers, or declines with None before it has done anything.
        self.simple_posts = SimplePosts()
        self._request_counters: dict[tuple[str, int], Callable[[], None]] = {}  # labelled children's adders, made once
        self._addresses: dict[Any, Any] = {}
        self.admission = Admission(clock)  # new connections started per reactor turn (a storm in slices)

    def shared_address(self, address: Any) -> Any:
        """One object for each local address the site's connections arrive on (at most
        L{_MAX_SHARED_ADDRESSES}: a PROXY-protocol listener's are the proxy's to choose)."""
        try:
            shared = self._addresses.get(address)
        except TypeError:
            return address  # unhashable: not shared
        if shared is not None:
            return shared
        if len(self._addresses) < _MAX_SHARED_ADDRESSES:
            self._addresses[address] = address
        return address

    def buildProtocol(self, addr: IAddress | None) -> Any:
        # (Once per connection: Site's, HTTPFactory's and Factory's settings given at once; the idle
        # timeout scheduled through the clock's one bound method, Timekeeper.give_timeouts.)
        protocol = None
        if type(self).protocol is _relay_channel:  # (not when a test or subclass builds another)
            protocol = built_channel(self, RelayChannel())
        if protocol is None:
            protocol = super().buildProtocol(addr)
        self.clock.give_timeouts(protocol)
        self._protocols.add(protocol)
        return protocol

    def track(self, protocol: Any, channel: Any = None) -> None:
        """Count C{protocol} among this site's connections (for drain) though the site did not build
        it: a held stream's, once it has left twisted.web (relayd.web.streams.held) from C{channel}, whose
        place under the per-client cap it takes (L{held_closed} when it ends)."""
        self._protocols.add(protocol)
        if channel is not None and getattr(channel, "client", None) is not None:
            channel.client = None  # (its client is the held stream's peer: the same address)

    def held_closed(self, peer: str) -> None:
        """A held stream of C{peer} ended: its connection leaves the per-client count."""
        if self.max_client_connections:
            self.client_left(peer)

    def getResourceFor(self, request: Any) -> IResource:
        """The addressed resource (every relayd site's root is a leaf that answers every path and
        method itself, in JSON: relayd.web.routes), or C{503} when the client holds more connections
        than L{max_client_connections}."""
        if self.max_client_connections:
            crowded = self._crowded_request(request)
            if crowded is not None:
                return crowded
        return super().getResourceFor(request)

    def _crowded_request(self, request: Any) -> IResource | None:
        channel = getattr(request, "channel", None)
        if not isinstance(channel, RelayChannel):
            return None
        if self.trust_forwarded_for:
            # The client is the request's: a proxy's connection counts for its latest client.
            client = self.client_address(request)
            if client != channel.client and not self._recount(channel, client):
                return self._crowded
        if channel.crowded and request.path not in self.health_paths:
            metrics.http_connections_refused.labels(relay=self.relay or "http").inc()
            return self._crowded
        return None

    def _recount(self, channel: RelayChannel, client: str) -> bool:
        """Count C{channel} for C{client}, the client of its latest request behind trusted proxies,
        instead of its previous one; C{False} when C{client} is refused (L{count_client})."""
        if channel.client is not None:
            self.client_left(channel.client)
            del channel.client
        return self.count_client(channel, client)

    def count_forwarded(self, channel: RelayChannel, client: str) -> bool:
        """Behind trusted proxies, for a request answered beside twisted.web (a plain POST): count
        C{channel} for C{client}, its request's client, as L{getResourceFor} would; C{True} when the
        request may be answered. C{False}, with nothing changed, when C{client} is at its cap (then
        twisted.web's path counts it, and answers the crowded C{503} or refuses it, once)."""
        if client != channel.client:
            if self._clients.get(client, 0) >= self.max_client_connections:
                return False
            self._recount(channel, client)
        return not channel.crowded

    def count_client(self, channel: RelayChannel, client: str) -> bool:
        """Count C{channel} for C{client}; C{False} (then not counted) when C{client} already holds
        its cap and its L{HEALTH_RESERVE}. Within the reserve the channel is marked C{crowded}."""
        count = self._clients.get(client, 0) + 1
        if count > self.max_client_connections + HEALTH_RESERVE:
            metrics.http_connections_refused.labels(relay=self.relay or "http").inc()
            return False
        self._clients[client] = count
        channel.client = client
        channel.crowded = count > self.max_client_connections
        return True

    def client_left(self, client: str) -> None:
        """One connection counted for C{client} closed (or left HTTP: a WebSocket)."""
        count = self._clients.get(client, 0) - 1
        if count > 0:
            self._clients[client] = count
        else:
            self._clients.pop(client, None)

    def log(self, request: Any) -> None:
        """Called by twisted.web when a response finishes: relayd's access line, not Twisted's."""
        access = getattr(request, "_access", None)
        if access is not None:
            access(request.code)

    def client_address(self, request: Any) -> str:
        """The client's address: the trusted C{X-Forwarded-For} entry, else the (PROXY) peer."""
        return self.client_of(request.requestHeaders.getRawHeaders(b"x-forwarded-for"), request.getClientAddress())

    def client_of(self, forwarded: list[bytes] | None, peer: Any) -> str:
        """The client's address from the C{X-Forwarded-For} values of its request and the address
        of the (PROXY) C{peer}: the one reading of every way a request comes in."""
        hops = self.trust_forwarded_for
        if hops:
            values = forwarded or []
            addresses = [a.strip() for value in values for a in value.split(b",") if a.strip()]
            if addresses:
                # Each trusted proxy appended the address it saw; the entry the outermost trusted
                # proxy appended is the client as far as anyone trustworthy knows (autobahn's rule).
                return addresses[-hops:][0].decode("ascii", "replace")[:64]
        return host_of(peer)

    def access(
        self, *, method: bytes, path: bytes, status: int, sent: int, peer: str, started: float | None = None
    ) -> None:
        """Count one answered request and log its line (never the query string)."""
        relay = self.relay or "http"
        count = self._request_counters.get((relay, status))
        if count is None:
            count = adder(metrics.http_requests.labels(relay=relay, code=str(status)))
            self._request_counters[(relay, status)] = count
        count()
        if not self.access_log:
            return
        clock = self.clock
        when = clock.seconds()
        verb = _loggable(method)
        where = _loggable(_strip_query(path))
        # Rendered here once: twisted.logger's own formatting of five fields cost a third of the
        # line's price, and one line is written per request.
        text = f'{relay} {peer} "{verb} {where}" {status} {sent}'
        if access_logger.written(when, text):
            return  # (straight to the text log, its only destination: relayd.logs.access_log)
        duration = round((clock.monotonic() - started) * 1000, 1) if started is not None else None
        access_logger.line(when, text, relay, peer, verb, where, status, sent, duration)

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
    return getattr(channel_of(protocol), "transport", None)


def _connected(protocol: Any) -> bool:
    transport = _transport(protocol)
    return transport is not None and bool(getattr(transport, "connected", False))


def _strip_query(path: bytes) -> bytes:
    # (find: docs/architecture.md, hot paths)
    return path.split(b"?", 1)[0] if path.find(b"?") >= 0 else path


# Bytes a client could use to break or forge an access line: controls (Twisted lets DEL through in a
# path), spaces and the line's own quote.
_UNLOGGABLE = re.compile(rb'[\x00-\x20\x7f"]')


# Methods and paths seen before (most requests name a few): their loggable text, not worked out again.
_LOGGABLE: dict[bytes, str] = {}
_LOGGABLE_KEPT = 256  # (a client chooses its paths: at most this many are kept)


def _loggable(value: bytes) -> str:
    """C{value} for an access line: unsafe bytes percent-encoded, the rest as UTF-8 (U+FFFD if not)."""
    known = _LOGGABLE.get(value)
    if known is not None:
        return known
    text = _escaped(value)
    if len(_LOGGABLE) < _LOGGABLE_KEPT:
        _LOGGABLE[value] = text
    return text


def _escaped(value: bytes) -> str:
    if _UNLOGGABLE.search(value):
        value = _UNLOGGABLE.sub(lambda m: b"%%%02X" % m.group()[0], value)
    return value.decode("utf-8", "replace")  # (Twisted refuses non-ASCII request targets)
