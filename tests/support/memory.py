"""Python-heap bytes per held object, measured with tracemalloc around the code that makes them."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Awaitable, Callable


async def heap_bytes_per(count: int, make: Callable[[], Awaitable[None]]) -> float:
    """The heap that C{await make()} leaves allocated, divided by the C{count} objects it holds.

    Collected before and after, so only what stays alive is counted (warm caches up first).
    """
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        await make()
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename")) / count
