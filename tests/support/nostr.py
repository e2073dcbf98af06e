"""A real Nostr relay (PyPI nostr-relay, NIP-42 on) for the broker's tests, and a fault proxy in front of it.

    relay = shared_nostr_relay()                 # one relay for the whole test process (own channels)
    relay = start_nostr_relay(self)              # a relay of the test's own, stopped by addCleanup
    relay = start_nostr_relay(self, authenticator=REQUIRE_MEMBERSHIP)
    proxy = start_fault_relay(self, relay.url)   # scripted faults; stopped by addCleanup

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
from dataclasses import dataclass, field
from typing import Any, Callable

from autobahn.twisted.websocket import (
    WebSocketClientFactory,
    WebSocketClientProtocol,
    WebSocketServerFactory,
    WebSocketServerProtocol,
)
from twisted.internet import defer, endpoints

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


# --- the fault proxy ----------------------------------------------------------------------------
#
# A scriptable fault-injecting WebSocket proxy in front of the real relay. The relay behind it holds
# the truth: every event the proxy lets through is stored or refused by the real relay, and tests
# compare the broker's verdicts with the relay's database. The proxy only adds the faults a
# well-behaved relay does not produce on demand:
#
#  - refuse: answer ["OK", id, false, message] without forwarding (the relay never sees it);
#  - drop_ok: forward the EVENT, swallow the relay's OK (the event is stored, nobody is told);
#  - close_before: close the client's connection instead of forwarding;
#  - close_after: forward, and close the client's connection when the relay's OK arrives;
#  - throttle: from this EVENT on, the client's connection forwards nothing and answers nothing
#    (a relay throttling one identity's connection); a new connection is served normally.
#
# Rules match EVENTs in arrival order; each fires `times` times (then the next matching rule, or plain
# forwarding). AUTH, REQ and CLOSE always pass, so NIP-42 is the real relay's.

FAULT_ACTIONS = frozenset({"pass", "refuse", "drop_ok", "close_before", "close_after", "throttle"})


@dataclass
class Rule:
    """What to do with EVENTs that C{match}: C{action} (one of L{FAULT_ACTIONS}), at most C{times} times."""

    action: str
    match: Callable[[dict[str, Any]], bool] = lambda ev: True
    times: int = 1
    message: str = "blocked: refused by the fault script"
    fired: int = 0

    def __post_init__(self) -> None:
        assert self.action in FAULT_ACTIONS, self.action


def kind(k: int) -> Callable[[dict[str, Any]], bool]:
    """A matcher for events of kind C{k}."""
    return lambda ev: ev.get("kind") == k


@dataclass
class Script:
    """The proxy's rules, and every EVENT that reached it."""

    rules: list[Rule] = field(default_factory=list)
    seen: list[dict[str, Any]] = field(default_factory=list)

    def decide(self, ev: dict[str, Any]) -> Rule | None:
        self.seen.append(ev)
        for rule in self.rules:
            if rule.fired < rule.times and rule.match(ev):
                rule.fired += 1
                return rule
        return None


def _reactor() -> Any:
    from twisted.internet import reactor

    return reactor


class _Upstream(WebSocketClientProtocol):
    down: _Downstream

    def onOpen(self) -> None:
        self.down.upstream_open(self)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        self.down.from_relay(payload)

    def onClose(self, wasClean: bool, code: Any, reason: Any) -> None:
        self.down.upstream_closed()

