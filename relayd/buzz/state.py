"""Broker state: credentials, agents and their sealed keys, idempotency receipts with pending events.

L{StateDB} is the synchronous SQLite core (also used by the admin command); L{SQLiteState} runs it
on one dedicated thread with one connection and returns Deferreds, behind the zope interfaces the
host uses (a Redis receipts store can implement L{IReceiptStore} later).

Durability: SQLite WAL with C{synchronous=NORMAL}: a committed transaction survives a crash of the
process (kill -9); power loss may lose the last commits.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, TypeVar

from twisted.internet import defer, threads
from twisted.python.threadpool import ThreadPool
from zope.interface import Interface, implementer

DB_FILE_NAME = "broker.sqlite3"
T = TypeVar("T")

_SCHEMA = """
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
"""


@dataclass(frozen=True)
class Credential:
    """What a credential is bound to (never the credential itself)."""

    id: str
    agent_pubkey: str
    channels: frozenset[str]
    actions: frozenset[str]
    created_at: int
    revoked: bool


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


@dataclass(frozen=True)
class Receipt:
    """An idempotency record: C{done} with its verdict bytes, or C{pending} with its stored plan."""

    digest: bytes
    state: str
    response: bytes | None
    plan: bytes | None


class ICredentialStore(Interface):
    def credential(hash: str) -> "defer.Deferred[Credential | None]":
        """The credential whose SHA-256 hex is C{hash}, revoked or not."""


class IAgentStore(Interface):
    def agent(pubkey: str) -> "defer.Deferred[Agent | None]":
        """The agent with this public key (deleted ones included)."""

    def agents_named(owner: str, name: str) -> "defer.Deferred[list[Agent]]":
        """Live agents of C{owner} called C{name}."""


class IReceiptStore(Interface):
    def receipt(principal: str, request_id: str) -> "defer.Deferred[Receipt | None]":
        """The receipt for (principal, requestId), if any."""

    def record(principal: str, request_id: str, digest: bytes, response: bytes) -> "defer.Deferred[None]":
        """Store a final verdict (replacing a pending plan)."""

    def store_plan(principal: str, request_id: str, digest: bytes, plan: bytes) -> "defer.Deferred[None]":
        """Durably store the signed events and effects of an execution before anything is sent."""

    def complete(
        principal: str, request_id: str, response: bytes, effects: list[dict[str, Any]]
    ) -> "defer.Deferred[None]":
        """Apply an execution's local effects and store its verdict, in one transaction."""


