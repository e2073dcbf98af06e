"""relayd.storage.sqlite_schema: numbered SQL files applied in order under PRAGMA user_version, one
transaction each; a newer database is refused; a failed step leaves the previous version."""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import tempfile
import uuid

from twisted.trial.unittest import TestCase

from relayd.storage import sqlite_schema
from relayd.storage.sqlite_schema import SchemaError

STEP_1 = "CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL);\n"
STEP_2 = """-- a column and a table
ALTER TABLE notes ADD COLUMN tag TEXT;
CREATE TABLE tags (name TEXT PRIMARY KEY);
"""


class SchemaCase(TestCase):
    def setUp(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="relayd-schema-")
        self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)
        sys.path.insert(0, self.dir)
        self.addCleanup(sys.path.remove, self.dir)
        self.db_path = os.path.join(self.dir, "state.sqlite3")

    def package(self, files: dict[str, str]) -> str:
        """A throwaway package holding C{schema/<name>} for each of C{files}."""
        name = "schema_probe_" + uuid.uuid4().hex
        os.makedirs(os.path.join(self.dir, name, "schema"))
        open(os.path.join(self.dir, name, "__init__.py"), "w").close()
        for filename, sql in files.items():
            with open(os.path.join(self.dir, name, "schema", filename), "w") as f:
                f.write(sql)
        self.addCleanup(sys.modules.pop, name, None)
        return name

    def connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.db_path, isolation_level=None)
        self.addCleanup(conn.close)
        return conn

    def columns(self, conn: sqlite3.Connection, table: str) -> list[str]:
        return [row[1] for row in conn.execute(f"PRAGMA table_info({table})")]


class Upgrade(SchemaCase):
    def test_fresh_database_gets_every_step_and_the_latest_version(self) -> None:
        package = self.package({"001-initial.sql": STEP_1, "002-tags.sql": STEP_2})
        conn = self.connect()
        self.assertEqual(sqlite_schema.upgrade(conn, package), 2)
        self.assertEqual(sqlite_schema.user_version(conn), 2)
        self.assertEqual(self.columns(conn, "notes"), ["id", "body", "tag"])
        self.assertEqual(self.columns(conn, "tags"), ["name"])

    def test_database_at_the_previous_version_is_upgraded_and_keeps_its_rows(self) -> None:
        conn = self.connect()
        self.assertEqual(sqlite_schema.upgrade(conn, self.package({"001-initial.sql": STEP_1})), 1)
        conn.execute("INSERT INTO notes (body) VALUES ('kept')")
        conn.close()

        conn = self.connect()
        package = self.package({"001-initial.sql": STEP_1, "002-tags.sql": STEP_2})
        self.assertEqual(sqlite_schema.upgrade(conn, package), 2)
        self.assertEqual(conn.execute("SELECT id, body, tag FROM notes").fetchall(), [(1, "kept", None)])

    def test_database_at_the_latest_version_is_left_alone(self) -> None:
        package = self.package({"001-initial.sql": STEP_1})
        conn = self.connect()
        sqlite_schema.upgrade(conn, package)
        before = conn.execute("PRAGMA schema_version").fetchone()
        self.assertEqual(sqlite_schema.upgrade(conn, package), 1)
        self.assertEqual(conn.execute("PRAGMA schema_version").fetchone(), before)

    def test_newer_database_is_refused_untouched(self) -> None:
        package = self.package({"001-initial.sql": STEP_1, "002-tags.sql": STEP_2})
        conn = self.connect()
        conn.execute("PRAGMA user_version = 3")
        error = self.assertRaises(SchemaError, sqlite_schema.upgrade, conn, package, label="broker.sqlite3")
        self.assertEqual(
            str(error),
            "broker.sqlite3 has schema version 3, newer than this relayd knows (version 2): a later relayd "
            "wrote it. Run that relayd (or a later one) on it, or restore the backup taken before the upgrade",
        )
        self.assertFalse(sqlite_schema.has_tables(conn))
        self.assertEqual(sqlite_schema.user_version(conn), 3)

    def test_the_newest_known_version_is_accepted(self) -> None:
        # The boundary: exactly the code's latest version is fine, one more is refused (above).
        package = self.package({"001-initial.sql": STEP_1, "002-tags.sql": STEP_2})
        conn = self.connect()
        conn.execute("PRAGMA user_version = 2")
        self.assertEqual(sqlite_schema.upgrade(conn, package), 2)
        self.assertFalse(sqlite_schema.has_tables(conn))  # nothing applied

    def test_a_step_that_fails_midway_leaves_the_previous_version(self) -> None:
        conn = self.connect()
        sqlite_schema.upgrade(conn, self.package({"001-initial.sql": STEP_1}))
        conn.execute("INSERT INTO notes (body) VALUES ('kept')")
        # 002's first statement succeeds, its second fails: neither may remain.
        broken = STEP_2 + "INSERT INTO missing_table VALUES (1);\n"
        package = self.package({"001-initial.sql": STEP_1, "002-tags.sql": broken})
        error = self.assertRaises(SchemaError, sqlite_schema.upgrade, conn, package, label="state")
        self.assertIn("state: schema upgrade from version 1 failed (no such table: missing_table)", str(error))
        self.assertIn("unchanged at version 1", str(error))
        self.assertEqual(sqlite_schema.user_version(conn), 1)
        self.assertEqual(self.columns(conn, "notes"), ["id", "body"])
        self.assertEqual(self.columns(conn, "tags"), [])
        self.assertEqual(conn.execute("SELECT body FROM notes").fetchall(), [("kept",)])
        self.assertFalse(conn.in_transaction)

    def test_steps_before_the_failing_one_stay_applied(self) -> None:
        package = self.package({"001-initial.sql": STEP_1, "002-tags.sql": STEP_2, "003-bad.sql": "SELECT nope FROM x;"})
        conn = self.connect()
        self.assertRaises(SchemaError, sqlite_schema.upgrade, conn, package)
        self.assertEqual(sqlite_schema.user_version(conn), 2)
        self.assertEqual(self.columns(conn, "tags"), ["name"])

    def test_another_connection_sees_no_half_applied_step(self) -> None:
        # The version is read again under the write lock: a step another process applied meanwhile
        # is not applied twice (ALTER TABLE ADD COLUMN would fail the second time).
        package = self.package({"001-initial.sql": STEP_1, "002-tags.sql": STEP_2})
        first, second = self.connect(), self.connect()
        self.assertEqual(sqlite_schema.user_version(second), 0)
        sqlite_schema.upgrade(first, package)
        self.assertEqual(sqlite_schema.upgrade(second, package), 2)
        self.assertEqual(self.columns(second, "notes"), ["id", "body", "tag"])


