"""Sharded pub/sub on a Redis Cluster (C{SSUBSCRIBE}): each shard channel heard on the master that owns it.

A classic C{PUBLISH} on a cluster is forwarded by the node it was sent to over the cluster bus to
every other node: every message crosses the cluster bus, and a subscriber hears it one hop after it
was published (docs/performance.md "Redis Cluster against one primary"). A shard channel (C{SPUBLISH})
lives in the slot of its name, like a key: it is published on that slot's master and heard there only.
So a L{ShardedBus} keeps one subscriber connection per master (a L{_ShardLink}) and subscribes each of
its channels on the master that owns the channel's slot now:

- The channels it wants are given by L{ShardedBus.subscribe} / L{ShardedBus.unsubscribe}
  (relayd/aep/redis/fanout.py subscribes only the buckets its local subscriptions need), and
  L{ShardedBus.heard} says when Redis has answered their C{SSUBSCRIBE} (a replay waits for it, so that
  no event of another instance falls between the history it reads and the live events it holds).
- Each change of what it wants, of the slot map (L{ClusterRedis.on_map}, after every read of it) and
  of its links (one up, one lost) places the channels again (L{ShardedBus._place}): a channel whose
  slot moved is unsubscribed where it was and subscribed on its new master.
- Redis tells a subscriber when a slot of its channels leaves its node (a reshard, a failover): an
  unasked C{sunsubscribe}. The channel is then unplaced and the map read again (it is placed where
  the new map says). A C{SSUBSCRIBE} sent to a node that no longer owns the slot is answered
  C{MOVED}: the slot is updated at once and the channel placed there.
- A link lost (its master gone) unplaces its channels and reads the map again, and while any wanted
  channel is unplaced the map is read again every L{REPLACE_EVERY} seconds: once the cluster has
  promoted a replica, the channels move to it.

Pub/sub is at-most-once either way: a message published while a channel is unplaced (between a
slot's move and its resubscription, or while its master is down) is not heard, as a classic
subscriber hears nothing while its connection is down; a consumer that needs every event resumes
(C{from=}, docs/aep.md "Replay"). txredisapi knows no sharded pub/sub: the replies are taken from
its parser (relayd/compat/txredisapi.py L{OwnReplies}) and the commands written on the transport.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import txredisapi
from twisted.internet import defer
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from relayd.compat.txredisapi import OwnReplies, WholeReads
from relayd.storage.buckets import key_slot
from relayd.storage.heard import HeardChannels
from relayd.storage.heartbeat import Heartbeat
from relayd.storage.redis import _endpoint, _Handshake

if TYPE_CHECKING:
    from relayd.storage.cluster import Address, ClusterRedis

REPLACE_EVERY = 0.5  # seconds between reads of the slot map while a wanted channel has no master

Handler = Callable[[bytes], None]

_log = Logger(namespace="relayd.storage.sharded")


def _command(*args: bytes) -> bytes:
    """One command in RESP (what txredisapi would write for it)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(arg), arg) for arg in args)


class _ShardSubscriber(_Handshake, Heartbeat, OwnReplies, WholeReads, txredisapi.SubscriberProtocol):
    """One subscriber connection to one master: after the handshake (AUTH), every reply is its link's
    (but the answers to its idle PINGs, L{Heartbeat}'s: a master that hangs is dropped, its channels
    unplaced and the map read again, as for one that went)."""

    link: _ShardLink

    def connectionMade(self) -> Any:
        d = super().connectionMade()
        self.whenConnected().addCallback(self._handshaken)
        return d

    def _handshaken(self, _: Any) -> None:
        self.own_replies = True
        self.link.came_up(self)
        cluster = self.link.bus.cluster
        self.start_heartbeat(cluster.clock, cluster.timeout)

    def own_reply(self, reply: Any) -> None:
        self.link.answer(reply)

    def connectionLost(self, why: Failure) -> None:
        self.stop_heartbeat()
        self.own_replies = False
        self.link.went_down(self)
        super().connectionLost(why)


