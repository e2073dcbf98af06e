"""Live AEP fan-out across relayd instances on one Redis.

Every accepted batch is published once per bucket of its sessions, on that bucket's channel
(relayd/aep/redis/store.py L{FanoutChannels}), by the append script itself
(relayd/aep/lua/append.lua) or by L{RedisFanout.publish}; every other instance that listens to
that channel parses it once and delivers it to its own subscribers.

On a single primary and with Sentinel every bucket's channel is the one classic channel
C{aep:fanout}, on the client's bus. On a Redis Cluster each bucket has its shard channel, heard on
the bucket's master (relayd/storage/sharded.py). Either way an instance subscribes to a channel
only while a local subscription needs it (reference counts per channel, from the relay's
L{need}/L{release}): on a cluster the buckets of the sessions a subscription pins, every bucket
for one that pins no session; the classic channel for any subscription. An instance that only
ingests hears nothing, not even its own publications read back.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from twisted.internet.defer import Deferred, gatherResults, succeed

from relayd.aep.core.event import Event, event_from
from relayd.aep.redis.store import FanoutChannels, fanout_header
from relayd.base.errors import first_error
from relayd.storage.redis import Redis, RedisBus

STORE = "aep"


class RedisFanout:
    """Live fan-out across instances: publish accepted events once, deliver others' locally."""

    def __init__(
        self, redis: Redis, bus: RedisBus, instance: str, deliver: Callable[[list[Event]], Any], prefix: str = "relayd:"
    ) -> None:
        self.redis = redis
        self.instance = instance.encode("utf-8")
        self.channels = FanoutChannels(prefix.encode("utf-8"), redis.sharded_pubsub)
        self.header = fanout_header(instance)
        self._deliver = deliver
        # Channels by how many local subscriptions need them.
        self._needed: dict[bytes, int] = {}
        self._bus: Any = redis.shard_bus() if self.channels.sharded else bus  # type: ignore[attr-defined]  # (a ClusterRedis's)

    def publish(self, events: Sequence[Event]) -> Deferred[Any]:
        if not events:
            return succeed(None)
        by_channel: dict[bytes, list[Event]] = {}
        of_session = self.channels.of_session
        for event in events:
            by_channel.setdefault(of_session(event.session), []).append(event)
        command = self.channels.command
        sent = [
            self.redis.execute(STORE, command, channel, self.header + b"\n".join(e.payload(None) for e in batch))
            for channel, batch in by_channel.items()
        ]
        return sent[0] if len(sent) == 1 else gatherResults(sent, consumeErrors=True).addErrback(first_error)

    def need(self, sessions: tuple[str, ...] | None) -> Deferred[None] | None:
        channels = self._channels_of(sessions)
        for channel in channels:
            held = self._needed.get(channel, 0)
            self._needed[channel] = held + 1
            if not held:
                self._bus.subscribe(channel, self._received)
        heard: Deferred[None] | None = self._bus.heard(channels)
        return heard

    def release(self, sessions: tuple[str, ...] | None) -> None:
        for channel in self._channels_of(sessions):
            held = self._needed.get(channel, 0) - 1
            if held > 0:
                self._needed[channel] = held
            elif held == 0:
                del self._needed[channel]
                self._bus.unsubscribe(channel)

    def _channels_of(self, sessions: tuple[str, ...] | None) -> set[bytes]:
        """The channels a subscription needs: each once, however many of its sessions share one."""
        if sessions is None:
            return set(self.channels.every())
        return {self.channels.of_session(session) for session in sessions}

    @property
    def needed(self) -> dict[bytes, int]:
        """The channels needed now, by how many local subscriptions need each."""
        return dict(self._needed)

    def _received(self, message: bytes) -> None:
        instance, _, body = message.partition(b"\n")
        if instance == self.instance:
            return  # delivered locally already, before publishing
        # One message is one batch of the publishing instance: delivered as one (one snapshot).
        self._deliver([event_from(raw) for raw in body.split(b"\n") if raw])
