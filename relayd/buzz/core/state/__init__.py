"""Broker state: credentials, agents and their sealed keys, idempotency receipts with pending events.

    records     the records (L{Credential}, L{Agent}, L{Receipt}, L{Claim}) and the limits they keep
    interfaces  the stores the host uses (zope interfaces)
    effects     an execution's local effects, typed, and their stored form
    sqlite      the database: schema, adoption of old files, L{StateDB} (the daemon's and the tool's)
    threaded    L{SQLiteState}: the stores on that database, for the reactor

L{relayd.buzz.redis.state} implements L{IReceiptStore} on Redis for several instances. The names
below are this package's public ones; import them from here.
"""

from relayd.buzz.core.state.effects import CreateAgent, DeleteAgent, Effect, EffectLike, UpdateAgent
from relayd.buzz.core.state.interfaces import IAgentStore, ICredentialStore, IReceiptStore
from relayd.buzz.core.state.records import (
    BUSY,
    CONFLICT,
    MAX_RECEIPTS,
    NEW,
    RECEIPT_RETENTION,
    STAMP_DIGEST_BYTES,
    STAMPS_PER_SECOND,
    Agent,
    Claim,
    Credential,
    Receipt,
    is_read_page,
)
from relayd.buzz.core.state.sqlite import DB_FILE_NAME, WAL_LIMIT, StateDB
from relayd.buzz.core.state.threaded import SQLiteState

__all__ = [
    "BUSY",
    "CONFLICT",
    "DB_FILE_NAME",
    "MAX_RECEIPTS",
    "NEW",
    "RECEIPT_RETENTION",
    "STAMPS_PER_SECOND",
    "STAMP_DIGEST_BYTES",
    "WAL_LIMIT",
    "Agent",
    "Claim",
    "CreateAgent",
    "Credential",
    "DeleteAgent",
    "Effect",
    "EffectLike",
    "IAgentStore",
    "ICredentialStore",
    "IReceiptStore",
    "Receipt",
    "SQLiteState",
    "StateDB",
    "UpdateAgent",
    "is_read_page",
]
