"""Micro-benchmark of relayd/base/jsoncodec.py on the hot paths: each wing's reading and writing through the
codec against the function it replaced (the reference copies in tests/base/test_jsoncodec.py), in one
process, alternated round by round so both meet the same machine.

    python bench/jsoncodec.py              # 15 rounds of 20,000 calls per function
    python bench/jsoncodec.py --rounds 31  # more rounds on a busy machine

Inputs are what the hot paths carry: an AEP event of ~500 bytes (bench/aep.py's shape) read by
parse_json (ingest's exact path) and written by dumps (a downlevelled payload), and an MCP tools/call
frame of ~500 bytes read by loads_json and re-written by _dumps (a frame with another id), plus its id.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from relayd.aep.core import event
from relayd.buzz.core.contract import strict_json
from relayd.mcp.core import jsontext
from tests.base.test_jsoncodec import (
    old_aep_dumps,
    old_aep_parse_json,
    old_buzz_dumps,
    old_mcp_dumps,
    old_mcp_loads_json,
)

PAD = "x" * 330  # as bench/aep.py: makes the event about 500 bytes
EVENT = event.dumps({
    "aep": "0.1", "id": "e-0000001234", "type": "tool.call", "time": "2026-11-30T12:00:00.000Z",
    "source": "bench", "agent": "bench-agent", "session": "s-0123456789", "seq": 1234,
    "severity": "notice", "data": {"message": PAD},
})  # fmt: skip
FRAME = jsontext.dumps({
    "jsonrpc": "2.0", "id": 1234, "method": "tools/call",
    "params": {"name": "search", "arguments": {"query": "y" * 380, "limit": 10}, "_meta": {"progressToken": 7}},
})  # fmt: skip


def timed(f: Callable[[Any], Any], arg: Any, number: int) -> float:
    """Nanoseconds per call of C{f(arg)}."""
    return timeit.timeit("f(arg)", globals={"f": f, "arg": arg}, number=number) / number * 1e9


def compare(name: str, old: Callable[[Any], Any], new: Callable[[Any], Any], arg: Any, rounds: int, number: int) -> None:
    assert old(arg) == new(arg), name
    olds: list[float] = []
    news: list[float] = []
    for i in range(rounds):
        # Alternate which goes first, so neither always meets a warmer (or busier) machine.
        pair = [(olds, old), (news, new)] if i % 2 == 0 else [(news, new), (olds, old)]
        for into, f in pair:
            into.append(timed(f, arg, number))
    ratios = sorted(n / o for n, o in zip(news, olds, strict=True))
    print(
        f"{name:<34} old {statistics.median(olds):6.0f} ns (min {min(olds):5.0f})"
        f"   new {statistics.median(news):6.0f} ns (min {min(news):5.0f})"
        f"   new/old median {statistics.median(ratios):.3f} [{ratios[len(ratios) // 4]:.3f}-{ratios[-1 - len(ratios) // 4]:.3f}]"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=20_000, help="calls per function per round")
    args = parser.parse_args()
    ev, frame = old_aep_parse_json(EVENT), old_mcp_loads_json(FRAME)
    print(f"event {len(EVENT)} bytes, frame {len(FRAME)} bytes; median ns per call, new/old median [quartiles]")
    cases: list[tuple[str, Callable[[Any], Any], Callable[[Any], Any], Any]] = [
        ("aep parse_json (event)", old_aep_parse_json, event.parse_json, EVENT),
        ("aep dumps (event)", old_aep_dumps, event.dumps, ev),
        ("mcp loads_json (frame)", old_mcp_loads_json, jsontext.loads_json, FRAME),
        ("mcp _dumps (frame)", old_mcp_dumps, jsontext.dumps, frame),
        ("mcp _dumps (id)", old_mcp_dumps, jsontext.dumps, 1234),
        ("broker dumps (frame)", old_buzz_dumps, strict_json.dumps, frame),
    ]
    for name, old, new, arg in cases:
        compare(name, old, new, arg, args.rounds, args.number)


if __name__ == "__main__":
    main()