class Adopt(SchemaCase):
    def test_unversioned_database_with_tables_is_adopted(self) -> None:
        conn = self.connect()
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT NOT NULL)")
        conn.execute("INSERT INTO notes (body) VALUES ('old')")
        calls = []

        def adopt(c: sqlite3.Connection) -> int:
            calls.append(c.in_transaction)
            return 1

        package = self.package({"001-initial.sql": STEP_1, "002-tags.sql": STEP_2})
        self.assertEqual(sqlite_schema.upgrade(conn, package, adopt=adopt), 2)
        self.assertEqual(calls, [True])  # inside the transaction, instead of 001 (which would fail)
        self.assertEqual(conn.execute("SELECT body, tag FROM notes").fetchall(), [("old", None)])

    def test_empty_database_is_not_adopted(self) -> None:
        calls: list[int] = []
        conn = self.connect()
        package = self.package({"001-initial.sql": STEP_1})
        self.assertEqual(sqlite_schema.upgrade(conn, package, adopt=lambda c: calls.append(1) or 1), 1)
        self.assertEqual(calls, [])

    def test_adoption_that_fails_leaves_version_0(self) -> None:
        conn = self.connect()
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY)")

        def adopt(c: sqlite3.Connection) -> int:
            c.execute("ALTER TABLE notes ADD COLUMN body TEXT")
            c.execute("ALTER TABLE notes ADD COLUMN body TEXT")  # duplicate column: fails
            return 1

        package = self.package({"001-initial.sql": STEP_1})
        self.assertRaises(SchemaError, sqlite_schema.upgrade, conn, package, adopt=adopt)
        self.assertEqual(sqlite_schema.user_version(conn), 0)
        self.assertEqual(self.columns(conn, "notes"), ["id"])


class Files(SchemaCase):
    def test_a_gap_in_the_numbering_is_a_packaging_error(self) -> None:
        package = self.package({"001-initial.sql": STEP_1, "003-tags.sql": STEP_2})
        error = self.assertRaises(ValueError, sqlite_schema.steps, package)
        self.assertIn("expected step 002, found 003-tags.sql", str(error))

    def test_a_misnamed_file_is_a_packaging_error(self) -> None:
        package = self.package({"001-initial.sql": STEP_1, "2-tags.sql": STEP_2})
        self.assertRaises(ValueError, sqlite_schema.steps, package)

    def test_statements_keep_a_trigger_whole_and_skip_comments(self) -> None:
        sql = (
            "-- leading comment\n"
            "CREATE TABLE a (x);\n"
            "CREATE TRIGGER t AFTER INSERT ON a BEGIN\n  UPDATE a SET x = 1;\n  SELECT 1;\nEND;\n"
            "CREATE TABLE b (y TEXT DEFAULT ';'); CREATE TABLE c (z);\n"
            "-- trailing comment\n"
        )
        parts = sqlite_schema.statements(sql)
        self.assertEqual(len(parts), 4)
        self.assertEqual(parts[2:], ["CREATE TABLE b (y TEXT DEFAULT ';');", "CREATE TABLE c (z);"])
        self.assertTrue(parts[1].startswith("CREATE TRIGGER") and parts[1].endswith("END;"))

    def test_an_unfinished_statement_is_an_error(self) -> None:
        self.assertRaises(ValueError, sqlite_schema.statements, "CREATE TABLE a (x);\nCREATE TABLE b (y)\n")
