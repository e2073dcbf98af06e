"""The garbage collector's policy: long-lived objects are moved out of its full passes.

CPython's full (generation 2) pass walks every tracked object the process holds; with 100 000
subscriptions that was 385-400 ms of CPU in one reactor turn (docs/performance.md, "Collector
policy"). What start-up allocated is frozen once (L{CollectorPolicy.start}). Then, every
C{--gc-freeze-interval} seconds, whatever has survived until then (connections, subscriptions,
buffered events) is frozen too, so a full pass walks only what arrived since. The cost is memory:
a frozen object that becomes garbage inside a reference cycle is not reclaimed until the next
C{--gc-full-interval}, when everything is unfrozen and collected once (the one long pause, at a
known rate).
"""

from __future__ import annotations

import gc

from twisted.logger import Logger

from relayd.clock import Timekeeper


class CollectorPolicy:
    """Freezes survivors every C{freeze_interval} seconds (0: only once, at start) and unfreezes and
    collects everything every C{full_interval} seconds (0: never)."""

    _log = Logger()

    def __init__(self, clock: Timekeeper, freeze_interval: float, full_interval: float) -> None:
        self.clock = clock
        self.freeze_interval = freeze_interval
        self.full_interval = full_interval
        self._last_full = 0.0
        self.freezes = 0
        self.full_passes = 0

    def start(self) -> None:
        """Freeze what start-up allocated (it lives as long as the process) and start the loop."""
        gc.collect()
        gc.freeze()
        self._last_full = self.clock.seconds()
        if self.freeze_interval > 0:
            self.clock.looping_call(self.freeze_interval, self.tick)

    def tick(self) -> None:
        """Freeze the survivors, or once per C{full_interval} unfreeze and collect everything."""
        now = self.clock.seconds()
        if self.full_interval > 0 and now - self._last_full >= self.full_interval:
            self._last_full = now
            gc.unfreeze()
            gc.collect()
            self.full_passes += 1
        else:
            # Only the young generations: what is garbage there goes now; an older survivor is
            # frozen as it is (a full pass here would be the pause this avoids).
            gc.collect(1)
            self.freezes += 1
        gc.freeze()
