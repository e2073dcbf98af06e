"""C{IMcpBus} on Redis pub/sub: MCP relay instances sharing a L{RedisStore} tell each other about
streams and parked polls that only the instance holding the connection can act on.

Channels (under the deployment's prefix): C{mcp:i:<instance>} carries SSE events for that instance's
streams; C{mcp:all} carries poll wake-ups and session ends for everyone. Messages are bytes:

- C{D<key>,<key>...\\n<event>}: write the encoded SSE event to these local streams;
- C{W<sender>\\n<key>,<key>...}: polls parked on these queue keys may take frames;
- C{E<sender>\\n<session>}: the session ended: end its streams and release its polls.

Pub/sub delivers to whoever listens right now. An event for an instance that is not listening
(gone, or reconnecting) is answered with L{StoreUnavailable} instead of a silent C{{"ok":true}}, and an
instance that lost its subscription ends its local streams when it is back, so their clients
reconnect and re-subscribe rather than miss frames. Poll frames live in Redis lists and are never
lost to a missed wake-up (the poll answers at the latest when its wait runs out).
"""

from __future__ import annotations

import secrets
from typing import Any

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from zope.interface import implementer

from relayd.mcp.core.bus import BusListener, IMcpBus, InstanceGone
from relayd.mcp.redis.store import STORE
from relayd.storage.redis import Redis, RedisBus


class _Subscription(RedisBus):
    """A pub/sub connection that tells its owner when it has been lost and when it is back."""

    def __init__(self, redis: Redis, owner: RedisMcpBus) -> None:
        self.owner = owner
        super().__init__(redis)
        # txredisapi's subscriber decodes channels and messages as UTF-8 by default; the bus keys
        # its handlers by bytes and events are bytes. (Set before the connection is built.)
        self._factory.charset = None

    def _subscribed(self, protocol: Any) -> None:
        super()._subscribed(protocol)
        self.owner._resubscribed()

    def _lost(self, protocol: Any) -> None:
        super()._lost(protocol)
        self.owner._lost()


@implementer(IMcpBus)
class RedisMcpBus:
    """Cross-instance notifications of one MCP relay process."""

    remote = True
    _log = Logger()

    def __init__(self, redis: Redis, prefix: str = "relayd:", instance: str | None = None) -> None:
        self.redis = redis
        self.prefix = prefix.encode("utf-8")
        self.instance = instance or secrets.token_hex(6)
        self._mine = self.prefix + b"mcp:i:" + self.instance.encode()
        self._all = self.prefix + b"mcp:all"
        self._sender = self.instance.encode()
        self._listener: BusListener | None = None
        self._sub: _Subscription | None = None
        self._was_lost = False

    @property
    def ready(self) -> Deferred[None]:
        """Fires once the subscription is up (tests wait for it)."""
        assert self._sub is not None
        return self._sub.ready

    def start(self, listener: BusListener) -> None:
        self._listener = listener
        sub = _Subscription(self.redis, self)
        sub.subscribe(self._mine, self._delivered)
        sub.subscribe(self._all, self._broadcast)
        self._sub = sub

    def stop(self) -> Deferred[None]:
        sub, self._sub = self._sub, None
        if sub is None:
            return succeed(None)
        return sub.close()

    # publishing

    def deliver(self, instance: str, keys: list[str], event: bytes) -> Deferred[None]:
        channel = self.prefix + b"mcp:i:" + instance.encode()
        message = b"D" + ",".join(keys).encode() + b"\n" + event

        def heard(receivers: Any) -> None:
            if int(receivers) == 0:
                # Nobody holds those streams right now: refuse rather than acknowledge a lost frame.
                raise InstanceGone(instance)

        return self.redis.execute(STORE, "PUBLISH", channel, message).addCallback(heard)

    def wake(self, keys: list[str]) -> Deferred[None]:
        message = b"W" + self._sender + b"\n" + ",".join(keys).encode()
        return self.redis.execute(STORE, "PUBLISH", self._all, message).addCallback(_none)

    def end_session(self, session_id: str) -> Deferred[None]:
        message = b"E" + self._sender + b"\n" + session_id.encode()
        return self.redis.execute(STORE, "PUBLISH", self._all, message).addCallback(_none)

    # receiving

    def _delivered(self, message: bytes) -> None:
        listener = self._listener
        if listener is None or not message.startswith(b"D"):
            return
        keys, _, event = message[1:].partition(b"\n")
        listener.bus_deliver(keys.decode().split(","), event)

    def _broadcast(self, message: bytes) -> None:
        listener = self._listener
        if listener is None or not message:
            return
        kind = message[:1]
        sender, _, rest = message[1:].partition(b"\n")
        if sender == self._sender:
            return  # this instance acted on it already
        if kind == b"W":
            listener.bus_wake(rest.decode().split(","))
        elif kind == b"E":
            listener.bus_end(rest.decode())

    def _lost(self) -> None:
        self._was_lost = True

    def _resubscribed(self) -> None:
        if self._was_lost and self._listener is not None:
            self._was_lost = False
            self._log.warn("MCP relay bus reconnected to Redis; ending local streams so their clients re-subscribe")
            self._listener.bus_reset()


def _none(_: Any) -> None:
    return None
