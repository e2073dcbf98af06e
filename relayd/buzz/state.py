"""Broker state: credentials, agents and their sealed keys, idempotency receipts with pending events.

L{StateDB} is the synchronous SQLite core (also used by the admin command); L{SQLiteState} serves
it to the reactor behind the zope interfaces the host uses (see its docstring for the threading).
L{relayd.buzz.redis_state} implements L{IReceiptStore} on Redis for several instances.

Durability: SQLite WAL with C{synchronous=NORMAL}: a committed transaction survives a crash of the
process (kill -9); power loss may lose the last commits.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

from twisted.internet import defer, threads
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.threadpool import ThreadPool
from zope.interface import Interface, implementer

from relayd.base.clock import BlockingClock
from relayd.storage import sqlite_schema

DB_FILE_NAME = "broker.sqlite3"
_SCHEMA_PACKAGE = "relayd.buzz"  # its schema/NNN-*.sql files (relayd/storage/sqlite_schema.py)
T = TypeVar("T")

WAL_LIMIT = 4 * 1024 * 1024  # bytes of WAL before a checkpoint truncates it
RECEIPT_RETENTION = 30 * 24 * 3600  # seconds a receipt is kept (the Redis store's expiry too)
MAX_RECEIPTS = 100_000  # receipts kept per agent (principal); its oldest settled tenth goes when it has more
_READ_PAGE = b'"status":"succeeded","action":"channel.read"'
_READ_PAGE_WITHIN = 200 + 2 * 128  # the envelope's first members, a requestId of 128 escaped characters included


def is_read_page(response: bytes) -> bool:
    """Whether a verdict is a C{channel.read} page (its envelope members come before any message).

    A page is never stored: its receipt keeps the digest only (state C{spent}), so the same
    requestId with other bytes is still a conflict, while the same bytes read again (a read
    changes nothing). Message contents, deleted on the relay or not, never reach the disk.
    """
    return response.find(_READ_PAGE, 0, _READ_PAGE_WITHIN) >= 0


# Columns added before versioned schemas: a database from then may lack them (see _adopt).
_UNVERSIONED_COLUMNS = (
    ("agents", "attestation", "TEXT"),
    ("credentials", "expires_at", "INTEGER"),
)


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone() is not None


def _adopt(conn: sqlite3.Connection) -> int:
    """Bring a database written before versioned schemas (user_version 0) to a known version, keeping every row.

    Those relayd versions created the tables of 001-initial.sql, added the columns above when
    missing, and the last of them also the receipt counts of 002-receipt-counts.sql: such a
    database is at version 2, an older one at version 1 (002 then follows as for any version 1).
    Runs inside the upgrade's transaction.
    """
    for statement in sqlite_schema.statements(sqlite_schema.steps(_SCHEMA_PACKAGE)[0].sql):
        conn.execute(statement)  # IF NOT EXISTS: only what is missing
    for table, column, definition in _UNVERSIONED_COLUMNS:
        have = {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")
    if _has_table(conn, "receipt_counts"):  # created with its triggers in one transaction
        conn.execute("CREATE INDEX IF NOT EXISTS receipts_principal_created ON receipts(principal, created_at)")
        return 2
    return 1


def _create_private(path: str) -> None:
    """Create the database file 0600 if it does not exist yet; never open one that does.

    SQLite gives the -wal and -shm files the database file's mode, so they are never readable by
    others, not even on first start. An existing file is left to SQLite alone: closing any
    descriptor of a file drops every POSIX lock the process holds on it, SQLite's included, and a
    process whose connections hold no lock lets another process's closing connection checkpoint
    and delete the WAL under it (its later reads see a stale snapshot, its commits go to a deleted file).
    A file that does not exist has no connection in this process to lose locks.
    """
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        pass  # there already (or not creatable: connecting says why)


def _connect(path: str) -> sqlite3.Connection:
    """A connection set up as every connection to the broker's state is, the daemon's and the tool's."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA busy_timeout=5000")  # the schema step may meet another process
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        # Deleted content (a destroyed sealed key, an expired receipt) is overwritten, not left in free space.
        conn.execute("PRAGMA secure_delete=ON")
    except BaseException:
        conn.close()
        raise
    return conn


