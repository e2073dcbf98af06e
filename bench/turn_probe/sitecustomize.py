"""A probe of a benchmark server's reactor turns (a benchmark tool, not a test): how long each turn
of the event loop held the process, wall and CPU, and how many sockets it served.

bench/relayd_process.py puts ``BENCH_EXTRA_PATH`` first on a started relayd's ``PYTHONPATH``, so this
``sitecustomize`` is imported by the server; with ``TURN_PROBE=FILE`` set it wraps the epoll reactor's
poller and, when the server exits, writes every turn longer than 5 ms to FILE as JSON lines
(``at``: seconds since the probe started, ``wall_ms``, ``cpu_ms``: the process's own CPU time in the
turn, ``ready``: sockets the poll returned before it, ``lost``: connections that closed in it, such as
a benchmark client's thousands closing at its end)::

    TURN_PROBE=/tmp/turns.jsonl BENCH_EXTRA_PATH=bench/turn_probe python bench/aep.py storm
    python bench/turn_probe/sitecustomize.py /tmp/turns.jsonl      # the longest turns

A turn is what the reactor does between two polls: the previous poll's events, then its timers. On a
loaded machine a turn's wall time includes waiting for a core; its CPU time does not.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
from typing import Any

_LONGER_THAN = 0.005


def _install(out: str) -> None:
    from twisted.internet import epollreactor, tcp

    turns: list[tuple[float, float, float, int, int]] = []
    start = time.perf_counter()
    lost = [0]
    closed = tcp.Connection.connectionLost

    def connectionLost(self: Any, reason: Any) -> Any:
        lost[0] += 1
        return closed(self, reason)

    tcp.Connection.connectionLost = connectionLost  # type: ignore[method-assign]

    class TimedPoller:
        def __init__(self, poller: Any) -> None:
            self._poller = poller
            self._since = time.perf_counter()
            self._cpu = time.thread_time()
            self._ready = 0

        def poll(self, timeout: float = -1, maxevents: int = -1) -> Any:
            now, cpu = time.perf_counter(), time.thread_time()
            if now - self._since > _LONGER_THAN:
                turns.append((self._since - start, now - self._since, cpu - self._cpu, self._ready, lost[0]))
            lost[0] = 0
            events = self._poller.poll(timeout, maxevents)
            self._since, self._cpu, self._ready = time.perf_counter(), time.thread_time(), len(events)
            return events

        def __getattr__(self, name: str) -> Any:
            return getattr(self._poller, name)

    made = epollreactor.EPollReactor.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        self._poller = TimedPoller(self._poller)

    epollreactor.EPollReactor.__init__ = __init__  # type: ignore[method-assign]

    def write() -> None:
        with open(out, "w") as f:
            for at, wall, cpu, ready, gone in turns:
                turn = {"at": round(at, 3), "wall_ms": round(wall * 1000, 1), "cpu_ms": round(cpu * 1000, 1)}
                f.write(json.dumps({**turn, "ready": ready, "lost": gone}) + "\n")

    atexit.register(write)


def _report(path: str, top: int = 8) -> None:
    turns = [json.loads(line) for line in open(path)]
    print(f"{len(turns)} turns over {_LONGER_THAN * 1000:.0f} ms; the longest by CPU:")
    for turn in sorted(turns, key=lambda t: -t["cpu_ms"])[:top]:
        print(json.dumps(turn))


if __name__ == "__main__":
    _report(sys.argv[1])
elif os.environ.get("TURN_PROBE"):
    _install(os.environ["TURN_PROBE"])
