"""Fixtures: a real PyPI nostr-relay (NIP-42 required, 64 KiB content) on a free loopback port.

The test binds and listens on 127.0.0.1:0 itself and hands the socket to the relay process, so the
port is known before the relay starts and early connections wait in the backlog: no readiness
polling, no port race. Without nostr-relay installed the relay tests skip, except under CI=true,
where they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any, Iterator

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def require_module(name: str, why: str) -> None:
    """Skip (or, under CI=true, fail) when an optional test dependency is missing."""
    if importlib.util.find_spec(name) is None:
        message = f"{why}: PyPI package providing {name!r} is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(message + " (required under CI=true)")
        pytest.skip(message)


_CONFIG = """
DEBUG: false
relay_name: relayd test relay
storage:
  sqlalchemy.url: sqlite+aiosqlite:///{db}
  num_concurrent_reqs: 10
  num_concurrent_adds: 1
  validators:
    - nostr_relay.validators.is_not_too_large
    - nostr_relay.validators.is_signed
    - nostr_relay.validators.is_recent
verification:
  nip05_verification: disabled
authentication:
  enabled: true
  authenticator_class: {authenticator}
  relay_urls:
    - {url}
  actions:
    save: w
    query: r
max_event_size: 140000
subscription_limit: 64
max_limit: 6000
message_timeout: 1800
logging:
  version: 1
  handlers:
    console:
      class: logging.StreamHandler
      stream: ext://sys.stderr
  root:
    level: WARNING
    handlers: [console]
"""


class NostrRelay:
    """A nostr-relay subprocess serving C{url}; stop/start keep the same port and database."""

    def __init__(self, workdir: str, authenticator: str = "tests.buzz.relay_auth.RequireAuth") -> None:
        self.workdir = workdir
        self.authenticator = authenticator
        self.members_file = os.path.join(workdir, "members")  # for RequireMembership
        self.db = os.path.join(workdir, "relay.sqlite3")
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self.port = 0
        self.log_path = os.path.join(workdir, "relay.log")

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def _listen(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(128)
        s.set_inheritable(True)
        self.port = s.getsockname()[1]
        return s

    def start(self) -> None:
        self.sock = self._listen()
        conf = os.path.join(self.workdir, "relay.yaml")
        with open(conf, "w") as f:
            f.write(_CONFIG.format(db=self.db, url=self.url, authenticator=self.authenticator))
        env = dict(os.environ)
        env["RELAYD_TEST_MEMBERS"] = self.members_file
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "nostr_relay_launcher.py"), conf, str(self.sock.fileno())],
            pass_fds=[self.sock.fileno()],
            stdout=log,
            stderr=log,
            cwd=self.workdir,
            env=env,
        )
        log.close()

    def stop(self) -> None:
        """Stop the relay and close the listening socket (connections are then refused)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
            self.proc = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def events(self, **filters: Any) -> list[dict[str, Any]]:
        """Read the relay's database directly (an independent view of what was stored)."""
        import sqlite3

        conn = sqlite3.connect(self.db)
        try:
            rows = conn.execute("SELECT id, created_at, kind, pubkey, tags, sig, content FROM events").fetchall()
        finally:
            conn.close()
        out = []
        for r in rows:
            ev = {
                "id": r[0].hex() if isinstance(r[0], bytes) else r[0],
                "created_at": r[1],
                "kind": r[2],
                "pubkey": r[3].hex() if isinstance(r[3], bytes) else r[3],
                "tags": json.loads(r[4]) if isinstance(r[4], (str, bytes)) else r[4],
                "sig": r[5].hex() if isinstance(r[5], bytes) else r[5],
                "content": r[6],
            }
            if all(ev.get(k) == v for k, v in filters.items()):
                out.append(ev)
        return out


def _running_relay() -> Iterator[NostrRelay]:
    require_module("nostr_relay", "needs a real Nostr relay")
    with tempfile.TemporaryDirectory(prefix="relayd-nostr-") as d:
        relay = NostrRelay(d)
        relay.start()
        try:
            yield relay
        finally:
            relay.stop()


@pytest.fixture(scope="session")
def nostr_relay() -> Iterator[NostrRelay]:
    """One relay for the session (tests use their own channels)."""
    yield from _running_relay()


@pytest.fixture
def private_relay() -> Iterator[NostrRelay]:
    """A relay of the test's own (for tests that stop and restart it)."""
    yield from _running_relay()


@pytest.fixture
def members_relay_for_class(request: pytest.FixtureRequest) -> Iterator[None]:
    """A relay of the class's test that admits members and identities their owners attest (NIP-OA)."""
    require_module("nostr_relay", "needs a real Nostr relay")
    with tempfile.TemporaryDirectory(prefix="relayd-nostr-") as d:
        relay = NostrRelay(d, authenticator="tests.buzz.relay_auth.RequireMembership")
        open(relay.members_file, "w").close()
        relay.start()
        request.cls.relay = relay
        try:
            yield
        finally:
            relay.stop()


@pytest.fixture
def relay_for_class(request: pytest.FixtureRequest, nostr_relay: NostrRelay) -> None:
    """Expose the session relay to trial TestCase classes as C{self.relay}."""
    request.cls.relay = nostr_relay


@pytest.fixture
def private_relay_for_class(request: pytest.FixtureRequest, private_relay: NostrRelay) -> None:
    request.cls.relay = private_relay