# Distinct events one identity may be given in one second before its clock moves on to the next.
STAMPS_PER_SECOND = 1024
STAMP_DIGEST_BYTES = 16


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
    """The answer to L{IReceiptStore.claim}.

    C{status} is one of:
     - C{new}: no verdict and no plan; the caller executes (and now holds the claim);
     - C{resume}: a stored plan (C{plan}) awaits its verdict; the caller resends it (and holds the claim);
     - C{done}: the verdict (C{response}) is on record; replay it;
     - C{conflict}: the requestId was used with different bytes;
     - C{busy}: another instance holds the claim; wait (L{IReceiptStore.wait}) and claim again.
    """

    status: str
    response: bytes | None = None
    plan: bytes | None = None


NEW = Claim("new")
CONFLICT = Claim("conflict")
BUSY = Claim("busy")


class ICredentialStore(Interface):
    def credential(hash: str) -> "defer.Deferred[Credential | None]":
        """The credential whose SHA-256 hex is C{hash}, revoked or not."""


class IAgentStore(Interface):
    def agent(pubkey: str) -> "defer.Deferred[Agent | None]":
        """The agent with this public key (deleted ones included)."""

    def agents_named(owner: str, name: str) -> "defer.Deferred[list[Agent]]":
        """Live agents of C{owner} called C{name}."""

    def children(owner: str) -> "defer.Deferred[int]":
        """How many live managed agents C{owner} owns."""

    def apply_effects(effects: list[dict[str, Any]]) -> "defer.Deferred[None]":
        """Apply an execution's local effects (agents created, updated, deleted) in one transaction.

        Idempotent: a retry that resumes a plan may apply the same effects again.
        """

    def stamp(pubkey: str, digest: bytes, now: int, after: int, strict: bool) -> "defer.Deferred[int]":
        """The C{created_at} for a new event of identity C{pubkey}, durably handed out once.

        C{digest} (L{STAMP_DIGEST_BYTES} bytes) identifies the event's kind, tags and content. The answer is at
        least C{now}, more than C{after}, never below one handed out before for this identity, and
        never the second of an earlier event with the same digest: two events of one identity
        never share an id, even across restarts and processes sharing the state. With C{strict},
        the answer is also later than every second handed out before for this identity (an
        agent record: so records of one owner are totally ordered by C{created_at}).
        """


class IReceiptStore(Interface):
    """Idempotency receipts and the pending signed events of executions, keyed by (principal, requestId).

    The caller serialises its own duplicates in process; C{claim} makes duplicates on other
    instances sharing the store wait, so each request executes once.
    """

    def receipt(principal: str, request_id: str) -> "defer.Deferred[Receipt | None]":
        """The receipt for (principal, requestId), if any."""

    def claim(principal: str, request_id: str, digest: bytes) -> "defer.Deferred[Claim]":
        """Look the request up and, when it needs executing, take the claim to execute it."""

    def wait(principal: str, request_id: str, timeout: float) -> "defer.Deferred[None]":
        """Fires when a claim held elsewhere may have ended (settled, released, lapsed), or after C{timeout}."""

    def release(principal: str, request_id: str) -> "defer.Deferred[None]":
        """Give a claim up without a verdict: a stored plan stays for a retry to resend; a bare claim goes."""

    def store_plan(principal: str, request_id: str, digest: bytes, plan: bytes) -> "defer.Deferred[None]":
        """Durably store the signed events and effects of an execution before anything is sent."""

    def complete(
        principal: str, request_id: str, digest: bytes, response: bytes, effects: list[dict[str, Any]]
    ) -> "defer.Deferred[bytes]":
        """Apply C{effects}, store the verdict (replacing a plan) and end the claim.

        Fires with the verdict on record: C{response}, or one another instance settled first.
        """


