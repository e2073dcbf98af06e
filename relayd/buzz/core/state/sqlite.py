"""The broker's SQLite database: opening it, its schema (and adoption of files from before versioned
schemas), and L{StateDB}, the synchronous core used by both the daemon and the operator tool.

L{relayd.buzz.core.state.threaded.SQLiteState} serves it to the reactor. Durability: SQLite WAL with
C{synchronous=NORMAL}: a committed transaction survives a crash of the process (kill -9); power loss
may lose the last commits.
"""

from __future__ import annotations

import json
import os
import sqlite3
from typing import Any, Callable, Iterable, Sequence, TypeVar

from relayd.base.clock import BlockingClock
from relayd.buzz.core.state.effects import (
    CreateAgent,
    DeleteAgent,
    Effect,
    EffectLike,
    UpdateAgent,
    destroys_keys,
    parse_all,
)
from relayd.buzz.core.state.records import (
    MAX_RECEIPTS,
    RECEIPT_RETENTION,
    STAMP_DIGEST_BYTES,
    STAMPS_PER_SECOND,
    Agent,
    Credential,
    Receipt,
    is_read_page,
)
from relayd.storage import sqlite_schema

DB_FILE_NAME = "broker.sqlite3"
_SCHEMA_PACKAGE = "relayd.buzz"  # its schema/NNN-*.sql files (relayd/storage/sqlite_schema.py)
T = TypeVar("T")

WAL_LIMIT = 4 * 1024 * 1024  # bytes of WAL before a checkpoint truncates it

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
        self, principal: str, request_id: str, digest: bytes, response: bytes, effects: Sequence[EffectLike]
    ) -> bytes:
        typed = parse_all(effects)
        spent = is_read_page(response)
        now = int(self.now())

        def tx(c: sqlite3.Connection) -> None:
            for effect in typed:
                _apply_effect(c, effect, now)
            c.execute(
                "INSERT INTO receipts (principal, request_id, digest, state, response, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (principal, request_id) DO UPDATE SET"
                " state = excluded.state, response = excluded.response, plan = NULL",
                (principal, request_id, digest, "spent" if spent else "done", None if spent else response, now),
            )
            self._trim(c, principal, request_id)

        self._tx(tx)
        if destroys_keys(typed):
            self.scrub_wal()
        return response

    def prune(self, now: int, retention: int = RECEIPT_RETENTION) -> int:
        """Delete receipts (verdicts and pending plans) older than C{retention} seconds; how many went."""
        return self._tx(lambda c: c.execute("DELETE FROM receipts WHERE created_at < ?", (now - retention,)).rowcount)

    def apply_effects(self, effects: Sequence[EffectLike]) -> None:
        typed = parse_all(effects)  # all of them before the transaction: an unknown one changes nothing
        now = int(self.now())

        def tx(c: sqlite3.Connection) -> None:
            for effect in typed:
                _apply_effect(c, effect, now)

        self._tx(tx)
        if destroys_keys(typed):
            self.scrub_wal()

    # event clocks

    def stamp(self, pubkey: str, digest: bytes, now: int, after: int = -1, strict: bool = False) -> int:
        """See C{IAgentStore.stamp} (interfaces.py). One write transaction, so processes sharing the file agree.

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


def _apply_effect(c: sqlite3.Connection, effect: Effect, now: int) -> None:
    # Effects are applied again when a plan is resumed and may arrive after newer ones: each is
    # written so that it never rolls newer state back (a created agent is never re-created over
    # itself or revived once deleted; an update lands only on a live agent whose record is not newer).
    if isinstance(effect, CreateAgent):
        c.execute(
            "INSERT INTO agents (pubkey, name, sealed_key, owner, managed, depth, channel, settings,"
            " record_created_at, created_at, attestation) VALUES (?, ?, ?, ?, 1, ?, ?, ?, ?, ?, ?)"
            " ON CONFLICT (pubkey) DO NOTHING",
            (
                effect.pubkey,
                effect.name,
                effect.sealed_key,
                effect.owner,
                effect.depth,
                effect.channel,
                json.dumps(effect.settings, sort_keys=True),
                effect.record_created_at,
                now,
                json.dumps(list(effect.attestation)) if effect.attestation else None,
            ),
        )
    elif isinstance(effect, UpdateAgent):
        c.execute(
            "UPDATE agents SET name = ?, settings = ?, record_created_at = ?"
            " WHERE pubkey = ? AND deleted_at IS NULL AND record_created_at <= ?",
            (
                effect.name,
                json.dumps(effect.settings, sort_keys=True),
                effect.record_created_at,
                effect.pubkey,
                effect.record_created_at,
            ),
        )
    elif isinstance(effect, DeleteAgent):
        # Destroy the key; credentials bound to the agent stop working.
        c.execute(
            "UPDATE agents SET sealed_key = NULL, deleted_at = ? WHERE pubkey = ? AND deleted_at IS NULL",
            (now, effect.pubkey),
        )
        c.execute(
            "UPDATE credentials SET revoked_at = ? WHERE agent_pubkey = ? AND revoked_at IS NULL",
            (now, effect.pubkey),
        )