class _ShardLink:
    """The subscriber connection to one master (reconnecting with backoff), and what it was asked."""

    def __init__(self, bus: ShardedBus, address: Address) -> None:
        self.bus = bus
        self.address = address
        cluster = bus.cluster
        self.protocol: _ShardSubscriber | None = None
        # The commands sent and not yet answered, in order: (b"SSUBSCRIBE" or b"SUNSUBSCRIBE", channel).
        # Each is answered once (a channel per command: a shard command's channels share a slot).
        self.pending: deque[tuple[bytes, bytes]] = deque()
        factory = txredisapi.SubscriberFactory(isLazy=True)
        factory.charset = None
        factory.convertNumbers = False
        factory.continueTrying = True

        class Subscriber(_ShardSubscriber):
            pass

        Subscriber.link = self
        factory.protocol = Subscriber
        factory.password = cluster.url.password
        factory.username = cluster.url.username
        factory.initialDelay = 0.2
        factory.maxDelay = 2
        factory.replyTimeout = cluster.timeout  # (the handshake's AUTH: L{RedisBus} says why)
        self._factory = factory
        factory.startConnecting(_endpoint(cluster.url, address[0], address[1], cluster.timeout, cluster.clock))

    @property
    def ready(self) -> bool:
        return self.protocol is not None

    def send(self, command: bytes, channel: bytes) -> None:
        assert self.protocol is not None
        self.pending.append((command, channel))
        self.protocol.transport.write(_command(command, channel))

    def came_up(self, protocol: _ShardSubscriber) -> None:
        self.protocol = protocol
        self.pending.clear()
        self.bus._place()

    def went_down(self, protocol: _ShardSubscriber) -> None:
        if self.protocol is not protocol:
            return
        self.protocol = None
        self.pending.clear()
        self.bus._link_lost(self)

    def answer(self, reply: Any) -> None:
        if isinstance(reply, list) and len(reply) == 3:
            kind, channel = reply[0], reply[1]
            if kind == b"smessage":
                self.bus.deliver(channel, reply[2])
                return
            if kind == b"ssubscribe":
                if self.pending:
                    self.pending.popleft()
                self.bus._confirm(self, channel)
                return
            if kind == b"sunsubscribe":
                if self.pending and self.pending[0] == (b"SUNSUBSCRIBE", channel):
                    self.pending.popleft()  # the answer to ours
                else:
                    self.bus._moved_away(self, channel)  # Redis's: the channel's slot left this node
                return
        if isinstance(reply, Exception) and self.pending:
            command, channel = self.pending.popleft()
            self.bus._refused(self, command, channel, str(reply))
            return
        _log.warn("Redis Cluster node {address}: unexpected reply on a shard subscriber: {reply!r}",
                           address=self.address, reply=reply)  # fmt: skip

    def close(self) -> Deferred[Any]:
        self._factory.stopTrying()
        return self._factory.disconnect()


