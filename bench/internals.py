"""Micro-benchmarks of the fence's shortcuts (relayd/compat/) that no scenario of bench/aep.py
isolates: each one timed with its feature detected and forced off (the public fallback), in-process.

    python bench/internals.py            # median of 5 rounds of 200,000 calls each

The transport, SSE, WebSocket-send and access-line shortcuts are measured end to end by bench/aep.py
(docs/performance.md).
"""

from __future__ import annotations

import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autobahn.twisted.websocket import WebSocketServerProtocol

from relayd.compat import autobahn as fence
from relayd.compat.autobahn import ws_data_received, ws_frames_direct

N = 200_000
ROUNDS = 5


def per_call(f: Callable[[], Any]) -> float:
    """Median microseconds per call of C{f}."""
    return statistics.median(timeit.timeit(f, number=N) / N * 1e6 for _ in range(ROUNDS))


def both(name: str, flag: str, f: Callable[[], Any]) -> None:
    detected = per_call(f)
    setattr(fence, flag, False)
    try:
        fallback = per_call(f)
    finally:
        setattr(fence, flag, True)
    print(f"{name}: {detected:.3f} us detected, {fallback:.3f} us fallback")


def main() -> None:
    protocol = WebSocketServerProtocol()
    protocol.peer = "tcp4:127.0.0.1:40000"
    protocol._dataReceived = lambda data: None  # only the per-read overhead is timed
    both("ws_data_received", "WS_QUIET_RECEIVE", lambda: ws_data_received(protocol, b"x" * 100))

    # What the fence costs where a check used to be inline (once per WebSocket connection per turn).
    protocol._perMessageCompress, protocol.send_queue = None, []
    fenced = per_call(lambda: ws_frames_direct(protocol))
    inline = per_call(lambda: protocol._perMessageCompress is None and not protocol.send_queue)
    print(f"ws_frames_direct: {fenced:.3f} us through the fence, {inline:.3f} us inline")


if __name__ == "__main__":
    main()
