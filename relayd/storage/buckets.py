"""Buckets: how relayd's keys are spread over Redis Cluster's slots (keyspace version 4).

A Redis Cluster stores a key in one of 16384 slots, the CRC16 of its hash tag (the text between the
first C{{} and the first C{}} after it, when not empty) or of the whole key; a script may only touch
keys of one slot. relayd tags every key with a I{bucket}: the bucket of a session (or tunnel, or
client) id is C{crc16(id) mod BUCKET_COUNT}, and every key of that id, and every per-bucket key
beside them (an AEP bucket's LRU, clock and claims; an MCP bucket's session and poller indexes and
buffered-bytes counter), carries the bucket's tag. So every script touches one slot, whatever the
id holds (an empty session, braces, any Unicode), and a reshard moves whole buckets.

The bucket count is part of the keyspace (changing it moves every key: a new keyspace version).
Each bucket's tag is chosen so that the buckets' slots are evenly spaced over the 16384 slots (the
bare tags C{{0}}, C{{1}}... fall unevenly), so a cluster whose masters own contiguous, equal slot
ranges (what C{redis-cli --cluster create} makes) holds about the same number of buckets on each.
"""

from __future__ import annotations

import itertools

SLOTS = 16384
BUCKET_COUNT = 64


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return table


_TABLE = _crc16_table()


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the checksum Redis Cluster computes a key's slot with."""
    crc = 0
    table = _TABLE
    for byte in data:
        crc = ((crc << 8) & 0xFFFF) ^ table[((crc >> 8) ^ byte) & 0xFF]
    return crc


def key_slot(key: bytes) -> int:
    """The slot Redis Cluster keeps C{key} in (C{CLUSTER KEYSLOT}): its hash tag's, when it has one."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return crc16(key) % SLOTS


class Buckets:
    """C{count} buckets with slot-balanced tags: C{tag_of(id)} is the C{{...}} to put in its keys."""

    def __init__(self, count: int = BUCKET_COUNT) -> None:
        self.count = count
        tags: list[bytes | None] = [None] * count
        missing = count
        # The first short tag (in this fixed order) whose slot falls in each bucket's share of the slots.
        for n in itertools.count():
            text = b"%d" % n
            share = key_slot(text) * count // SLOTS
            if tags[share] is None:
                tags[share] = b"{" + text + b"}"
                missing -= 1
                if not missing:
                    break
        self.tags: tuple[bytes, ...] = tuple(t for t in tags if t is not None)

    def index_of(self, identifier: bytes) -> int:
        return crc16(identifier) % self.count

    def tag_of(self, identifier: bytes) -> bytes:
        """The tag of C{identifier}'s bucket (a session, tunnel or client id as bytes)."""
        return self.tags[crc16(identifier) % self.count]


BUCKETS = Buckets()


def redis_prefix(text: str) -> str:
    """Setting parser of C{--redis-prefix}: a brace would take over the keys' bucket tags."""
    if "{" in text or "}" in text:
        raise ValueError(
            "must not contain '{' or '}': relayd tags its keys with Redis Cluster hash tags of its own "
            "(docs/scaling.md \"Redis Cluster\"); use another prefix, such as relayd:"
        )
    return text
