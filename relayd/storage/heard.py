"""Which pub/sub channels a subscriber is heard on, and who waits for that.

A channel is heard once Redis has answered its subscribe on the subscriber's current connection
(C{SUBSCRIBE} on a L{relayd.storage.redis.RedisBus}, C{SSUBSCRIBE} on a Redis Cluster's
L{relayd.storage.sharded.ShardedBus}): a message published after that answer reaches it. An AEP
subscription waits for its channels before it reads its history and before it says it is
subscribed (relayd/aep/core/relay.py L{need}), so that no event of another instance falls between
the history and the live events; never longer than L{HEARD_WAIT}, so a node that is down makes a
subscription as unheard as a lost connection would, not a hang.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred

from relayd.base.clock import Timekeeper

HEARD_WAIT = 1.0  # seconds a waiter waits for its channels, at most


class HeardChannels:
    """The channels heard now, and the waiters of those that are not yet."""

    def __init__(self, clock: Timekeeper) -> None:
        self.clock = clock
        self.confirmed: set[bytes] = set()
        self._waiting: list[tuple[set[bytes], Deferred[None]]] = []  # each waiter's channels still unheard

    def wait(self, channels: set[bytes]) -> Deferred[None] | None:
        """C{None} when every one of C{channels} is heard, else a C{Deferred} that fires once they
        are, or after L{HEARD_WAIT} seconds whatever happens."""
        missing = channels - self.confirmed
        if not missing:
            return None
        d: Deferred[None] = Deferred()
        entry = (missing, d)
        self._waiting.append(entry)
        clock = self.clock
        late = clock.call_later(HEARD_WAIT, self._stop_waiting, entry)

        def done(result: Any) -> Any:
            clock.cancel(late)
            return result

        return d.addBoth(done)

    def confirm(self, channel: bytes) -> None:
        """Redis answered C{channel}'s subscribe: heard from now on."""
        self.confirmed.add(channel)
        for entry in list(self._waiting):
            entry[0].discard(channel)
            if not entry[0]:
                self._waiting.remove(entry)
                entry[1].callback(None)

    def forget(self, channel: bytes) -> None:
        """C{channel} is unsubscribed, or its connection gone: no longer heard."""
        self.confirmed.discard(channel)

    def _stop_waiting(self, entry: tuple[set[bytes], Deferred[None]]) -> None:
        if entry in self._waiting:
            self._waiting.remove(entry)
            entry[1].callback(None)