class ShardedBus:
    """Shard channels (C{SSUBSCRIBE}) of a Redis Cluster, each on its slot's master (module docstring)."""

    def __init__(self, cluster: ClusterRedis) -> None:
        self.cluster = cluster
        self._handlers: dict[bytes, Handler] = {}
        self._links: dict[Address, _ShardLink] = {}
        # Where each channel's SSUBSCRIBE was sent on the link's current connection, and the
        # channels Redis answered it for there.
        self._placed: dict[bytes, Address] = {}
        self._heard = HeardChannels(cluster.clock)
        self._retry: Any = None
        self._closing = False
        cluster.on_map(self._place)
        self._place()

    def subscribe(self, channel: bytes, handler: Handler) -> None:
        """Call C{handler(message)} for every message published on the shard channel C{channel}."""
        self._handlers[channel] = handler
        self._place()

    def unsubscribe(self, channel: bytes) -> None:
        self._handlers.pop(channel, None)
        self._place()

    def heard(self, channels: set[bytes]) -> Deferred[None] | None:
        """C{None} when every one of C{channels} is heard (its SSUBSCRIBE answered), else a
        C{Deferred} that fires once they are, or after at most a second (L{HeardChannels.wait})."""
        return self._heard.wait(channels)

    def _confirm(self, link: _ShardLink, channel: bytes) -> None:
        if self._placed.get(channel) == link.address:
            self._heard.confirm(channel)

    def _forget(self, channel: bytes) -> None:
        """The channel is subscribed nowhere now."""
        self._placed.pop(channel, None)
        self._heard.forget(channel)

    @property
    def channels(self) -> dict[bytes, Address]:
        """The channels subscribed (or being subscribed) now, and the master each is on."""
        return dict(self._placed)

    def _place(self) -> None:
        """Subscribe every wanted channel on its slot's master, and nothing else anywhere."""
        if self._closing:
            return
        owner_of = self.cluster.owner_of
        for channel, on in list(self._placed.items()):
            owner = owner_of(key_slot(channel))
            if channel in self._handlers and on == owner:
                continue
            self._forget(channel)
            link = self._links.get(on)
            if link is not None and link.ready:
                link.send(b"SUNSUBSCRIBE", channel)
        unplaced = False
        for channel in self._handlers:
            if channel in self._placed:
                continue
            owner = owner_of(key_slot(channel))
            if owner is None:  # the map not read yet (or that slot unserved)
                unplaced = True
                continue
            link = self._links.get(owner)
            if link is None:
                link = self._links[owner] = _ShardLink(self, owner)
            if not link.ready:
                unplaced = True  # placed once it is up (L{_ShardLink.came_up})
                continue
            link.send(b"SSUBSCRIBE", channel)
            self._placed[channel] = owner
        # A link to every master, made as soon as the map names it, so that a new subscription waits
        # for its SSUBSCRIBE only; a link to a node that serves no slot now (a failed master, a
        # removed node) holds nothing.
        masters = self.cluster.masters()
        for address in masters:
            if address not in self._links:
                self._links[address] = _ShardLink(self, address)
        for address in [a for a in self._links if a not in masters and a not in self._placed.values()]:
            self._links.pop(address).close()
        if unplaced and self._retry is None:
            self._retry = self.cluster.clock.call_later(REPLACE_EVERY, self._replace)

    def _replace(self) -> None:
        """A wanted channel has no master up: read the map again (its master may have been replaced)."""
        self._retry = None
        self.cluster.refresh()
        self._place()

    def _unplace(self, link: _ShardLink, channel: bytes) -> None:
        if self._placed.get(channel) == link.address:
            self._forget(channel)

    def _moved_away(self, link: _ShardLink, channel: bytes) -> None:
        _log.info("Redis Cluster: shard channel {channel} left {address}; resubscribing on its new master",
                       channel=channel, address=link.address)  # fmt: skip
        self._unplace(link, channel)
        self.cluster.refresh()  # then placed by the new map (L{ClusterRedis.on_map})
        self._place()

    def _refused(self, link: _ShardLink, command: bytes, channel: bytes, error: str) -> None:
        words = error.split()
        if command != b"SSUBSCRIBE":
            return
        self._unplace(link, channel)
        if len(words) == 3 and words[0] == "MOVED":
            self.cluster.moved(int(words[1]), words[2], link.address)
            self._place()  # on the master the answer names
            return
        # (CLUSTERDOWN...: asked again once the map is read again, not at once, which would ask
        # the same node again and again.)
        _log.warn("Redis Cluster node {address} refused SSUBSCRIBE {channel}: {error}",
                  address=link.address, channel=channel, error=error)  # fmt: skip
        self.cluster.refresh()
        if self._retry is None:
            self._retry = self.cluster.clock.call_later(REPLACE_EVERY, self._replace)

    def _link_lost(self, link: _ShardLink) -> None:
        for channel in [c for c, on in self._placed.items() if on == link.address]:
            self._forget(channel)
        if not self._closing:
            self.cluster.refresh()  # its master may be gone
            self._place()

    def deliver(self, channel: bytes, message: bytes) -> None:
        handler = self._handlers.get(channel)
        if handler is None:
            return
        try:
            handler(message)
        except Exception:
            _log.failure("Redis shard channel handler failed for {channel}", channel=channel)

    def close(self) -> Deferred[Any]:
        self._closing = True
        self.cluster.clock.cancel(self._retry)
        self._retry = None
        links, self._links = list(self._links.values()), {}
        return defer.gatherResults([link.close() for link in links], consumeErrors=True)
