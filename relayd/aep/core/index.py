"""The subscription index: which subscribers an event can match, without asking the others.

A subscription whose filter pins an attribute to exact strings (L{pin_of}: the session first) sits
in one bucket per pinned value of that one attribute; a filter that pins nothing sits in the scan
list. An event is offered only to the buckets of its own values plus the scan list, so fan-out
costs what can match, not the number of subscribers. An event has one value per attribute and a
subscriber is indexed under one attribute, so no subscriber is offered an event twice.

Pure data structure: no I/O, no Twisted.
"""

from __future__ import annotations

from typing import Any, Hashable

from relayd.aep.core.filters import Pin, index_value

__all__ = ["Group", "Snapshot", "SubscriptionIndex"]

# One group of candidates: the subscribers, and whether their filter must still be evaluated
# (False: the filter is exactly the pin, so being in the bucket is the match).
Group = tuple[tuple[Any, ...], bool]


class _Bucket:
    """The subscribers pinned to one value of one attribute, split by whether they need a check."""

    __slots__ = ("alone", "checked")

    def __init__(self) -> None:
        self.alone: dict[Hashable, Any] = {}
        self.checked: dict[Hashable, Any] = {}


class SubscriptionIndex:
    """Subscribers by key, bucketed by their pin (L{add}, L{remove}: O(number of pinned values))."""

    def __init__(self) -> None:
        self._pins: dict[Hashable, Pin | None] = {}
        # attr -> value -> bucket; an emptied bucket (and attribute) is dropped at once.
        self._buckets: dict[str, dict[str, _Bucket]] = {}
        self._scan: dict[Hashable, Any] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def add(self, key: Hashable, sub: Any, pin: Pin | None) -> None:
        """Index C{sub} under C{key} (replacing what was there)."""
        self.remove(key)
        self._pins[key] = pin
        if pin is None:
            self._scan[key] = sub
            return
        values = self._buckets.setdefault(pin.attr, {})
        for value in pin.values:
            bucket = values.get(value)
            if bucket is None:
                bucket = values[value] = _Bucket()
            (bucket.alone if pin.alone else bucket.checked)[key] = sub

    def remove(self, key: Hashable) -> bool:
        """Forget C{key}; C{False} when it was not indexed."""
        if key not in self._pins:
            return False
        pin = self._pins.pop(key)
        if pin is None:
            del self._scan[key]
            return True
        values = self._buckets[pin.attr]
        for value in pin.values:
            bucket = values[value]
            (bucket.alone if pin.alone else bucket.checked).pop(key, None)
            if not bucket.alone and not bucket.checked:
                del values[value]
        if not values:
            del self._buckets[pin.attr]
        return True

    def snapshot(self) -> Snapshot:
        """A view for one batch of events (see L{Snapshot})."""
        return Snapshot(self)

    @property
    def empty(self) -> bool:
        """Whether nobody is subscribed: a batch's L{snapshot} would be empty (asked first, so that
        a relay without subscribers builds none)."""
        return not self._buckets and not self._scan

    def sizes(self) -> tuple[int, int, int]:
        """(indexed subscribers, buckets, scan list length): what a leak test looks at."""
        buckets = sum(len(values) for values in self._buckets.values())
        return len(self._pins), buckets, len(self._scan)


class Snapshot:
    """The subscribers one batch is offered to, as the index held them when the batch began.

    Each bucket is copied the first time an event of the batch needs it, the scan list at once: a
    subscriber that closes during the batch (its writes are refused then) cannot disturb the
    iteration, and the copying costs what the batch can match, not the number of subscribers.
    """

    __slots__ = ("_attrs", "_copies", "_scan", "empty")

    def __init__(self, index: SubscriptionIndex) -> None:
        # The attributes indexed now (a removal during the batch may drop one from the index).
        self._attrs = tuple(index._buckets.items())
        self._copies: dict[tuple[str, str], tuple[Group, Group]] = {}
        self._scan: Group = (tuple(index._scan.values()), True)
        # Whether no event of the batch can have a candidate (nobody subscribed): fan-out is skipped.
        self.empty = not self._attrs and not self._scan[0]

    def groups(self, event: Any) -> list[Group]:
        """The candidate groups for C{event} (an L{Event}): its buckets, then the scan list."""
        found: list[Group] = []
        copies = self._copies
        ev = None
        for attr, values in self._attrs:
            # Session and type are read off the event without parsing it.
            if attr == "session":
                value: Any = event.session
            elif attr == "type":
                value = event.type
            else:
                if ev is None:
                    ev = event.ev
                value = index_value(ev, attr)
            if not isinstance(value, str):
                continue
            copied = copies.get((attr, value))
            if copied is None:
                bucket = values.get(value)
                if bucket is None:
                    continue
                copied = copies[(attr, value)] = (
                    (tuple(bucket.alone.values()), False),
                    (tuple(bucket.checked.values()), True),
                )
            found.extend(copied)
        if self._scan[0]:
            found.append(self._scan)
        return found
