"""L{SQLiteState}: the broker's stores on its SQLite database, served to the reactor.

Reads and most writes run inline on the reactor thread; what could block runs on one worker thread
with its own connection (see L{SQLiteState}).
"""

from __future__ import annotations

import sqlite3
from typing import Any, Callable, Sequence, TypeVar

from twisted.internet import defer, threads
from twisted.internet.interfaces import IReactorFromThreads
from twisted.python.threadpool import ThreadPool
from zope.interface import implementer

from relayd.buzz.core.state.effects import EffectLike
from relayd.buzz.core.state.interfaces import IAgentStore, ICredentialStore, IReceiptStore
from relayd.buzz.core.state.records import CONFLICT, NEW, RECEIPT_RETENTION, Agent, Claim, Credential, Receipt
from relayd.buzz.core.state.sqlite import StateDB

T = TypeVar("T")


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

    def _write(self, write: Callable[[StateDB], T]) -> "defer.Deferred[T]":
        """Run C{write(db)} inline on the reactor's connection, or on the worker's when the worker
        is busy (writes commit in order) or another process holds the write lock."""
        if self._queued == 0:
            try:
                result = write(self.db)
            except sqlite3.OperationalError as e:
                if not _locked(e):
                    return defer.fail()
            except Exception:
                return defer.fail()
            else:
                self._committed()
                return defer.succeed(result)
        self._queued += 1
        d = self._on_worker(lambda: write(self._worker()))

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

    def apply_effects(self, effects: Sequence[EffectLike]) -> "defer.Deferred[None]":
        return self._write(lambda db: db.apply_effects(effects)).addBoth(self._after_effects)

    def stamp(
        self, pubkey: str, digest: bytes, now: int, after: int = -1, strict: bool = False
    ) -> "defer.Deferred[int]":
        return self._write(lambda db: db.stamp(pubkey, digest, now, after, strict))

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
        return self._write(lambda db: db.store_plan(principal, request_id, digest, plan))

    def prune(self, now: int, retention: int = RECEIPT_RETENTION) -> "defer.Deferred[int]":
        """L{StateDB.prune} on the worker thread (a large delete must not stall the reactor)."""
        return self._on_worker(lambda: self._worker().prune(now, retention))

    def complete(
        self, principal: str, request_id: str, digest: bytes, response: bytes, effects: Sequence[EffectLike]
    ) -> "defer.Deferred[bytes]":
        d = self._write(lambda db: db.complete(principal, request_id, digest, response, effects))
        return d.addBoth(self._after_effects) if effects else d


def _locked(e: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the lock this one needs."""
    text = str(e).lower()
    return "locked" in text or "busy" in text