class StateDB:
    """The synchronous SQLite core. Not thread-safe: use from one thread."""

    def __init__(self, path: str, busy_timeout_ms: int = 5000) -> None:
        self.path = path
        # Stamps receipts (the retention counts from it), credentials and agents: the daemon hands in
        # its clock's (BrokerService), the broker's command-line tool its BlockingClock's.
        self.now: Callable[[], float] = BlockingClock().wall
        self.max_receipts = MAX_RECEIPTS  # per principal; see _trim
        _create_private(path)
        self.conn = _connect(path)
        try:
            # relayd/buzz/schema/*.sql, applied in order (relayd/storage/sqlite_schema.py).
            sqlite_schema.upgrade(self.conn, _SCHEMA_PACKAGE, adopt=_adopt, label=path)
        except BaseException:
            self.conn.close()
            raise
        self.conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        for name in (path, path + "-wal", path + "-shm"):  # files from before this rule
            try:
                os.chmod(name, 0o600)  # by name: no descriptor of the file (see _create_private)
            except OSError:
                pass

    def another(self) -> "StateDB":
        """A second connection to this database, set up as this one (the file and its schema are there)."""
        other = StateDB.__new__(StateDB)
        other.path, other.now, other.max_receipts = self.path, self.now, self.max_receipts
        other.conn = _connect(self.path)
        return other

    @classmethod
    def in_dir(cls, state_dir: str) -> "StateDB":
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        return cls(os.path.join(state_dir, DB_FILE_NAME))

    def close(self) -> None:
        self.conn.close()

    def _tx(self, f: Callable[[sqlite3.Connection], T]) -> T:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            result = f(self.conn)
            self.conn.execute("COMMIT")
        except BaseException:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            raise
        return result

    def data_version(self) -> int:
        """Changes whenever another connection (thread or process) commits; never for this one's commits."""
        return int(self.conn.execute("PRAGMA data_version").fetchone()[0])

    def checkpoint(self) -> None:
        """Copy committed WAL pages into the database without waiting for readers or writers.

        Under steady writes a passive checkpoint never catches up with the frames appended while
        it runs, so the WAL is never restarted and grows without end: once it is larger than
        L{WAL_LIMIT}, the checkpoint waits for the writers (they queue meanwhile) and truncates it.
        """
        self.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
        try:
            size = os.path.getsize(self.path + "-wal")
        except OSError:
            return
        if size > WAL_LIMIT:
            self.scrub_wal()

    def scrub_wal(self) -> None:
        """Checkpoint and truncate the WAL, so older page images (a destroyed key's) leave the disk.

        Best effort: with a reader in the way the WAL is not truncated now, and the next
        destruction tries again.
        """
        self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    # credentials

    def add_credential(
        self,
        hash: str,
        agent_pubkey: str,
        channels: Iterable[str],
        actions: Iterable[str],
        expires_at: int | None = None,
    ) -> str:
        cid = hash[:16]
        self._tx(
            lambda c: c.execute(
                "INSERT INTO credentials (hash, id, agent_pubkey, channels, actions, created_at, expires_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    hash,
                    cid,
                    agent_pubkey,
                    json.dumps(sorted(channels)),
                    json.dumps(sorted(actions)),
                    int(self.now()),
                    expires_at,
                ),
            )
        )
        return cid

    def credential(self, hash: str) -> Credential | None:
        row = self.conn.execute(
            "SELECT id, agent_pubkey, channels, actions, created_at, revoked_at, expires_at FROM credentials WHERE hash = ?",
            (hash,),
        ).fetchone()
        return _credential(row) if row else None

    def credentials(self) -> list[Credential]:
        rows = self.conn.execute(
            "SELECT id, agent_pubkey, channels, actions, created_at, revoked_at, expires_at FROM credentials"
            " ORDER BY created_at, id"
        ).fetchall()
        return [_credential(r) for r in rows]

    def revoke(self, credential_id: str | None = None, agent_pubkey: str | None = None) -> int:
        now = int(self.now())
        arg: str | None
        if credential_id is not None:
            q, arg = "UPDATE credentials SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", credential_id
        else:
            q, arg = "UPDATE credentials SET revoked_at = ? WHERE agent_pubkey = ? AND revoked_at IS NULL", agent_pubkey
        return self._tx(lambda c: c.execute(q, (now, arg)).rowcount)

    # agents

    def put_agent(self, agent: Agent) -> None:
        now = int(self.now())
        self._tx(lambda c: _put_agent(c, agent, now))

    def agent(self, pubkey: str) -> Agent | None:
        row = self.conn.execute(_AGENT_SELECT + " WHERE pubkey = ?", (pubkey,)).fetchone()
        return _agent(row) if row else None

    def agents_named(self, owner: str | None, name: str) -> list[Agent]:
        if owner is None:
            rows = self.conn.execute(
                _AGENT_SELECT + " WHERE name = ? AND deleted_at IS NULL ORDER BY created_at", (name,)
            ).fetchall()
        else:
            rows = self.conn.execute(
                _AGENT_SELECT + " WHERE owner = ? AND name = ? AND deleted_at IS NULL ORDER BY created_at",
                (owner, name),
            ).fetchall()
        return [_agent(r) for r in rows]

    def children(self, owner: str) -> int:
        row = self.conn.execute(
            "SELECT COUNT(*) FROM agents WHERE owner = ? AND managed = 1 AND deleted_at IS NULL", (owner,)
        ).fetchone()
        return int(row[0])

    def agents(self) -> list[Agent]:
        return [_agent(r) for r in self.conn.execute(_AGENT_SELECT + " ORDER BY created_at").fetchall()]

    # receipts

    def receipt(self, principal: str, request_id: str) -> Receipt | None:
        row = self.conn.execute(
            "SELECT digest, state, response, plan FROM receipts WHERE principal = ? AND request_id = ?",
            (principal, request_id),
        ).fetchone()
        return Receipt(bytes(row[0]), row[1], row[2], row[3]) if row else None

    def store_plan(self, principal: str, request_id: str, digest: bytes, plan: bytes) -> None:
        def tx(c: sqlite3.Connection) -> None:
            c.execute(
                "INSERT INTO receipts (principal, request_id, digest, state, plan, created_at)"
                " VALUES (?, ?, ?, 'pending', ?, ?)",
                (principal, request_id, digest, plan, int(self.now())),
            )
            self._trim(c, principal, request_id)

        self._tx(tx)

    def _trim(self, c: sqlite3.Connection, principal: str, keep: str) -> None:
        """Hold C{principal} to L{max_receipts} (docs/decisions.md B-12), C{keep} excepted.

        A tenth at a time, so the delete (an indexed walk of the oldest rows) runs once per tenth
        of the cap's writes, not on each. Pending plans are never deleted here: each is a request
        whose outcome is unknown, and its retry must find the signed events it may have sent.
        """
        row = c.execute("SELECT n FROM receipt_counts WHERE principal = ?", (principal,)).fetchone()
        if row is None or row[0] <= self.max_receipts:
            return
        excess = row[0] - self.max_receipts + max(1, self.max_receipts // 10)
        c.execute(
            "DELETE FROM receipts WHERE rowid IN (SELECT rowid FROM receipts WHERE principal = ?"
            " AND state != 'pending' AND request_id != ? ORDER BY created_at, rowid LIMIT ?)",
            (principal, keep, excess),
        )

    def complete(
        self, principal: str, request_id: str, digest: bytes, response: bytes, effects: list[dict[str, Any]]
    ) -> bytes:
        spent = is_read_page(response)
        now = int(self.now())

        def tx(c: sqlite3.Connection) -> None:
            for effect in effects:
                _apply_effect(c, effect, now)
            c.execute(
                "INSERT INTO receipts (principal, request_id, digest, state, response, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (principal, request_id) DO UPDATE SET"
                " state = excluded.state, response = excluded.response, plan = NULL",
                (principal, request_id, digest, "spent" if spent else "done", None if spent else response, now),
            )
            self._trim(c, principal, request_id)

        self._tx(tx)
        if _destroys_keys(effects):
            self.scrub_wal()
        return response

    def prune(self, now: int, retention: int = RECEIPT_RETENTION) -> int:
        """Delete receipts (verdicts and pending plans) older than C{retention} seconds; how many went."""
        return self._tx(lambda c: c.execute("DELETE FROM receipts WHERE created_at < ?", (now - retention,)).rowcount)

    def apply_effects(self, effects: list[dict[str, Any]]) -> None:
        now = int(self.now())

        def tx(c: sqlite3.Connection) -> None:
            for effect in effects:
                _apply_effect(c, effect, now)

        self._tx(tx)
        if _destroys_keys(effects):
            self.scrub_wal()

    # event clocks

    def stamp(self, pubkey: str, digest: bytes, now: int, after: int = -1, strict: bool = False) -> int:
        """See L{IAgentStore.stamp}. One write transaction, so processes sharing the file agree.

        Per identity the row keeps the latest second handed out and the digests given in it:
        only an event identical to one already in that second moves the clock on (by one
        second), so the C{created_at} of distinct events stays the wall clock.
        """

        def tx(c: sqlite3.Connection) -> int:
            row = c.execute("SELECT second, digests FROM clocks WHERE pubkey = ?", (pubkey,)).fetchone()
            second, used = (int(row[0]), bytes(row[1])) if row else (-1, b"")
            at = max(now, after + 1, second + 1 if strict else second)
            if at != second:
                used = b""
            elif _holds(used, digest) or len(used) >= STAMPS_PER_SECOND * STAMP_DIGEST_BYTES:
                at, used = second + 1, b""
            c.execute(
                "INSERT INTO clocks (pubkey, second, digests) VALUES (?, ?, ?)"
                " ON CONFLICT (pubkey) DO UPDATE SET second = excluded.second, digests = excluded.digests",
                (pubkey, at, used + digest),
            )
            return at

        return self._tx(tx)


_AGENT_SELECT = (
    "SELECT pubkey, name, sealed_key, owner, managed, depth, channel, settings, record_created_at, deleted_at,"
    " attestation"
    " FROM agents"
)


def _destroys_keys(effects: list[dict[str, Any]]) -> bool:
    return any(e["op"] == "delete_agent" for e in effects)


def _holds(used: bytes, digest: bytes) -> bool:
    """Whether the concatenated fixed-size digests C{used} include C{digest} (at a digest boundary)."""
    i = used.find(digest)
    while i >= 0 and i % STAMP_DIGEST_BYTES:
        i = used.find(digest, i + 1)
    return i >= 0


def _credential(row: Any) -> Credential:
    return Credential(
        id=row[0],
        agent_pubkey=row[1],
        channels=frozenset(json.loads(row[2])),
        actions=frozenset(json.loads(row[3])),
        created_at=row[4],
        revoked=row[5] is not None,
        expires_at=row[6],
    )


def _agent(row: Any) -> Agent:
    return Agent(
        pubkey=row[0],
        name=row[1],
        sealed_key=bytes(row[2]) if row[2] is not None else None,
        owner=row[3],
        managed=bool(row[4]),
        depth=row[5],
        channel=row[6],
        settings=json.loads(row[7]),
        record_created_at=row[8],
        deleted=row[9] is not None,
        attestation=tuple(json.loads(row[10])) if row[10] else None,
    )


def _put_agent(c: sqlite3.Connection, a: Agent, now: int) -> None:
    c.execute(
        "INSERT INTO agents (pubkey, name, sealed_key, owner, managed, depth, channel, settings,"
        " record_created_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
        " ON CONFLICT (pubkey) DO UPDATE SET name = excluded.name, sealed_key = excluded.sealed_key,"
        " owner = excluded.owner, managed = excluded.managed, depth = excluded.depth,"
        " channel = excluded.channel, settings = excluded.settings,"
        " record_created_at = excluded.record_created_at, deleted_at = NULL",
        (
            a.pubkey,
            a.name,
            a.sealed_key,
            a.owner,
            int(a.managed),
            a.depth,
            a.channel,
            json.dumps(a.settings, sort_keys=True),
            a.record_created_at,
            now,
        ),
    )


def _apply_effect(c: sqlite3.Connection, effect: dict[str, Any], now: int) -> None:
    op = effect["op"]
    # Effects are applied again when a plan is resumed and may arrive after newer ones: each is
    # written so that it never rolls newer state back (a created agent is never re-created over
    # itself or revived once deleted; an update lands only on a live agent whose record is not newer).
    if op == "create_agent":
        a = effect["agent"]
        c.execute(
            "INSERT INTO agents (pubkey, name, sealed_key, owner, managed, depth, channel, settings,"
            " record_created_at, created_at, attestation) VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (pubkey) DO NOTHING",
            (
                a["pubkey"],
                a["name"],
                bytes.fromhex(a["sealed_key"]),
                a["owner"],
                a["depth"],
                a["channel"],
                json.dumps(a["settings"], sort_keys=True),
                a["record_created_at"],
                now,
                json.dumps(a["attestation"]) if a.get("attestation") else None,
            ),
        )
    elif op == "update_agent":
        c.execute(
            "UPDATE agents SET name = ?, settings = ?, record_created_at = ?"
            " WHERE pubkey = ? AND deleted_at IS NULL AND record_created_at <= ?",
            (
                effect["name"],
                json.dumps(effect["settings"], sort_keys=True),
                effect["record_created_at"],
                effect["pubkey"],
                effect["record_created_at"],
            ),
        )
    elif op == "delete_agent":
        # Destroy the key; credentials bound to the agent stop working.
        c.execute(
            "UPDATE agents SET sealed_key = NULL, deleted_at = ? WHERE pubkey = ? AND deleted_at IS NULL",
            (now, effect["pubkey"]),
        )
        c.execute(
            "UPDATE credentials SET revoked_at = ? WHERE agent_pubkey = ? AND revoked_at IS NULL",
            (now, effect["pubkey"]),
        )
    else:
        raise ValueError(f"unknown effect {op!r}")


@implementer(ICredentialStore, IAgentStore, IReceiptStore)
class SQLiteState:
    """The stores on SQLite: one connection on the reactor thread, a worker thread for the rest.

    Reads and writes run inline on the reactor thread, on one connection: a primary-key read is a
    few microseconds and a WAL commit with C{synchronous=NORMAL} is a C{write()} without C{fsync},
    while handing either to a thread and back cost several times the work itself (two wake-ups,
    the GIL changing hands). What could block stays off the reactor: checkpoints (which C{fsync})
    run on the worker thread, and a write that finds another process holding the write lock (the
    admin command) is handed to the worker, which waits for it; later writes queue behind it so
    they commit in order.

    Credentials and agents are cached. The cache is dropped whenever C{PRAGMA data_version} says
    another connection committed (the admin command revoking, another instance, the worker) and
    after this connection applies agent effects, so a revocation counts from the next request.

    Receipts need no claim here: the host serialises duplicates in its process, and a process
    owns its SQLite receipts (several instances share receipts through Redis).
    """

    BUSY_TIMEOUT_MS = 10  # the reactor thread waits this long for another process's write lock
    CHECKPOINT_EVERY = 256  # inline commits between passive checkpoints
    CACHE_ENTRIES = 10_000

    def __init__(self, db: StateDB, reactor: IReactorFromThreads) -> None:
        self.db = db
        db.conn.execute(f"PRAGMA busy_timeout={self.BUSY_TIMEOUT_MS}")
        db.conn.execute("PRAGMA wal_autocheckpoint=0")  # the worker checkpoints (it may fsync)
        self._reactor = reactor
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name="relayd-buzz-sqlite")
        self._worker_db: StateDB | None = None
        self._queued = 0
        self._commits = 0
        self._checkpointing = False
        self._version = db.data_version()
        self._credentials: dict[str, Credential] = {}
        self._agents: dict[str, Agent] = {}

    @classmethod
    def in_dir(cls, state_dir: str, reactor: IReactorFromThreads) -> "SQLiteState":
        return cls(StateDB.in_dir(state_dir), reactor)

    # --- plumbing

    def _worker(self) -> StateDB:
        """The worker thread's own connection (opened there, on first use)."""
        if self._worker_db is None:
            self._worker_db = self.db.another()
            self._worker_db.conn.execute("PRAGMA wal_autocheckpoint=0")
        return self._worker_db

    def _on_worker(self, f: Callable[..., T], *args: Any) -> "defer.Deferred[T]":
        if not self._pool.started:  # started on first use, so an unstarted service leaves no thread
            self._pool.start()
        return threads.deferToThreadPool(self._reactor, self._pool, f, *args)

    def _write(self, name: str, *args: Any) -> "defer.Deferred[Any]":
        """Run C{StateDB.<name>(*args)} inline, or on the worker when it is busy or the lock is taken."""
        if self._queued == 0:
            try:
                result = getattr(self.db, name)(*args)
            except sqlite3.OperationalError as e:
                if not _locked(e):
                    return defer.fail()
            except Exception:
                return defer.fail()
            else:
                self._committed()
                return defer.succeed(result)
        self._queued += 1
        d = self._on_worker(lambda: getattr(self._worker(), name)(*args))

        def done(result: Any) -> Any:
            self._queued -= 1
            return result

        return d.addBoth(done)

    def _committed(self) -> None:
        self._commits += 1
        if self._commits >= self.CHECKPOINT_EVERY and not self._checkpointing:
            self._commits = 0
            self._checkpointing = True

            def done(result: Any) -> None:
                self._checkpointing = False

            self._on_worker(lambda: self._worker().checkpoint()).addBoth(done)

    def _fresh(self) -> None:
        version = self.db.data_version()
        if version != self._version:
            self._version = version
            self._forget()

    def _forget(self) -> None:
        self._credentials.clear()
        self._agents.clear()

    def close(self) -> "defer.Deferred[None]":
        """Close the worker's connection on its thread, stop the thread, close the reactor's connection."""
        if not self._pool.started:
            self.db.close()
            return defer.succeed(None)

        def close_worker() -> None:
            if self._worker_db is not None:
                self._worker_db.close()
                self._worker_db = None

        d = self._on_worker(close_worker)

        def stop(result: Any) -> Any:
            self._pool.stop()
            self.db.close()
            return result

        return d.addBoth(stop)

    # --- credentials and agents

    def credential(self, hash: str) -> "defer.Deferred[Credential | None]":
        try:
            self._fresh()
            cred = self._credentials.get(hash)
            if cred is None:
                cred = self.db.credential(hash)
                if cred is not None:
                    if len(self._credentials) >= self.CACHE_ENTRIES:
                        self._credentials.clear()
                    self._credentials[hash] = cred
        except Exception:
            return defer.fail()
        return defer.succeed(cred)

    def agent(self, pubkey: str) -> "defer.Deferred[Agent | None]":
        try:
            self._fresh()
            agent = self._agents.get(pubkey)
            if agent is None:
                agent = self.db.agent(pubkey)
                if agent is not None:
                    if len(self._agents) >= self.CACHE_ENTRIES:
                        self._agents.clear()
                    self._agents[pubkey] = agent
        except Exception:
            return defer.fail()
        return defer.succeed(agent)

    def agents_named(self, owner: str, name: str) -> "defer.Deferred[list[Agent]]":
        return defer.maybeDeferred(self.db.agents_named, owner, name)

    def children(self, owner: str) -> "defer.Deferred[int]":
        return defer.maybeDeferred(self.db.children, owner)

    def apply_effects(self, effects: list[dict[str, Any]]) -> "defer.Deferred[None]":
        return self._write("apply_effects", effects).addBoth(self._after_effects)

    def stamp(
        self, pubkey: str, digest: bytes, now: int, after: int = -1, strict: bool = False
    ) -> "defer.Deferred[int]":
        return self._write("stamp", pubkey, digest, now, after, strict)

    def _after_effects(self, result: Any) -> Any:
        self._forget()
        return result

    # --- receipts

    def receipt(self, principal: str, request_id: str) -> "defer.Deferred[Receipt | None]":
        return defer.maybeDeferred(self.db.receipt, principal, request_id)

    def claim(self, principal: str, request_id: str, digest: bytes) -> "defer.Deferred[Claim]":
        try:
            r = self.db.receipt(principal, request_id)
        except Exception:
            return defer.fail()
        if r is None:
            return defer.succeed(NEW)
        if r.digest != digest:
            return defer.succeed(CONFLICT)
        if r.state == "done" and r.response is not None:
            return defer.succeed(Claim("done", response=bytes(r.response)))
        if r.state == "spent":
            return defer.succeed(NEW)  # a read whose page was not kept: read again
        return defer.succeed(Claim("resume", plan=bytes(r.plan) if r.plan is not None else b"{}"))

    def wait(self, principal: str, request_id: str, timeout: float) -> "defer.Deferred[None]":
        return defer.succeed(None)  # never busy: no other process shares these receipts

    def release(self, principal: str, request_id: str) -> "defer.Deferred[None]":
        return defer.succeed(None)  # a claim here is only the host's in-process gate

    def store_plan(self, principal: str, request_id: str, digest: bytes, plan: bytes) -> "defer.Deferred[None]":
        return self._write("store_plan", principal, request_id, digest, plan)

    def prune(self, now: int, retention: int = RECEIPT_RETENTION) -> "defer.Deferred[int]":
        """L{StateDB.prune} on the worker thread (a large delete must not stall the reactor)."""
        return self._on_worker(lambda: self._worker().prune(now, retention))

    def complete(
        self, principal: str, request_id: str, digest: bytes, response: bytes, effects: list[dict[str, Any]]
    ) -> "defer.Deferred[bytes]":
        d = self._write("complete", principal, request_id, digest, response, effects)
        return d.addBoth(self._after_effects) if effects else d


def _locked(e: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the lock this one needs."""
    text = str(e).lower()
    return "locked" in text or "busy" in text
