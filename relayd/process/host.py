"""What relayd asks of the host it runs on: the open-file limit, systemd's readiness protocol, and the
garbage collector's policy.

B{Open files.} Every SSE stream and WebSocket is a file descriptor. As magic-wormhole-mailbox-server's
C{increase_rlimits}: distributions often start services with a soft limit of 1024, which a relay with a
few thousand consumers exhausts (accept() then fails with EMFILE). The soft limit is raised to the hard
limit, or to the largest of a few steps the kernel accepts (L{increase_rlimits}).

B{sd_notify.} C{READY=1} once listening, C{STOPPING=1} at shutdown. Twisted has no sd_notify; this is
the small datagram send synapse uses. It does nothing unless systemd (or a test) set C{NOTIFY_SOCKET},
so a unit can use C{Type=notify} and be considered started only once every relay is accepting
connections (L{notify}).

B{The collector.} Long-lived objects are moved out of its full passes. CPython's full (generation 2)
pass walks every tracked object the process holds; with 100 000 subscriptions that was 385-400 ms of
CPU in one reactor turn (docs/performance.md, "Collector policy"). What start-up allocated is frozen
once (L{CollectorPolicy.start}). Then, every C{--gc-freeze-interval} seconds, whatever has survived
until then (connections, subscriptions, buffered events) is frozen too, so a full pass walks only
what arrived since. The cost is memory: a frozen object that becomes garbage inside a reference cycle
is not reclaimed until the next C{--gc-full-interval}, when everything is unfrozen and collected once
(the one long pause, at a known rate).
"""

from __future__ import annotations

import gc
import os
import socket
from typing import Mapping

from twisted.logger import Logger

from relayd.base.clock import Timekeeper

try:
    import resource
except ImportError:  # not POSIX
    resource = None  # type: ignore[assignment]

# -- the open-file limit -----------------------------------------------------------------------------

_rlimits_log = Logger(namespace="relayd.rlimits")
TARGET = 1 << 20  # when the hard limit is "unlimited", ask for this much


def increase_rlimits() -> int | None:
    """Raise C{RLIMIT_NOFILE}'s soft limit as far as allowed; returns the limit in force (C{None}: unknown)."""
    if resource is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling = TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft >= ceiling:
        return soft
    for candidate in (ceiling, 65536, 10000, 3200, 1024):
        if candidate <= soft:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (candidate, hard))
        except (ValueError, OSError):
            continue
        _rlimits_log.info("open-file limit raised from {old} to {new}", old=soft, new=candidate)
        return candidate
    return soft


# -- systemd readiness -------------------------------------------------------------------------------

_notify_log = Logger(namespace="relayd.sdnotify")


def notify(state: str, environ: Mapping[str, str] | None = None) -> bool:
    """Send C{state} (e.g. C{"READY=1"}) to C{$NOTIFY_SOCKET}; C{False} when unset or unreachable.

    A path starting with C{@} is a Linux abstract socket. Failures are logged, never raised: a
    missing supervisor must not stop relayd.
    """
    env = os.environ if environ is None else environ
    address = env.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(state.encode("utf-8"))
    except OSError as e:
        _notify_log.warn("sd_notify {state} to NOTIFY_SOCKET failed: {error}", state=state, error=e)
        return False
    return True


# -- the garbage collector ---------------------------------------------------------------------------


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
