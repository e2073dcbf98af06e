"""The fence's prometheus_client entry: adding one to a counter, or a duration to a histogram, on the
reactor's thread without a lock.

C{Counter.inc} checks that the counter can be observed, that the amount is not negative and whether an
exemplar came with it, then adds under its value's lock: about 4,000 instructions, and an MCP round trip
counts four (two answered requests, two frames). L{adder} gives a call that adds one (or a count)
to the value itself. The lock guards one value against increments from two threads at once; the counters given to
L{adder} are only ever incremented on the reactor's thread, and a scrape (which reads under the lock)
reads the float whole either way. The value and its exposition are C{inc}'s: C{value += amount}.

A histogram's C{observe} pays the same checks and locks, for its sum and then its bucket, found by a
walk over every bound: about 6,600 instructions, once per AEP ingest POST. L{recorder} gives a call
that adds the amount to the sum's value and one to its bucket's, found by bisection: the same bucket
(C{observe}'s first bound at or above the amount), for an amount that is a number, not NaN.

Feature-detected: the process's value class is prometheus_client's plain C{MutexValue} (not the
multiprocess one) and its C{inc} adds to C{_value}; anything else gets the counter's own C{inc}.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Callable

from prometheus_client import Histogram, values

from relayd.compat.detect import code_uses

DIRECT_VALUES = values.ValueClass is values.MutexValue and code_uses(values.MutexValue.inc, "_value", "_lock")
"""A counter holds its count as C{_value} of a C{MutexValue}, which C{inc} adds to under C{_lock}."""


def adder(counter: Any) -> Callable[..., None]:
    """A call adding one (or the count it is given) to C{counter} (a counter, or one labelled child
    of it), as C{counter.inc(count)} does; for counters incremented on the reactor's thread only."""
    value = getattr(counter, "_value", None)
    if not DIRECT_VALUES or type(value) is not values.MutexValue:
        return counter.inc

    def add(count: int = 1) -> None:
        value._value += count

    return add


DIRECT_HISTOGRAMS = DIRECT_VALUES and code_uses(Histogram.observe, "_sum", "_upper_bounds", "_buckets")
"""A histogram adds an observation to the C{_sum} value and to the one of its C{_buckets} values
(non-cumulative: the exposition sums them) whose bound in C{_upper_bounds} (sorted, the last
C{+Inf}) is the first at or above it."""


def recorder(histogram: Any) -> Callable[[float], None]:
    """A call recording one duration (a number, never NaN) in C{histogram} (a histogram, or one
    labelled child of it), as C{histogram.observe(amount)} does; for histograms observed on the
    reactor's thread only."""
    total = getattr(histogram, "_sum", None)
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    if not (
        DIRECT_HISTOGRAMS
        and type(total) is values.MutexValue
        and isinstance(buckets, list)
        and all(type(bucket) is values.MutexValue for bucket in buckets)
        and isinstance(bounds, list)
        and len(bounds) == len(buckets)
        and bounds == sorted(bounds)
        and bounds[-1] == float("inf")
    ):
        return histogram.observe
    bounds = list(bounds)
    buckets = list(buckets)

    def record(amount: float) -> None:
        total._value += amount
        buckets[bisect_left(bounds, amount)]._value += 1

    return record
