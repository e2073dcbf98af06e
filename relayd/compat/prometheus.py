"""The fence's prometheus_client entry: adding one to a counter on the reactor's thread without a lock.

C{Counter.inc} checks that the counter can be observed, that the amount is not negative and whether an
exemplar came with it, then adds under its value's lock: about 4,000 instructions, and an MCP round trip
counts four (two answered requests, two frames). L{adder} gives a call that adds one to the value
itself. The lock guards one value against increments from two threads at once; the counters given to
L{adder} are only ever incremented on the reactor's thread, and a scrape (which reads under the lock)
reads the float whole either way. The value and its exposition are C{inc}'s: C{value += 1}.

Feature-detected: the process's value class is prometheus_client's plain C{MutexValue} (not the
multiprocess one) and its C{inc} adds to C{_value}; anything else gets the counter's own C{inc}.
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import values

from relayd.compat.detect import code_uses

DIRECT_VALUES = values.ValueClass is values.MutexValue and code_uses(values.MutexValue.inc, "_value", "_lock")
"""A counter holds its count as C{_value} of a C{MutexValue}, which C{inc} adds to under C{_lock}."""


def adder(counter: Any) -> Callable[[], None]:
    """A call adding one to C{counter} (a counter, or one labelled child of it), as C{counter.inc()}
    does; for counters incremented on the reactor's thread only."""
    value = getattr(counter, "_value", None)
    if not DIRECT_VALUES or type(value) is not values.MutexValue:
        return counter.inc

    def add() -> None:
        value._value += 1

    return add
