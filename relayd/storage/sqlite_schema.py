"""Versioned SQLite schemas: numbered SQL files applied in order, the version kept in C{PRAGMA user_version}.

It knows no wing. A wing keeps its schema as package data, C{<package>/schema/NNN-what.sql}, numbered
from C{001} without gaps (listed in setup.cfg's package_data so the wheel carries them). L{upgrade}
applies the files a database lacks, each in its own C{BEGIN IMMEDIATE} transaction that also sets
C{user_version}: a step that fails leaves the database at the version before it, and processes that
share the file (several brokers on one state directory) apply each step once. A database whose
version is newer than the code's last file is refused (L{SchemaError}): it was written by a later
relayd, and this one would misread it. See docs/broker.md "Upgrades".
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources

SCHEMA_DIR = "schema"
_STEP_NAME = re.compile(r"^(\d{3})-[a-z0-9][a-z0-9-]*\.sql$")


class SchemaError(sqlite3.DatabaseError):
    """The database cannot be brought to this relayd's schema (too new, or a step failed).

    A C{sqlite3.DatabaseError}, so callers that already refuse an unusable database refuse this too.
    """


@dataclass(frozen=True)
class Step:
    """One schema file: after it, the database is at C{version}."""

    version: int
    name: str
    sql: str


def steps(package: str) -> list[Step]:
    """The schema files of C{package}, in order.

    @raise ValueError: a misnamed file or a gap in the numbering (a packaging bug, not a database's).
    """
    found = []
    for entry in resources.files(package).joinpath(SCHEMA_DIR).iterdir():
        if not entry.name.endswith(".sql"):
            continue
        match = _STEP_NAME.match(entry.name)
        if match is None:
            raise ValueError(f"{package}/{SCHEMA_DIR}/{entry.name}: not named NNN-description.sql")
        found.append(Step(int(match.group(1)), entry.name, entry.read_text(encoding="utf-8")))
    found.sort(key=lambda s: s.version)
    for expected, step in enumerate(found, 1):
        if step.version != expected:
            raise ValueError(f"{package}/{SCHEMA_DIR}: expected step {expected:03d}, found {step.name}")
    return found


def statements(sql: str) -> list[str]:
    """Split a script into whole statements (a trigger's C{BEGIN ... END} stays one).

    Each is run with C{execute}: C{executescript} would commit the step's transaction first.
    """
    out, pending = [], ""
    pieces = sql.split(";")
    for piece in pieces[:-1]:
        pending += piece + ";"
        if sqlite3.complete_statement(pending):  # not a ";" inside a string, comment or trigger body
            out.append(pending.strip())
            pending = ""
    pending += pieces[-1]
    if any(line.strip() and not line.strip().startswith("--") for line in pending.splitlines()):
        raise ValueError(f"incomplete SQL statement at the end of the script: {pending.strip()[:80]!r}")
    return out


def user_version(conn: sqlite3.Connection) -> int:
    """The schema version recorded in the database (0 for a new or pre-versioning one)."""
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def has_tables(conn: sqlite3.Connection) -> bool:
    """Whether the database holds any table of its own (SQLite's internal ones aside)."""
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' LIMIT 1"
    ).fetchone()
    return row is not None


def _label(conn: sqlite3.Connection) -> str:
    for row in conn.execute("PRAGMA database_list"):
        if row[1] == "main":
            return row[2] or "the in-memory database"
    return "the database"


def upgrade(
    conn: sqlite3.Connection,
    package: str,
    *,
    adopt: Callable[[sqlite3.Connection], int] | None = None,
    label: str | None = None,
) -> int:
    """Bring C{conn}'s database to the latest schema of C{package}; the version it is at.

    C{conn} must be in autocommit mode (C{isolation_level=None}), with a busy timeout for the
    write lock other processes may hold. C{adopt} recognises a database written before versioned
    schemas (version 0, yet with tables): called inside the transaction, it brings such a database
    to a known version without loss and returns that version (which is then recorded).

    @raise SchemaError: the database's version is newer than this code knows, or a step failed
        (the database stays at the version before that step).
    """
    known = steps(package)
    latest = known[-1].version if known else 0
    where = label or _label(conn)
    version = user_version(conn)
    _refuse_newer(version, latest, where)
    while version < latest:
        conn.execute("BEGIN IMMEDIATE")  # the write lock: another process may be upgrading too
        try:
            version = user_version(conn)  # re-read under the lock
            _refuse_newer(version, latest, where)
            if version >= latest:
                conn.execute("COMMIT")
                break
            if version == 0 and adopt is not None and has_tables(conn):
                reached = adopt(conn)
                if not 0 < reached <= latest:
                    raise ValueError(f"adopt returned version {reached}, outside 1..{latest}")
            else:
                step = known[version]  # known[i] leads to version i + 1
                for statement in statements(step.sql):
                    conn.execute(statement)
                reached = step.version
            conn.execute(f"PRAGMA user_version = {int(reached)}")
            conn.execute("COMMIT")
        except BaseException as e:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            if isinstance(e, (sqlite3.Error, ValueError)) and not isinstance(e, SchemaError):
                raise SchemaError(
                    f"{where}: schema upgrade from version {version} failed ({e}); the database is "
                    f"unchanged at version {version}"
                ) from e
            raise
        version = reached
    return version


def _refuse_newer(version: int, latest: int, where: str) -> None:
    if version > latest:
        raise SchemaError(
            f"{where} has schema version {version}, newer than this relayd knows (version {latest}): "
            "a later relayd wrote it. Run that relayd (or a later one) on it, or restore the backup "
            "taken before the upgrade"
        )
