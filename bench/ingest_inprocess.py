"""In-process cost of batched NDJSON ingest (a benchmark, not a test): C{parse_batch} and
C{EventRelay.ingest} of the bodies C{bench/aep.py ingest} posts (100 events of ~540 B, one session
per body, 8 sessions in turn, buffers of 1 000 kept full), without HTTP or a second process.

    python bench/ingest_inprocess.py                          # this tree's relayd
    python bench/ingest_inprocess.py --tree /path/to/other    # another tree's, to alternate with

It prints CPU per event for parse + ingest and for the parse alone, and the Python-level calls per
event that cProfile counts for one body (deterministic, unlike the times on a shared machine).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

PAD = "x" * 330  # as bench/aep.py: each event about 540 bytes
BATCH = 100
SESSIONS = 8


def bodies(count: int) -> list[bytes]:
    """C{count} bodies per session, in the order the bench's 8 connections post them."""
    templates = []
    for c in range(SESSIONS):
        session = f"s{c}"
        event = {"aep": "0.1", "id": f"{session}-123456789", "type": "progress.status",
                 "time": "2026-11-29T00:00:00Z", "source": f"aep://bench/agent/a/session/{session}",
                 "agent": "bench", "session": session, "seq": 123456789, "severity": "notice",
                 "data": {"message": PAD}}
        templates.append(json.dumps(event, separators=(",", ":")).encode().replace(b"123456789", b"%d"))
    return [b"".join(templates[c] % (n * BATCH + i, n * BATCH + i) + b"\n" for i in range(BATCH))
            for n in range(count) for c in range(SESSIONS)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=str(Path(__file__).resolve().parents[1]), help="where relayd is imported from")
    parser.add_argument("--bodies", type=int, default=600, help="bodies per session (the first 20 warm up)")
    args = parser.parse_args()
    sys.path.insert(0, args.tree)

    from relayd.aep.core.ingest import parse_batch
    from relayd.aep.core.relay import EventRelay
    from relayd.aep.core.store import MemoryEventLog

    def relay() -> Any:
        return EventRelay(MemoryEventLog(1000, 64), token=None, buffer=1000, max_from=100)

    posted = bodies(args.bodies)
    warm, timed = posted[: 20 * SESSIONS], posted[20 * SESSIONS :]
    results: dict[str, Any] = {"tree": args.tree}
    for name, ingest in (("parse_ingest_us_per_event", True), ("parse_us_per_event", False)):
        target = relay()
        for body in warm:
            target.ingest(parse_batch(body, True, 10_000))
        gc.collect()
        gc.freeze()  # as relayd's collector policy does with what lives long
        started = time.process_time()
        for body in timed:
            events = parse_batch(body, True, 10_000)
            if ingest:
                target.ingest(events)
        results[name] = round((time.process_time() - started) / (len(timed) * BATCH) * 1e6, 3)
        gc.unfreeze()
    target = relay()
    for body in warm:
        target.ingest(parse_batch(body, True, 10_000))
    profile = cProfile.Profile()
    profile.enable()
    target.ingest(parse_batch(timed[0], True, 10_000))
    profile.disable()
    results["profiled_calls_per_event"] = round(pstats.Stats(profile).total_calls / BATCH, 2)  # type: ignore[attr-defined]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
