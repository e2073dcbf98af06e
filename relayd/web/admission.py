"""How many new connections a site starts serving per reactor turn: a subscriber storm in slices.

A connection's first request is the expensive one: a stream's subscription, its filter and its
replay, the request's own objects. When thousands of clients connect at once (dashboards after a
deploy) their requests arrive together, and the reactor hands every readable socket to its protocol
in one turn: two thousand stream openings at a few hundred microseconds each hold the reactor for
most of a second, and a health probe or an event for the subscribers already connected waits
behind them all.

So a site starts at most L{NEWCOMERS_PER_TURN} connections' first requests per reactor turn. A
connection whose first bytes arrive once the turn's share is spent keeps them unparsed and joins a
queue (one that goes on sending past a header block's worth stops being read meanwhile); each
following turn starts the next slice of the queue, in arrival order, before any newer connection. A connection that has been served before
(a kept-alive health probe, a client posting events) never waits, nor does a health check on a new
connection (the channel lets it by): only newcomers are sliced. The storm takes the same work in
more, shorter turns, and whatever else the reactor has to do waits for one slice at most.

A WebSocket subscription's start (its filter, its place in the index, its replay) is a newcomer's
work too, and a wing counts it here with the connections' first requests (the AEP wing's sockets): a
connection whose subscribe cannot start this turn keeps it, and what it sends after it, until its
turn. One count per site and turn, whichever transport the storm comes by.

The count is reset by a call on the next turn, armed once half the share is counted: a connection
that arrives alone (a client opening one per request) arms no timer, and a turn never starts more
than its share (the count only falls at a turn's start), nor less than half of it while others wait.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from relayd.base.clock import NextTurn, Timekeeper

NEWCOMERS_PER_TURN = 16
"""First requests a site starts per reactor turn: a slice of a storm, a few milliseconds of work."""


class Newcomer(Protocol):
    """A connection waiting for its turn (L{relayd.web.channel.RelayChannel}; a wing's WebSocket
    whose subscribe waits)."""

    def admitted(self) -> bool:
        """Start on what was kept meanwhile; C{False} if the connection closed (it counts for nothing)."""


class Admission:
    """One site's share of new connections per reactor turn, and the queue of those beyond it."""

    __slots__ = ("per_turn", "started", "waiting", "_arm_at", "_turn")

    def __init__(self, clock: Timekeeper, per_turn: int = NEWCOMERS_PER_TURN) -> None:
        self.per_turn = per_turn
        self.started = 0
        """Newcomers started since the count was last reset (in this turn and maybe a few before)."""
        self._arm_at = max(1, per_turn // 2)
        self.waiting: deque[Newcomer] = deque()
        self._turn = NextTurn(clock, self._next_turn)

    def starts_now(self) -> bool:
        """Whether a newcomer may start in this turn (it is then counted); C{False} when the turn's
        share is spent or others wait before it (the caller then L{wait}s, or lets a health check by)."""
        if self.started >= self.per_turn or self.waiting:
            return False
        self.started += 1
        if self.started >= self._arm_at and self._turn.scheduled is None:
            self._turn.request()
        return True

    def wait(self, newcomer: Newcomer) -> None:
        """Queue C{newcomer}: its L{Newcomer.admitted} is called on a later turn, in arrival order."""
        self.waiting.append(newcomer)
        if self._turn.scheduled is None:
            self._turn.request()

    def _next_turn(self) -> None:
        self.started = 0
        waiting = self.waiting
        while waiting and self.started < self.per_turn:
            if waiting.popleft().admitted():
                self.started += 1
        if self.started >= self._arm_at:
            self._turn.request()
