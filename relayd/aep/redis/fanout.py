"""Live AEP fan-out across relayd instances on one Redis.

Every accepted batch is published once on C{aep:fanout} (by the append script itself,
relayd/aep/lua/append.lua, or by L{RedisFanout.publish}); every other instance parses it once and
delivers it to its own subscribers.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from twisted.internet.defer import Deferred, succeed

from relayd.aep.core.event import Event, event_from
from relayd.aep.redis.store import FANOUT_CHANNEL, fanout_header
from relayd.storage.redis import Redis, RedisBus

STORE = "aep"


class RedisFanout:
    """Live fan-out across instances: publish accepted events once, deliver others' locally."""

    def __init__(
        self, redis: Redis, bus: RedisBus, instance: str, deliver: Callable[[list[Event]], Any], prefix: str = "relayd:"
    ) -> None:
        self.redis = redis
        self.instance = instance.encode("utf-8")
        self.channel = prefix.encode("utf-8") + FANOUT_CHANNEL
        self.header = fanout_header(instance)
        self._deliver = deliver
        bus.subscribe(self.channel, self._received)

    def publish(self, events: Sequence[Event]) -> Deferred[Any]:
        if not events:
            return succeed(None)
        message = self.header + b"\n".join(event.payload(None) for event in events)
        return self.redis.execute(STORE, "PUBLISH", self.channel, message)

    def _received(self, message: bytes) -> None:
        instance, _, body = message.partition(b"\n")
        if instance == self.instance:
            return  # delivered locally already, before publishing
        # One message is one batch of the publishing instance: delivered as one (one snapshot).
        self._deliver([event_from(raw) for raw in body.split(b"\n") if raw])
