"""The broker's SQLite state across an upgrade (issue 12 acceptance 4): a database written by a
previous schema (relayd before versioned schemas: user_version 0, the inline DDL below, in each of
its three shapes) is opened by this relayd, upgraded in place, and its credentials, sealed keys,
agents, receipts, receipt counts and event clocks read back as the broker stores them; a database
from a later relayd is refused."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import sqlite3
import tempfile

from twisted.trial.unittest import TestCase

from relayd.base.clock import Timekeeper
from relayd.base.config import ConfigError, resolve
from relayd.buzz.config import SETTINGS
from relayd.buzz.core.keys import Custody
from relayd.buzz.core.state import DB_FILE_NAME, STAMP_DIGEST_BYTES, Credential, StateDB
from relayd.buzz.service import make_service
from relayd.cli import broker as admin
from relayd.storage import sqlite_schema
from relayd.storage.sqlite_schema import SchemaError
from tests.support.cases import cases, expand

# The schema exactly as relayd wrote it before versioned schemas (relayd/buzz/core/state/'s inline
# _SCHEMA, then the columns and the receipt counts it added when missing). Never edit: it is the past.
PREVIOUS_SCHEMA = """
CREATE TABLE IF NOT EXISTS credentials (
    hash TEXT PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    agent_pubkey TEXT NOT NULL,
    channels TEXT NOT NULL,
    actions TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    revoked_at INTEGER
);
CREATE INDEX IF NOT EXISTS credentials_agent ON credentials(agent_pubkey);
CREATE TABLE IF NOT EXISTS agents (
    pubkey TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    sealed_key BLOB,
    owner TEXT,
    managed INTEGER NOT NULL DEFAULT 0,
    depth INTEGER NOT NULL DEFAULT 0,
    channel TEXT,
    settings TEXT NOT NULL DEFAULT '{}',
    record_created_at INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    deleted_at INTEGER
);
CREATE INDEX IF NOT EXISTS agents_owner_name ON agents(owner, name);
CREATE TABLE IF NOT EXISTS receipts (
    principal TEXT NOT NULL,
    request_id TEXT NOT NULL,
    digest BLOB NOT NULL,
    state TEXT NOT NULL,
    response BLOB,
    plan BLOB,
    created_at INTEGER NOT NULL,
    PRIMARY KEY (principal, request_id)
);
CREATE INDEX IF NOT EXISTS receipts_created ON receipts(created_at);
CREATE TABLE IF NOT EXISTS clocks (
    pubkey TEXT PRIMARY KEY,
    second INTEGER NOT NULL,
    digests BLOB NOT NULL
);
"""
# The last unversioned relayd (the per-agent receipt cap) added one index to _SCHEMA ...
PREVIOUS_SCHEMA_COUNTED = PREVIOUS_SCHEMA.replace(
    "CREATE INDEX IF NOT EXISTS receipts_created ON receipts(created_at);\n",
    "CREATE INDEX IF NOT EXISTS receipts_created ON receipts(created_at);\n"
    "CREATE INDEX IF NOT EXISTS receipts_principal_created ON receipts(principal, created_at);\n",
)
# ... and made these in one transaction when receipt_counts was missing, before the columns.
PREVIOUS_RECEIPT_COUNTS = (
    "CREATE TABLE receipt_counts (principal TEXT PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID",
    "INSERT INTO receipt_counts SELECT principal, COUNT(*) FROM receipts GROUP BY principal",
    "CREATE TRIGGER receipts_counted AFTER INSERT ON receipts BEGIN"
    " INSERT INTO receipt_counts VALUES (new.principal, 1) ON CONFLICT (principal) DO UPDATE SET n = n + 1;"
    " END",
    "CREATE TRIGGER receipts_uncounted AFTER DELETE ON receipts BEGIN"
    " UPDATE receipt_counts SET n = n - 1 WHERE principal = old.principal;"
    " DELETE FROM receipt_counts WHERE principal = old.principal AND n <= 0;"
    " END",
)
PREVIOUS_COLUMNS = """
ALTER TABLE agents ADD COLUMN attestation TEXT;
ALTER TABLE credentials ADD COLUMN expires_at INTEGER;
"""
# The shapes an unversioned state file can have: the first schema; with the two columns; with the
# receipt counts too (the last unversioned relayd). Adopted at version 1, 1 and 2.
FIRST, COLUMNS, COUNTED = "first", "columns", "counted"

OWNER = "0" * 63 + "1"
AGENT = "a" * 64
CHANNEL = "b2c38ca8-9ec3-411e-bab5-f9deab34d52e"
CREDENTIAL_HASH = hashlib.sha256(b"bzh_previous-schema-credential").hexdigest()
SECRET = bytes(range(32))
KEK = bytes(range(32, 64))
NOW = 1_790_000_000
DIGEST = hashlib.sha256(b"request bytes").digest()
VERDICT = b'{"status":"succeeded","action":"message.post","requestId":"r-done"}'
PLAN = b'{"events":[{"id":"e1"}],"effects":[]}'
STAMP = b"\x07" * STAMP_DIGEST_BYTES


def previous_database(path: str, era: str = COUNTED) -> bytes:
    """A state file as relayd wrote it before versioned schemas, with one row of each kind; the sealed key."""
    sealed = Custody(KEK).seal(SECRET, AGENT)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(PREVIOUS_SCHEMA_COUNTED if era == COUNTED else PREVIOUS_SCHEMA)
    if era == COUNTED:
        conn.execute("BEGIN IMMEDIATE")
        for statement in PREVIOUS_RECEIPT_COUNTS:
            conn.execute(statement)
        conn.execute("COMMIT")
    if era != FIRST:
        conn.executescript(PREVIOUS_COLUMNS)
    conn.execute(
        "INSERT INTO credentials (hash, id, agent_pubkey, channels, actions, created_at) VALUES (?, ?, ?, ?, ?, ?)",
        (CREDENTIAL_HASH, CREDENTIAL_HASH[:16], AGENT, json.dumps([CHANNEL]),
         json.dumps(["channel.read", "message.post"]), NOW),
    )  # fmt: skip
    conn.execute(
        "INSERT INTO agents (pubkey, name, sealed_key, owner, managed, depth, channel, settings,"
        " record_created_at, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (AGENT, "worker", sealed, OWNER, 1, 1, CHANNEL, json.dumps({"model": "m"}), NOW, NOW),
    )
    if era != FIRST:
        conn.execute("UPDATE credentials SET expires_at = ? WHERE hash = ?", (NOW + 3600, CREDENTIAL_HASH))
        conn.execute("UPDATE agents SET attestation = ? WHERE pubkey = ?", (json.dumps(["auth", OWNER, "", "sig"]), AGENT))
    conn.execute(
        "INSERT INTO receipts (principal, request_id, digest, state, response, created_at) VALUES (?, ?, ?, 'done', ?, ?)",
        (AGENT, "r-done", DIGEST, VERDICT, NOW),
    )
    conn.execute(
        "INSERT INTO receipts (principal, request_id, digest, state, plan, created_at) VALUES (?, ?, ?, 'pending', ?, ?)",
        (AGENT, "r-pending", DIGEST, PLAN, NOW),
    )
    conn.execute(
        "INSERT INTO receipts (principal, request_id, digest, state, created_at) VALUES (?, ?, ?, 'spent', ?)",
        (AGENT, "r-read", DIGEST, NOW),
    )
    conn.execute(
        "INSERT INTO receipts (principal, request_id, digest, state, response, created_at) VALUES (?, ?, ?, 'done', ?, ?)",
        (OWNER, "r-owner", DIGEST, VERDICT, NOW),
    )
    conn.execute("INSERT INTO clocks (pubkey, second, digests) VALUES (?, ?, ?)", (AGENT, NOW, STAMP))
    assert sqlite_schema.user_version(conn) == 0
    conn.close()
    return sealed


def counts(db: StateDB) -> list[tuple[str, int]]:
    return db.conn.execute("SELECT principal, n FROM receipt_counts ORDER BY principal").fetchall()


def layout(path: str) -> dict[str, list[tuple]]:
    """Every table's columns and every index, as SQLite reports them."""
    conn = sqlite3.connect(path)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        out = {t: [tuple(r[1:]) for r in conn.execute(f"PRAGMA table_info({t})")] for t in tables}
        out["indexes and triggers"] = conn.execute(
            "SELECT type, name, tbl_name FROM sqlite_master WHERE type IN ('index', 'trigger') ORDER BY name"
        ).fetchall()
        return out
    finally:
        conn.close()