class _Downstream(WebSocketServerProtocol):
    factory: Any

    def onConnect(self, request: Any) -> Any:
        # The client's handshake completes only once the relay's is done, so the relay's AUTH
        # challenge reaches the client as promptly as it would without the proxy.
        self.up: _Upstream | None = None
        self.opened = False
        self.early: list[bytes] = []  # relay messages before the client's side is open
        self.swallow: set[str] = set()  # event ids whose OK is not passed on
        self.close_on_ok: set[str] = set()
        self.throttled = False
        self.factory.connections.append(self)
        self.ready: defer.Deferred[None] = defer.Deferred()
        f = WebSocketClientFactory(self.factory.upstream_url)
        down = self

        class P(_Upstream):
            pass

        P.down = down  # type: ignore[misc]
        f.protocol = P
        endpoints.TCP4ClientEndpoint(_reactor(), "127.0.0.1", self.factory.upstream_port).connect(f).addErrback(
            lambda _: self.ready.called or self.ready.errback(ConnectionRefusedError("relay unreachable"))
        )
        return self.ready.addCallback(lambda _: None)

    def onOpen(self) -> None:
        self.opened = True
        early, self.early = self.early, []
        for m in early:
            self.sendMessage(m)

    def upstream_open(self, up: _Upstream) -> None:
        self.up = up
        if not self.ready.called:
            self.ready.callback(None)

    def upstream_closed(self) -> None:
        self.sendClose()

    def _forward(self, payload: bytes) -> None:
        if self.up is not None:
            self.up.sendMessage(payload)

    def onMessage(self, payload: bytes, isBinary: bool) -> None:
        if self.throttled:
            return
        try:
            msg = json.loads(payload)
        except ValueError:
            msg = None
        if not (isinstance(msg, list) and msg and msg[0] == "EVENT" and isinstance(msg[1], dict)):
            self._forward(payload)
            return
        ev = msg[1]
        rule = self.factory.script.decide(ev)
        action = rule.action if rule is not None else "pass"
        eid = str(ev.get("id"))
        if action == "refuse":
            assert rule is not None
            self.sendMessage(json.dumps(["OK", eid, False, rule.message]).encode())
        elif action == "close_before":
            self.dropConnection(abort=True)
        elif action == "throttle":
            self.throttled = True
        else:
            if action == "drop_ok":
                self.swallow.add(eid)
            elif action == "close_after":
                self.close_on_ok.add(eid)
            self._forward(payload)

    def from_relay(self, payload: bytes) -> None:
        try:
            msg = json.loads(payload)
        except ValueError:
            msg = None
        if isinstance(msg, list) and len(msg) > 1 and msg[0] == "OK":
            eid = str(msg[1])
            if eid in self.close_on_ok:
                self.dropConnection(abort=True)
                return
            if eid in self.swallow:
                return
        if self.throttled:
            return
        if self.opened:
            self.sendMessage(payload)
        else:
            self.early.append(payload)

    def onClose(self, wasClean: bool, code: Any, reason: Any) -> None:
        up = getattr(self, "up", None)
        if up is not None:
            up.dropConnection(abort=True)

class FaultRelay(WebSocketServerFactory):
    """The proxy: C{start()} listens on 127.0.0.1:0; C{proxy_url} is what the broker connects to."""

    protocol = _Downstream

    def __init__(self, upstream_url: str) -> None:
        super().__init__()
        self.upstream_url = upstream_url
        self.upstream_port = int(upstream_url.rsplit(":", 1)[1])
        self.script = Script()
        self.connections: list[_Downstream] = []
        self.listening: Any = None

    def start(self) -> None:
        self.listening = _reactor().listenTCP(0, self, interface="127.0.0.1")
        self.port_number = self.listening.getHost().port
        self.setSessionParameters(url=self.proxy_url)

    @property
    def proxy_url(self) -> str:
        return f"ws://127.0.0.1:{self.port_number}"

    def on(
        self,
        action: str,
        match: Callable[[dict[str, Any]], bool] = lambda ev: True,
        times: int = 1,
        message: str | None = None,
    ) -> Rule:
        """Add a rule (see the comment above L{FAULT_ACTIONS})."""
        rule = Rule(action, match, times, message or "blocked: refused by the fault script")
        self.script.rules.append(rule)
        return rule

    def clear(self) -> None:
        self.script.rules.clear()

    def stop(self) -> defer.Deferred[None]:
        """Abort every proxied connection and stop listening (idempotent)."""
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abortConnection()
            up = getattr(c, "up", None)
            if up is not None and up.transport is not None:
                up.transport.abortConnection()
        listening, self.listening = self.listening, None
        if listening is None:
            return defer.succeed(None)
        return defer.maybeDeferred(listening.stopListening)


def start_fault_relay(testcase: Any, upstream_url: str) -> FaultRelay:
    """A listening fault proxy in front of C{upstream_url}, stopped by C{testcase.addCleanup}."""
    proxy = FaultRelay(upstream_url)
    proxy.start()
    testcase.addCleanup(proxy.stop)
    return proxy


# --- the relay process's side --------------------------------------------------------------------


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
    from alembic import config as alembic_config

    import nostr_relay

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
