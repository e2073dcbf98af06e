"""What the broker keeps: credentials, agents, idempotency receipts and the answers of a claim.

Plain frozen records, shared by the SQLite database (L{relayd.buzz.core.state.sqlite}), the stores
serving it to the reactor and Redis's receipts, and the operator tool; they know no storage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RECEIPT_RETENTION = 30 * 24 * 3600  # seconds a receipt is kept (the Redis store's expiry too)
MAX_RECEIPTS = 100_000  # receipts kept per agent (principal); its oldest settled tenth goes when it has more
# Distinct events one identity may be given in one second before its clock moves on to the next.
STAMPS_PER_SECOND = 1024
STAMP_DIGEST_BYTES = 16

_READ_PAGE = b'"status":"succeeded","action":"channel.read"'
_READ_PAGE_WITHIN = 200 + 2 * 128  # the envelope's first members, a requestId of 128 escaped characters included


def is_read_page(response: bytes) -> bool:
    """Whether a verdict is a C{channel.read} page (its envelope members come before any message).

    A page is never stored: its receipt keeps the digest only (state C{spent}), so the same
    requestId with other bytes is still a conflict, while the same bytes read again (a read
    changes nothing). Message contents, deleted on the relay or not, never reach the disk.
    """
    return response.find(_READ_PAGE, 0, _READ_PAGE_WITHIN) >= 0


@dataclass(frozen=True)
class Credential:
    """What a credential is bound to (never the credential itself)."""

    id: str
    agent_pubkey: str
    channels: frozenset[str]
    actions: frozenset[str]
    created_at: int
    revoked: bool
    expires_at: int | None = None  # unix time; refused from that second on (relayd-admin broker issue --expires)

    def expired(self, now: float) -> bool:
        """Whether the credential has expired at C{now}."""
        return self.expires_at is not None and now >= self.expires_at


@dataclass(frozen=True)
class Agent:
    """An identity the host signs for."""

    pubkey: str
    name: str
    sealed_key: bytes | None
    owner: str | None
    managed: bool
    depth: int
    channel: str | None
    settings: dict[str, Any]
    record_created_at: int
    deleted: bool
    attestation: tuple[str, ...] | None = None  # NIP-OA ["auth", owner, conditions, sig]


@dataclass(frozen=True)
class Receipt:
    """An idempotency record: C{done} with its verdict bytes, C{pending} with its stored plan,
    C{spent} (a read: the digest only, see L{is_read_page}), or (Redis only) C{claimed} while an
    instance executes it and nothing is stored yet."""

    digest: bytes
    state: str
    response: bytes | None
    plan: bytes | None


@dataclass(frozen=True)
class Claim:
    """The answer to L{IReceiptStore.claim<relayd.buzz.core.state.interfaces.IReceiptStore.claim>}.

    C{status} is one of:
     - C{new}: no verdict and no plan; the caller executes (and now holds the claim);
     - C{resume}: a stored plan (C{plan}) awaits its verdict; the caller resends it (and holds the claim);
     - C{done}: the verdict (C{response}) is on record; replay it;
     - C{conflict}: the requestId was used with different bytes;
     - C{busy}: another instance holds the claim; wait (C{IReceiptStore.wait}) and claim again.
    """

    status: str
    response: bytes | None = None
    plan: bytes | None = None


NEW = Claim("new")
CONFLICT = Claim("conflict")
BUSY = Claim("busy")