class StateDB:
    """The synchronous SQLite core. Not thread-safe: use from one thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=5000")
        self.conn.executescript(_SCHEMA)
        try:
            os.chmod(path, 0o600)
        except OSError:
            pass

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
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")
        return result

    # credentials

    def add_credential(self, hash: str, agent_pubkey: str, channels: Iterable[str], actions: Iterable[str]) -> str:
        cid = hash[:16]
        self._tx(
            lambda c: c.execute(
                "INSERT INTO credentials (hash, id, agent_pubkey, channels, actions, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (hash, cid, agent_pubkey, json.dumps(sorted(channels)), json.dumps(sorted(actions)), int(time.time())),
            )
        )
        return cid

    def credential(self, hash: str) -> Credential | None:
        row = self.conn.execute(
            "SELECT id, agent_pubkey, channels, actions, created_at, revoked_at FROM credentials WHERE hash = ?",
            (hash,),
        ).fetchone()
        return _credential(row) if row else None

    def credentials(self) -> list[Credential]:
        rows = self.conn.execute(
            "SELECT id, agent_pubkey, channels, actions, created_at, revoked_at FROM credentials ORDER BY created_at, id"
        ).fetchall()
        return [_credential(r) for r in rows]

    def revoke(self, credential_id: str | None = None, agent_pubkey: str | None = None) -> int:
        now = int(time.time())
        if credential_id is not None:
            q, arg = "UPDATE credentials SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", credential_id
        else:
            q, arg = "UPDATE credentials SET revoked_at = ? WHERE agent_pubkey = ? AND revoked_at IS NULL", agent_pubkey
        return self._tx(lambda c: c.execute(q, (now, arg)).rowcount)

    # agents

    def put_agent(self, agent: Agent) -> None:
        self._tx(lambda c: _put_agent(c, agent))

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

    def agents(self) -> list[Agent]:
        return [_agent(r) for r in self.conn.execute(_AGENT_SELECT + " ORDER BY created_at").fetchall()]

    # receipts

    def receipt(self, principal: str, request_id: str) -> Receipt | None:
        row = self.conn.execute(
            "SELECT digest, state, response, plan FROM receipts WHERE principal = ? AND request_id = ?",
            (principal, request_id),
        ).fetchone()
        return Receipt(bytes(row[0]), row[1], row[2], row[3]) if row else None

    def record(self, principal: str, request_id: str, digest: bytes, response: bytes) -> None:
        self._tx(
            lambda c: c.execute(
                "INSERT INTO receipts (principal, request_id, digest, state, response, created_at)"
                " VALUES (?, ?, ?, 'done', ?, ?) ON CONFLICT (principal, request_id) DO UPDATE SET"
                " state = 'done', response = excluded.response, plan = NULL",
                (principal, request_id, digest, response, int(time.time())),
            )
        )

    def store_plan(self, principal: str, request_id: str, digest: bytes, plan: bytes) -> None:
        self._tx(
            lambda c: c.execute(
                "INSERT INTO receipts (principal, request_id, digest, state, plan, created_at)"
                " VALUES (?, ?, ?, 'pending', ?, ?)",
                (principal, request_id, digest, plan, int(time.time())),
            )
        )

    def complete(self, principal: str, request_id: str, response: bytes, effects: list[dict[str, Any]]) -> None:
        def tx(c: sqlite3.Connection) -> None:
            for effect in effects:
                _apply_effect(c, effect)
            c.execute(
                "UPDATE receipts SET state = 'done', response = ?, plan = NULL WHERE principal = ? AND request_id = ?",
                (response, principal, request_id),
            )

        self._tx(tx)


_AGENT_SELECT = (
    "SELECT pubkey, name, sealed_key, owner, managed, depth, channel, settings, record_created_at, deleted_at"
    " FROM agents"
)


def _credential(row: Any) -> Credential:
    return Credential(
        id=row[0],
        agent_pubkey=row[1],
        channels=frozenset(json.loads(row[2])),
        actions=frozenset(json.loads(row[3])),
        created_at=row[4],
        revoked=row[5] is not None,
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
    )


def _put_agent(c: sqlite3.Connection, a: Agent) -> None:
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
            int(time.time()),
        ),
    )


def _apply_effect(c: sqlite3.Connection, effect: dict[str, Any]) -> None:
    op = effect["op"]
    if op == "create_agent":
        a = effect["agent"]
        _put_agent(
            c,
            Agent(
                pubkey=a["pubkey"],
                name=a["name"],
                sealed_key=bytes.fromhex(a["sealed_key"]),
                owner=a["owner"],
                managed=True,
                depth=a["depth"],
                channel=a["channel"],
                settings=a["settings"],
                record_created_at=a["record_created_at"],
                deleted=False,
            ),
        )
    elif op == "update_agent":
        c.execute(
            "UPDATE agents SET name = ?, settings = ?, record_created_at = ? WHERE pubkey = ?",
            (effect["name"], json.dumps(effect["settings"], sort_keys=True), effect["record_created_at"], effect["pubkey"]),
        )
    elif op == "delete_agent":
        # Destroy the key; credentials bound to the agent stop working.
        now = int(time.time())
        c.execute("UPDATE agents SET sealed_key = NULL, deleted_at = ? WHERE pubkey = ?", (now, effect["pubkey"]))
        c.execute(
            "UPDATE credentials SET revoked_at = ? WHERE agent_pubkey = ? AND revoked_at IS NULL",
            (now, effect["pubkey"]),
        )
    else:
        raise ValueError(f"unknown effect {op!r}")


@implementer(ICredentialStore, IAgentStore, IReceiptStore)
class SQLiteState:
    """L{StateDB} writes on one dedicated thread; lookups on a read-only connection in the caller's thread.

    Lookups are single-row primary-key reads; in WAL mode readers never wait for the writer, so
    they run inline (already-fired Deferreds) instead of paying a thread hop each: that hop was
    most of the host's CPU per replayed verdict.
    """

    def __init__(self, db: StateDB, reactor: Any) -> None:
        self.db = db
        self._reader = StateDB(db.path)
        self._reader.conn.execute("PRAGMA query_only=1")
        self._reactor = reactor
        self._pool = ThreadPool(minthreads=1, maxthreads=1, name="relayd-buzz-sqlite")

    @classmethod
    def in_dir(cls, state_dir: str, reactor: Any) -> "SQLiteState":
        return cls(StateDB.in_dir(state_dir), reactor)

    def _run(self, f: Callable[..., T], *args: Any) -> "defer.Deferred[T]":
        if not self._pool.started:  # started on first use, so an unstarted service leaves no thread
            self._pool.start()
        return threads.deferToThreadPool(self._reactor, self._pool, f, *args)

    def close(self) -> "defer.Deferred[None]":
        """Close the connection on its thread, then stop the thread."""
        self._reader.close()
        if not self._pool.started:
            self.db.close()
            return defer.succeed(None)
        d = self._run(self.db.close)

        def stop(result: Any) -> Any:
            self._pool.stop()
            return result

        return d.addBoth(stop)

    def credential(self, hash: str) -> "defer.Deferred[Credential | None]":
        return defer.maybeDeferred(self._reader.credential, hash)

    def agent(self, pubkey: str) -> "defer.Deferred[Agent | None]":
        return defer.maybeDeferred(self._reader.agent, pubkey)

    def agents_named(self, owner: str, name: str) -> "defer.Deferred[list[Agent]]":
        return defer.maybeDeferred(self._reader.agents_named, owner, name)

    def receipt(self, principal: str, request_id: str) -> "defer.Deferred[Receipt | None]":
        return defer.maybeDeferred(self._reader.receipt, principal, request_id)

    def record(self, principal: str, request_id: str, digest: bytes, response: bytes) -> "defer.Deferred[None]":
        return self._run(self.db.record, principal, request_id, digest, response)

    def store_plan(self, principal: str, request_id: str, digest: bytes, plan: bytes) -> "defer.Deferred[None]":
        return self._run(self.db.store_plan, principal, request_id, digest, plan)

    def complete(
        self, principal: str, request_id: str, response: bytes, effects: list[dict[str, Any]]
    ) -> "defer.Deferred[None]":
        return self._run(self.db.complete, principal, request_id, response, effects)
