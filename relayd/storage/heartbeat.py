"""The liveness check of every connection relayd only listens on (a pub/sub subscriber of a data
node, a cluster master's shard subscriber, a sentinel's watcher): one policy, mixed into each."""

from __future__ import annotations

from typing import Any, Callable

from twisted.logger import Logger

from relayd.base.clock import Timekeeper
from relayd.compat import txredisapi as fence

# A subscriber connection that heard nothing for this long sends PING, and one that has no reply to
# it within the client's timeout is dropped and reconnected (L{Heartbeat}): a node that hangs is
# noticed within PING_IDLE to twice that, plus the timeout (docs/scaling.md "A node that hangs").
PING_IDLE = 2.0


class Heartbeat(fence.HearsReplies):
    """Mixed into a subscriber connection: a node that hangs (stopped, frozen, cut off without a
    reset) is dropped within seconds instead of when TCP gives up (minutes), and the factory
    reconnects (to another node where the client has one to go to).

    A subscriber only listens, so silence alone says nothing: every L{PING_IDLE} seconds, a connection
    that heard no reply since the last look sends C{PING} (answered C{["pong", ""]} in subscribed
    mode, taken by L{fence.HearsReplies}); any reply within C{timeout} proves the node alive (a message
    ahead of the pong is delivered as usual), none aborts the connection. A busy bus sends no PING.
    Both waits are deadlines of fixed lengths on the client's clock, cancelled when the connection goes.
    """

    _log = Logger()
    transport: Any
    _clock: Timekeeper | None = None
    _reply_timeout = 2.0  # (set by start_heartbeat: the client's timeout)
    _beat: Any = None
    _quiet = True  # no reply since the last look
    _pinged = False  # a PING is out, unanswered

    def start_heartbeat(self, clock: Timekeeper, timeout: float) -> None:
        """After the handshake: from now on, look every L{PING_IDLE} seconds (without L{fence.PONGS},
        never: the connection is as TCP keeps it)."""
        if not fence.PONGS or self._clock is not None:
            return
        self._clock, self._reply_timeout = clock, timeout
        self._beat = clock.deadline(PING_IDLE, self._look)

    def heard(self) -> None:
        if self._pinged:  # answered (by the pong or what came before it): the next look is from now
            self._pinged = False
            self._quiet = True
            self._set(PING_IDLE, self._look)
        else:
            self._quiet = False

    def _set(self, delay: float, f: Callable[[], None]) -> None:
        beat, self._beat = self._beat, None
        if beat is not None and beat.active():
            beat.cancel()
        if self._clock is not None:
            self._beat = self._clock.deadline(delay, f)

    def _look(self) -> None:
        if not self._quiet:
            self._quiet = True
            self._set(PING_IDLE, self._look)
            return
        self._pinged = True
        self.transport.write(b"*1\r\n$4\r\nPING\r\n")
        self._set(self._reply_timeout, self._silent)

    def _silent(self) -> None:
        self._beat = None
        self.unanswered(self._reply_timeout)
        self.transport.abortConnection()

    def unanswered(self, timeout: float) -> None:
        """The PING had no reply within C{timeout}: said before the connection is dropped."""
        peer = self.transport.getPeer()
        self._log.warn("Redis node {host}:{port} did not answer a subscriber's PING within {timeout} s; reconnecting",
                       host=getattr(peer, "host", "?"), port=getattr(peer, "port", "?"), timeout=timeout)  # fmt: skip

    def stop_heartbeat(self) -> None:
        beat, self._beat = self._beat, None
        if beat is not None and beat.active():
            beat.cancel()
        self._clock = None