LATEST = 2  # relayd/buzz/schema/002-receipt-counts.sql


@expand
class Upgrade(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="relayd-schema-upgrade-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        self.path = os.path.join(self.dir, DB_FILE_NAME)

    def open(self) -> StateDB:
        db = StateDB(self.path)
        self.addCleanup(db.close)
        return db

    def assert_rows_read_back(self, db: StateDB, sealed: bytes, expires_at: int | None) -> None:
        self.assertEqual(
            db.credential(CREDENTIAL_HASH),
            Credential(
                id=CREDENTIAL_HASH[:16], agent_pubkey=AGENT, channels=frozenset([CHANNEL]),
                actions=frozenset(["channel.read", "message.post"]), created_at=NOW, revoked=False,
                expires_at=expires_at,
            ),
        )  # fmt: skip
        agent = db.agent(AGENT)
        assert agent is not None
        self.assertEqual((agent.name, agent.owner, agent.managed, agent.depth), ("worker", OWNER, True, 1))
        self.assertEqual((agent.channel, agent.settings, agent.record_created_at), (CHANNEL, {"model": "m"}, NOW))
        self.assertEqual(agent.sealed_key, sealed)
        self.assertEqual(Custody(KEK).open(agent.sealed_key, AGENT), SECRET)  # the key still opens
        self.assertEqual([a.pubkey for a in db.agents_named(OWNER, "worker")], [AGENT])
        self.assertEqual(db.children(OWNER), 1)

        done = db.receipt(AGENT, "r-done")
        assert done is not None
        self.assertEqual((done.digest, done.state, done.response, done.plan), (DIGEST, "done", VERDICT, None))
        pending = db.receipt(AGENT, "r-pending")
        assert pending is not None
        self.assertEqual((pending.digest, pending.state, pending.response, pending.plan), (DIGEST, "pending", None, PLAN))
        read = db.receipt(AGENT, "r-read")
        assert read is not None
        self.assertEqual((read.digest, read.state, read.response), (DIGEST, "spent", None))
        # The event clock: the same event in the same second moves on a second; another does not.
        self.assertEqual(db.stamp(AGENT, STAMP, NOW), NOW + 1)
        self.assertEqual(db.stamp(AGENT, b"\x08" * STAMP_DIGEST_BYTES, NOW), NOW + 1)

    @cases(first=FIRST, columns=COLUMNS, counted=COUNTED)
    def test_previous_schema_is_upgraded_and_its_rows_read_back(self, era: str) -> None:
        sealed = previous_database(self.path, era)
        db = self.open()
        self.assertEqual(sqlite_schema.user_version(db.conn), LATEST)
        self.assert_rows_read_back(db, sealed, expires_at=None if era == FIRST else NOW + 3600)
        attestation = None if era == FIRST else ("auth", OWNER, "", "sig")
        self.assertEqual(db.agent(AGENT).attestation, attestation)  # type: ignore[union-attr]
        # The receipts present are counted (by 002, or by the relayd that wrote the file).
        self.assertEqual(counts(db), [(OWNER, 1), (AGENT, 3)])

    @cases(columns=COLUMNS, counted=COUNTED)
    def test_upgraded_database_takes_new_writes_and_reopens(self, era: str) -> None:
        previous_database(self.path, era)
        db = self.open()
        db.now = lambda: NOW + 5
        db.store_plan(AGENT, "r-new", DIGEST, PLAN)
        self.assertEqual(db.complete(AGENT, "r-new", DIGEST, VERDICT, []), VERDICT)
        self.assertEqual(db.complete(AGENT, "r-pending", DIGEST, VERDICT, []), VERDICT)
        self.assertEqual(counts(db), [(OWNER, 1), (AGENT, 4)])  # the triggers count new receipts
        self.assertEqual(db.prune(NOW + 5 + 10, retention=10), 4)  # the old receipts; r-new stays
        self.assertEqual(counts(db), [(AGENT, 1)])
        db.close()
        again = self.open()
        self.assertEqual(sqlite_schema.user_version(again.conn), LATEST)
        self.assertEqual(again.receipt(AGENT, "r-new").state, "done")  # type: ignore[union-attr]

    @cases(first=FIRST, columns=COLUMNS, counted=COUNTED)
    def test_upgraded_layout_is_the_fresh_layout(self, era: str) -> None:
        # Adopting an old file gives exactly what a fresh start creates: the same columns, types,
        # defaults and order, the same indexes and triggers; so the next step can build on either.
        previous_database(self.path, era)
        self.open().close()
        fresh = os.path.join(self.dir, "fresh.sqlite3")
        StateDB(fresh).close()
        self.assertEqual(layout(self.path), layout(fresh))

    def test_version_1_database_gets_the_receipt_counts(self) -> None:
        # A database recorded at version 1 is upgraded by 002 alone, its receipts counted.
        previous_database(self.path, COLUMNS)  # the tables of 001-initial.sql exactly
        conn = sqlite3.connect(self.path)
        conn.execute("PRAGMA user_version = 1")
        conn.close()
        db = self.open()
        self.assertEqual(sqlite_schema.user_version(db.conn), LATEST)
        self.assertEqual(counts(db), [(OWNER, 1), (AGENT, 3)])

    def test_fresh_database_gets_the_latest_version(self) -> None:
        db = self.open()
        self.assertEqual(sqlite_schema.steps("relayd.buzz")[-1].version, LATEST)
        self.assertEqual(sqlite_schema.user_version(db.conn), LATEST)
        self.assertEqual(counts(db), [])

    def test_database_from_a_later_relayd_is_refused(self) -> None:
        latest = sqlite_schema.steps("relayd.buzz")[-1].version
        StateDB(self.path).close()
        conn = sqlite3.connect(self.path)
        conn.execute(f"PRAGMA user_version = {latest + 1}")
        conn.close()
        error = self.assertRaises(SchemaError, StateDB, self.path)
        self.assertEqual(
            str(error),
            f"{self.path} has schema version {latest + 1}, newer than this relayd knows (version {latest}): "
            "a later relayd wrote it. Run that relayd (or a later one) on it, or restore the backup taken "
            "before the upgrade",
        )

    def test_later_database_refused_by_the_broker_and_the_admin_command(self) -> None:
        StateDB(self.path).close()
        conn = sqlite3.connect(self.path)
        conn.execute("PRAGMA user_version = 999")
        conn.close()
        with open(os.path.join(self.dir, "kek"), "w") as f:
            f.write(KEK.hex())
        settings = resolve(SETTINGS, {
            "broker-nostr-relay": "ws://127.0.0.1:1", "broker-state-dir": self.dir,
            "broker-kek-file": os.path.join(self.dir, "kek"),
        }, {})  # fmt: skip
        error = self.assertRaises(ConfigError, make_service, settings, None, Timekeeper(None))  # type: ignore[arg-type]
        self.assertIn("cannot open state", str(error))
        self.assertIn("has schema version 999, newer than this relayd knows", str(error))

        out, err = io.StringIO(), io.StringIO()
        self.assertEqual(admin.main(["list", "--state-dir", self.dir], out, err), 1)
        self.assertIn("has schema version 999, newer than this relayd knows", err.getvalue())
        self.assertNotIn("Traceback", err.getvalue())
