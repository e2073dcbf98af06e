"""A real Nostr relay (PyPI nostr-relay, NIP-42 on) for the broker's tests (the fault proxy in front
of it is tests/support/fault_relay.py).

    relay = shared_nostr_relay()                 # one relay for the whole test process (own channels)
    relay = start_nostr_relay(self)              # a relay of the test's own, stopped by addCleanup
    relay = start_nostr_relay(self, authenticator=REQUIRE_MEMBERSHIP)

The test binds and listens on 127.0.0.1:0 itself and hands the socket to the relay process, so the
port is known before the relay starts and early connections wait in the backlog: no readiness
polling, no port race. The relay process exits when the test process's end of its stdin closes, so
a killed test run leaves no relay behind. Without nostr-relay installed the relay tests skip
(tests/support/skips.py), except under CI=true, where they fail.

Run as C{python -m tests.support.nostr CONFIG FD}, this module is the relay process itself; the
NIP-42 authenticators the relay's configuration names (L{REQUIRE_AUTH}, L{REQUIRE_MEMBERSHIP}) are
defined lazily (module C{__getattr__}) because only the relay process has nostr-relay imported.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
from typing import Any

from tests.support.skips import require_module

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REQUIRE_AUTH = "tests.support.nostr.RequireAuth"
REQUIRE_MEMBERSHIP = "tests.support.nostr.RequireMembership"

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
    """A nostr-relay subprocess serving C{url}; stop/start keep the same port and database.

    C{members_file} lists (one public key a line) who a L{REQUIRE_MEMBERSHIP} relay admits."""

    def __init__(self, workdir: str, authenticator: str = REQUIRE_AUTH) -> None:
        self.workdir = workdir
        self.authenticator = authenticator
        self.members_file = os.path.join(workdir, "members")
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
        """Start the relay (on the same port as before after a L{stop})."""
        self.sock = self._listen()
        conf = os.path.join(self.workdir, "relay.yaml")
        with open(conf, "w") as f:
            f.write(_CONFIG.format(db=self.db, url=self.url, authenticator=self.authenticator))
        if not os.path.exists(self.members_file):
            open(self.members_file, "w").close()
        env = dict(os.environ)
        env["RELAYD_TEST_MEMBERS"] = self.members_file
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.nostr", conf, str(self.sock.fileno())],
                pass_fds=[self.sock.fileno()],
                stdin=subprocess.PIPE,  # closed by the test process (or its death): the relay exits
                stdout=log,
                stderr=log,
                cwd=self.workdir,
                env=env,
            )

    def stop(self) -> None:
        """Stop the relay and close the listening socket (connections are then refused)."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc = None
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def events(self, **filters: Any) -> list[dict[str, Any]]:
        """Read the relay's database directly (an independent view of what was stored)."""
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


def new_nostr_relay(authenticator: str = REQUIRE_AUTH) -> NostrRelay:
    """A started relay in a fresh temporary directory; the caller stops it and removes C{workdir}.

    Skips (fails under CI=true) without nostr-relay."""
    require_module("nostr_relay", "needs a real Nostr relay")
    relay = NostrRelay(tempfile.mkdtemp(prefix="relayd-nostr-"), authenticator)
    relay.start()
    return relay


def _discard(relay: NostrRelay) -> None:
    relay.stop()
    shutil.rmtree(relay.workdir, ignore_errors=True)


def start_nostr_relay(testcase: Any, authenticator: str = REQUIRE_AUTH) -> NostrRelay:
    """A relay of the test's own (for tests that stop and restart it, or need another authenticator),
    stopped and removed by C{testcase.addCleanup}. Call from setUp or a test method."""
    relay = new_nostr_relay(authenticator)
    testcase.addCleanup(_discard, relay)
    return relay


_shared: NostrRelay | None = None


def shared_nostr_relay() -> NostrRelay:
    """The test process's one L{REQUIRE_AUTH} relay, started on first use and stopped at exit.

    Tests that share it use channels of their own and never stop it. Both runners call it from
    setUp; its startup cost is paid once per run, as the former session-wide pytest fixture did."""
    global _shared
    if _shared is None:
        _shared = new_nostr_relay()
        atexit.register(_discard, _shared)
    return _shared


def _attested(tag: list[str], agent: str) -> bool:
    """NIP-OA, checked here independently of relayd: BIP-340 by the owner over
    SHA-256("nostr:agent-auth:" + agent + ":" + conditions)."""
    from coincurve import PublicKeyXOnly

    _, owner, conditions, sig = tag
    if owner == agent:
        return False
    digest = hashlib.sha256(f"nostr:agent-auth:{agent}:{conditions}".encode()).digest()
    try:
        return bool(PublicKeyXOnly(bytes.fromhex(owner)).verify(bytes.fromhex(sig), digest))
    except ValueError:
        return False


def _authenticators() -> dict[str, type]:
    from nostr_relay.auth import Authenticator

    class RequireAuth(Authenticator):  # type: ignore[misc]
        """With actions C{save: w, query: r}, only identities that completed AUTH get C{r}/C{w}."""

        async def authenticate(self, auth_event_json: dict[str, Any], challenge: str = "") -> dict[str, Any]:
            token = await super().authenticate(auth_event_json, challenge)
            token["roles"] = {"a", "r", "w"}
            return token

    class RequireMembership(Authenticator):  # type: ignore[misc]
        """A relay for members only, as a Buzz community relay is: an identity listed in the file named
        by C{RELAYD_TEST_MEMBERS} may read and write; any other identity only when its AUTH event
        carries a valid owner attestation (NIP-OA C{auth} tag) by a member."""

        async def authenticate(self, auth_event_json: dict[str, Any], challenge: str = "") -> dict[str, Any]:
            token = await super().authenticate(auth_event_json, challenge)
            with open(os.environ["RELAYD_TEST_MEMBERS"]) as f:
                members = {line.strip() for line in f if line.strip()}
            pubkey = auth_event_json.get("pubkey")
            admitted = pubkey in members or any(
                t[:1] == ["auth"] and len(t) == 4 and t[1] in members and _attested(t, str(pubkey))
                for t in auth_event_json.get("tags", [])
            )
            token["roles"] = {"a", "r", "w"} if admitted else set()
            return token

    return {"RequireAuth": RequireAuth, "RequireMembership": RequireMembership}


_AUTHENTICATORS: dict[str, type] = {}


def __getattr__(name: str) -> Any:
    # The relay loads its authenticator_class by dotted name; only the relay process needs it.
    if name in ("RequireAuth", "RequireMembership"):
        if not _AUTHENTICATORS:
            _AUTHENTICATORS.update(_authenticators())
        return _AUTHENTICATORS[name]
    raise AttributeError(name)


def _exit_when_stdin_closes() -> None:
    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    """Run nostr-relay on the already-listening socket FD (no readiness polling): CONFIG FD."""
    conf, fd = sys.argv[1], int(sys.argv[2])
    _exit_when_stdin_closes()
    from nostr_relay.config import Config

    Config.load(conf)
    import nostr_relay
    from alembic import config as alembic_config

    ini = os.path.join(os.path.dirname(nostr_relay.__file__), "alembic.ini")
    alembic_config.main([f"-c{ini}", "upgrade", "head"])
    from nostr_relay import monkeypatch

    monkeypatch.monkey()
    import uvicorn
    from nostr_relay.web import create_app

    app = create_app(conf)
    uvicorn.run(app, fd=fd, log_level="warning", lifespan="on")


if __name__ == "__main__":
    main()
